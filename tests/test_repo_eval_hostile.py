"""`codeforge eval --repo` against hostile input (issue 55, item 7): a repository file nested too deeply for
Python's compiler, an endpoint whose fill is nested too deeply, whose `content` is not text, whose reply is
JSON nested too deeply, or whose reply never ends. Each is a case counted as not parsing or a clear
EvalError, never a RecursionError, a TypeError or a read without end."""

import http.server
import json
import re
import select
import socket
import threading
import time

import pytest

from codeforge.evaluation import repo as repo_eval
from codeforge.evaluation.lm import EvalError
from codeforge.evaluation.repo import (completions_backend, infill_backend, parses, repo_cases, repo_files,
                                       run_repo_eval)
from test_repo_eval import py_file

# a chain of 4,000 unary minus signs, one a line (so no line is long enough for the corpus reader to take
# the file for minified): Python's compiler gives up on it with a RecursionError
DEEP_PY = "import os\n\n\ndef f():\n    return 1\n\n\nx = (\n" + "-\n" * 4000 + "1)\n"


@pytest.fixture()
def hostile_repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    for i in range(3):
        (root / f"m{i}.py").write_text(py_file(i))
    (root / "deep.py").write_text(DEEP_PY)
    # 100k nested brackets: too long to be a case, but read, hashed and sent as context
    (root / "brackets.py").write_text("x = (\n" + "[\n" * 100_000 + "]\n" * 100_000 + ")\n")
    return root


class Hostile(http.server.BaseHTTPRequestHandler):
    """Answers every POST as `Hostile.mode` says: "json" (Hostile.body, whole), "endless" (a body that never
    ends, no length given) or "trickle" (a byte now and then, a huge length announced)."""
    mode = "json"
    body = b"{}"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if Hostile.mode == "json":
                self.send_header("Content-Length", str(len(Hostile.body)))
                self.end_headers()
                self.wfile.write(Hostile.body)
                return
            if Hostile.mode == "trickle":
                self.send_header("Content-Length", str(10**9))
            self.end_headers()
            self.wfile.write(b'{"content": "')
            stop = time.monotonic() + 60  # the client hangs up long before
            while time.monotonic() < stop:
                if Hostile.mode == "endless":
                    self.wfile.write(b"x" * 65536)
                else:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.02)
        except OSError:  # the client hung up: what it should do
            pass

    def log_message(self, *a):
        pass


@pytest.fixture()
def hostile():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Hostile.mode, Hostile.body = "json", b"{}"
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def answer(obj) -> None:
    Hostile.mode, Hostile.body = "json", json.dumps(obj).encode()


def test_a_file_nested_too_deep_to_compile_gives_no_case(hostile_repo):
    assert not parses(DEEP_PY, "python")  # not a RecursionError
    assert not parses("x = " + "-" * 5000 + "1\n", "python")
    assert not parses("x = " + "not " * 100_000 + "1\n", "python")  # the parser's stack: a MemoryError
    files = dict(repo_files(str(hostile_repo)))
    assert {"deep.py", "brackets.py"} <= set(files)
    cases = repo_cases(list(files.items()), 3)
    assert cases and not {c["path"] for c in cases} & {"deep.py", "brackets.py"}


def test_a_fill_nested_too_deep_counts_as_not_parsing(hostile_repo, hostile):
    answer({"content": "-" * 5000 + "1"})
    r = run_repo_eval(str(hostile_repo), endpoint=hostile, n=2)
    assert r["cases"] == 6 and r["scores"]["all"]["cases"] == 6
    assert r["scores"]["all"]["syntax_valid"] == 0.0 and r["scores"]["all"]["exact_match"] == 0.0


@pytest.mark.parametrize("reply, match", [
    ({"content": 5}, r"`content` that is int, not text"),
    ({"content": None}, r"`content` that is NoneType, not text"),
    ({"content": ["x"]}, r"`content` that is list, not text"),
    (["content"], r"not a JSON object"),
])
def test_an_infill_answer_that_is_not_text_is_a_clear_error(hostile, reply, match):
    answer(reply)
    with pytest.raises(EvalError, match=match):
        infill_backend(hostile)("a\n", "b\n", [], 8)


