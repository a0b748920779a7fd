"""An option declared once: default, allowed range or choices, and help, in the dataclass itself.

Every options object of every command (the run's [model] and [train], and corpus, prepare, tokenizer, serve,
eval, export, import, quickstart) declares its fields with `setting`. Validation (`check_fields`), the
command line (`add_flags` makes a flag per field, `from_args` builds the object back) and `codeforge config
keys` all read this declaration, so a default, a range, a choice list or a help text is written in exactly
one place.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, Field, field, fields
from typing import Any

from . import CodeforgeError


class ConfigError(CodeforgeError):
    """An invalid configuration value; the message names the field, the value, the range and the fix."""


def setting(default: Any, help: str = "", range: tuple[float, float] | None = None, open_low: bool = False,
            choices: tuple[str, ...] | None = None, zero_means: str = "", flag: str | None = None,
            cli: bool = True, required: bool = False, metavar: str | None = None, type: type | None = None,
            many: bool = False, positional: bool = False, switch: bool = False) -> Any:
    """A dataclass field with its declaration in metadata. range: inclusive [lo, hi] (open at lo with
    open_low); zero_means: 0 is allowed outside the range and means this (e.g. "from the data"); flag: the
    command-line name when it is not --field-name; cli=False keeps the field off the command line;
    required: the command cannot start without it (the flag is required, and --help says so); metavar: the
    placeholder in --help; type: the value's type where the default (None) does not show it; many: the
    flag takes one or more values (a list default is copied for each object); positional: an argument
    without a flag; switch: an auto/on/off choice whose flag alone means on (`--compile`), `--no-X` off,
    and whose saved true/false (from when it was a plain on/off setting) read as on/off."""
    meta = {"help": help, "range": range, "open_low": open_low, "choices": choices, "zero_means": zero_means,
            "flag": flag, "cli": cli, "required": required, "metavar": metavar, "type": type,
            "many": many or isinstance(default, list), "positional": positional,
            "switch": switch}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def switch_value(f: Field, value: Any) -> Any:
    """A switch's value as its field holds it: true/false (a bool, or its words) as on/off."""
    if not f.metadata.get("switch"):
        return value
    word = str(value).lower()
    if isinstance(value, bool) or word in ("true", "false", "yes", "no", "1", "0"):
        return "on" if word in ("true", "yes", "1") else "off"
    return value


