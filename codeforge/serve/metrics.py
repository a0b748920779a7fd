"""/metrics in the Prometheus text exposition format (version 0.0.4), written by hand: a few counters and
two histograms do not need a client library.

Families: codeforge_requests_total{endpoint,status}; codeforge_request_duration_seconds{endpoint} and
codeforge_time_to_first_token_seconds (histograms); codeforge_generated_tokens_total,
codeforge_prompt_tokens_total, codeforge_decode_steps_total, codeforge_decode_step_rows_total (their ratio
is the mean batch size), codeforge_rows_total{outcome}; gauges codeforge_queue_length,
codeforge_active_rows, codeforge_active_rows_max, codeforge_batch_slots, process_resident_memory_bytes.
"""

from __future__ import annotations

import collections
import threading

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/infill", "/v1/models", "/health", "/metrics", "/")


class Histogram:
    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)  # the last is +Inf
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        i = next((i for i, b in enumerate(BUCKETS) if v <= b), len(BUCKETS))
        self.counts[i] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, cum = [], 0
        sep = "," if labels else ""
        for b, c in zip(list(BUCKETS) + ["+Inf"], self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels}{sep}le="{b}"}} {cum}')
        lab = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{lab} {self.sum:.6f}", f"{name}_count{lab} {self.n}"]
        return out


def endpoint_label(path: str) -> str:
    """The route a path belongs to (unknown paths share one label, so scanners cannot grow the series)."""
    if path.startswith("/v1/models"):
        return "/v1/models"
    return path if path in ENDPOINTS else "other"


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()
        self.latency: dict[str, Histogram] = collections.defaultdict(Histogram)
        self.ttft = Histogram()

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        ep = endpoint_label(path)
        with self.lock:
            self.requests[(ep, status)] += 1
            self.latency[ep].observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def render(self, sched) -> str:
        s = sched.stats
        out = ["# HELP codeforge_requests_total HTTP requests by endpoint and status.",
               "# TYPE codeforge_requests_total counter"]
        with self.lock:
            for (ep, st), n in sorted(self.requests.items()):
                out.append(f'codeforge_requests_total{{endpoint="{ep}",status="{st}"}} {n}')
            out += ["# HELP codeforge_request_duration_seconds Time from request to the last byte of the response.",
                    "# TYPE codeforge_request_duration_seconds histogram"]
            for ep, h in sorted(self.latency.items()):
                out += h.lines("codeforge_request_duration_seconds", f'endpoint="{ep}"')
            out += ["# HELP codeforge_time_to_first_token_seconds Time from queueing a row to its first token.",
                    "# TYPE codeforge_time_to_first_token_seconds histogram"]
            out += self.ttft.lines("codeforge_time_to_first_token_seconds")

        def metric(name: str, kind: str, help_: str, value) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"])

        metric("codeforge_generated_tokens_total", "counter", "Tokens generated.", s["generated_tokens"])
        metric("codeforge_prompt_tokens_total", "counter", "Prompt tokens prefilled.", s["prompt_tokens"])
        metric("codeforge_decode_steps_total", "counter", "Batched decode steps.", s["steps"])
        metric("codeforge_decode_step_rows_total", "counter",
               "Rows summed over decode steps (divided by steps: the mean batch size).", s["step_rows"])
        out += ["# HELP codeforge_rows_total Generation rows (one per prompt and choice) by outcome.",
                "# TYPE codeforge_rows_total counter"]
        for k in ("admitted", "finished", "cancelled", "timed_out", "failed"):
            out.append(f'codeforge_rows_total{{outcome="{k}"}} {s["rows_" + k]}')
        metric("codeforge_generation_loop_errors_total", "counter", "Failed steps (their rows got a 500).",
               s["loop_errors"])
        metric("codeforge_queue_length", "gauge", "Rows waiting for a batch slot.", sched.queue_length())
        metric("codeforge_active_rows", "gauge", "Rows in the running batch.", sched.active_rows())
        metric("codeforge_active_rows_max", "gauge", "Most rows ever decoded in one step.", s["max_active"])
        metric("codeforge_batch_slots", "gauge", "Batch slots (--max-batch).", sched.max_batch)
        metric("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", rss_bytes())
        return "\n".join(out) + "\n"
