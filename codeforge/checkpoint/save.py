"""Writing a checkpoint: aside, verified, published by rename; the sharded (DCP) form of FSDP runs,
background saves, keep-last-N with best and final."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file as st_save_file
from safetensors.torch import save_model as st_save_model

from .. import rundir
from ..atomic import publish, staging_dir
from ..distributed import lost_peer
from ..models import lora
from .state import encode_state
from .store import (POINTERS, SHARDED, STATE_JSON, STATE_TENSORS, STEP_PREFIX, CheckpointWriteError,
                    file_entries, pointer_target, read_pointer, step_dirs, write_manifest, write_pointer)


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
        return (f"could not write checkpoint {name} in {root}: the disk is full ({e}). A checkpoint of this "
                f"run needs about {_mb(need)}{room}. {lost} Free space on that disk (delete old runs, lower "
                f"--keep-last) or move the run directory to a larger disk, then continue with --resume.")
    return (f"could not write checkpoint {name} in {root}: {type(e).__name__}: {e}. {lost} Fix the cause, "
            f"then continue with --resume.")


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
        # merged weights under the model's own names, and the adapter alone beside them
        if lora.is_lora(model):
            st_save_file(lora.merged_state(model), str(tmp / "model.safetensors"))
            st_save_file(lora.adapter_state(model), str(tmp / lora.ADAPTER_FILE))
            (tmp / lora.ADAPTER_CONFIG).write_text(lora.adapter_json(model))
        else:
            st_save_model(model, str(tmp / "model.safetensors"))
        _write_rest(tmp, step, config, skeleton, tensors, assets)
        # replaces the same step saved earlier (e.g. on SIGTERM right after a periodic save)
        publish(tmp, root / name)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):
            raise CheckpointWriteError(_write_failure(e, root, name, need, before)) from e
        raise
    return _point_and_prune(root, name, keep_last, best, final)


def _begin(run_dir: str | Path, step: int) -> tuple[Path, str, str | None]:
    root = Path(run_dir) / rundir.CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    before = pointer_target(root, "latest")
    return root, f"{STEP_PREFIX}{step:06d}", before.name if before is not None else None


def _write_rest(tmp: Path, step: int, config: dict, skeleton, tensors: dict, assets: dict | None,
                known: dict | None = None) -> None:
    """Everything of a checkpoint but its weights, then the manifest over all of it."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    st_save_file(tensors, str(tmp / STATE_TENSORS))
    (tmp / STATE_JSON).write_text(json.dumps(skeleton))
    for asset, src in (assets or {}).items():
        shutil.copytree(src, tmp / asset)
    write_manifest(tmp, step, known)


def save_sharded_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer, config: dict,
                            train_state: dict, assets: dict[str, Path] | None, keep_last: int,
                            best: bool = False, final: bool = False, background_group=None) -> "ShardedSave":
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
        job.future = dcp.async_save(state, checkpoint_id=str(job.tmp / SHARDED),
                                    process_group=background_group)
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
        self.root, self.name, self.tmp, self.step = root, name, tmp, step
        self.need, self.before, self.config, self.assets = need, before, config, assets
        self.keep_last, self.best, self.final = keep_last, best, final
        self.future = None
        self.state = None

    def done(self) -> bool:
        """This rank's part is written (a background write has ended, well or not)."""
        return self.future is None or self.future.done()

    def failed(self, e: Exception):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if lost_peer(e):  # not the disk: another rank is gone (the trainer says so)
            raise e
        # DCP wraps each rank's failure; the first OSError among them keeps its errno (a full disk says so)
        inner = [x for x in [e, e.__cause__, *getattr(e, "failures", {}).values()] if isinstance(x, OSError)]
        raise CheckpointWriteError(_write_failure(inner[0] if inner else OSError(str(e)), self.root,
                                                  self.name, self.need, self.before)) from e

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
            mine = file_entries(self.tmp, sorted((self.tmp / SHARDED).glob(f"__{rank}_*")))
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
        write_pointer(root, "latest", name)
        if best:
            write_pointer(root, "best", name)
        if final:
            write_pointer(root, "final", name)
    except OSError as e:
        now = pointer_target(root, "latest")
        raise CheckpointWriteError(
            f"checkpoint {final_dir} was written completely, but a pointer beside it could not be updated "
            f"({e}); `latest` names {now.name if now else 'nothing'}. Free space on that disk, then continue "
            f"with --resume (it continues from the checkpoint `latest` names).") from e
    _prune(root, keep_last)
    return final_dir


def _prune(root: Path, keep_last: int) -> None:
    steps = step_dirs(root)
    keep = set(steps[-keep_last:])
    for ptr in POINTERS:
        p = read_pointer(root, ptr)
        if p is not None:
            keep.add(p)
    for p in steps:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():  # unfinished saves of a crashed process (atomic.py restores a lone `.old-` copy)
        if (
            p.name.startswith(f".{STEP_PREFIX}")
            and ".tmp-" in p.name
            and not p.name.endswith(f"-{os.getpid()}")
        ):
            shutil.rmtree(p, ignore_errors=True)
