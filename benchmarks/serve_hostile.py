"""`codeforge serve` under clients that never finish: what slowloris-style attacks do to a server whose
process may hold few files, and whether it recovers.

Starts `codeforge serve` in a subprocess with RLIMIT_NOFILE --nofile (256), short timeouts where the server
has the flags (--header-timeout, --body-timeout, --keep-alive: checked in its --help, so an older commit
without them runs too), then for each attack, on a fresh server:

  idle-head   --conns connections that send nothing, or a request head without its end
  slow-body   --conns connections that send a complete head, then their body a byte a second
  both        both at once (2 x --conns)

and prints a table: how long opening the attack's connections took, /health latency while the attack holds
them (a 1 s client timeout: "timeout" when it did not answer), how many of them the server had closed --wait
seconds after the last one opened, /health again, the server's resident memory before and after, and the
lines its stderr holds about accept() failing for want of file descriptors (EMFILE). --code DIR runs the
server from another checkout (git worktree or `git archive COMMIT | tar -x -C DIR`) for before/after figures.

    python benchmarks/serve_hostile.py [--run RUN] [--code DIR] [--conns 300] [--nofile 256] [--wait 8]

Without --run a tiny run is trained first (two steps on the Python standard library's json package).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import selectors
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def tiny_run(tmp: Path, code: Path) -> Path:
    """A two-step run on a small corpus, made with the checkout under test."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    env = {**os.environ, "PYTHONPATH": str(code)}
    steps = [["tokenizer", "train", "--input", str(stdlib / "json"), str(stdlib / "asyncio"), "--vocab-size",
              "1024", "--out", str(tmp / "tok")],
             ["prepare", "--input", str(stdlib / "json"), str(stdlib / "asyncio"), "--tokenizer",
              str(tmp / "tok"), "--out", str(tmp / "data")],
             ["train", "--data", str(tmp / "data"), "--out", str(tmp / "tiny"), "--block-size", "64",
              "--n-layer", "1",
              "--n-head", "2", "--n-embd", "32", "--max-iters", "2", "--device", "cpu", "--no-progress",
              "--eval-tokens", "128", "--batch-size", "2"]]
    for args in steps:
        r = subprocess.run([sys.executable, "-m", "codeforge", *args], capture_output=True, text=True,
                           env=env, cwd=code)
        if r.returncode:
            raise SystemExit(f"codeforge {args[0]} failed:\n{r.stdout}\n{r.stderr}")
    return tmp / "tiny"


def has_flag(code: Path, flag: str) -> bool:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-m", "codeforge", "serve", "--help"], capture_output=True,
                         text=True, env=env, cwd=code).stdout
    return flag in out


def start(a, run: Path, code: Path, flags: list[str]) -> tuple[subprocess.Popen, int, list[str]]:
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile, a.nofile))

    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "codeforge", "serve", "--run", str(run), "--port", "0",
                          "--device",
                          "cpu", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=code, preexec_fn=limit)
    err: list[str] = []
    for line in p.stdout:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
            return p, int(m.group(1)), err
    raise SystemExit(f"the server did not start:\n{p.stderr.read()}")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def health(port: int) -> str:
    t = time.perf_counter()
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
    except httpx.HTTPError:
        return "timeout"
    return f"{(time.perf_counter() - t) * 1000:.0f} ms" + ("" if r.status_code == 200
                                                           else f" ({r.status_code})")


def connect(port: int, n: int, first: bytes) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            if first:
                s.sendall(first)
        except OSError:
            s.close()
            continue
        s.setblocking(False)
        out.append(s)
    return out


def count_closed(socks: list[socket.socket]) -> int:
    """Connections the server has closed (EOF or reset); what it sent before is read and dropped."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    for key, _ in sel.select(timeout=0):
        try:
            while key.fileobj.recv(65536):  # a response (a 503, say) before the end
                pass
        except BlockingIOError:  # open: nothing more to read yet
            continue
        except OSError:  # reset
            pass
        closed += 1
    sel.close()
    return closed


def attack(a, run: Path, code: Path, flags: list[str], kind: str) -> dict:
    p, port, err = start(a, run, code, flags)
    stop = threading.Event()
    socks: list[socket.socket] = []
    try:
        time.sleep(0.5)
        rss0 = rss_mb(p.pid)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                f"application/json\r\nContent-Length: 1000\r\n\r\n{{").encode()
        t0 = time.monotonic()
        if kind in ("idle-head", "both"):
            socks += connect(port, a.conns // 2, b"") + connect(port, a.conns - a.conns // 2,
                                                                b"GET /health HTTP/1.1\r\nHost: 127.0.0.1")
        if kind in ("slow-body", "both"):
            slow = connect(port, a.conns, head)
            socks += slow

            def trickle():
                while not stop.wait(1.0):
                    for s in slow:
                        try:
                            s.send(b" ")
                        except OSError:
                            pass
            threading.Thread(target=trickle, daemon=True).start()
        opened = time.monotonic() - t0
        during = health(port)
        time.sleep(max(0.0, a.wait - (time.monotonic() - t0 - opened)))
        closed = count_closed(socks)
        after = health(port)
        rss1 = rss_mb(p.pid)
        emfile = sum("out of system resource" in line for line in err)
        return {"attack": kind, "conns": len(socks), "open_s": opened, "during": during, "closed": closed,
                "after": after, "rss0": rss0, "rss1": rss1, "emfile": emfile}
    finally:
        stop.set()
        for s in socks:
            s.close()
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=None, help="run directory (default: train a tiny one)")
    ap.add_argument("--code", default=str(ROOT),
                    help="checkout whose `codeforge serve` runs (default: this one)")
    ap.add_argument("--conns", type=int, default=300, help="connections per attack (default 300)")
    ap.add_argument("--nofile", type=int, default=256, help="the server's RLIMIT_NOFILE (default 256)")
    ap.add_argument("--wait", type=float, default=5.0,
                    help="seconds from the last attack connection opened to counting closed ones (default 5)")
    ap.add_argument("--attacks", nargs="+", default=["idle-head", "slow-body", "both"])
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3 * a.conns + 64:  # this process holds the attack's sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 3 * a.conns + 1024), hard))
    code = Path(a.code).resolve()
    commit = subprocess.run(["git", "-C", str(code), "log", "-1", "--format=%h %s"], capture_output=True,
                            text=True).stdout.strip()[:80] or str(code)
    flags = []
    if has_flag(code, "--header-timeout"):
        flags = ["--header-timeout", "2", "--body-timeout", "3", "--keep-alive", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(a.run) if a.run else tiny_run(Path(tmp), code)
        print(f"code: {commit}\nserver: RLIMIT_NOFILE {a.nofile}, flags "
              f"{' '.join(flags) or '(none: not supported)'}")
        print(f"machine: {os.cpu_count()} CPUs, load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
        cols = (
            f"{'attack':<10} {'conns':>5} {'open s':>6} {'/health during':>15} {f'closed +{a.wait:g}s':>13} "
            f"{'/health after':>14} {'RSS MB before/after':>20} {'EMFILE logs':>11}"
        )
        print(cols)
        print("-" * len(cols))
        for kind in a.attacks:
            r = attack(a, run, code, flags, kind)
            print(f"{r['attack']:<10} {r['conns']:>5} {r['open_s']:>6.1f} {r['during']:>15} "
                  f"{r['closed']:>6}/{r['conns']:<6} {r['after']:>14} {r['rss0']:>9.0f}/{r['rss1']:<10.0f} "
                  f"{r['emfile']:>11}", flush=True)


if __name__ == "__main__":
    main()
