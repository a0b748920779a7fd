"""A config field declared once: default, allowed range or choices, and help, in the dataclass itself.

Validation (`check_fields`) and the command line (cli/train.py generates a flag per field) both read this
declaration, so a range, a choice list or a help text is written in exactly one place.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, field, fields
from typing import Any

from . import CodeforgeError


class ConfigError(CodeforgeError):
    """An invalid configuration value; the message names the field, the value, the range and the fix."""


def setting(default: Any, help: str = "", range: tuple[float, float] | None = None, open_low: bool = False,
            choices: tuple[str, ...] | None = None, zero_means: str = "", flag: str | None = None,
            cli: bool = True, required: bool = False, metavar: str | None = None) -> Any:
    """A dataclass field with its declaration in metadata. range: inclusive [lo, hi] (open at lo with
    open_low); zero_means: 0 is allowed outside the range and means this (e.g. "from the data"); flag: the
    command-line name when it is not --field-name; cli=False keeps the field off the command line;
    required: the run cannot start without it (said in --help); metavar: the placeholder in --help."""
    return field(default=default, metadata={"help": help, "range": range, "open_low": open_low,
                                            "choices": choices, "zero_means": zero_means, "flag": flag,
                                            "cli": cli, "required": required, "metavar": metavar})


def saved(obj: Any, order: tuple[str, ...]) -> dict:
    """The fields of dataclass `obj` as a dict for a saved file (config.toml, a checkpoint's config.json), the
    names in `order` first and in that order, the rest after in declaration order: the key order saved files
    have always had, whichever class now declares a field. A new field need not be added to `order`."""
    d = {f.name: getattr(obj, f.name) for f in fields(obj)}
    return {**{k: d[k] for k in order if k in d}, **d}


def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def describe(f: Field) -> str:
    """Help text with the allowed values and the default, for --help."""
    m = f.metadata
    parts = [m.get("help", "")]
    if m.get("choices"):
        parts.append("{" + "|".join(m["choices"]) + "}")
    if m.get("range"):
        lo, hi = m["range"]
        parts.append(f"{'(' if m.get('open_low') else '['}{lo}, {hi}]")
    if m.get("zero_means"):
        parts.append(f"0: {m['zero_means']}")
    if m.get("required"):
        parts.append("required")
    elif f.default is not MISSING:
        parts.append(f"default {f.default}" if f.default != "" else "default: none")
    return "; ".join(p for p in parts if p)


def check_fields(obj: Any, section: str) -> None:
    """Raise ConfigError for the first field of `obj` outside its declared range or choices."""
    for f in fields(obj):
        m, v = f.metadata, getattr(obj, f.name)
        key = f"{section}.{f.name}"
        if m.get("choices") and v not in m["choices"]:
            raise ConfigError(f"{key} = {v!r} is not one of {m['choices']}; "
                              f"set {flag_name(f)} (or --set {key}=...)")
        if m.get("range"):
            if m.get("zero_means") and v == 0:
                continue
            lo, hi = m["range"]
            ok = (lo < v if m.get("open_low") else lo <= v) and v <= hi
            if not ok:
                raise ConfigError(f"{key} = {v!r} is out of range {'(' if m.get('open_low') else '['}{lo}, "
                                  f"{hi}]; set {flag_name(f)} (or --set {key}=...) to a value in that range")
