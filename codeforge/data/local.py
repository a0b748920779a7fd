"""prepare's local executor: the engine's process pool on this machine, its workers and helpers ending with
the prepare command, and the engine's console output kept off the terminal (slurm.py is the other executor).

A kill -9 of the command must leave nothing behind writing into the work directory a rerun will use: pool
workers watch the command and exit when it is gone (_exit_with), and every other child it forks while the
stages run (the engine's manager servers, which hold its fork server and resource tracker alive) gets the
kernel's parent-death signal (ending_with_this_process). The engine logs each task to WORK/logs and, per task,
to the console: the console copy is dropped (Quiet, LocalExecutor), so a failure reaches the user as
codeforge's error naming the task's log file.
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import re
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from datatrove.executor import LocalPipelineExecutor
from datatrove.utils.logging import setup_default_logger

from .. import printable


def _lib_dirs_once() -> None:
    """loguru works out the standard library's directories (sysconfig: ~110 calls a scheme) for every handler
    added, and the engine adds three for every task: ~0.5 CPU-s of a prepare's 59 tasks on an 8 MB corpus
    (benchmarks/prepare_stages.py). They cannot change within a process: computed once. A loguru without
    that method is left as it is."""
    try:
        from loguru._better_exceptions import ExceptionFormatter
    except ImportError:
        return
    find = ExceptionFormatter.__dict__.get("_get_lib_dirs")
    if isinstance(find, staticmethod) and not hasattr(find.__func__, "cache_info"):
        ExceptionFormatter._get_lib_dirs = staticmethod(functools.cache(find.__func__))


_lib_dirs_once()

_ENGINE_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \| ")
# tqdm's redrawn line: "\rname:  50%|#####     | 8/16 [00:01<..."
_PROGRESS_BAR = re.compile(r"\r|\d+/\d+ \[\d")


class _Escaped(io.TextIOBase):
    """stderr with control characters written as escapes (codeforge.printable, as every printed name from
    outside is): the reader's warnings name files, and a name can hold an ESC that retitles the terminal."""

    def __init__(self, real):
        self.real = real

    def write(self, s: str) -> int:
        self.real.write(printable(s))
        return len(s)

    def flush(self) -> None:
        self.real.flush()


class _WithoutEngineLog(_Escaped):
    """stderr, escaped, less the engine's log records (loguru writes each, traceback included, in one call)
    and its progress bars (tqdm, when it was imported before TQDM_DISABLE could turn them off): the records
    stay in the task's log file, and a failure reaches the user as codeforge's error naming that file."""

    def __init__(self, real):
        super().__init__(real)
        self.dropped = False

    def write(self, s: str) -> int:
        drop = bool(_ENGINE_LOG_LINE.match(s) or _PROGRESS_BAR.search(s) or (s == "\n" and self.dropped))
        self.dropped = drop
        if not drop:
            super().write(s)
        return len(s)


def _exit_with(owner: int) -> None:
    """In a pool worker: end this process when `owner` (the prepare command) is gone, so a kill -9 of the
    command alone leaves no worker writing into the work directory a rerun is using."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                os._exit(1)
            except OSError:
                pass
    threading.Thread(target=watch, daemon=True).start()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child only calls it
except (OSError, AttributeError):  # not Linux
    _prctl = None
_command: int | None = None  # the prepare command's pid while its stages run; None in every other process


def _die_with_command() -> None:
    """In each child the command forks while its stages run (os.register_at_fork, ending_with_this_process),
    the engine's manager servers (multiprocess.Manager(), one a stage): end it with the command. A kill -9
    left them under init for good, and with them the fork server and resource tracker, which end when the
    last holder of their pipe closes it (a manager forked after they started holds both): ~170 MB each time.
    Pool workers watch the command themselves (_exit_with)."""
    global _command
    owner, _command = _command, None  # a grandchild is its own parent's business
    if owner is None:
        return
    if _prctl is not None:  # the kernel's: SIGKILL when the thread that forked this one ends
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        _exit_with(owner)
    if os.getppid() != owner:  # the command ended before that took effect
        os._exit(1)


os.register_at_fork(after_in_child=_die_with_command)


@contextmanager
def ending_with_this_process() -> Iterator[None]:
    """While it is entered, every child this process forks ends with it (_die_with_command)."""
    global _command
    _command = os.getpid()
    try:
        yield
    finally:
        _command = None


class LocalExecutor(LocalPipelineExecutor):
    """The engine's local executor, its per-task log records kept to its log files; its workers end with
    the command that started them."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.owner = os.getpid()

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        # in a pool worker (a worker runs many tasks): one watch per process, started with its first task
        if os.getpid() != self.owner and not getattr(LocalExecutor, "_watching", False):
            LocalExecutor._watching = True
            _exit_with(self.owner)
        real = sys.stderr
        sys.stderr = _WithoutEngineLog(real)  # the engine points its console log at sys.stderr per task
        try:
            # a task of local rank 0 also logs to the console; from 1 on, the engine logs to the task's file
            return super()._run_for_rank(rank, max(local_rank, 1), node_rank)
        finally:
            sys.stderr = real



def raise_open_files() -> None:
    """The soft limit on open files raised to the hard one (65536 where there is none): the exact-dedup stage
    holds files of every task open. Left as it is where the system refuses."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass

class Quiet:
    """While the stages run: the engine's progress bars off and its console log at warnings (its logs stay
    in WORK/logs), stderr escaped and without the engine's records (_WithoutEngineLog), the soft limit on
    open files raised to the hard one; all put back after."""

    def __enter__(self):
        # the engine's records (its closing stats table, emoji and all, logged in this process after the
        # workers end) stay in WORK/logs, as the workers' do
        self.stderr, sys.stderr = sys.stderr, _WithoutEngineLog(sys.stderr)
        setup_default_logger()  # loguru's console handler holds the stderr of its making: this one now
        self.env = {k: os.environ.get(k) for k in ("TQDM_DISABLE", "LOGURU_LEVEL")}
        os.environ.update(TQDM_DISABLE="1", LOGURU_LEVEL="WARNING")
        self.nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise_open_files()
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr = self.stderr
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile)
        except (ValueError, OSError):
            pass
        setup_default_logger()  # loguru's default console handler on the real stderr again
