"""Run configuration: model + training settings from presets, a TOML/YAML file and `--set key=value`,
validated where they enter and saved resolved into the run directory.

Precedence, later wins: defaults < presets (in the order given) < config file < `--set` < plain flags.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from . import CodeforgeError
from .models.gpt import GPTConfig


class ConfigError(CodeforgeError):
    """An invalid configuration value; the message names the field, the value, the range and the fix."""


@dataclass
class TrainConfig:
    data: str = ""
    out: str = ""
    batch_size: int = 8
    grad_accum_steps: int = 1
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1  # the schedule's floor, as a fraction of learning_rate
    schedule: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: share of the run spent decaying
    max_iters: int = 0  # optimizer steps; 0: from max_tokens or epochs
    max_tokens: int = 0
    epochs: float = 0.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    optimizer: str = "adamw"  # adamw | adamw8bit
    eval_every: int = 250
    eval_iters: int = 20
    sample_every: int = 0
    sample_tokens: int = 64
    save_every: int = 500
    keep_last: int = 3
    log_every: int = 10
    seed: int = 1337
    device: str = "auto"
    precision: str = "auto"  # auto | fp32 | fp16 | bf16
    compile: bool = False
    grad_checkpointing: bool = False
    # > 0: fused chunked lm_head + cross-entropy with this many rows per chunk (models/gpt.py). Off by default:
    # neutral on CPU (docs/LOG.md) and not yet measured on a GPU; it saves the (B*T, vocab) logits' memory.
    loss_chunk_rows: int = 0
    max_bad_steps: int = 5  # stop after this many non-finite losses in a row
    init_from: str = ""
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "codeforge"
    progress: bool = True


# field: (low, high, inclusive_low); the ranges of seed 002 are the floor, wider where users need it.
RANGES: dict[str, tuple[float, float, bool]] = {
    "model.vocab_size": (256, 200_000, True), "model.block_size": (8, 131_072, True),
    "model.n_layer": (1, 256, True), "model.n_head": (1, 256, True), "model.n_embd": (16, 16_384, True),
    "model.embd_dropout": (0.0, 0.9, True), "model.attn_dropout": (0.0, 0.9, True),
    "model.resid_dropout": (0.0, 0.9, True), "model.rope_base": (1.0, 1e9, True),
    "train.batch_size": (1, 4096, True), "train.grad_accum_steps": (1, 4096, True),
    "train.learning_rate": (0.0, 1e-1, False), "train.min_lr_ratio": (0.0, 1.0, True),
    "train.warmup_steps": (0, 10**9, True), "train.max_iters": (0, 10**12, True),
    "train.epochs": (0.0, 1e6, True), "train.weight_decay": (0.0, 10.0, True),
    "train.beta1": (0.0, 0.999999, True), "train.beta2": (0.0, 0.999999, True), "train.grad_clip": (0.0, 1e6, True),
    "train.eval_every": (0, 10**9, True), "train.eval_iters": (1, 10**6, True), "train.save_every": (0, 10**9, True),
    "train.keep_last": (1, 10**6, True), "train.log_every": (1, 10**9, True), "train.decay_fraction": (0.0, 1.0, True),
    "train.loss_chunk_rows": (0, 10**7, True),
}
CHOICES: dict[str, tuple[str, ...]] = {
    "model.mlp": ("gelu", "swiglu", "relu2"), "model.norm": ("layernorm", "rmsnorm"), "model.pos": ("learned", "rope"),
    "train.schedule": ("cosine", "linear", "constant", "wsd"), "train.optimizer": ("adamw", "adamw8bit"),
    "train.precision": ("auto", "fp32", "fp16", "bf16"),
}
FLAG_OF = {"learning_rate": "--learning-rate", "batch_size": "--batch-size", "vocab_size": "--vocab-size"}


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return {"model": asdict(self.model), "train": asdict(self.train)}

    def validate(self) -> "RunConfig":
        flat = {f"model.{k}": v for k, v in asdict(self.model).items()}
        flat.update({f"train.{k}": v for k, v in asdict(self.train).items()})
        for key, (lo, hi, incl) in RANGES.items():
            v = flat[key]
            if key == "model.vocab_size" and v == 0:
                continue  # 0: taken from the prepared data's tokenizer at training time
            if not ((lo <= v if incl else lo < v) and v <= hi):
                name = key.split(".")[1]
                flag = FLAG_OF.get(name, "--" + name.replace("_", "-"))
                raise ConfigError(f"{key} = {v!r} is out of range {'[' if incl else '('}{lo}, {hi}]; "
                                  f"set {flag} (or --set {key}=...) to a value in that range")
        for key, options in CHOICES.items():
            if flat[key] not in options:
                raise ConfigError(f"{key} = {flat[key]!r} is not one of {options}")
        m = self.model
        if m.n_embd % m.n_head:
            raise ConfigError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = {m.n_head}; "
                              f"pick n_embd a multiple of n_head (e.g. {m.n_head * max(1, round(m.n_embd / m.n_head))})")
        if m.n_head % m.n_kv_head:
            raise ConfigError(f"model.n_head = {m.n_head} is not divisible by model.n_kv_head = {m.n_kv_head}")
        if m.pos == "rope" and m.head_dim % 2:
            raise ConfigError(f"rotary positions need an even head size; n_embd/n_head = {m.head_dim}")
        return self


def _preset_tables() -> dict[str, dict[str, dict]]:
    out = {}
    for kind, fname in (("model", "models.toml"), ("train", "hardware.toml")):
        out[kind] = tomllib.loads(resources.files("codeforge.presets").joinpath(fname).read_text())
    return out


def preset_names() -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in _preset_tables().items()}


def _coerce(key: str, value: Any, current: Any) -> Any:
    """Convert a `--set` string (or a file value) to the type of the field it sets."""
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        s = str(value).lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key} = {value!r} is not a boolean; use true or false")
    try:
        if isinstance(current, int):
            f = float(value)
            if not f.is_integer():
                raise ValueError
            return int(f)
        if isinstance(current, float):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} = {value!r} is not a{'n integer' if isinstance(current, int) else ' number'}") from None
    return str(value)


def _apply(cfg: RunConfig, key: str, value: Any) -> None:
    """Set `model.x`, `train.x` or a bare `x` (found in whichever section has it)."""
    section, _, name = key.rpartition(".")
    sections = [section] if section else [s for s in ("model", "train") if name in _field_names(s)]
    if not sections or section not in ("", "model", "train") or name not in _field_names(sections[0]):
        raise ConfigError(f"unknown setting {key!r}; model keys: {sorted(_field_names('model'))}; "
                          f"train keys: {sorted(_field_names('train'))}")
    obj = getattr(cfg, sections[0])
    setattr(obj, name, _coerce(f"{sections[0]}.{name}", value, getattr(obj, name)))


def _field_names(section: str) -> set[str]:
    return {f.name for f in fields(GPTConfig if section == "model" else TrainConfig)}


def load_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml
        data = yaml.safe_load(text) or {}
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a table of settings")
    return data


def resolve(presets: list[str] = (), file: str | None = None, sets: list[str] = (),
            flags: dict[str, Any] | None = None, base: dict | None = None,
            vocab_from_data: bool = False) -> RunConfig:
    """Build and validate a RunConfig. `base` (a saved config dict) starts it instead of the defaults.
    vocab_from_data: a preset's vocab_size is dropped (0 = take it from the data) unless the file, --set or
    a flag sets one."""
    cfg = RunConfig()
    cfg.model.n_kv_head = cfg.model.ffn_hidden = 0  # derived at the end unless something sets them
    if base:
        cfg = RunConfig(GPTConfig.from_dict(base["model"]), TrainConfig(**base["train"]))
    tables = _preset_tables()
    for name in presets:
        kind = next((k for k, t in tables.items() if name in t), None)
        if kind is None:
            raise ConfigError(f"unknown preset {name!r}; models: {sorted(tables['model'])}; "
                              f"hardware: {sorted(tables['train'])}")
        for k, v in tables[kind][name].items():
            _apply(cfg, f"{kind}.{k}", v)
    if vocab_from_data and not base:
        cfg.model.vocab_size = 0
    if file:
        for k, v in load_file(file).items():
            if isinstance(v, dict) and k in ("model", "train"):
                for kk, vv in v.items():
                    _apply(cfg, f"{k}.{kk}", vv)
            else:
                _apply(cfg, k, v)
    for s in sets:
        if "=" not in s:
            raise ConfigError(f"--set {s!r} must look like key=value (e.g. --set model.n_layer=6)")
        k, v = s.split("=", 1)
        _apply(cfg, k.strip(), v.strip())
    for k, v in (flags or {}).items():
        if v is not None:
            _apply(cfg, k, v)
    cfg.model.__post_init__()  # derived defaults (n_kv_head, ffn_hidden) after overrides
    return cfg.validate()


def dumps_toml(d: dict) -> str:
    """TOML for a dict of tables of scalars (what RunConfig holds)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
            raise ConfigError(f"cannot save non-finite value {v}")
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))
    lines = []
    for table, kv in d.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {val(v)}" for k, v in kv.items()]
        lines.append("")
    return "\n".join(lines)
