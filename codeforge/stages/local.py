"""One run as several processes on this machine (--local-ranks N): data parallelism on a CPU without torchrun.

Why processes and not threads: one process with N threads meets at a barrier after every operation, so on
cores other programs share, each operation waits for whichever thread the kernel has just set aside. N
one-thread processes meet once a step (the gradients' all-reduce) and each keeps its own share of the
cores: beside six busy programs on two cores, 2 x 1 thread trained 1.7x faster than 1 x 2 threads (the
policy's 1 thread), and as fast on idle cores (docs/LOG.md, 2026-11-25 sixth session).

How: this process is rank 0 and runs the stage itself (so the caller gets its result, as with one
process); ranks 1..N-1 are `python -m codeforge train --config FILE` with the run's resolved configuration,
started in this process's session and process group (so Ctrl-C in a terminal reaches them all, and the
kernel shares the cores with them as with this process). The environment is torchrun's (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on loopback), so everything after is the trainer's
DDP path, tested under torchrun. A rank that fails ends the job: the others are stopped and the error says
which rank and where its messages are."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..config import SECTIONS, ConfigError, RunConfig, dumps_toml
from ..device import held_threads, thread_policy
from ..distributed import distributed_env
from ..train.trainer import TrainingError

PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # the directory holding this codeforge package
STOP_GRACE_S = 60
STARTED_ENV = "CODEFORGE_LOCAL_RANKS"  # set in the ranks run_local starts: they are ranks, not launchers


def launches(cfg: RunConfig) -> bool:
    """Whether this process starts the run's local ranks (and is their rank 0), rather than being one."""
    return cfg.train.local_ranks > 1 and not os.environ.get(STARTED_ENV)  # how long ranks 1..N-1 may take to finish after rank 0 has


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """os.environ with `values` for the block, as it was after."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check(cfg: RunConfig) -> None:
    """Refuse what --local-ranks cannot do, before anything starts."""
    n = cfg.train.local_ranks
    if distributed_env()[1] > 1:
        raise ConfigError(f"--local-ranks {n} starts its own ranks, and this process is already one of "
                          f"{distributed_env()[1]} (torchrun): give --local-ranks 1 under torchrun, whose "
                          f"--nproc-per-node sets the ranks")
    dev = cfg.train.device
    gpu = dev.startswith(("cuda", "mps")) or (dev == "auto" and _gpu_visible())
    if gpu:
        raise ConfigError(f"--local-ranks {n} is for training on the CPU, and this run's device is "
                          f"{'a GPU' if dev == 'auto' else dev}: on GPUs use torchrun --nproc-per-node (one rank "
                          f"per GPU), or --device cpu")


def auto_ranks(cfg: RunConfig, most: int = 4) -> int:
    """How many local ranks a CPU run of cfg's batch is best split over here (the quickstart's choice): one per
    core this process may use, at most `most` and a divisor of the batch (so the global batch stays what it
    is, with --batch-size per rank); 1 on a GPU. Measured on 2 cores (docs/LOG.md); beyond `most` the rows
    per rank get few, and each rank holds a whole copy of the model and its optimizer state."""
    if cfg.train.device.startswith(("cuda", "mps")) or (cfg.train.device == "auto" and _gpu_visible()):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(cores, most, cfg.train.batch_size)
    while cfg.train.batch_size % n:
        n -= 1
    return n


def _gpu_visible() -> bool:
    import torch
    return torch.cuda.is_available() or torch.backends.mps.is_available()


def run_local(cfg: RunConfig, resume: bool, log, body: Callable[[RunConfig, bool, Callable], dict]) -> dict:
    """Run `body` (a stage's run) as rank 0 of cfg.train.local_ranks ranks, starting the others; see the
    module docstring."""
    check(cfg)
    n = cfg.train.local_ranks
    t = cfg.train
    if t.threads:
        per, why, total = t.threads, f"--threads, each of {n} local processes", t.threads * n
    else:
        total, why_total = thread_policy()
        per, why = max(1, total // n), f"each of {n} local processes; {why_total}"
    env = {STARTED_ENV: str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "ROLE_RANK": "0"}
    fd, cfg_file = tempfile.mkstemp(prefix="codeforge-ranks-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(dumps_toml({k: v for k, v in cfg.to_dict().items() if k in SECTIONS}))
    # `python -m codeforge` would import whatever ./codeforge the working directory holds: this package instead
    argv = [sys.executable, "-c", f"import runpy, sys; sys.path.insert(0, {str(PACKAGE_ROOT)!r}); "
            "runpy.run_module('codeforge', run_name='__main__')", "train", "--config", cfg_file, "--out", t.out] + (
        ["--data", t.data] if t.data else []) + (["--resume"] if resume else [])
    procs: list[subprocess.Popen] = []
    done = threading.Event()
    try:
        for r in range(1, n):
            procs.append(subprocess.Popen(argv, env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r),
                                                     "OMP_NUM_THREADS": str(per)},
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        threading.Thread(target=_watch, args=(procs, done), daemon=True).start()
        try:
            with _environment({**env, "RANK": "0", "LOCAL_RANK": "0"}), held_threads(per, why, alone=total):
                result = body(cfg, resume, log)
        except BaseException:
            done.set()
            _name_failed(procs)
            raise
        done.set()
        failed = _finish(procs)
        if failed:
            raise TrainingError(failed)
        return result
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        with contextlib.suppress(OSError):
            os.unlink(cfg_file)


def _finish(procs: list[subprocess.Popen]) -> str | None:
    """Wait for ranks 1..N-1 after rank 0 finished; what went wrong with one, if anything."""
    deadline = time.monotonic() + STOP_GRACE_S
    for r, p in enumerate(procs, 1):
        try:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"rank {r} of {len(procs) + 1} (pid {p.pid}) did not end within {STOP_GRACE_S}s of rank 0; stopped"
        if rc not in (0, 130, -signal.SIGINT):
            return f"rank {r} of {len(procs) + 1} exited with {_code(rc)}; its messages are above"
    return None


def _name_failed(procs: list[subprocess.Popen], wait_s: float = 3.0) -> None:
    """Rank 0 failed: say which other ranks had ended badly (the usual cause: rank 0 lost contact with them)."""
    deadline = time.monotonic() + wait_s
    for r, p in enumerate(procs, 1):
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        rc = p.poll()
        if rc not in (None, 0, 130, -signal.SIGINT):
            print(f"rank {r} of {len(procs) + 1} exited with {_code(rc)}; its messages, if any, are above",
                  file=sys.stderr, flush=True)


def _code(rc: int) -> str:
    return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"code {rc}"


def _watch(procs: list[subprocess.Popen], done: threading.Event) -> None:
    """While rank 0 runs: a rank that fails (not an interrupt, which rank 0 hears too) ends the job at once,
    as torchrun would, instead of leaving rank 0 to wait for it in a collective until --dist-timeout."""
    while not done.wait(0.5):
        for r, p in enumerate(procs, 1):
            rc = p.poll()
            if rc is None or rc in (0, 130, -signal.SIGINT):
                continue
            if done.wait(2.0):  # rank 0 finished (or failed) meanwhile: it reports
                return
            print(f"error: rank {r} of {len(procs) + 1} exited with {_code(rc)} (its messages are above); "
                  f"stopping the job. Checkpoints already written are kept: --resume continues from the last.",
                  file=sys.stderr, flush=True)
            for q in procs:
                if q.poll() is None:
                    q.kill()
            sys.stdout.flush()
            os._exit(1)
