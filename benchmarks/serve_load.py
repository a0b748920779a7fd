"""Load on `codeforge serve`: what continuous batching buys, and how the server holds up under many clients.

Starts the server in a subprocess (`codeforge serve --run RUN --port 0`), then, over HTTP with streaming
requests (/v1/completions, stream_options.include_usage so each request reports its own token count):

  speed-up  the same requests (prompts, seeds, temperature 0.8, --max-tokens each) sent by 1 client one at a
            time, then by --clients clients at once: total generated tokens per second of each, and the ratio.
  load      --load-clients clients, each sending streaming requests back to back for --duration seconds:
            requests by status (no 5xx expected; 429 is the queue saying no), p50/p95 time to first token,
            tokens/s, the mean batch size from /metrics, and the server's resident memory (sampled peak).

    python benchmarks/serve_load.py --run runs/quickstart-chat/run [--mode both] [--clients 8] [--requests 4]
        [--max-tokens 128] [--repeats 3] [--load-clients 32] [--duration 60] [--max-batch 8]

The machine's load average is printed with the figures: other processes on the same cores slow every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
           "class Stack:\n    def __init__(self):\n",
           "func Reverse(s string) string {\n", "for i in range(10):\n", "# Parse a JSON config file\n",
           "package main\n\nimport \"fmt\"\n\nfunc main() {\n",
           "def read_lines(path):\n    with open(path) as f:\n"]


def start_server(a) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "codeforge", "serve", "--run", a.run, "--port", "0", "--device", a.device,
           "--max-batch", str(a.max_batch), "--max-queue", str(a.max_queue)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        print("  server: " + line.rstrip())
        m = re.search(r"listening on (http://\S+?)/ ", line)
        if m:
            # keep the pipe drained
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, m.group(1)
    raise SystemExit(f"the server did not start:\n{p.stderr.read()}")


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


async def one(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, seed: int
) -> tuple[int, int, float | None]:
    """(status, completion tokens, seconds to the first text) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    return 500, tokens, first
                if first is None and d["choices"] and d["choices"][0]["text"]:
                    first = time.perf_counter() - t0
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
    except httpx.HTTPError:
        return -1, tokens, first  # connection-level failure
    return 200, tokens, first


async def speedup(url: str, a) -> None:
    """Rounds of (1 client, then --clients clients), interleaved so that a change in the machine's other load
    hits both sides of a ratio alike; the median ratio is the figure."""
    print(f"\nspeed-up: streaming completions, {a.max_tokens} "
          f"max tokens, temperature 0.8; {a.requests} requests "
          f"one at a time vs {a.requests * a.clients} by {a.clients} clients at once, {a.repeats} rounds")
    print(f"{'round':>5s} {'clients':>8s} {'requests':>9s} {'tokens':>7s} {'seconds':>8s} {'tokens/s':>9s} "
          f"{'p50 TTFT s':>11s} {'load avg':>9s}")
    ratios = []
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as client:
        await one(client, "warm", 8, 0)
        for rnd in range(a.repeats):
            rates = []
            for c in (1, a.clients):
                n = a.requests * c

                async def worker(w: int, c: int = c, n: int = n) -> list:
                    return [await one(client, PROMPTS[i % len(PROMPTS)], a.max_tokens, i)
                            for i in range(w, n, c)]

                t0 = time.perf_counter()
                res = [x for ws in await asyncio.gather(*(worker(w) for w in range(c))) for x in ws]
                t = time.perf_counter() - t0
                tokens = sum(x[1] for x in res)
                rates.append(tokens / t)
                ttft = statistics.median([x[2] for x in res if x[2] is not None] or [float("nan")])
                print(f"{rnd + 1:5d} {c:8d} {len(res):9d} {tokens:7d} {t:8.1f} {tokens / t:9.1f} "
                      f"{ttft:11.3f} {os.getloadavg()[0]:9.1f}")
            ratios.append(rates[1] / rates[0])
    print(f"total tokens/s with {a.clients} concurrent clients vs 1 at a time: median "
          f"{statistics.median(ratios):.2f}x (rounds: {', '.join(f'{r:.2f}x' for r in ratios)})")


async def load(url: str, pid: int, a) -> None:
    stop_at = time.monotonic() + a.duration
    results: list[tuple[int, int, float | None]] = []
    peak = [rss_mb(pid)]

    async def sample_rss() -> None:
        while time.monotonic() < stop_at:
            peak[0] = max(peak[0], rss_mb(pid))
            await asyncio.sleep(0.5)

    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as client:
        async def worker(w: int) -> None:
            i = w
            while time.monotonic() < stop_at:
                res = await one(client, PROMPTS[i % len(PROMPTS)], a.max_tokens, i)
                results.append(res)
                if res[0] == 429:
                    await asyncio.sleep(1.0)
                i += a.load_clients

        rss0 = rss_mb(pid)
        t0 = time.perf_counter()
        await asyncio.gather(sample_rss(), *(worker(w) for w in range(a.load_clients)))
        wall = time.perf_counter() - t0
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).status_code

    def m(name: str) -> float:
        hit = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.M)
        return float(hit.group(1)) if hit else float("nan")

    by_status: dict[int, int] = {}
    for s, _, _ in results:
        by_status[s] = by_status.get(s, 0) + 1
    ok = [r for r in results if r[0] == 200]
    ttft = sorted(r[2] for r in ok if r[2] is not None)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")  # noqa: E731
    tokens = sum(r[1] for r in ok)
    print(f"\nload: {a.load_clients} streaming clients for "
          f"{a.duration:.0f}s ({wall:.1f}s with the last replies), "
          f"{a.max_tokens} max tokens, server --max-batch {a.max_batch} --max-queue {a.max_queue} (load "
          f"average {os.getloadavg()[0]:.1f})")
    print(f"  requests: {len(results)} ({', '.join(f'{k}: {v}' for k, v in sorted(by_status.items()))}); "
          f"5xx: {sum(v for k, v in by_status.items() if k >= 500 or k < 0)}")
    print(f"  time to first token: p50 {pct(0.5):.2f}s, p95 "
          f"{pct(0.95):.2f}s (includes waiting for a batch slot)")
    print(f"  generated: {tokens} tokens, {tokens / wall:.1f} tokens/s; mean batch "
          f"{m('codeforge_decode_step_rows_total') / max(1.0, m('codeforge_decode_steps_total')):.2f} "
          "rows/step")
    print(f"  server RSS: {rss0:.0f} MB before, peak {peak[0]:.0f} MB during, {rss_mb(pid):.0f} MB after "
          f"(VmHWM {rss_mb(pid, 'VmHWM'):.0f} MB); /health after: {health}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="runs/quickstart-chat/run")
    ap.add_argument("--mode", choices=["speedup", "load", "both"], default="both")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="requests per client in the speed-up mode")
    ap.add_argument("--repeats", type=int, default=3, help="speed-up rounds (the median ratio is reported)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--load-clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    p, url = start_server(a)
    try:
        if a.mode in ("speedup", "both"):
            asyncio.run(speedup(url, a))
        if a.mode in ("load", "both"):
            asyncio.run(load(url, p.pid, a))
    finally:
        p.terminate()
        p.wait(30)


if __name__ == "__main__":
    main()
