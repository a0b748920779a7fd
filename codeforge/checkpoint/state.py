"""The training state as safetensors + JSON (no pickle): encode and decode, RNG states, and reading the
state of older (train_state.pt) checkpoints with weights_only. A state read back has its counters checked
(check_counters): a step of 10^18, -5 or "x" is refused naming the file, not trained from, and so is a data
cursor with a key missing, a value of the wrong type or out of range, or (on --resume: check_loader) past the
data."""

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
            raise CheckpointError(f"training state at {path or '/'}: a NumPy array of dtype {obj.dtype} "
                                  f"cannot be stored safely (numbers and booleans only)")
        return {"__ndarray__": {"dtype": obj.dtype.str, "shape": list(obj.shape),
                                "data": obj.ravel().tolist()}}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in "biuf":
            raise CheckpointError(
                f"training state at {path or '/'}: NumPy {obj.dtype} cannot be stored safely")
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
        return {"__items__": [[_encode(k, f"{path}/key", tensors, seen),
                               _encode(v, f"{path}/{k}", tensors, seen)]
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
COUNTERS = {"step": (0, 10**12), "tokens": (0, 2**63 - 1), "skipped": (0, 2**63 - 1),
            "last_val_step": (-1, 10**12)}
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
                                      f"train`, so it cannot be resumed; start a new run from its weights "
                                      f"with --init-from {ckpt}")
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
    if "loader" in st:
        check_loader(st["loader"], f, ckpt)
    if STEP_RE.fullmatch(ckpt.name) and st["step"] != step_of(ckpt):
        raise CheckpointError(f"{f}: step = {st['step']!r} but the checkpoint is {ckpt.name} (it was saved "
                              f"at step {step_of(ckpt)}); {DAMAGED}")
    return st


# The data cursor: train_state.json's "loader", the batch source's state_dict(). The keys its
# load_state_dict() reads, per kind of training data (config.py's Stage.data), and the values every key may
# take: counters as a signed 64-bit count, sizes as positive 32-bit ones, the seed as train.seed may be
# (config.py), the FIM rates as fractions, flags as booleans. Keys a loader saves but reads with a default
# (start, rank, fim_*) are checked when present, so a state written before they existed still resumes.
LOADER_KEYS = {
    "shards": ("epoch", "pos", "seed", "shuffle", "world_size", "B", "T"),  # data/loader.py BatchLoader
    # data/loader.py ChatBatchLoader
    "chat shards": ("epoch", "pos", "seed", "shuffle", "world_size", "B", "T"),
    "plans": ("epoch", "pos", "drawn", "seed", "shuffle", "world_size", "B", "accum", "plan_len", "code_len"),
    "pairs": ("epoch", "cursor"),  # data/pairs.py PairBatches
    "tasks": ("round", "cursor"),  # stages/rl.py
}
_COUNT, _SIZE = (0, 2**63 - 1), (1, 2**31 - 1)
LOADER_FIELDS: dict[str, tuple | type] = {
    "epoch": _COUNT, "pos": _COUNT, "start": _COUNT, "drawn": _COUNT, "cursor": _COUNT, "round": _COUNT,
    "pairs": _COUNT, "tasks": _COUNT, "seed": (0, 2**63 - 1), "rank": (0, 2**31 - 1), "world_size": _SIZE,
    "B": _SIZE, "T": _SIZE, "accum": _SIZE, "plan_len": _SIZE, "code_len": _SIZE, "fim_rate": (0.0, 1.0),
    "fim_spm_rate": (0.0, 1.0), "shuffle": bool, "chat": bool}


def check_loader(loader, f: Path, ckpt: Path, data: str | None = None, tokens: int | None = None) -> dict:
    """`loader`, the data cursor read from file `f` of checkpoint `ckpt`, once every field it has holds a
    value of its type and range (LOADER_FIELDS). data: the kind of training data the run reads (config.py's
    Stage.data): the keys its loader reads must be there (LOADER_KEYS). tokens: the size of the training split
    of packed shards, which the cursor may not pass (it counts whole sequences of T+1 tokens of it)."""
    fix = f"{DAMAGED}, or start a new run from its weights with --init-from {ckpt}"
    if not isinstance(loader, dict):
        raise CheckpointError(f"{f}: loader is a {type(loader).__name__}, not the data loader's cursor (an "
                              f"object of its epoch, position and settings); {fix}")
    missing = [k for k in LOADER_KEYS.get(data, ()) if k not in loader]
    if missing:
        raise CheckpointError(f"{f}: loader has no {', '.join(missing)} (a run on {data} saves "
                              f"{', '.join(LOADER_KEYS[data])}); {fix}")
    for key, want in LOADER_FIELDS.items():
        if key not in loader:
            continue
        v = loader[key]
        if want is bool:
            if not isinstance(v, (bool, np.bool_)):
                raise CheckpointError(f"{f}: loader.{key} = {v!r} is not true or false; {fix}")
            continue
        lo, hi = want
        kind = numbers.Integral if isinstance(lo, int) else numbers.Real
        if not isinstance(v, kind) or isinstance(v, bool):
            what = "an integer" if kind is numbers.Integral else "a number"
            raise CheckpointError(f"{f}: loader.{key} = {v!r} is not {what}; {fix}")
        if not lo <= v <= hi:
            raise CheckpointError(f"{f}: loader.{key} = {v!r} is out of range [{lo}, {hi}]; {fix}")
    if "buffer" in loader and not (loader["buffer"] is None or isinstance(loader["buffer"], dict)):
        raise CheckpointError(f"{f}: loader.buffer is a {type(loader['buffer']).__name__}, "
                              f"not a rollout; {fix}")
    if tokens is not None and data in ("shards", "chat shards") and "pos" in loader:
        _check_cursor_in_data(loader, f, data, tokens, fix)
    return loader


def _check_cursor_in_data(loader: dict, f: Path, data: str, tokens: int, fix: str) -> None:
    """A packed loader has read start + pos x B x world_size sequences of T+1 tokens of one epoch's order,
    never more than the split holds (tokens // T: fewer still, as no sequence spans two shards); a chat
    loader's pos counts conversation pieces of at least one token each."""
    if data == "chat shards":
        if loader["pos"] > tokens:
            raise CheckpointError(f"{f}: loader.pos = {loader['pos']!r} is beyond the data: "
                                  "it counts conversation pieces read this epoch, "
                                  f"and the training split holds {tokens:,} tokens; {fix}")
        return
    most = tokens // loader["T"]
    start = loader.get("start", 0)
    if start > most:
        raise CheckpointError(f"{f}: loader.start = {start!r} is beyond the data: the training split holds "
                              f"{tokens:,} tokens, at most {most:,} sequences of T+1 = {loader['T'] + 1}; "
                              f"{fix}")
    read = start + loader["pos"] * loader["B"] * loader["world_size"]
    if read > most:
        raise CheckpointError(f"{f}: loader.pos = {loader['pos']!r} is beyond the data: start {start} + pos "
                              f"x B {loader['B']} x world_size {loader['world_size']} = {read:,} sequences "
                              f"read this epoch, but the training split holds {tokens:,} tokens, at most "
                              f"{most:,} sequences of T+1 = {loader['T'] + 1}; {fix}")


class _Unread(dict):
    """The tensors of a state skeleton decoded without them: each reads as None."""

    def __missing__(self, key):
        return None


def loader_state(ckpt: Path) -> tuple[object, Path] | None:
    """(the data cursor saved with checkpoint `ckpt`, unchecked; the file it is in), read without the state's
    tensors where it can be (train_state.json), so --resume can check it before anything is built. None when
    the checkpoint holds no training state at all (load_train_state refuses that, saying what to do)."""
    ckpt = Path(ckpt)
    if not (ckpt / STATE_JSON).exists() and not (ckpt / LEGACY_STATE).exists():
        return None
    if (ckpt / STATE_JSON).exists():
        f = ckpt / STATE_JSON
        st = read_json(f, STATE_BYTES, CheckpointError, DAMAGED)
        if isinstance(st, dict) and "loader" in st:
            try:  # NumPy scalars as they were saved; a tensor (a rollout's) as None, as it is not read here
                st = {"loader": decode_state(st["loader"], _Unread())}
            except (ValueError, TypeError, AttributeError, RecursionError) as e:
                raise CheckpointError(
                    f"{f}: the loader is unreadable ({type(e).__name__}: {e}); {DAMAGED}") from e
    else:
        st, f = load_train_state(ckpt), ckpt / LEGACY_STATE
    if not isinstance(st, dict):
        raise CheckpointError(f"{f} is a {type(st).__name__}, not a training state; {DAMAGED}")
    if "loader" not in st:
        raise CheckpointError(f"{f} has no loader (the data cursor); {DAMAGED}, or start a new run from its "
                              f"weights with --init-from {ckpt}")
    return st["loader"], f


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
            raise CheckpointError(f"the training state in {ckpt} is unreadable ({type(e).__name__}: {e}); "
                                  f"the checkpoint is damaged: use another one") from e
        return check_counters(st, ckpt / STATE_JSON, ckpt)
    if (ckpt / LEGACY_STATE).exists():
        check_regular(ckpt / LEGACY_STATE, CheckpointError, DAMAGED)
        return check_counters(_load_legacy_state(ckpt), ckpt / LEGACY_STATE, ckpt)
    raise CheckpointError(f"{ckpt} holds no training state ({STATE_JSON}), so it cannot be resumed; start a "
                          f"new run from its weights with --init-from {ckpt}")


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
    except Exception as e:  # a damaged file fails in many ways
        if not (isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e)):
            raise CheckpointError(f"{f} is unreadable ({type(e).__name__}: {str(e)[:300]}); the checkpoint "
                                  f"is damaged: use another one") from e
        names = {f"{g.__module__}.{g.__qualname__}" for g in allowed}
        try:
            others = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(f)) - names)
        except Exception:  # only for the message
            others = []
        holds = f" (it names {', '.join(others[:8])})" if others else ""
        raise CheckpointError(
            f"{f}, written by an older codeforge, holds more than tensors and plain values{holds}: loading "
            "it would run code from the file, so it was not loaded. If you trust this run, start a new one "
            "from its weights, which load safely: "
            f"codeforge train --init-from {ckpt} --out NEW_RUN ...") from e
    if not isinstance(st, dict) or "step" not in st:
        raise CheckpointError(f"{f} is not a codeforge training state")
    return st
