"""The process group under torchrun: the ranks' environment, joining and leaving the group (NCCL on GPUs,
gloo on the CPU), the start-up group in which ranks wait for rank 0's work alone, work done by rank 0 and
told to the others, the process's exit, and telling a lost peer from any other error."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch

from .fields import ConfigError

T = TypeVar("T")


def distributed_env() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; (0, 1) for a plain process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


RENDEZVOUS_ENV = "CODEFORGE_RENDEZVOUS"  # a file the ranks meet through instead of MASTER_ADDR:MASTER_PORT


def launched_by_torchrun() -> bool:
    """True in a process torchrun started (it sets the rendezvous address), whatever the number of ranks."""
    return "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ and "LOCAL_RANK" in os.environ


def setup_distributed(device: torch.device, timeout_s: int = 600, alone: bool = False) -> bool:
    """Join the process group when torchrun started several ranks (NCCL on GPUs, gloo on CPU); True if so.
    alone: join it also when torchrun started one rank (--parallel fsdp on one GPU: FSDP2 over a mesh of one,
    for --fsdp-offload or the sharded checkpoints). timeout_s: how long a collective waits for a rank that
    does not come (killed, stuck) before it fails, so the job ends instead of hanging. Called at the entry
    point, paired with teardown_distributed."""
    _, world = distributed_env()
    if world <= 1 and not (alone and launched_by_torchrun() and RENDEZVOUS_ENV not in os.environ):
        return False
    meet = os.environ.get(RENDEZVOUS_ENV)  # --local-ranks: a file, not torchrun's port (stages/local.py)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         timeout=timedelta(seconds=timeout_s),
                                         **({"init_method": f"file://{meet}", "rank": distributed_env()[0],
                                             "world_size": world} if meet else {}))
    global _JOINED, _STARTUP
    _JOINED = True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _STARTUP = torch.distributed.new_group(backend="gloo",
                                           timeout=timedelta(seconds=max(timeout_s, STARTUP_WAIT_S)))
    return True


_JOINED = False  # this process joined a process group (set once, never cleared)


_STARTUP = None


STARTUP_WAIT_S = 3600  # how long ranks wait for rank 0's work alone at the start (verify, build, load)


def startup_group():
    """A gloo group whose collectives wait up to STARTUP_WAIT_S (or --dist-timeout when longer): for the
    ranks that wait while rank 0 alone verifies a checkpoint or builds the whole model, work that takes
    longer on a big model than a collective in training should ever wait. None outside torchrun."""
    return _STARTUP


def teardown_distributed() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_process(code: int) -> None:
    """End the process with `code`. A torchrun rank that joined a process group skips the interpreter's
    finalization (os._exit, after flushing stdout and stderr): FSDP2's parameter hooks keep the group, and
    with it the backend's C++ threads, alive after destroy_process_group, and a backend thread that touches
    Python while the interpreter is being torn down aborts the process (`terminate called without an active
    exception`, SIGABRT), which torchrun reports as a failed job after a run that had finished. Every file
    codeforge writes is closed before this point."""
    if not _JOINED:
        raise SystemExit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


_LOST = re.compile(r"gloo/transport|Connection (reset|closed) by peer|Timed out waiting \d+ms|NCCL (error|"
                   r"communicator was aborted)|ProcessGroup\w* (timeout|watchdog)")


def lost_peer(e: BaseException) -> bool:
    """True when `e` comes from a collective whose other side went away (a rank killed, crashed, out of
    memory) or did not answer within the process group's timeout (a stuck rank)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.distributed.DistError) or (isinstance(e, RuntimeError)
                                                          and _LOST.search(str(e))):
            return True
        e = e.__cause__ or e.__context__
    return False


def found_by_rank0(work: Callable[[], T]) -> T:
    """work() (say, reading and hashing a checkpoint) on rank 0 only, its answer or its error passed to the
    other ranks: N ranks sharing a filesystem do it once, not N times, and all take the same answer. One
    process: just work()."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return work()
    msg: list = [None]
    group = startup_group()  # hashing a big checkpoint can take longer than --dist-timeout
    if torch.distributed.get_rank() == 0:
        try:
            msg[0] = ("found", work())
        except Exception as e:
            msg[0] = ("error", str(e))
            torch.distributed.broadcast_object_list(msg, src=0, group=group)
            raise
    torch.distributed.broadcast_object_list(msg, src=0, group=group)
    kind, value = msg[0]
    if kind == "error":  # rank 0 raised it (and the CLI prints it there); the others end with it too
        raise ConfigError(value)
    return value
