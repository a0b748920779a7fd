"""`codeforge serve` against hostile or careless clients: connections that never finish their headers or
their body (slowloris), more connections than the process has file descriptors, requests from other web
pages (Host and Origin), secrets and paths that must not leak, and malformed chat bodies."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from argparse import Namespace

import httpx
import openai
import pytest
import uvicorn

from codeforge.cli import main
from codeforge.engine import Engine
from codeforge.serve import ServeError, ServeOptions, create_app
from codeforge.serve.connections import ConnectionGuard, ConnectionLimits
from codeforge.serve.server import api_key, bind

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--max-iters", "2", "--device", "cpu",
        "--no-progress", "--eval-tokens", "128", "--batch-size", "2"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("hostile") / "tiny"
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--block-size", "64", *TINY]) == 0
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Server:
    """`codeforge serve` in a subprocess, optionally with a small RLIMIT_NOFILE."""

    def __init__(self, run, *flags: str, nofile: int | None = None, env: dict | None = None):
        def limit():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.p = subprocess.Popen([sys.executable, "-m", "codeforge", "serve", "--run", str(run), "--port",
                                   "0",
                                   "--device", "cpu", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env or ENV, preexec_fn=limit)
        self.out: list[str] = []
        self.url = None
        for line in self.p.stdout:
            self.out.append(line)
            m = re.search(r"listening on http://(127\.0\.0\.1):(\d+)/", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                self.url = f"http://{self.host}:{self.port}"
                break
        if self.url is None:
            raise AssertionError("the server did not start:\n" + "".join(self.out) + self.p.stderr.read())
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()
        threading.Thread(target=lambda: self.out.extend(self.p.stdout), daemon=True).start()

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def open_conns(port: int, n: int, first: bytes) -> list[socket.socket]:
    """n TCP connections to the server, each having sent `first` (b"": nothing)."""
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
        out.append(s)
    return out


def closed_by_server(socks: list[socket.socket], within: float) -> int:
    """How many of socks the server closes (EOF or reset) within `within` seconds; response bytes are read
    and ignored."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + within
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            try:
                data = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except OSError:  # reset
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed += 1
    sel.close()
    return closed


