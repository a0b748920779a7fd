"""The training state as safetensors + JSON (no pickle): encode and decode, RNG states, and reading the
state of older (train_state.pt) checkpoints with weights_only. A state read back has its counters checked
(check_counters): a step of 10^18, -5 or "x" is refused naming the file, not trained from."""

from __future__ import annotations

import numbers
import pickle
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as st_load_file

from .guard import STATE_BYTES, check_regular, read_json
from .store import DAMAGED, LEGACY_STATE, STATE_JSON, STATE_TENSORS, STEP_RE, CheckpointError, step_of


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


_TAGS = ("__tensor__", "__ndarray__", "__npscalar__", "__tuple__", "__items__")


def _encode(obj, path: str, tensors: dict[str, torch.Tensor], seen: set[int]):
    if isinstance(obj, torch.Tensor):
        key = path.lstrip("/") or "tensor"
        while key in tensors:
            key += "'"
        t = obj.detach().to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise CheckpointError(f"training state at {path or '/'}: a NumPy array of dtype {obj.dtype} cannot be "
                                  f"stored safely (numbers and booleans only)")
        return {"__ndarray__": {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in "biuf":
            raise CheckpointError(f"training state at {path or '/'}: NumPy {obj.dtype} cannot be stored safely")
        return {"__npscalar__": [obj.dtype.str, obj.item()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _TAGS for k in obj):
            return {k: _encode(v, f"{path}/{k}", tensors, seen) for k, v in obj.items()}
        return {"__items__": [[_encode(k, f"{path}/key", tensors, seen), _encode(v, f"{path}/{k}", tensors, seen)]
                              for k, v in obj.items()]}
    raise CheckpointError(f"training state at {path or '/'}: a {type(obj).__name__} cannot be stored safely; "
                          f"state_dict() must hold tensors, NumPy arrays and plain values only")


def _decode(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, v), = obj.items()
        if tag == "__tensor__":
            return tensors[v]
        if tag == "__ndarray__":
            dt = np.dtype(v["dtype"])
            if dt.kind not in "biuf":
                raise ValueError(f"array dtype {dt}")
            return np.array(v["data"], dtype=dt).reshape(v["shape"])
        if tag == "__npscalar__":
            dt = np.dtype(v[0])
            if dt.kind not in "biuf":
                raise ValueError(f"scalar dtype {dt}")
            return dt.type(v[1])
        if tag == "__tuple__":
            return tuple(_decode(x, tensors) for x in v)
        if tag == "__items__":
            return {_decode(k, tensors): _decode(x, tensors) for k, x in v}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def encode_state(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON-able skeleton, {key: tensor}) for a training state; see the comment above."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(state, "", tensors, set()), tensors


def decode_state(skeleton, tensors: dict[str, torch.Tensor]) -> dict:
    return _decode(skeleton, tensors)


# The counters a trainer continues from, and the values they may take: a step as train.max_iters may be
# (config.py), tokens and skipped batches as a signed 64-bit count, the last evaluated step or -1 (none yet).
COUNTERS = {"step": (0, 10**12), "tokens": (0, 2**63 - 1), "skipped": (0, 2**63 - 1), "last_val_step": (-1, 10**12)}
REQUIRED = ("step", "tokens")


def check_counters(st, f: Path, ckpt: Path) -> dict:
    """`st`, the state read from file `f` of checkpoint `ckpt`, once its counters are integers in their
    ranges and its step is the one the checkpoint's directory is named by (step_NNNNNN)."""
    if not isinstance(st, dict):
        raise CheckpointError(f"{f} is a {type(st).__name__}, not a training state; {DAMAGED}")
    for key, (lo, hi) in COUNTERS.items():
        if key not in st:
            if key in REQUIRED:
                raise CheckpointError(f"{f} has no {key}: it is not a training state written by `codeforge "
                                      f"train`, so it cannot be resumed; start a new run from its weights with "
                                      f"--init-from {ckpt}")
            continue
        v = st[key]
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise CheckpointError(f"{f}: {key} = {v!r} is not an integer; {DAMAGED}")
        if not lo <= v <= hi:
            raise CheckpointError(f"{f}: {key} = {v!r} is out of range [{lo}, {hi}]; {DAMAGED}")
    for key in ("best_val", "last_val"):
        v = st.get(key)
        if v is not None and (not isinstance(v, numbers.Real) or isinstance(v, bool)):
            raise CheckpointError(f"{f}: {key} = {v!r} is not a number; {DAMAGED}")
    if STEP_RE.fullmatch(ckpt.name) and st["step"] != step_of(ckpt):
        raise CheckpointError(f"{f}: step = {st['step']!r} but the checkpoint is {ckpt.name} (it was saved at step "
                              f"{step_of(ckpt)}); {DAMAGED}")
    return st


def load_train_state(ckpt: Path) -> dict:
    """The training state saved with a checkpoint, loaded without running any code from it, its counters
    checked (check_counters)."""
    ckpt = Path(ckpt)
    if (ckpt / STATE_JSON).exists():
        skeleton = read_json(ckpt / STATE_JSON, STATE_BYTES, CheckpointError, DAMAGED)
        check_regular(ckpt / STATE_TENSORS, CheckpointError, DAMAGED)
        try:
            st = decode_state(skeleton, st_load_file(str(ckpt / STATE_TENSORS), device="cpu"))
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError,
                SafetensorError) as e:
            raise CheckpointError(f"the training state in {ckpt} is unreadable ({type(e).__name__}: {e}); the "
                                  f"checkpoint is damaged: use another one") from e
        return check_counters(st, ckpt / STATE_JSON, ckpt)
    if (ckpt / LEGACY_STATE).exists():
        check_regular(ckpt / LEGACY_STATE, CheckpointError, DAMAGED)
        return check_counters(_load_legacy_state(ckpt), ckpt / LEGACY_STATE, ckpt)
    raise CheckpointError(f"{ckpt} holds no training state ({STATE_JSON}), so it cannot be resumed; start a new "
                          f"run from its weights with --init-from {ckpt}")


def _numpy_safe_globals() -> list:
    """What NumPy arrays of numbers need to unpickle (older checkpoints held NumPy's RNG state): the array
    rebuilder and the numeric dtype classes. Nothing here can call out to other code."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")
              and n not in ("ObjectDType", "VoidDType", "StringDType")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


def _load_legacy_state(ckpt: Path) -> dict:
    f = ckpt / LEGACY_STATE
    allowed = _numpy_safe_globals()
    try:
        with torch.serialization.safe_globals(allowed):
            st = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (a damaged file fails in many ways)
        if not (isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e)):
            raise CheckpointError(f"{f} is unreadable ({type(e).__name__}: {str(e)[:300]}); the checkpoint is "
                                  f"damaged: use another one") from e
        names = {f"{g.__module__}.{g.__qualname__}" for g in allowed}
        try:
            others = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(f)) - names)
        except Exception:  # noqa: BLE001 (only for the message)
            others = []
        holds = f" (it names {', '.join(others[:8])})" if others else ""
        raise CheckpointError(
            f"{f}, written by an older codeforge, holds more than tensors and plain values{holds}: loading it "
            f"would run code from the file, so it was not loaded. If you trust this run, start a new one from "
            f"its weights, which load safely: codeforge train --init-from {ckpt} --out NEW_RUN ...") from e
    if not isinstance(st, dict) or "step" not in st:
        raise CheckpointError(f"{f} is not a codeforge training state")
    return st
