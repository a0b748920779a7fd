"""One run as several processes on this machine (--local-ranks N): data parallelism on a CPU without torchrun.

Why processes and not threads: one process with N threads meets at a barrier after every operation, so on
cores other programs share, each operation waits for whichever thread the kernel has just set aside. N
one-thread processes meet once a step (the gradients' all-reduce). Where the kernel shares the CPU per
thread (neighbours started from the same shell, a container, Linux without autogroup), each process keeps
its share: beside six busy programs on two cores, 2 x 1 thread trained 1.64x faster than the one process
the thread policy gives 1 thread. Where it shares per session first (autogroup, neighbours in sessions of
their own), the whole job gets its session's share however it is split: there the two are within a few
percent; on idle cores too (docs/LOG.md#2026-11-25-local-ranks-measured).

How: this process is rank 0 and runs the stage itself (so the caller gets its result, as with one
process); ranks 1..N-1 are `codeforge train --config FILE` with the run's resolved configuration, started in
this process's session (Ctrl-C in a terminal reaches them all, and the kernel counts them with it) and
ended by the kernel if this process dies. They meet through a file (a FileStore, no listening port) and
gloo on the loopback interface; the rest is the trainer's DDP path, tested under torchrun. A rank that
fails ends the job, and its last messages are shown; the others' are kept out of the way."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..config import SECTIONS, ConfigError, RunConfig, dumps_toml
from ..device import held_threads, thread_policy, usable_cores
from ..distributed import RENDEZVOUS_ENV, distributed_env, lost_peer
from ..train.trainer import TrainingError

# the directory holding this codeforge package
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)
STARTED_ENV = "CODEFORGE_LOCAL_RANKS"  # set in the ranks run_local starts: they are ranks, not launchers
STOP_GRACE_S = 60  # how long ranks 1..N-1 may take to finish after rank 0 has
FAIL_GRACE_S = 10  # after a rank fails: how long rank 0 may take to notice and fail on its own
INTERRUPTED = (130, -signal.SIGINT)  # Ctrl-C: rank 0 hears it too and reports


def launches(cfg: RunConfig) -> bool:
    """Whether this process starts the run's local ranks (and is their rank 0), rather than being one."""
    return cfg.train.local_ranks > 1 and not os.environ.get(STARTED_ENV)


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
    if _on_gpu(cfg):
        raise ConfigError(f"--local-ranks {n} is for training on the CPU, and this run's device is "
                          f"{'a GPU' if dev == 'auto' else dev}: on GPUs use torchrun --nproc-per-node (one "
                          f"rank per GPU), or --device cpu")


def auto_ranks(cfg: RunConfig, most: int = 4) -> int:
    """How many local ranks a CPU run of cfg's batch is best split over here (the quickstart's choice): one
    per core this process may use (affinity, cgroup quota), at most `most` and a divisor of the batch (so the
    global batch stays what it is, with --batch-size per rank); 1 on a GPU. Measured on 2 cores
    (docs/LOG.md#2026-11-25-local-ranks-measured); beyond `most` the rows per rank get few, and each rank
    holds a whole copy of the model and its optimizer state."""
    if _on_gpu(cfg):
        return 1
    n = max(1, min(usable_cores(), most, cfg.train.batch_size))
    while cfg.train.batch_size % n:
        n -= 1
    return n