def health_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_slow_clients_cannot_exhaust_the_server(tiny_run):
    """300 connections that never finish their headers and 300 that send their body at a byte a second,
    against a server whose process may hold 256 files: /health still answers within a second (the client's
    timeout), the server closes every one of them within its timeouts, and its memory stays bounded."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    header_timeout, body_timeout = 3, 4
    srv = Server(tiny_run, "--header-timeout", str(header_timeout), "--body-timeout", str(body_timeout),
                 "--keep-alive", "1", nofile=256)
    socks: list[socket.socket] = []
    stop = threading.Event()
    try:
        assert health_ok(srv.url)
        rss0 = rss_mb(srv.p.pid)
        idle = open_conns(srv.port, 150, b"") + open_conns(srv.port, 150,
                                                           b"GET /health HTTP/1.1\r\nHost: 127.0.0.1")
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: "
                f"application/json\r\nContent-Length: 1000\r\n\r\n{{").encode()
        slow = open_conns(srv.port, 300, head)
        socks = idle + slow

        def trickle():  # a byte a second on every slow body
            while not stop.wait(1.0):
                for s in slow:
                    try:
                        s.send(b" ")
                    except OSError:
                        pass
        threading.Thread(target=trickle, daemon=True).start()
        assert len(idle) == 300 and len(slow) == 300, (len(idle), len(slow))
        # the 600 connects return at once (the kernel queues them); the server takes them off its listen queue
        # at about a millisecond each on a busy 2-core machine, a burst /health would wait behind. A second
        # later they are taken (none has reached its deadline yet) and a new client is served at once
        time.sleep(1)
        assert health_ok(srv.url), "/health did not answer within 1 s with 600 hostile connections open"
        n_idle = closed_by_server(idle, header_timeout + 5)
        n_slow = closed_by_server(slow, body_timeout + 5)
        assert (n_idle, n_slow) == (300, 300), f"closed by the server: {n_idle} idle, {n_slow} slow bodies"
        assert health_ok(srv.url)
        rss1 = rss_mb(srv.p.pid)
        print(f"server RSS {rss0:.0f} MB before, {rss1:.0f} MB after")
        assert rss1 - rss0 < 100, (rss0, rss1)
    finally:
        stop.set()
        for s in socks:
            s.close()
        srv.stop()
    assert "out of system resource" not in "".join(srv.err), "".join(srv.err)[-2000:]


# -- in process: the connection guard's deadlines and cap ----------------------------------------------------

@contextlib.contextmanager
def guarded(run, limits: ConnectionLimits = ConnectionLimits(), **opts):
    """The app under uvicorn with the connection guard, in a thread on a free 127.0.0.1 port."""
    engine = Engine.from_run(str(run), "cpu")
    app = create_app(engine, ServeOptions(model_name="tiny", **opts))
    guard = ConnectionGuard(limits)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=guard.protocol_class(), ws="none",
                                           timeout_keep_alive=limits.keep_alive))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.02)
    port = sock.getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", port, guard, app.state.srv
    finally:
        server.should_exit = True
        th.join(10)


def test_deadlines_close_slow_heads_and_bodies(tiny_run):
    """A connection that sends nothing, one that trickles its head, one that trickles its body: each is closed
    at its deadline, which trickling does not extend; a kept-alive connection is closed when idle; /health
    answers throughout."""
    limits = ConnectionLimits(header_timeout=1.0, body_timeout=1.5, keep_alive=0.5, max_connections=50)
    with guarded(tiny_run, limits) as (url, port, guard, _):
        silent = open_conns(port, 1, b"")
        head = open_conns(port, 1, b"GET /health HTTP/1.1\r\n")
        body = open_conns(port, 1, f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                   "Content-Type: "
                                   "application/json\r\nContent-Length: 100\r\n\r\n{".encode())
        kept = open_conns(port, 1, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        stop = threading.Event()

        def trickle():
            while not stop.wait(0.2):
                for s, b in ((head[0], b"X"), (body[0], b" ")):
                    with contextlib.suppress(OSError):
                        s.send(b)
        threading.Thread(target=trickle, daemon=True).start()
        try:
            assert health_ok(url)
            assert closed_by_server(silent + head, 10) == 2
            assert closed_by_server(body, 10) == 1
            assert closed_by_server(kept, 10) == 1  # answered, then closed idle (uvicorn's keep-alive)
        finally:
            stop.set()
        assert guard.closed["header_timeout"] == 2 and guard.closed["body_timeout"] == 1
        assert health_ok(url)
        deadline = time.monotonic() + 10
        while guard.live and time.monotonic() < deadline:  # the client closes its connection: nothing stays
            time.sleep(0.02)
        assert not guard.live


def test_connection_cap_displaces_the_longest_waiting(tiny_run):
    """At --max-connections a new connection displaces the one waiting longest on its client, so idle
    connections cannot lock anyone out; when every connection is being answered the newcomer gets 503."""
    limits = ConnectionLimits(header_timeout=60, body_timeout=60, keep_alive=60, max_connections=4)
    with guarded(tiny_run, limits) as (url, port, guard, srv):
        idle = open_conns(port, 10, b"")
        assert health_ok(url)  # a fresh client gets in at once, not after the 60 s header timeout
        assert closed_by_server(idle[:7], 10) == 7  # the oldest went first
        assert guard.closed["displaced"] >= 7 and guard.closed["refused"] == 0
        body = json.dumps({"prompt": "x", "max_tokens": 2})
        req = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
        with srv.sched.hold():  # four requests in, none answered: nothing to displace
            busy = open_conns(port, 4, req)
            deadline = time.monotonic() + 20
            while srv.sched.queue_length() < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert srv.sched.queue_length() == 4
            r = httpx.get(url + "/health", timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
            assert "--max-connections" in r.json()["error"]["message"]
        for s in busy:  # once answered they are served normally
            s.settimeout(20)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            s.close()
        assert health_ok(url) and guard.closed["refused"] == 1


# -- Host and Origin: other web pages and DNS rebinding ------------------------------------------------------

def test_host_and_origin_checked(tiny_run):
    with guarded(tiny_run) as (url, port, _, _srv):
        get = lambda path="/health", **h: httpx.get(url + path, headers=h, timeout=10)  # noqa: E731
        # DNS rebinding: the browser sends the attacker's name as Host
        r = get(host="evil.example")
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        assert "--allowed-hosts evil.example" in r.json()["error"]["message"]
        for host in (f"evil.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.1", "not a host",
                     f"localhost:{port}x"):
            assert get(host=host).status_code == 400, host
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
            assert get(host=host).status_code == 200, host
        # another site's page, through the user's browser (a simple POST needs no preflight)
        body = {"prompt": "x", "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "http://evil.example"},
                       timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert "--allowed-origins http://evil.example" in r.json()["error"]["message"]
        for origin in ("null", f"http://localhost:{port + 1}", f"https://127.0.0.1:{port}"):
            r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": origin}, timeout=10)
            assert r.status_code == 403, origin
        # the server's own page (the playground) and clients that are not browsers are served
        r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": url}, timeout=10)
        assert r.status_code == 200, r.text
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=1).choices
    # the flags widen it; CORS lets the allowed page read the answers
    with guarded(tiny_run, allowed_hosts=("evil.example",), allowed_origins=("http://evil.example",),
                 api_key="k") as (url, port, _, _srv):
        assert httpx.get(url + "/health", headers={"Host": f"evil.example:{port}"},
                         timeout=10).status_code == 200
        pre = httpx.options(url + "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"}, timeout=10)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://evil.example"
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10,
                       headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://evil.example"
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://other.example",
                                                                                "Authorization": "Bearer k"})
        assert r.status_code == 403
    with guarded(tiny_run, allowed_hosts=("*",), allowed_origins=("*",)) as (url, port, _, _srv):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10,
                       headers={"Host": "anything.example", "Origin": "http://other.example"})
        assert r.status_code == 200


def test_serve_flags_checked(tiny_run, tmp_path, capsys):
    for flags, msg in ((["--allowed-hosts", "a/b"], "--allowed-hosts: 'a/b' is not a host"),
                       (["--allowed-origins", "evil.example"],
                        "--allowed-origins: 'evil.example' is not an origin"),
                       (["--allowed-origins", "http://x.example/path"], "is not an origin"),
                       (["--header-timeout", "0"], "--header-timeout = 0.0 is out of range (0.0, 3600.0]"),
                       (["--body-timeout", "-1"], "--body-timeout = -1.0 is out of range (0.0, 86400.0]"),
                       (["--keep-alive", "-1"], "--keep-alive = -1.0 is out of range [0.0, 3600.0]"),
                       (["--max-connections", "-1"], "--max-connections = -1 is out of range [1, "),
                       (["--max-connections", "10000000"],
                        "--max-connections 10000000 is more than this process's "
                        "file limit allows"),
                       (["--api-key-file", str(tmp_path / "missing")],
                        f"--api-key-file {tmp_path / 'missing'}: no "
                        f"such file")):
        assert main(["serve", "--run", str(tiny_run), "--device", "cpu", "--port", "0", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert "error: " in err and msg in err, (flags, err)


# -- secrets and paths ---------------------------------------------------------------------------------------

def key_args(**kw) -> Namespace:
    return Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_api_key_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("CODEFORGE_API_KEY", raising=False)
    assert api_key(key_args()) == (None, "")
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    assert api_key(key_args(api_key_file=str(f))) == ("s3cret", "--api-key-file")
    with pytest.raises(ServeError, match=f"--api-key-file {tmp_path / 'nope'}: no such file"):
        api_key(key_args(api_key_file=str(tmp_path / "nope")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ServeError, match=f"--api-key-file {tmp_path / 'empty'} is empty"):
        api_key(key_args(api_key_file=str(tmp_path / "empty")))
    with pytest.raises(ServeError, match="both given"):
        api_key(key_args(api_key="a", api_key_file=str(f)))
    monkeypatch.setenv("CODEFORGE_API_KEY", "from-env")
    assert api_key(key_args()) == ("from-env", "CODEFORGE_API_KEY")
    assert api_key(key_args(api_key_file=str(f)))[0] == "s3cret"  # an option beats the environment
    monkeypatch.setenv("CODEFORGE_API_KEY", " ")
    with pytest.raises(ServeError, match="CODEFORGE_API_KEY is set but empty"):
        api_key(key_args())


def test_key_not_in_ps_and_no_paths_in_models(tiny_run, tmp_path):
    """The key read from the environment is required and never on the command line; /v1/models names the
    model and its checkpoint, and holds no filesystem path."""
    srv = Server(tiny_run, env={**ENV, "CODEFORGE_API_KEY": "env-key-123"})
    try:
        assert b"env-key-123" not in open(f"/proc/{srv.p.pid}/cmdline", "rb").read()
        assert "API key required (from CODEFORGE_API_KEY)" in "".join(srv.out)
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer env-key-123"}, timeout=10)
        assert r.status_code == 200
        card = r.json()["data"][0]
        assert card["id"] == "tiny" and card["checkpoint"] == "step_000002"
        text = json.dumps(r.json())
        assert str(tiny_run) not in text and "/" not in text, text
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer env-key-123"},
                            timeout=10).text
        assert "codeforge_open_connections " in metrics and "codeforge_max_connections " in metrics
        assert 'codeforge_connections_closed_total{reason="header_timeout"} 0.0' in metrics
    finally:
        srv.stop()


def test_a_body_in_a_million_pieces_is_refused_early(tiny_run):
    """Found in the second hostile review: a 1 MB body sent as a million 1-byte chunks cost ~7 s of the event
    loop. Now a body that comes in more pieces than an honest client sends (4,096, or one per 256 bytes of
    --max-body-bytes) is refused by name after that many, and /health answers beside it."""
    from codeforge.serve.connections import body_pieces
    limits = ConnectionLimits(max_body_pieces=body_pieces(1 << 20))
    with guarded(tiny_run, limits, max_body_bytes=1 << 20) as (url, port, guard, _):
        n = 200_000
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                f"application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(30)
        t0 = time.perf_counter()
        with contextlib.suppress(OSError):  # the server may close before it has read everything sent
            s.sendall(head + b"1\r\n \r\n" * n + b"0\r\n\r\n")
        got = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in got or b"}" not in got:
                part = s.recv(65536)
                if not part:
                    break
                got += part
        s.close()
        print(f"answered in {time.perf_counter() - t0:.2f} s")
        assert got.startswith(b"HTTP/1.1 400"), got[:200]
        assert b"body_too_fragmented" in got
        assert health_ok(url) and guard.closed["fragmented"] == 1
        # an honest body of the same size, sent whole, is read as before (and refused only for its content)
        r = httpx.post(url + "/v1/completions", content=b" " * 900_000 + b"{}", timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code != 400 or "fragmented" not in r.text
