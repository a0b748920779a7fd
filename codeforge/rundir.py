"""The run directory: the names under RUN/ (one place for them) and the run lock."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from . import CodeforgeError, printable

# RUN/ (`codeforge train --out RUN`): every command that reads or writes a run names its files from here
CHECKPOINTS = "checkpoints"  # step_NNNNNN/ directories and the latest/best/final pointers (checkpoint/)
CONFIG = "config.toml"  # the fully resolved configuration of the run
METRICS = "metrics.jsonl"  # one JSON object per logged step and per evaluation
EVAL = "eval.jsonl"  # one JSON object per `codeforge eval`
TENSORBOARD = "tensorboard"  # TensorBoard event files (training and `codeforge eval`)
SAMPLES = "samples.jsonl"  # the samples training writes at each evaluation
ROLLOUTS = "rollouts.jsonl"  # the RL stages' rollout statistics
# sorted uint64 content-hash keys of every document the run (and the runs it
TRAINED = "trained_documents.npy"
# started from with --init-from) is known to have trained on: evaluation leaves them out of what it scores
# {"documents", "sha256" of the keys TRAINED holds, "unknown": [what else it trained on that has no key, in
TRAINED_INFO = "trained_documents.json"  # words]}: an empty "unknown" is a complete record (data/trained.py)
LOCK_FILE = ".train.lock"  # flock()ed by the training process (run_lock)


GENERIC_RUN_NAMES = ("run", "base", "pretrain", "sft", "tools", "dpo", "rl", "ppo", "grpo", "hrm", "code")


def model_name(run: str | Path) -> str:
    """The model's name (what the server calls it, and the name an exported file carries): the run directory's
    name (also when a checkpoint directory is given).
    A name that says only the stage (the quickstart's run/, sft/, tools/) takes its parent's name in front:
    runs/quickstart/run serves `quickstart`, runs/quickstart-chat/tools `quickstart-chat-tools`."""
    p = Path(run).resolve()
    if p.parent.name == CHECKPOINTS:
        p = p.parent.parent
    if p.name in GENERIC_RUN_NAMES and p.parent.name:
        name = p.parent.name if p.name == "run" else f"{p.parent.name}-{p.name}"
    else:
        name = p.name or "codeforge"
    return printable(name)  # printed, and sent to clients: never a terminal escape


class RunDirError(CodeforgeError):
    """The run directory cannot be used: its lock cannot be made, or another process holds it."""


class RunLockedError(RunDirError):
    """Another process is training in the run directory."""


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
        raise RunDirError(f"cannot create the run directory's lock {path}: {e}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"cannot lock {path}: {e}") from e
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                holder = {}
            holder = holder if isinstance(holder, dict) else {}
            who = (f"PID {holder.get('pid')} on {holder.get('host')}, training since {holder.get('started')}"
                   if holder.get("pid") else "PID unknown")
            raise RunLockedError(
                f"{run_dir} is in use by another training process ({who}); two trainers in one run directory "
                f"would overwrite each other's checkpoints. Wait for it to finish (or stop it), or train "
                f"into another --out. (The lock is {path}; it is released when that process ends.)") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
