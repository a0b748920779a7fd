"""The model registry: every architecture by its `arch` key, so nothing outside models/ names a class.

A model config is a dataclass with an `arch` field (saved in every checkpoint's config); a model offers the
shared surface described in gpt.py's docstring, and a static `shapes(cfg)`: its state dict's names and shapes
from the config alone (state_shapes). Add an architecture by adding one entry to ARCHS.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import CodeforgeError
from .gpt import GPT, GPTConfig
from .hrm import HRM, HRMConfig
from .reward import RewardConfig, RewardModel

ARCHS: dict[str, tuple[type, type]] = {"gpt": (GPTConfig, GPT), "hrm": (HRMConfig, HRM),
                                       "reward": (RewardConfig, RewardModel)}


class ModelConfigError(CodeforgeError):
    """A model config names an unknown architecture or carries keys that architecture does not have."""


def config_class(arch: str) -> type:
    if arch not in ARCHS:
        raise ModelConfigError(f"unknown model arch {arch!r}; known: {sorted(ARCHS)}")
    return ARCHS[arch][0]


def model_config(d: dict[str, Any] | Any) -> Any:
    """A config object from a saved dict (arch defaults to "gpt" for checkpoints
    written before the registry)."""
    if not isinstance(d, dict):
        return d
    cls = config_class(d.get("arch", "gpt"))
    try:
        return cls.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"model config: {e}") from e


def state_shapes(cfg: Any) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """({state-dict name: shape}, groups of names that are one tensor) of the model `cfg` (a config object)
    declares, without building it: each model class says (its `shapes`). checkpoint/guard.py compares a
    weights file with it, and counts the parameters, before anything is allocated."""
    return ARCHS[cfg.arch][1].shapes(cfg)


def build_model(cfg: dict[str, Any] | Any) -> torch.nn.Module:
    """The model for a config (object or saved dict), initialised by the model's own init_weights."""
    cfg = model_config(cfg)
    return ARCHS[cfg.arch][1](cfg)
