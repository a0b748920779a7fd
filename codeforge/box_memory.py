"""The memory and process count of a sandbox's whole process tree: a fresh cgroup per run where the evaluator
may make one (root, or a delegated cgroup), else the asked memory split over the processes' address spaces
(box_limits). sandbox.py starts the box inside the run's cgroup and kills the tree through it.

Without a memory cgroup nothing in the kernel bounds a process tree's memory: each process's address space
(RLIMIT_AS) is bounded, and their number (RLIMIT_NPROC). So the asked memory is split: at most
NO_CGROUP_PROCESSES processes of memory_mb / processes each, and fewer processes where that would leave one
under MIN_PROCESS_MB. Processes x address space is then the asked memory, except under MIN_PROCESS_MB asked,
where the one process still gets MIN_PROCESS_MB (and the caller is warned, once per asked size, on stderr).
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MAX_PROCESSES = 32  # processes and threads the program may have at once (with a memory cgroup)
# A bare `python3 -c pass` peaks at 14 MB of address space in the box, with a dozen standard-library imports
# at 21 MB: MIN_PROCESS_MB leaves room for a program's own data above that.
MIN_PROCESS_MB = 64
# 8 left a single process of an RL box (512 MB) 64 MB, and a 12M-element list or sorting 2M floats failed
# (review); with 4 it has 128 MB, and a program may still start 3 more threads or processes.
NO_CGROUP_PROCESSES = 4


# -- cgroups: memory and process count for the whole tree, and a kill switch ------------------------------

class Cgroups:
    """A fresh cgroup per run (v2 where the evaluator may create one with the memory and pids controllers,
    else v1 memory + pids hierarchies); `paths` empty when neither can be made here."""

    _base: dict | None = None
    _lock = threading.Lock()

    @classmethod
    def base(cls) -> dict:
        with cls._lock:
            if cls._base is None:
                cls._base = cls._probe()
            return cls._base

    @staticmethod
    def _probe() -> dict:
        try:
            mounts = Path("/proc/self/mountinfo").read_text().splitlines()
            own = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return {}
        mine = {}
        for line in own:
            hid, ctrls, path = line.split(":", 2)
            for c in (ctrls.split(",") if ctrls else [""]):
                mine[c] = path
        found: dict[str, str] = {}
        for line in mounts:
            pre, _, post = line.partition(" - ")
            fields, post_f = pre.split(), post.split()
            if len(post_f) < 3:
                continue
            point, fstype, opts = fields[4], post_f[0], post_f[2].split(",")
            if fstype == "cgroup2" and "" in mine:
                d = point + mine[""]
                ctl = Path(d, "cgroup.subtree_control")
                try:
                    if {"memory", "pids"} <= set(ctl.read_text().split()) and os.access(d, os.W_OK):
                        found.setdefault("v2", d)
                except OSError:
                    pass
            elif fstype == "cgroup":
                for c in ("memory", "pids"):
                    if c in opts and c in mine:
                        d = point + mine[c]
                        if os.access(d, os.W_OK):
                            found.setdefault(c, d)
        base = {"v2": found["v2"]} if "v2" in found else {c: found[c] for c in ("memory", "pids")
                                                          if c in found}
        for parent in base.values():  # cgroups left by evaluators that were killed before cleaning up
            for d in Path(parent).glob("codeforge-sandbox-*"):
                try:
                    os.kill(int(d.name.split("-")[2]), 0)
                except ProcessLookupError:
                    try:
                        d.rmdir()
                    except OSError:
                        pass
                except (ValueError, IndexError, PermissionError):
                    pass
        return base

    def __init__(self, memory_bytes: int, max_procs: int):
        self.paths: dict[str, Path] = {}
        name = f"codeforge-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            for kind, parent in self.base().items():
                d = Path(parent, name)
                d.mkdir()
                self.paths[kind] = d
                if kind == "v2":
                    (d / "memory.max").write_text(str(memory_bytes))
                    # memory.max counts RAM only: with swap the tree could hold more than asked, and slowly
                    if (d / "memory.swap.max").exists():
                        (d / "memory.swap.max").write_text("0")
                    (d / "pids.max").write_text(str(max_procs))
                elif kind == "memory":
                    (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
                    if (d / "memory.memsw.limit_in_bytes").exists():
                        try:
                            (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                        except OSError:
                            pass
                else:
                    (d / "pids.max").write_text(str(max_procs))
        except OSError:
            self.remove()
            self.paths = {}

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.paths.values()]

    def oom_killed(self) -> bool:
        for kind, d in self.paths.items():
            f = d / ("memory.events" if kind == "v2" else "memory.oom_control")
            try:
                for line in f.read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill" and int(v) > 0:
                        return True
                if kind == "memory" and int((d / "memory.failcnt").read_text()) > 0:
                    return True
            except (OSError, ValueError):
                pass
        return False

    def kill(self) -> None:
        for kind, d in self.paths.items():
            if kind == "v2" and (d / "cgroup.kill").exists():
                try:
                    (d / "cgroup.kill").write_text("1")
                    continue
                except OSError:
                    pass
            for _ in range(100):
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.005)

    def remove(self) -> None:
        for d in self.paths.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        break
                    time.sleep(0.01)


# -- memory limits: the whole tree's, with or without a cgroup -----------------------------------------------

@dataclass(frozen=True)
class BoxLimits:
    """The memory limits of one box: `processes` (RLIMIT_NPROC, threads included) of `process_mb` address
    space each (RLIMIT_AS), and with `cgroup` a memory cgroup of `memory_mb` over the whole tree."""
    memory_mb: int    # asked
    processes: int
    process_mb: int
    cgroup: bool

    @property
    def tree_mb(self) -> int:
        """What the whole process tree can hold at most (resident memory is within address space)."""
        return self.memory_mb if self.cgroup else self.processes * self.process_mb

    @property
    def weaker(self) -> bool:
        return self.tree_mb > self.memory_mb

    def describe(self) -> str:
        if self.cgroup:
            return (f"{self.memory_mb} MB for the whole process tree (memory cgroup), {self.processes} "
                    f"processes of at most {self.process_mb} MB address space each")
        text = (f"no memory cgroup: {self.processes} process{'es' if self.processes > 1 else ''} of at most "
                f"{self.process_mb} MB address space each, {self.tree_mb} MB for the whole tree")
        if self.weaker:
            text += (f" (WEAKER than the {self.memory_mb} MB asked: no process is given less than "
                     f"{MIN_PROCESS_MB} MB)")
        return text


def box_limits(memory_mb: int, cgroup: bool) -> BoxLimits:
    """The limits of a box asked for `memory_mb`: with a memory cgroup, the cgroup bounds the tree and each
    process may use all of it (MAX_PROCESSES of them); without, processes x address space <= memory_mb
    (NO_CGROUP_PROCESSES at most, fewer below MIN_PROCESS_MB each; one of MIN_PROCESS_MB when less is
    asked)."""
    if cgroup:
        return BoxLimits(memory_mb, MAX_PROCESSES, memory_mb, True)
    processes = max(1, min(NO_CGROUP_PROCESSES, memory_mb // MIN_PROCESS_MB))
    return BoxLimits(memory_mb, processes, max(MIN_PROCESS_MB, memory_mb // processes), False)


_warned_limits: set[int] = set()
_warn_lock = threading.Lock()


def warn_limits(limits: BoxLimits) -> None:
    """Once per asked size: say on stderr that the tree's memory is split over processes (no cgroup here),
    loudly where that is weaker than asked."""
    if limits.cgroup:
        return
    with _warn_lock:
        if limits.memory_mb in _warned_limits:
            return
        _warned_limits.add(limits.memory_mb)
    how = ("run the evaluator as root or in a delegated cgroup (e.g. `systemd-run --user --scope -p "
           "Delegate=yes ...`) to bound the tree with a cgroup instead")
    if limits.weaker:
        print(f"WARNING: sandbox memory limit is WEAKER than asked: {limits.memory_mb} MB asked, but a box "
              f"without a memory cgroup gives its one process {limits.process_mb} MB of address space (the "
              f"least any process is given), so the tree may hold {limits.tree_mb} MB; {how}",
              file=sys.stderr)
    else:
        print(f"sandbox: no memory cgroup here, so a box's {limits.memory_mb} MB is split over its process "
              f"tree: at most {limits.processes} processes (threads included) of {limits.process_mb} MB "
              f"address space each; {how}", file=sys.stderr)
