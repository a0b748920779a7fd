"""Checkpoints: atomic save, keep-last-N plus best and final, exact resume, the compatibility check, and
loading a model for inference. Model-agnostic: models are built through the registry by the saved `arch`.

RUN/checkpoints/step_NNNNNN/
  model.safetensors   weights (tied tensors stored once)
  config.json         the resolved run configuration (model + train) and the tokenizer hash
  train_state.pt      optimizer, grad scaler, loader cursor, RNG states, step and token counters
  tokenizer/          the tokenizer, so a checkpoint alone can generate
RUN/checkpoints/latest, best, final   one line each: the name of a step directory

A checkpoint is written to a hidden temporary directory and renamed into place, and `latest` is replaced
atomically after that, so a crash (even kill -9) never leaves a half-written checkpoint behind `latest`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model as st_load_model
from safetensors.torch import save_model as st_save_model

from . import CodeforgeError
from .atomic import publish, staging_dir

STEP_PREFIX = "step_"


class CheckpointError(CodeforgeError):
    pass


def _write_pointer(ckpt_root: Path, name: str, target: str) -> None:
    tmp = ckpt_root / f".{name}.tmp"
    tmp.write_text(target + "\n")
    os.replace(tmp, ckpt_root / name)


def _read_pointer(ckpt_root: Path, name: str) -> Path | None:
    f = ckpt_root / name
    if not f.exists():
        return None
    p = ckpt_root / f.read_text().strip()
    return p if (p / "model.safetensors").exists() else None


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, config: dict, train_state: dict,
                    assets: dict[str, Path] | None, keep_last: int, best: bool = False,
                    final: bool = False) -> Path:
    """Write step_NNNNNN aside and rename it into place; `assets` are directories copied in by name
    (the tokenizer). Then move the pointers and prune to keep_last plus the pointed-to steps."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"{STEP_PREFIX}{step:06d}"
    final_dir = root / name
    tmp = staging_dir(final_dir)
    st_save_model(model, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(train_state, tmp / "train_state.pt")
    for asset, src in (assets or {}).items():
        shutil.copytree(src, tmp / asset)
    publish(tmp, final_dir)  # replaces the same step saved earlier (e.g. on SIGTERM right after a periodic save)
    _write_pointer(root, "latest", name)
    if best:
        _write_pointer(root, "best", name)
    if final:
        _write_pointer(root, "final", name)
    _prune(root, keep_last)
    return final_dir


def _step_of(p: Path) -> int:
    """The step of a step_NNNNNN directory: numeric, so step_1000000 sorts after step_999500."""
    return int(p.name[len(STEP_PREFIX):])


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)), key=_step_of)
    keep = set(steps[-keep_last:])
    for ptr in ("latest", "best", "final"):
        p = _read_pointer(root, ptr)
        if p is not None:
            keep.add(p)
    for p in steps:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():  # leftovers of a crashed save
        if p.name.startswith(f".{STEP_PREFIX}") and not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


POINTERS = ("latest", "best", "final")


def find_checkpoint(path: str | Path, which: str = "latest") -> Path:
    """A checkpoint directory from a checkpoint path, or from a run directory by pointer: "latest", "best",
    "final", or "auto" (best if the run has one, else latest). Asking for best or final when the run has
    none says so by name; only a missing `latest` pointer (a crash between save and pointer) falls back to
    the newest complete step."""
    if which not in (*POINTERS, "auto"):
        raise CheckpointError(f"checkpoint {which!r} is not one of {POINTERS + ('auto',)}")
    p = Path(path)
    if (p / "model.safetensors").exists():
        return p
    root = p / "checkpoints"
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: pass a run directory (from `codeforge train --out`) or a "
                              f"checkpoint directory")
    if which == "auto":
        which = "best" if root.exists() and _read_pointer(root, "best") is not None else "latest"
    found = _read_pointer(root, which) if root.exists() else None
    if found is None and which in ("best", "final") and root.exists() and any(root.iterdir()):
        why = ("no evaluated step was saved (no validation split, or --eval-every 0)" if which == "best"
               else "the run has not finished")
        raise CheckpointError(f"{p} has no '{which}' checkpoint: {why}; use --checkpoint latest")
    if found is None and root.exists():  # latest pointer missing: the newest complete step
        steps = sorted((q for q in root.iterdir() if q.name.startswith(STEP_PREFIX)
                        and (q / "model.safetensors").exists()), key=_step_of)
        found = steps[-1] if steps else None
    if found is None:
        raise CheckpointError(f"no checkpoint in {p}: train first (`codeforge train --out {p}`) or pass a "
                              f"checkpoint directory")
    return found


def read_config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def load_weights(model: torch.nn.Module, ckpt: Path) -> None:
    missing, unexpected = st_load_model(model, str(ckpt / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{ckpt}: weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def load_train_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "train_state.pt", map_location="cpu", weights_only=False)


def shape_diff(saved: dict, current: dict) -> dict:
    """Model fields whose difference makes saved weights unusable: {field: (saved, current)}. Dropout rates
    may change between stages, so they are not compared."""
    saved = {"arch": "gpt", **saved}
    return {k: (v, current.get(k)) for k, v in saved.items() if not k.endswith("dropout") and current.get(k) != v}


def check_compatible(ck: Path, model_cfg: dict, tokenizer_hash: str, what: str, data: str = "the data") -> None:
    """Refuse a checkpoint whose weights do not fit `model_cfg` or whose tokenizer is not `tokenizer_hash`."""
    saved = read_config(ck)
    diff = shape_diff(saved["model"], model_cfg)
    if diff:
        raise CheckpointError(f"{what} {ck}: model shape differs (field: (checkpoint, this run)) {diff}; use the "
                              f"same model settings as the run you continue from")
    if saved.get("tokenizer_hash") != tokenizer_hash:
        raise CheckpointError(f"{what} {ck}: it was trained with tokenizer {saved.get('tokenizer_hash')} but "
                              f"{data} uses {tokenizer_hash}; prepare the data with that tokenizer")


def load_model(path: str | Path, device: torch.device, which: str = "auto"):
    """(model in eval mode, tokenizer, checkpoint dir, saved config) from a run or checkpoint directory."""
    from .models import build_model
    from .tokenizer import CodeTokenizer, TokenizerError
    ck = find_checkpoint(path, which)
    cfg = read_config(ck)
    if not (ck / "tokenizer" / "tokenizer.json").exists():
        raise CheckpointError(f"{ck} has no tokenizer/ directory; copy the tokenizer the run was trained with "
                              f"to {ck / 'tokenizer'}")
    try:
        tok = CodeTokenizer.load(ck / "tokenizer")
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    model = build_model(cfg["model"])
    load_weights(model, ck)
    return model.to(device).eval(), tok, ck, cfg