def default_of(f: Field) -> Any:
    """A field's default value (a fresh one for a list), MISSING when it has none."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def value_type(f: Field) -> type:
    """The type of one value of the field: declared, else the default's (an element's for a list)."""
    d = default_of(f)
    if f.metadata.get("type"):
        return f.metadata["type"]
    if isinstance(d, (list, tuple)):
        return type(d[0]) if d else str
    return str if d is None or d is MISSING else type(d)


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
    # a help that says its default itself ("default: both") keeps it
    elif not re.search(r"\bdefault\b", m.get("help", "")):
        d = default_of(f)
        if isinstance(d, bool):
            parts.append(f"default {'on' if d else 'off'}")
        elif isinstance(d, (list, tuple)) and d:
            parts.append("default " + " ".join(map(str, d)))
        elif d in (None, "", [], ()):
            parts.append("default: none")
        elif d is not MISSING:
            parts.append(f"default {d}")
    return "; ".join(p for p in parts if p)


class SwitchAction(argparse.Action):
    """A switch's flags: `--X` alone is on, `--X VALUE` one of its choices (or true/false), `--no-X` off."""

    ALONE = object()  # what nargs "?" hands over when no value follows the flag (not a str: never checked)

    def __init__(self, option_strings, dest, **kw):
        kw["type"] = _switch_word
        super().__init__(option_strings, dest, nargs="?", const=self.ALONE, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string and option_string.startswith("--no-"):
            if values is not self.ALONE:
                parser.error(f"{option_string} takes no value")
            values = "off"
        elif values is self.ALONE:
            values = "on"
        setattr(namespace, self.dest, values)


def _switch_word(value: str) -> str:
    """A switch's value on the command line: true/false (yes/no, 1/0) as on/off."""
    word = value.lower()
    return {"true": "on", "yes": "on", "1": "on", "false": "off", "no": "off", "0": "off"}.get(word, value)


def add_flags(parser: argparse.ArgumentParser, cls: type, group: str | None = None, dest_prefix: str = "",
              given_only: bool = False, skip: tuple[str, ...] = ()) -> None:
    """A command-line argument per field of dataclass `cls` (those declared with `setting`, cli=True, not in
    `skip`), its name, type, choices, help and default all from the declaration. dest_prefix: the
    namespace key is PREFIX + field name (cli/train.py's "model."); given_only: every default is None, so a
    caller can tell a flag given from one left out (a bool then also gets its --no- form). Each action
    remembers its field (`action.field`), and the parser the classes it holds (`parser.options`), for the
    test that no flag is declared twice."""
    target = parser.add_argument_group(group) if group else parser
    parser.options = [*getattr(parser, "options", []), cls]
    for f in fields(cls):
        m = f.metadata
        if "cli" not in m or not m["cli"] or f.name in skip:
            continue
        d, vt = default_of(f), value_type(f)
        kw: dict = {"help": describe(f).replace("%", "%%")}
        if vt is bool and not m.get("many"):
            kw["action"] = (argparse.BooleanOptionalAction if given_only or d is True
                            else "store_true")
        elif m.get("switch"):  # --X (on), --X auto|on|off, --no-X (off)
            kw.update(choices=m["choices"], action=SwitchAction)
        else:
            kw["type"] = vt
            if m.get("choices"):
                kw["choices"] = m["choices"]
            else:
                kw["metavar"] = m.get("metavar") or {int: "N", float: "X"}.get(vt, "TEXT")
            if m.get("many"):
                kw["nargs"] = "+"
        kw["default"] = None if given_only else d
        if m.get("positional"):
            action = target.add_argument(dest_prefix + f.name, **kw)
        else:
            if m.get("required") and not given_only:
                kw["required"] = True
            names = [flag_name(f)] + (["--no-" + flag_name(f)[2:]] if m.get("switch") else [])
            action = target.add_argument(*names, dest=dest_prefix + f.name, **kw)
        action.field = (cls, f)


def from_args(cls: type, a: argparse.Namespace, section: str, **given: Any) -> Any:
    """The `cls` object the parsed flags describe (fields without a flag keep their defaults, `given`
    overrides), checked against its declaration: ConfigError names the flag and the allowed values."""
    kw = {f.name: getattr(a, f.name) for f in fields(cls) if f.name not in given and hasattr(a, f.name)}
    obj = cls(**kw, **given)
    check_fields(obj, section, via_set=False)
    return obj


def check_fields(obj: Any, section: str, via_set: bool = True) -> None:
    """Raise ConfigError for the first field of `obj` outside its declared range or choices. section: the
    config table ("train") or the command ("prepare") the message names; via_set: the field can also be
    given as --set SECTION.FIELD=... (the run's config sections)."""
    for f in fields(obj):
        m, v = f.metadata, getattr(obj, f.name)
        if v is None:
            continue
        on_cli = m.get("cli", True)
        key = f"{section}.{f.name}" if via_set or not on_cli else f"{section} {flag_name(f)}"
        if via_set:
            fix = f"set {flag_name(f)} (or --set {key}=...)" if on_cli else f"set it with --set {key}=..."
        else:
            fix = f"set {flag_name(f)}" if on_cli else f"set {f.name} (it has no flag)"
        values = v if m.get("many") and isinstance(v, (list, tuple)) else [v]
        for x in values:
            if m.get("choices") and x not in m["choices"]:
                raise ConfigError(f"{key} = {x!r} is not one of {m['choices']}; {fix}")
            if m.get("range") and not (m.get("zero_means") and x == 0):
                lo, hi = m["range"]
                if not ((lo < x if m.get("open_low") else lo <= x) and x <= hi):
                    zero = f" (or 0: {m['zero_means']})" if m.get("zero_means") else ""
                    raise ConfigError(f"{key} = {x!r} is out of range {'(' if m.get('open_low') else '['}"
                                      f"{lo}, {hi}]{zero}; {fix} to a value in that range")
