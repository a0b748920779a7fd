"""Checkpoints: atomic, verified save; keep-last-N plus best and final; exact resume; the compatibility checks;
the run-directory lock; and loading a model for inference. Model-agnostic: models are built through the
registry by the saved `arch`.

RUN/checkpoints/step_NNNNNN/
  model.safetensors        weights (tied tensors stored once)
  config.json              the resolved run configuration (model + train), the tokenizer hash and the
                           training data's identity (`data_identity`: see data_identity())
  train_state.safetensors  every tensor of the training state (optimizer moments, RNG states)
  train_state.json         the rest of it (step and token counters, loader cursor, scaler, Python and NumPy
                           RNG states), with {"__tensor__": key} where a tensor of the file above goes
  tokenizer/               the tokenizer, so a checkpoint alone can generate
  manifest.json            {"format", "step", "files": {relative path: {"bytes", "sha256"}}}: every file
                           above, hashed after it was written; written last
  sharded/                 instead of model.safetensors and the optimizer moments, in runs with --parallel
                           fsdp: a torch.distributed.checkpoint (DCP) directory, `.metadata` plus one
                           `__R_0.distcp` per rank, written by every rank in parallel. It holds the weights
                           ("model.*") and the optimizer state ("optim.*") by parameter name, so it loads on
                           any number of ranks (DCP reshards), on one process (resume, generate, export), and
                           into DDP. For several nodes, RUN must be on a filesystem all of them see.
RUN/checkpoints/latest, best, final   one line each: the name of a step directory
RUN/.train.lock            flock()ed by the training process for the whole run (its PID inside)

Safety. Loading a checkpoint runs no code from it: weights and state tensors are safetensors, the rest is
JSON. Checkpoints of older codeforge versions (train_state.pt, no manifest) are read with
torch.load(weights_only=True), which admits only tensors, plain values and NumPy arrays; one holding anything
else is refused, never unpickled.

Damage. A checkpoint is written to a hidden temporary directory and renamed into place, and `latest` is
replaced atomically after that, so a crash (even kill -9) never leaves a half-written checkpoint behind
`latest`; the manifest catches what the rename cannot (a truncated or changed file, a disk that lost
unsynced data). find_checkpoint() checks it before trusting a checkpoint:
  - `latest` (and `auto` when its `best` is damaged) falls back to the newest intact step and says which
    one it skipped and why; --resume then trains the skipped steps again;
  - a named checkpoint directory, `best` or `final` is refused with the reason (the caller asked for that one).
A checkpoint without a manifest (older codeforge) is checked as far as it can be without one: on --resume
its files must open (safetensors header, JSON, the zip CRCs of train_state.pt); elsewhere a file that does
not load is reported by name when it is loaded.

A failed write (a full disk, or any OSError) removes the unfinished checkpoint, leaves `latest` and the
earlier checkpoints as they were, and raises CheckpointWriteError saying what happened and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import socket
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file as st_load_file
from safetensors.torch import load_model as st_load_model
from safetensors.torch import save_file as st_save_file
from safetensors.torch import save_model as st_save_model

from . import CodeforgeError
from .atomic import publish, staging_dir
from .fields import ConfigError

STEP_PREFIX = "step_"
STEP_RE = re.compile(r"step_\d+")
POINTERS = ("latest", "best", "final")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "codeforge-checkpoint/2"
STATE_TENSORS = "train_state.safetensors"
STATE_JSON = "train_state.json"
LEGACY_STATE = "train_state.pt"  # pickled by codeforge before the manifest; read only with weights_only=True
LOCK_FILE = ".train.lock"
SHARDED = "sharded"  # the DCP directory of an FSDP run's checkpoint


class CheckpointError(CodeforgeError):
    pass


class NoCheckpointError(CheckpointError):
    """The run has no checkpoint at all (as opposed to only damaged ones)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written; nothing earlier was lost."""


class RunLockedError(CheckpointError):
    """Another process is training in the run directory."""


# -- pointers ---------------------------------------------------------------------------------------------

def _write_pointer(ckpt_root: Path, name: str, target: str) -> None:
    tmp = ckpt_root / f".{name}.tmp"
    try:
        tmp.write_text(target + "\n")
        os.replace(tmp, ckpt_root / name)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _pointer_target(ckpt_root: Path, name: str) -> Path | None:
    """The step directory a pointer names (whether or not it exists), or None without a readable pointer."""
    try:
        text = (ckpt_root / name).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return ckpt_root / text if STEP_RE.fullmatch(text) else None


def _read_pointer(ckpt_root: Path, name: str) -> Path | None:
    p = _pointer_target(ckpt_root, name)
    return p if p is not None and ((p / "model.safetensors").exists() or is_sharded(p)) else None


def _step_of(p: Path) -> int:
    """The step of a step_NNNNNN directory: numeric, so step_1000000 sorts after step_999500."""
    return int(p.name[len(STEP_PREFIX):])


def _step_dirs(root: Path) -> list[Path]:
    """step_NNNNNN directories under checkpoints/, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_RE.fullmatch(p.name) and p.is_dir()), key=_step_of)