def resolve_auto(cfg: RunConfig) -> RunConfig:
    """--local-ranks 0 (auto, the lowend-cpu profile's): cfg with as many ranks as auto_ranks chooses, each
    with its share of --batch-size (the global batch); cfg itself when the ranks are given."""
    t = cfg.train
    if t.local_ranks != 0:
        return cfg
    n = 1 if distributed_env()[1] > 1 or os.environ.get(STARTED_ENV) else auto_ranks(cfg)
    return replace(cfg, train=replace(t, local_ranks=n, batch_size=t.batch_size // n))


def _on_gpu(cfg: RunConfig) -> bool:
    """Whether the run's device is (or `auto` picks) a GPU."""
    dev = cfg.train.device
    return dev.startswith(("cuda", "mps")) or (dev == "auto" and _gpu_visible())


def _gpu_visible() -> bool:
    import torch
    return torch.cuda.is_available() or torch.backends.mps.is_available()


def _loopback() -> str | None:
    """The loopback interface's name, for gloo to listen on (GLOO_SOCKET_IFNAME) rather than on the address
    the host name resolves to."""
    with contextlib.suppress(OSError, AttributeError):
        names = {name for _, name in socket.if_nameindex()}
        return next((n for n in ("lo", "lo0") if n in names), None)
    return None


def _die_with_parent():
    """A preexec_fn for the ranks (Linux; None elsewhere): the kernel kills a rank when the process that
    started it dies, so a rank 0 killed outside the training loop leaves no rank waiting for it. prctl is
    looked up here, in the parent: the child, forked from a process with threads, only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child_code() -> str:
    """The -c program of a rank: this codeforge package's CLI, whatever ./codeforge the working directory
    holds (`python -m codeforge` would import that one)."""
    return (f"import runpy, sys; r = {PACKAGE_ROOT!r}; sys.path[0:1] = [] if r in sys.path[1:] else [r]; "
            "runpy.run_module('codeforge', run_name='__main__')")


def run_local(cfg: RunConfig, resume: bool, log, body: Callable[[RunConfig, bool, Callable], dict]) -> dict:
    """Run `body` (a stage's run) as rank 0 of cfg.train.local_ranks ranks, starting the others; see the
    module docstring."""
    check(cfg)
    n, t = cfg.train.local_ranks, cfg.train
    if t.threads:
        per, why, total = t.threads, f"--threads, each of {n} local processes", t.threads * n
    else:
        total, why_total = thread_policy()
        per, why = max(1, total // n), f"each of {n} local processes; {why_total}"
    work = Path(tempfile.mkdtemp(prefix="codeforge-ranks-"))
    cfg_file = work / "config.toml"
    cfg_file.write_text(dumps_toml({k: v for k, v in cfg.to_dict().items() if k in SECTIONS}))
    env = {STARTED_ENV: str(n), RENDEZVOUS_ENV: str(work / "rendezvous"), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "ROLE_RANK": "0"}
    if lo := _loopback():
        env["GLOO_SOCKET_IFNAME"] = lo
    argv = [sys.executable, "-c", _child_code(), "train", "--config", str(cfg_file), "--out", t.out] + (
        ["--data", t.data] if t.data else []) + (["--resume"] if resume else [])
    procs: list[tuple[subprocess.Popen, Path]] = []
    done, die_with_parent = threading.Event(), _die_with_parent()
    try:
        for r in range(1, n):
            errors = work / f"rank{r}.log"
            with open(errors, "wb") as err:
                procs.append((subprocess.Popen(
                    argv, env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r),
                               "OMP_NUM_THREADS": str(per), "CODEFORGE_THREADS": str(per)},
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    preexec_fn=die_with_parent), errors))
        threading.Thread(target=_watch, args=(procs, done, work), daemon=True).start()
        try:
            with _environment({**env, "RANK": "0", "LOCAL_RANK": "0"}), held_threads(per, why, alone=total):
                result = body(cfg, resume, log)
        except BaseException as e:
            done.set()
            # the cause is another rank: say which, and its words
            if lost_peer(e) or "lost contact" in str(e):
                _name_failed(procs)
            raise
        done.set()
        failed = _finish(procs)
        if failed:
            raise TrainingError(failed)
        return result
    finally:
        done.set()
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)


def _tail(errors: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        text = errors.read_text(errors="replace").strip().splitlines()[-lines:]
        return "\n".join(f"  | {x}" for x in text) if text else "  (it wrote nothing)"
    return "  (its messages could not be read)"


def _finish(procs: list[tuple[subprocess.Popen, Path]]) -> str | None:
    """Wait for ranks 1..N-1 after rank 0 finished; what went wrong with one, if anything."""
    deadline = time.monotonic() + STOP_GRACE_S
    for r, (p, errors) in enumerate(procs, 1):
        try:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return (f"rank {r} of {len(procs) + 1} (pid {p.pid}) did not end within {STOP_GRACE_S}s "
                    "of rank 0; stopped")
        if rc and rc not in INTERRUPTED:
            return (f"rank {r} of {len(procs) + 1} exited with {_code(rc)}; its last "
                    f"messages:\n{_tail(errors)}")
    return None


def _name_failed(procs: list[tuple[subprocess.Popen, Path]], wait_s: float = 3.0) -> None:
    """Rank 0 lost contact with the others: say which ended badly, with its last messages."""
    deadline = time.monotonic() + wait_s
    for r, (p, errors) in enumerate(procs, 1):
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        rc = p.poll()
        if rc is not None and rc and rc not in INTERRUPTED:
            print(f"rank {r} of {len(procs) + 1} exited with {_code(rc)}; its last "
                  f"messages:\n{_tail(errors)}",
                  file=sys.stderr, flush=True)


def _code(rc: int) -> str:
    return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"code {rc}"


def _watch(procs: list[tuple[subprocess.Popen, Path]], done: threading.Event, work: Path) -> None:
    """While rank 0 runs: when another rank fails (not an interrupt, which rank 0 hears too), rank 0 usually
    notices in its next collective and fails with a message of its own. If it has not within FAIL_GRACE_S
    (it is waiting for a rank that died before it joined the group), the job ends here, as torchrun would
    end it, rather than wait out --dist-timeout."""
    while not done.wait(0.5):
        for r, (p, errors) in enumerate(procs, 1):
            rc = p.poll()
            if rc is None or rc == 0 or rc in INTERRUPTED:
                continue
            if done.wait(FAIL_GRACE_S):  # rank 0 finished or failed meanwhile: it reports
                return
            print(f"error: rank {r} of {len(procs) + 1} exited with {_code(rc)}; its last messages:\n"
                  f"{_tail(errors)}\nstopping the job. Checkpoints already written are kept: --resume "
                  f"continues from the last.", file=sys.stderr, flush=True)
            for q, _ in procs:
                if q.poll() is None:
                    q.kill()
            shutil.rmtree(work, ignore_errors=True)
            sys.stdout.flush()
            os._exit(1)
