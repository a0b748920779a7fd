"""Run untrusted generated Python code with time, memory, process and network limits.

Layers, outermost first (none alone is a container; together they stop what generated code does by
accident or on purpose in pass@k evaluation):
  1. a separate process in its own session, killed with its whole process group at the wall-clock limit;
  2. a prelude, run by the child before the code (no preexec_fn, which is unsafe in a threaded parent), that
     sets rlimits (address space, CPU seconds, file size, no core dumps), enters a new network namespace
     where the kernel allows it (root or user namespaces: only a down loopback, nothing reachable), and
     disables process creation (fork, exec, subprocess, os.system), sockets, and file creation or access
     outside the scratch directory (reads of Python's own installation stay allowed) through builtins, io,
     os and the C modules behind them (posix, _posixsubprocess, _socket, ctypes);
  3. an empty scratch directory as cwd, HOME and TMPDIR, removed afterwards; an environment with nothing of
     the user's (only PATH and the locale).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

PRELUDE = r'''
import builtins, io, os, sys
import resource as _resource
_mem = __MEMORY_BYTES__
_resource.setrlimit(_resource.RLIMIT_AS, (_mem, _mem))
_resource.setrlimit(_resource.RLIMIT_CPU, (__CPU_SECONDS__, __CPU_SECONDS__ + 1))
_resource.setrlimit(_resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))
_resource.setrlimit(_resource.RLIMIT_CORE, (0, 0))
if __ISOLATE_NET__:
    import ctypes as _ctypes
    try:  # a new, empty network namespace: needs root or unprivileged user namespaces
        _ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
    except Exception:
        pass  # the socket guard below still applies
_scratch = os.path.realpath(os.getcwd())
_allowed_read = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix} | set(p for p in sys.path if p))
_real_open = builtins.open
def _guarded_open(file, mode="r", *a, **k):
    if isinstance(file, int):
        return _real_open(file, mode, *a, **k)
    p = os.path.realpath(os.fspath(file))
    inside = p == _scratch or p.startswith(_scratch + os.sep)
    if not inside and (any(c in mode for c in "wax+") or not p.startswith(_allowed_read)):
        raise PermissionError(f"sandbox: access to {p} is not allowed")
    return _real_open(file, mode, *a, **k)
import _io
builtins.open = io.open = _io.open = _guarded_open
def _blocked(*a, **k):
    raise PermissionError("sandbox: not allowed")
for _name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp", "execvp",
              "execvpe", "spawnv", "spawnve", "spawnl", "posix_spawn", "posix_spawnp", "kill", "killpg",
              "remove", "unlink", "rmdir", "removedirs", "rename", "replace", "chmod", "chown", "putenv",
              "open", "truncate", "symlink", "link", "mkdir", "makedirs", "utime", "mkfifo", "mknod", "chroot"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
import socket as _socket
class _NoSocket(_socket.socket):
    def __init__(self, *a, **k):
        raise PermissionError("sandbox: network access is not allowed")
_socket.socket = _NoSocket
_socket.create_connection = _blocked
_socket.getaddrinfo = _blocked
import subprocess as _subprocess
_subprocess.Popen = _blocked
# the C modules behind os, subprocess and socket, so the guards above cannot be sidestepped by importing them
for _mod in ("shutil", "multiprocessing", "ctypes", "_ctypes", "resource", "posix", "_posixsubprocess", "_socket"):
    sys.modules[_mod] = None
del _name, _mod
'''


@dataclass
class SandboxResult:
    status: str  # passed | failed | timeout | memory | error
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 1024, isolate_net: bool = True) -> SandboxResult:
    """Run `code` under the limits above. passed: exit 0; failed: an exception or non-zero exit (the last
    line of stderr in detail); timeout; memory: MemoryError or killed by the address-space limit."""
    scratch = tempfile.mkdtemp(prefix="codeforge-sandbox-")
    path = os.path.join(scratch, "program.py")
    prelude = (PRELUDE.replace("__MEMORY_BYTES__", str(memory_mb * 2**20))
               .replace("__CPU_SECONDS__", str(int(timeout) + 1)).replace("__ISOLATE_NET__", str(bool(isolate_net))))
    with open(path, "w", encoding="utf-8") as f:
        f.write(prelude + "\n" + code)
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-I", "program.py"], cwd=scratch, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        status = None
    except subprocess.TimeoutExpired:
        status = "timeout"
        err = b""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it managed to start
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - t0
    text = err.decode("utf-8", "replace").strip()
    last = text.splitlines()[-1] if text else ""
    if status == "timeout":
        return SandboxResult("timeout", f"exceeded {timeout}s", seconds)
    if proc.returncode == 0:
        return SandboxResult("passed", "", seconds)
    if "MemoryError" in last or proc.returncode == -signal.SIGKILL and not last:
        return SandboxResult("memory", last or "killed (memory limit)", seconds)
    if proc.returncode in (-signal.SIGXCPU,):
        return SandboxResult("timeout", "CPU time limit", seconds)
    return SandboxResult("failed", last or f"exit code {proc.returncode}", seconds)