def test_a_completion_that_is_not_text_is_a_clear_error(hostile):
    answer({"choices": [{"text": {"x": 1}}]})
    with pytest.raises(EvalError, match=r"choices\[0\]\.text that is dict, not text"):
        completions_backend(hostile, None)("a\n", "b\n", [], 8)


def test_json_nested_too_deep_is_a_clear_error(hostile):
    Hostile.mode, Hostile.body = "json", b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(EvalError, match="not JSON.*nested too deeply"):
        infill_backend(hostile)("a\n", "b\n", [], 8)
    Hostile.body = b"{\"content\": " + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(EvalError, match="not JSON.*nested too deeply"):
        completions_backend(hostile, None)("a\n", "b\n", [], 8)


def test_a_reply_that_never_ends_stops_at_the_cap(hostile, monkeypatch):
    Hostile.mode = "endless"
    t = time.monotonic()
    with pytest.raises(EvalError, match=f"more than {repo_eval.MAX_REPLY_BYTES:,} bytes"):
        infill_backend(hostile)("a\n", "b\n", [], 8)
    assert time.monotonic() - t < 30
    # one that trickles in: stopped at the time a reply may take
    monkeypatch.setattr(repo_eval, "REPLY_SECONDS", 1.0)
    Hostile.mode = "trickle"
    t = time.monotonic()
    with pytest.raises(EvalError, match="did not finish its answer within 1 s"):
        completions_backend(hostile, None)("a\n", "b\n", [], 8)
    assert time.monotonic() - t < 10


def trickler(mode: str, gap: float = 0.05):
    """A one-connection server that reads a request, then sends its answer a piece every `gap` seconds: the
    status line a byte at a time ("status"), the headers a line at a time ("headers") or the body a byte at
    a time ("body"), each for seconds. `seen["left"]` is how many pieces it still had to send when the
    client hung up (0: it sent them all)."""
    srv = socket.create_server(("127.0.0.1", 0))
    body = b'{"content": "' + b"x" * 100 + b'"}'
    status = b"HTTP/1.1 200 " + b"O" * 100 + b"\r\n"
    head = [f"X-Slow-{i}: {i}\r\n".encode() for i in range(60)]
    end = f"Content-Length: {len(body)}\r\n\r\n".encode()
    pieces = {"status": [status[i:i + 1] for i in range(len(status))] + head[:1] + [end + body],
              "headers": [status] + head + [end + body],
              "body": [status + end] + [body[i:i + 1] for i in range(len(body))]}[mode]
    seen = {}

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10)
            got = b""
            while b"\r\n\r\n" not in got:
                got += conn.recv(65536)
            length = int(re.search(rb"(?i)content-length: *(\d+)", got).group(1))
            while len(got.split(b"\r\n\r\n", 1)[1]) < length:
                got += conn.recv(65536)
            left = len(pieces)
            try:
                for p in pieces:
                    conn.sendall(p)
                    left -= 1
                    # the client hanging up (its end shut down: readable, and nothing to read) stops it
                    if select.select([conn], [], [], gap)[0] and not conn.recv(1024):
                        break
            except OSError:
                pass
            seen["left"] = left
        srv.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", thread, seen


@pytest.mark.parametrize("mode", ["status", "headers", "body"])
def test_a_server_that_trickles_its_status_line_headers_or_body_is_cut_off_at_the_deadline(monkeypatch, mode):
    """REPLY_SECONDS bounds the whole request: the socket's timeout starts again with every byte, so a
    status line or headers sent a byte or a line at a time held the eval as long as the server liked (the
    deadline was checked only while reading the body). The error says so once, naming the url once."""
    monkeypatch.setattr(repo_eval, "REPLY_SECONDS", 0.5)
    base, thread, seen = trickler(mode)
    with pytest.raises(EvalError) as err:
        infill_backend(base)("a\n", "b\n", [], 8)
    msg = str(err.value)
    assert msg.startswith(f"{base}/infill did not finish its answer within 0.5 s") and msg.count(base) == 1
    assert "is the server running there" not in msg
    thread.join(30)
    assert seen["left"] > 0  # hung up on before the server had sent it all