# -- RNG ----------------------------------------------------------------------------------------------------

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


# -- the training state as safetensors + JSON ---------------------------------------------------------------
# A nested structure of dicts, lists, tuples, str/int/float/bool/None, tensors, NumPy arrays and scalars is
# stored as JSON with tagged objects where JSON has no type of its own; tensors go to the safetensors file by
# key. Decoding builds only those types, so a tampered file can at worst give wrong numbers (which the
# manifest catches), never run code. JSON floats round-trip exactly (repr), inf/nan included.

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


# -- manifest and verification --------------------------------------------------------------------------------

def _sha256(f: Path) -> str:
    with open(f, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _file_entries(d: Path, files) -> dict:
    return {f.relative_to(d).as_posix(): {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files}


def _write_manifest(d: Path, step: int, known: dict | None = None) -> None:
    """known: entries already hashed (by the ranks that wrote those files)."""
    known = known or {}
    files = {**_file_entries(d, (f for f in sorted(d.rglob("*"))
                                 if f.is_file() and f.relative_to(d).as_posix() not in known)), **known}
    files = dict(sorted(files.items()))
    (d / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": files}, indent=1) + "\n")


_verified: dict[tuple, str | None] = {}  # (checkpoint, train_state, every file's (name, size, mtime)) -> result


def verify_checkpoint(ck: str | Path, train_state: bool = True) -> str | None:
    """None if checkpoint `ck` is intact, else why not (naming the file). train_state=False checks only what
    inference needs (weights, config, tokenizer). Results are remembered while no file changes."""
    ck = Path(ck)
    try:
        sig = tuple(sorted((str(f.relative_to(ck)), st.st_size, st.st_mtime_ns)
                           for f in ck.rglob("*") if f.is_file() for st in [f.stat()]))
    except OSError as e:
        return f"it cannot be read ({e})"
    key = (str(ck.resolve()), train_state, sig)
    if key not in _verified:
        if len(_verified) > 64:
            _verified.clear()
        _verified[key] = _verify(ck, train_state)
    return _verified[key]


def _verify(ck: Path, train_state: bool) -> str | None:
    if not (ck / MANIFEST).exists():
        return _verify_legacy(ck, train_state)
    try:
        man = json.loads((ck / MANIFEST).read_text())
        files = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in man["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    weights = f"{SHARDED}/.metadata" if any(k.startswith(f"{SHARDED}/") for k in files) else "model.safetensors"
    needed = {weights, "config.json"} | ({STATE_TENSORS, STATE_JSON} if train_state else set())
    unlisted = sorted(needed - set(files))
    if unlisted:
        return f"{unlisted[0]} is not in {MANIFEST}"
    no_tokenizer = not (ck / "tokenizer").exists()  # removed as a whole: load_model says what to do
    for rel, (size, sha) in files.items():
        if (not train_state and rel.startswith("train_state")) or (no_tokenizer and rel.startswith("tokenizer/")):
            continue
        if rel.startswith("/") or ".." in Path(rel).parts:
            return f"{MANIFEST} names a file outside the checkpoint ({rel})"
        f = ck / rel
        if not f.is_file():
            return f"{rel} is missing"
        have = f.stat().st_size
        if have != size:
            return f"{rel} is {have:,} bytes but was saved with {size:,} (truncated or overwritten)"
        if _sha256(f) != sha:
            return f"{rel} does not match the sha256 recorded when it was saved (damaged or changed on disk)"
    return None


def _verify_legacy(ck: Path, train_state: bool) -> str | None:
    """A checkpoint without a manifest. For inference only its weights' presence (load_weights reports a file
    that does not load); for --resume, that every file opens, without unpickling anything."""
    if not (ck / "model.safetensors").is_file():
        return "model.safetensors is missing"
    if not train_state:
        return None
    try:
        json.loads((ck / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"config.json is unreadable ({type(e).__name__}: {e})"
    try:
        with safe_open(str(ck / "model.safetensors"), "pt") as f:
            list(f.keys())
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        return f"model.safetensors is unreadable ({e})"
    if (ck / STATE_JSON).exists():  # the new state without its manifest: written by hand, or the manifest lost
        try:
            json.loads((ck / STATE_JSON).read_text())
            with safe_open(str(ck / STATE_TENSORS), "pt") as f:
                list(f.keys())
        except (OSError, SafetensorError, ValueError, RuntimeError) as e:
            return f"the training state is unreadable ({e})"
        return None
    if not (ck / LEGACY_STATE).is_file():
        return f"it has no training state ({STATE_JSON} or {LEGACY_STATE})"
    try:
        with zipfile.ZipFile(ck / LEGACY_STATE) as z:
            bad = z.testzip()  # CRC of every member: reads the bytes, unpickles nothing
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"{LEGACY_STATE} is unreadable ({e})"
    if bad is not None:
        return f"{LEGACY_STATE} is damaged (checksum error in {bad})"
    return None


# -- save ---------------------------------------------------------------------------------------------------

def _nbytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.dtype, t.shape) if t.numel() else None
        if key not in seen:
            seen.add(key)
            n += t.numel() * t.element_size()
    return n


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    s = str(e)  # safetensors' writer reports the OS error in its message
    return "os error 28" in s or "No space left" in s or "os error 122" in s or "quota exceeded" in s.lower()


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _write_failure(e: BaseException, root: Path, name: str, need: int, before: str | None) -> str:
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    kept = (f"`latest` still names {before} and the earlier checkpoints are intact" if before
            else "there was no earlier checkpoint")
    lost = f"Nothing earlier was lost: the unfinished {name} was removed, {kept}."
    if _disk_full(e):
        room = f" and {_mb(free)} are free there" if free is not None else ""
        return (f"could not write checkpoint {name} in {root}: the disk is full ({e}). A checkpoint of this run "
                f"needs about {_mb(need)}{room}. {lost} Free space on that disk (delete old runs, lower "
                f"--keep-last) or move the run directory to a larger disk, then continue with --resume.")
    return (f"could not write checkpoint {name} in {root}: {type(e).__name__}: {e}. {lost} Fix the cause, then "
            f"continue with --resume.")


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, config: dict, train_state: dict,
                    assets: dict[str, Path] | None, keep_last: int, best: bool = False,
                    final: bool = False) -> Path:
    """Write step_NNNNNN aside (files, then the manifest over them) and rename it into place; `assets` are
    directories copied in by name (the tokenizer). Then move the pointers and prune to keep_last plus the
    pointed-to steps. A failed write raises CheckpointWriteError and changes nothing that was there."""
    root, name, before = _begin(run_dir, step)
    skeleton, tensors = encode_state(train_state)
    need = (_nbytes(model.state_dict().values()) + _nbytes(tensors.values())
            + sum(_dir_bytes(src) for src in (assets or {}).values()))
    tmp = None
    try:
        tmp = staging_dir(root / name)
        st_save_model(model, str(tmp / "model.safetensors"))
        _write_rest(tmp, step, config, skeleton, tensors, assets)
        publish(tmp, root / name)  # replaces the same step saved earlier (e.g. on SIGTERM right after a periodic save)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):
            raise CheckpointWriteError(_write_failure(e, root, name, need, before)) from e
        raise
    return _point_and_prune(root, name, keep_last, best, final)


def _begin(run_dir: str | Path, step: int) -> tuple[Path, str, str | None]:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    before = _pointer_target(root, "latest")
    return root, f"{STEP_PREFIX}{step:06d}", before.name if before is not None else None


def _write_rest(tmp: Path, step: int, config: dict, skeleton, tensors: dict, assets: dict | None,
                known: dict | None = None) -> None:
    """Everything of a checkpoint but its weights, then the manifest over all of it."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    st_save_file(tensors, str(tmp / STATE_TENSORS))
    (tmp / STATE_JSON).write_text(json.dumps(skeleton))
    for asset, src in (assets or {}).items():
        shutil.copytree(src, tmp / asset)
    _write_manifest(tmp, step, known)


def save_sharded_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer, config: dict,
                            train_state: dict, assets: dict[str, Path] | None, keep_last: int, best: bool = False,
                            final: bool = False, background_group=None) -> "ShardedSave":
    """save_checkpoint for an FSDP run, called by every rank together: rank 0 makes the staging directory,
    every rank writes its shards of the weights and optimizer state into it with DCP (in parallel), then
    rank 0 writes the rest (`train_state` without the optimizer, which is in the shards), the manifest,
    renames it into place and moves the pointers, and tells the others how it went. The same atomicity:
    a failure on any rank removes the unfinished directory, and every rank raises CheckpointWriteError.

    Returns a ShardedSave; call `finish()` on every rank (together) to publish it. background_group: a
    process group of its own (gloo) for DCP's `async_save`: the state is copied aside now and written by a
    background thread while training goes on, and `finish()` waits for it; None: written before returning."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank = dist.get_rank()
    root, name, before = _begin(run_dir, step)
    need = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + two AdamW moments
    msg: list = [None, None]  # (staging dir or None, error or None), from rank 0
    if rank == 0:
        try:
            msg[0] = str(staging_dir(root / name))
        except OSError as e:
            msg[1] = _write_failure(e, root, name, need, before)
    dist.broadcast_object_list(msg, src=0)
    if msg[1]:
        raise CheckpointWriteError(msg[1])
    job = ShardedSave(root, name, Path(msg[0]), step, need, before, config, assets, keep_last, best, final)
    job.state = encode_state(train_state) if rank == 0 else None  # as it is now, not when finished
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    if background_group is not None:
        job.future = dcp.async_save(state, checkpoint_id=str(job.tmp / SHARDED), process_group=background_group)
        return job
    try:
        dcp.save(state, checkpoint_id=str(job.tmp / SHARDED))
    except Exception as e:  # DCP gathers every rank's failure and raises it on all of them
        job.failed(e)
    return job


class ShardedSave:
    """A sharded checkpoint on its way: its shards written (or being written in the background), the rest
    and the publishing left to `finish()`."""

    def __init__(self, root, name, tmp, step, need, before, config, assets, keep_last, best, final):
        self.root, self.name, self.tmp, self.step, self.need, self.before = root, name, tmp, step, need, before
        self.config, self.assets, self.keep_last, self.best, self.final = config, assets, keep_last, best, final
        self.future = None
        self.state = None

    def done(self) -> bool:
        """This rank's part is written (a background write has ended, well or not)."""
        return self.future is None or self.future.done()

    def failed(self, e: Exception):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        from .train.parallel import lost_peer
        if lost_peer(e):  # not the disk: another rank is gone (the trainer says so)
            raise e
        # DCP wraps each rank's failure; the first OSError among them keeps its errno (a full disk says so)
        inner = [x for x in [e, e.__cause__, *getattr(e, "failures", {}).values()] if isinstance(x, OSError)]
        raise CheckpointWriteError(_write_failure(inner[0] if inner else OSError(str(e)), self.root, self.name,
                                                  self.need, self.before)) from e

    def finish(self) -> Path:
        """Every rank together: wait for the shards, then rank 0 writes the rest, renames the directory into
        place and moves the pointers; all ranks raise CheckpointWriteError if that failed."""
        import torch.distributed as dist
        if self.future is not None:
            try:
                self.future.result()
            except Exception as e:
                self.failed(e)
        # every rank hashes the shard files it wrote (in parallel), rank 0 the rest
        rank = dist.get_rank()
        try:
            mine = _file_entries(self.tmp, sorted((self.tmp / SHARDED).glob(f"__{rank}_*")))
        except OSError as e:  # said on rank 0, not raised here: the others would wait for this rank
            mine = {"": f"rank {rank} could not read back its shard: {e}"}
        hashed: list = [None] * dist.get_world_size()
        dist.all_gather_object(hashed, mine)
        result: list = [None]
        if rank == 0:
            try:
                unread = [h[""] for h in hashed if "" in h]
                if unread:
                    raise OSError("; ".join(unread))
                _write_rest(self.tmp, self.step, self.config, *self.state, self.assets,
                            {k: v for h in hashed for k, v in h.items()})
                publish(self.tmp, self.root / self.name)
                _point_and_prune(self.root, self.name, self.keep_last, self.best, self.final)
            except (OSError, SafetensorError, CheckpointWriteError) as e:
                shutil.rmtree(self.tmp, ignore_errors=True)
                result[0] = str(e) if isinstance(e, CheckpointWriteError) else _write_failure(
                    e, self.root, self.name, self.need, self.before)
        dist.broadcast_object_list(result, src=0)
        if result[0]:
            raise CheckpointWriteError(result[0])
        return self.root / self.name


def _point_and_prune(root: Path, name: str, keep_last: int, best: bool, final: bool) -> Path:
    final_dir = root / name
    try:
        _write_pointer(root, "latest", name)
        if best:
            _write_pointer(root, "best", name)
        if final:
            _write_pointer(root, "final", name)
    except OSError as e:
        now = _pointer_target(root, "latest")
        raise CheckpointWriteError(
            f"checkpoint {final_dir} was written completely, but a pointer beside it could not be updated "
            f"({e}); `latest` names {now.name if now else 'nothing'}. Free space on that disk, then continue with "
            f"--resume (it continues from the checkpoint `latest` names).") from e
    _prune(root, keep_last)
    return final_dir


def _prune(root: Path, keep_last: int) -> None:
    steps = _step_dirs(root)
    keep = set(steps[-keep_last:])
    for ptr in POINTERS:
        p = _read_pointer(root, ptr)
        if p is not None:
            keep.add(p)
    for p in steps:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():  # unfinished saves of a crashed process (atomic.py restores a lone `.old-` copy)
        if p.name.startswith(f".{STEP_PREFIX}") and ".tmp-" in p.name and not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


# -- find and load ----------------------------------------------------------------------------------------------

def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def _is_checkpoint_dir(p: Path) -> bool:
    return (p / "model.safetensors").exists() or (p / MANIFEST).exists() or is_sharded(p)


def is_sharded(ck: str | Path) -> bool:
    """True for a checkpoint written by an FSDP run (weights and optimizer state in DCP shards)."""
    return (Path(ck) / SHARDED).is_dir()


def _dcp_load(state: dict, ck: Path, alone: bool = False) -> None:
    """Load the tensors of `state` in place from the checkpoint's DCP shards, resharding to however `state`
    is laid out (DTensor shards on any number of ranks, or whole tensors in one process). alone: this
    process reads whole tensors for itself, even inside a process group (no collective: the other ranks
    need not be loading too)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # one process: DCP says it assumes so, which is what is meant
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load(state, checkpoint_id=str(ck / SHARDED), no_dist=alone)
        except Exception as e:  # a missing key, another shape, an unreadable shard: all raised as one kind
            raise CheckpointError(f"{ck / SHARDED}: the sharded checkpoint does not load into this model "
                                  f"({type(e).__name__}: {str(e)[:600]}); the checkpoint is damaged or was "
                                  f"written for another model") from e


def load_whole_into_sharded(model: torch.nn.Module, optimizer, ck: Path, optimizer_state: dict) -> None:
    """A whole checkpoint (one process or DDP: model.safetensors, the optimizer's state by parameter index)
    into an FSDP model and its optimizer: every rank reads it whole, keys the optimizer state by parameter
    name (the order of the optimizer's groups, which the same model builds the same way), and PyTorch's
    set_state_dict keeps this rank's shard of each."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    try:
        weights = st_load_file(str(Path(ck) / "model.safetensors"), device="cpu")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{ck}/model.safetensors cannot be read ({e}); the checkpoint is damaged") from e
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for ids in names.values():  # tied weights are stored once: give every name its tensor
        have = [n for n in ids if n in weights]
        for n in ids:
            if have and n not in weights:
                weights[n] = weights[have[0]]
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = optimizer_state["param_groups"]
    if sum(len(g["params"]) for g in saved_groups) != len(flat):
        raise CheckpointError(f"{ck}: its optimizer state has {sum(len(g['params']) for g in saved_groups)} "
                              f"parameters and this model's optimizer {len(flat)}; it was written for another model")
    fqn = {}
    for g in saved_groups:
        for i in g["params"]:
            fqn[i] = names[id(flat[len(fqn)])][0]
    osd = {"state": {fqn[int(i)]: v for i, v in optimizer_state["state"].items()},
           "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in saved_groups]}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))


def load_sharded_state(model: torch.nn.Module, optimizer, ck: Path) -> None:
    """Weights and optimizer state of a sharded checkpoint into `model` and `optimizer`, on this run's ranks
    (FSDP on any world size, DDP, or one process): DCP reshards them by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    _dcp_load(state, Path(ck))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def latest_step(run_dir: str | Path) -> Path | None:
    """The step directory RUN/checkpoints/latest names (unverified), or None."""
    return _pointer_target(Path(run_dir) / "checkpoints", "latest")


def find_checkpoint(path: str | Path, which: str = "latest", *, train_state: bool = False,
                    log: Callable[[str], None] | None = None, verify: bool = True) -> Path:
    """An intact checkpoint directory from a checkpoint path, or from a run directory by pointer: "latest",
    "best", "final", or "auto" (best if the run has one, else latest). train_state: it will be resumed, so
    its training state must be intact too.

    `latest` that is missing or damaged falls back to the newest intact step before it, and so does `auto`
    whose best is damaged; `log` (default: stderr) says which was skipped and why. A checkpoint directory
    given by path, `best` and `final` are never swapped for another: damaged, they are refused. Asking for
    best or final when the run has none says so by name. NoCheckpointError: the run has no checkpoint.
    verify=False: follow the pointers without hashing the files (to read a configuration; whatever loads the
    weights verifies them)."""
    check = verify_checkpoint if verify else (lambda c, state: None)
    if which not in (*POINTERS, "auto"):
        raise CheckpointError(f"checkpoint {which!r} is not one of {POINTERS + ('auto',)}")
    say = log or _warn
    p = Path(path)
    if _is_checkpoint_dir(p):
        why = check(p, train_state)
        if why:
            run = f" ({p.parent.parent})" if p.parent.name == "checkpoints" else ""
            raise CheckpointError(f"checkpoint {p} is damaged: {why}. Use another checkpoint, or pass the run "
                                  f"directory{run} to take its newest intact one")
        return p
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: pass a run directory (from `codeforge train --out`) or a "
                              f"checkpoint directory")
    root = p / "checkpoints"
    steps = _step_dirs(root)
    if not steps and _step_dirs(p):  # RUN/checkpoints itself was given
        raise CheckpointError(f"{p} is the checkpoints folder of a run: pass the run directory {p.parent} "
                              f"(or one checkpoint, e.g. {_step_dirs(p)[-1]})")
    if not steps:
        raise NoCheckpointError(f"no checkpoint in {p}: train first (`codeforge train --out {p}`) or pass a "
                                f"checkpoint directory")
    if which == "auto":
        best = _pointer_target(root, "best")
        if best is None:
            which = "latest"
        else:
            why = check(best, train_state) if best.is_dir() else "it is missing"
            if why is None:
                return best
            say(f"the best checkpoint {best} is damaged: {why}; taking the newest intact one instead")
            which = "latest"
    if which in ("best", "final"):
        target = _pointer_target(root, which)
        if target is None:
            why = ("no evaluated step was saved (no validation split, or --eval-every 0)" if which == "best"
                   else "the run has not finished")
            raise CheckpointError(f"{p} has no '{which}' checkpoint: {why}; use --checkpoint latest")
        why = check(target, train_state) if target.is_dir() else "it is missing"
        if why:
            raise CheckpointError(f"the '{which}' checkpoint {target} is damaged: {why}. Use --checkpoint latest "
                                  f"for the newest intact one, or pass another step directory")
        return target
    target = _pointer_target(root, "latest")  # None after a crash between save and pointer: the newest step
    candidates = steps[::-1] if target is None else [target] + [s for s in steps[::-1] if _step_of(s) < _step_of(target)]
    bad: list[tuple[Path, str]] = []
    for c in candidates:
        why = check(c, train_state) if c.is_dir() else "it is missing"
        if why is None:
            if bad:
                skipped = "; ".join(f"{b} is damaged: {w}" for b, w in bad)
                say(f"{skipped}; using {c.name}, the newest intact checkpoint")
            return c
        bad.append((c, why))
    listing = "; ".join(f"{b.name}: {w}" for b, w in bad)
    raise CheckpointError(f"no intact checkpoint in {root} ({listing}). Start again with another --out (or remove "
                          f"{root} to train from scratch here)")


def read_config(ckpt: Path) -> dict:
    f = Path(ckpt) / "config.json"
    if f.exists() and not f.is_file():  # a FIFO or a device would block the read
        raise CheckpointError(f"{f} is not a regular file; the checkpoint is damaged: use another one")
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}/config.json is unreadable ({type(e).__name__}: {e}); the checkpoint is "
                              f"damaged: use another one") from e


def load_weights(model: torch.nn.Module, ckpt: Path, new_ok: tuple[str, ...] = ()) -> None:
    """The checkpoint's weights into `model`, every key matched; `new_ok`: prefixes of parameters the model
    may have that the checkpoint lacks (a head added on a trained trunk keeps its initialisation)."""
    if is_sharded(ckpt):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             set_model_state_dict)
        sd = {k: v for k, v in get_model_state_dict(model).items() if not (new_ok and k.startswith(new_ok))}
        state = {"model": sd}
        _dcp_load(state, Path(ckpt), alone=True)  # a whole model in this process, whatever other ranks do
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not new_ok))
        return
    f = Path(ckpt) / "model.safetensors"
    try:
        missing, unexpected = st_load_model(model, str(f), strict=False)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{f} cannot be read ({e}); the checkpoint is damaged: use another one") from e
    except RuntimeError as e:  # a tensor of another shape
        raise CheckpointError(f"{f}: weights do not fit the model ({e})") from e
    missing = [k for k in missing if not k.startswith(new_ok)] if new_ok else missing
    if missing or unexpected:
        raise CheckpointError(f"{ckpt}: weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def load_train_state(ckpt: Path) -> dict:
    """The training state saved with a checkpoint, loaded without running any code from it."""
    ckpt = Path(ckpt)
    if (ckpt / STATE_JSON).exists():
        try:
            skeleton = json.loads((ckpt / STATE_JSON).read_text())
            return decode_state(skeleton, st_load_file(str(ckpt / STATE_TENSORS), device="cpu"))
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError,
                SafetensorError) as e:
            raise CheckpointError(f"the training state in {ckpt} is unreadable ({type(e).__name__}: {e}); the "
                                  f"checkpoint is damaged: use another one") from e
    if (ckpt / LEGACY_STATE).exists():
        return _load_legacy_state(ckpt)
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


# -- resume: what must not change ----------------------------------------------------------------------------

# The saved optimizer state and data cursor mean something only with these unchanged: the cursor counts
# batches of this size in this seed's order of this data; the optimizer's saved param groups carry its
# betas and weight decay (they would silently override new ones).
# muon_*: the optimizer state restores its groups' rate ratio, momentum and decay, so a change would not apply
RESUME_FIXED = ("stage", "batch_size", "grad_accum_steps", "seed", "optimizer", "weight_decay", "beta1", "beta2",
                "fim_rate", "fim_spm_rate", "muon_lr", "muon_momentum", "muon_weight_decay")
# Applied step by step from the configuration, so a change takes effect from the resumed step on; the run is
# then no longer the one a straight run would give, which --resume says.
RESUME_NOTED = ("learning_rate", "min_lr_ratio", "schedule", "warmup_steps", "decay_fraction", "grad_clip",
                "precision", "eval_tokens")
# The budget: extending a run is what --resume is for; only the schedule's shape follows it.
RESUME_BUDGET = ("max_iters", "max_tokens", "epochs")


def data_identity(data_dir: str | Path, sample: int = 1 << 16) -> dict:
    """What the training split of a prepared data directory is, cheaply enough to take at every start: the
    tokenizer, the kind of data, its token and document counts, and for every train_* file its size and the
    sha256 of three `sample`-byte pieces (start, middle, end): a changed, added or removed shard shows."""
    d = Path(data_dir)
    meta = json.loads((d / "meta.json").read_text())
    files = {}
    for f in sorted(d.glob("train_*")):
        n = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for off in sorted({0, max(0, n // 2 - sample // 2), max(0, n - sample)}):
                fh.seek(off)
                h.update(fh.read(sample))
        files[f.name] = f"{n} bytes, sha256 of samples {h.hexdigest()[:16]}"
    tr = meta["splits"]["train"]
    return {"tokenizer_hash": meta.get("tokenizer_hash"), "chat": bool(meta.get("chat")), "tokens": tr["tokens"],
            "documents": tr["documents"], "files": files}


def jsonl_identity(path: str | Path, tok_hash: str, names: tuple[str, ...] = ("train.jsonl",)) -> dict:
    """data_identity for stages that read JSONL (hrm, reward, dpo, ppo, grpo): the size and sha256 of the
    file, or of the named files in a directory, so --resume refuses other data."""
    p = Path(path)
    files = [p] if p.is_file() else [p / n for n in names if (p / n).is_file()]
    return {"tokenizer_hash": tok_hash, "chat": False, "tokens": None, "documents": None,
            "files": {f.name: f"{f.stat().st_size} bytes, sha256 {hashlib.sha256(f.read_bytes()).hexdigest()[:16]}"
                      for f in files}}


def _data_diff(saved: dict, now: dict) -> list[str]:
    out = [f"data {k} {saved.get(k)!r} -> {now.get(k)!r}" for k in ("tokenizer_hash", "chat", "tokens", "documents")
           if saved.get(k) != now.get(k)]
    a, b = saved.get("files", {}), now.get("files", {})
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(f"data file {name} is gone")
        elif name not in a:
            out.append(f"data file {name} is new")
        elif a[name] != b[name]:
            out.append(f"data file {name} changed ({a[name]} -> {b[name]})")
    return out


def check_resume(ck: Path, run_config: dict) -> list[str]:
    """Compare the run about to resume with the one saved in checkpoint `ck`. Raises ConfigError listing every
    difference that breaks the saved state (RESUME_FIXED, the training data); returns notes for the settings
    that take effect from here on (RESUME_NOTED, dropout)."""
    saved = read_config(ck)
    st, nt = saved.get("train", {}), run_config["train"]
    notes = []
    keys = RESUME_FIXED
    sw, nw = saved.get("world_size") or _saved_world(ck), run_config.get("world_size")
    chat = bool((saved.get("data_identity") or {}).get("chat"))
    if sw and nw and sw != nw and "batch_size" in st and not chat:
        keys = tuple(k for k in RESUME_FIXED if k not in ("batch_size", "grad_accum_steps"))
        notes += _world_change(st, nt, sw, nw)
    fixed = [f"train.{k} {st[k]!r} -> {nt[k]!r}" for k in keys if k in st and st[k] != nt[k]]
    if sw and nw and sw != nw and chat:
        fixed.append(f"the number of ranks {sw} -> {nw} (chat batches are packed per rank from its own share of "
                     f"the conversations, so a chat run resumes on as many ranks as it was saved with)")
    elif sw and nw and sw != nw and "batch_size" in st:
        was, now = st["batch_size"] * st["grad_accum_steps"] * sw, nt["batch_size"] * nt["grad_accum_steps"] * nw
        if was != now:
            fixed.append(f"the global batch {st['batch_size']} x {st['grad_accum_steps']} x {sw} rank(s) = {was} "
                         f"sequences -> {nt['batch_size']} x {nt['grad_accum_steps']} x {nw} = {now} (set "
                         f"--batch-size and --grad-accum-steps so that their product times {nw} ranks is {was})")
    sd, nd = saved.get("data_identity"), run_config.get("data_identity")
    if sd is None:
        notes.append(f"{ck} records no identity of its training data (older codeforge): not checked that "
                     f"{nt['data']} is the same data")
    elif nd is not None:
        fixed += _data_diff(sd, nd)
    if fixed:
        fix = ["drop the options that change them (the saved settings are in RUN/config.toml)"]
        if any(x.startswith("data") for x in fixed):
            fix.append(f"point --data at the data the run was trained on (it was {st.get('data')})")
        raise ConfigError(
            f"--resume from {ck}: this run differs from the saved one where its optimizer state and data cursor "
            f"depend on it (checkpoint -> now): {'; '.join(fixed)}. To continue that run exactly, "
            f"{' and '.join(fix)}; or start a new run from its weights with these settings: "
            f"--init-from {ck} --out NEW_RUN")
    changed = [f"train.{k} {st[k]!r} -> {nt[k]!r}" for k in RESUME_NOTED if k in st and st[k] != nt[k]]
    sm, nm = saved.get("model", {}), run_config["model"]
    changed += [f"model.{k} {sm[k]!r} -> {nm[k]!r}" for k in sm if k.endswith("dropout") and sm[k] != nm.get(k)]
    if changed:
        notes.append(f"resuming with changed settings, in effect from the resumed step on (so the run is no "
                     f"longer what an uninterrupted one would give): {'; '.join(changed)}")
    budget = [f"train.{k} {st[k]!r} -> {nt[k]!r}" for k in RESUME_BUDGET if k in st and st[k] != nt[k]]
    if budget and not st.get("schedule") == nt["schedule"] == "constant":
        notes.append(f"the budget changed ({'; '.join(budget)}): the {nt['schedule']} learning-rate schedule runs "
                     f"over the new budget from the resumed step on")
    return notes


def _saved_world(ck: Path) -> int | None:
    """The number of ranks a checkpoint written before config.json recorded it was trained on, from its
    loader cursor (None when unknown)."""
    try:
        w = json.loads((Path(ck) / STATE_JSON).read_text()).get("loader", {}).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return w if isinstance(w, int) and w > 0 else None


def _world_change(st: dict, nt: dict, sw: int, nw: int) -> list[str]:
    """A resume on another number of ranks keeps the global batch (sequences per optimizer step): with the
    saved batch size and accumulation unchanged, the accumulation is scaled to make up for the ranks (it is
    set in `nt`, the run's train section, which the stage then uses). Says what changes."""
    was = st["batch_size"] * st["grad_accum_steps"] * sw
    same = nt["batch_size"] == st["batch_size"] and nt["grad_accum_steps"] == st["grad_accum_steps"]
    if same and was % (nt["batch_size"] * nw) == 0:
        nt["grad_accum_steps"] = was // (nt["batch_size"] * nw)
    if nt["batch_size"] * nt["grad_accum_steps"] * nw != was:
        return []  # check_resume refuses it, saying what to set
    return [f"resuming on {nw} rank(s), saved on {sw}: the global batch stays {was} sequences (batch "
            f"{nt['batch_size']} x accumulation {nt['grad_accum_steps']} x {nw} ranks) and the data continues where "
            f"it stopped; what changes is how it is split over ranks, so dropout masks and the order in which "
            f"gradients are summed (float rounding) differ from a run that kept {sw} rank(s)"]


# -- the run-directory lock -----------------------------------------------------------------------------------

@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold an exclusive flock() on RUN/.train.lock while training: a second trainer on the same run directory
    is refused (naming the holder's PID) instead of overwriting its checkpoints. The kernel frees the lock
    when the holding process ends in any way (kill -9 included); the file stays, harmless."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(f"cannot create the run directory's lock {path}: {e}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"cannot lock {path}: {e}") from e
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                holder = {}
            holder = holder if isinstance(holder, dict) else {}
            who = (f"PID {holder.get('pid')} on {holder.get('host')}, training since {holder.get('started')}"
                   if holder.get("pid") else "PID unknown")
            raise RunLockedError(
                f"{run_dir} is in use by another training process ({who}); two trainers in one run directory "
                f"would overwrite each other's checkpoints. Wait for it to finish (or stop it), or train into "
                f"another --out. (The lock is {path}; it is released when that process ends.)") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


# -- inference ---------------------------------------------------------------------------------------------------

def load_model(path: str | Path, device: torch.device, which: str = "auto",
               log: Callable[[str], None] | None = None):
    """(model in eval mode, tokenizer, checkpoint dir, saved config) from a run or checkpoint directory; a
    damaged checkpoint is skipped or refused as find_checkpoint() says."""
    from .models import build_model
    from .tokenizer import CodeTokenizer, TokenizerError
    ck = find_checkpoint(path, which, log=log)
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
