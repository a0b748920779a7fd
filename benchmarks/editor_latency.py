"""How long an editor waits: a llama.vim-like session against `codeforge serve` and llama.cpp's own
llama-server on the same model (its GGUF in f32 and q8_0), with the prompt cache and without.

The session, as llama.vim sends it (its autoload/llama.vim at the version docs/serving.md names): one warm-up
request (`n_predict: 0`, the ring of extra context chunks), then one /infill request per line as the cursor
moves down a file: `input_prefix` the 256 lines above, `input_suffix` the 64 below, `prompt` the current line
up to the cursor, `input_extra` 3 chunks of 64 lines from other files, `n_indent` the line's indentation,
`id_slot` 0, `cache_prompt` true (or false for the "no cache" column). Sampling is greedy
(`samplers: ["top_k"]`, `top_k: 1`) and `n_predict` fixed, so both servers generate the same tokens on the
same weights and the difference is the servers' own. Each request is timed at the client (send to full reply).

    python benchmarks/editor_latency.py --run RUN [--requests 40] [--threads 2]

RUN is a codeforge run directory (a trained one, or one step of a preset: the weights do not change the time a
token takes). llama-server is found as tests/test_llama_server.py finds it (benchmarks/build_llama_server.py
builds it). Prints one table: p50 and p95 per request in milliseconds, and the mean prompt tokens computed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILE = STDLIB / "json" / "decoder.py"  # the file the cursor moves down
EXTRA = [STDLIB / "json" / "encoder.py", STDLIB / "json" / "scanner.py", STDLIB / "json" / "__init__.py"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 300.0) -> tuple[dict, float]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{url}: {e.code} {e.read()[:500]!r}") from None
    return json.loads(raw or b"{}"), (time.perf_counter() - t0) * 1000


def wait_up(url: str, proc: subprocess.Popen, seconds: float = 300.0) -> None:
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before answering {url}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up in {seconds:.0f} s")


def session(url: str, n: int, cache: bool, n_predict: int) -> list[tuple[float, int]]:
    """(milliseconds, prompt tokens computed) per request of one llama.vim-like session."""
    lines = FILE.read_text().splitlines()
    extra = []
    for p in EXTRA:
        text = p.read_text().splitlines()[:64]
        extra.append({"text": "\n".join(text) + "\n", "filename": p.name, "time": 0})
    common = {"id_slot": 0, "cache_prompt": cache, "samplers": ["top_k"], "top_k": 1, "stream": False}
    post(url + "/infill", {**common, "input_prefix": "", "input_suffix": "", "input_extra": extra,
                           "prompt": "", "n_predict": 0, "response_fields": [""]})
    out = []
    start = 40
    for i in range(start, min(start + n, len(lines) - 1)):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        body = {**common, "input_prefix": "\n".join(lines[max(0, i - 256):i]) + "\n",
                "input_suffix": line[indent:] + "\n" + "\n".join(lines[i + 1:i + 65]) + "\n",
                "input_extra": extra, "prompt": line[:indent], "n_predict": n_predict,
                "n_indent": indent, "t_max_predict_ms": 1000}
        reply, ms = post(url + "/infill", body)
        out.append((ms, int((reply.get("timings") or {}).get("prompt_n", -1))))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a codeforge run directory")
    ap.add_argument("--requests", type=int, default=40, help="/infill requests per session")
    ap.add_argument("--n-predict", type=int, default=16, help="tokens each request generates at most")
    ap.add_argument("--threads", type=int, default=2, help="threads for both servers")
    ap.add_argument("--llama-server", default=None, help="the binary (default: as the slow tests find it)")
    a = ap.parse_args()
    import tomllib

    from codeforge.evaluation.llama_server import find_binary
    binary = find_binary(a.llama_server)
    ctx = tomllib.loads((Path(a.run) / "config.toml").read_text())["model"]["block_size"]
    work = Path(tempfile.mkdtemp(prefix="editor_latency_"))
    ggufs = {}
    for dtype in ("f32", "q8_0"):
        out = work / f"model.{dtype}.gguf"
        subprocess.run([sys.executable, "-m", "codeforge", "export", "--run", os.path.abspath(a.run),
                        "--format", "gguf", "--out", str(out), "--dtype", dtype], check=True, cwd=work,
                       stdout=subprocess.DEVNULL)
        ggufs[dtype] = out
    rows = []
    servers = [("codeforge serve", None)] + [(f"llama-server {d}", g) for d, g in ggufs.items()]
    env = {**os.environ, "CODEFORGE_THREADS": str(a.threads)}
    for name, gguf in servers:
        port = free_port()
        if gguf is None:
            cmd = [sys.executable, "-m", "codeforge", "serve", "--run", os.path.abspath(a.run),
                   "--port", str(port), "--infill-predict", str(a.n_predict)]
        else:
            # one slot, codeforge's context, and the same /infill budget (-b as --infill-batch, half the
            # context; -n as --infill-predict): the same prompt on both, llama.vim's id_slot 0 one cache
            cmd = [binary, "-m", str(gguf), "--port", str(port), "-t", str(a.threads), "-np", "1",
                   "-c", str(ctx), "-b", str(ctx // 2), "-ub", str(ctx // 2), "-n", str(a.n_predict),
                   "--no-webui"]
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_up(url, proc)
            for cache in (True, False):
                got = session(url, a.requests, cache, a.n_predict)
                ms = [m for m, _ in got]
                rows.append((name, "yes" if cache else "no", pct(ms, 0.5), pct(ms, 0.95),
                             statistics.mean(p for _, p in got)))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{'server':22} {'cache':>5} {'p50 ms':>8} {'p95 ms':>8} {'prompt tokens computed':>23}")
    for name, cache, p50, p95, pn in rows:
        print(f"{name:22} {cache:>5} {p50:8.1f} {p95:8.1f} {pn:23.1f}")


if __name__ == "__main__":
    main()
