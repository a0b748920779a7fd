"""/metrics in the Prometheus text format, through prometheus_client (one registry per app, so two servers
in one process, as in the tests, keep separate counts).

Families: codeforge_requests_total{endpoint,status}; codeforge_request_duration_seconds{endpoint} and
codeforge_time_to_first_token_seconds (histograms); from the scheduler at scrape time:
codeforge_generated_tokens_total, codeforge_prompt_tokens_total, codeforge_decode_steps_total,
codeforge_decode_step_rows_total (their ratio is the mean batch size), codeforge_rows_total{outcome},
codeforge_generation_loop_errors_total, gauges codeforge_queue_length, codeforge_active_rows,
codeforge_active_rows_max, codeforge_batch_slots; from the connection guard (`codeforge serve` only):
codeforge_open_connections, codeforge_max_connections, codeforge_connections_closed_total{reason}
(header_timeout, body_timeout, displaced, refused); and prometheus_client's process_* family
(process_resident_memory_bytes, CPU seconds, open files).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
def endpoint_label(path: str, routes: tuple[str, ...]) -> str:
    """The route a path belongs to, from the app's route table (app.py): the route's own path, a templated
    one (`/v1/models/{model_id:path}`) by the part before its first parameter; unknown paths share one label,
    "other", so scanners cannot grow the series."""
    if path in routes:
        return path
    for r in routes:
        if "{" in r and path.startswith(r[:r.index("{")]):
            return r[:r.index("{")].rstrip("/") or "/"
    return "other"


class _SchedulerCollector:
    """Reads the scheduler's counters when /metrics is scraped (they live in the generation loop)."""

    def __init__(self, sched):
        self.sched = sched

    def collect(self):
        sched, s = self.sched, self.sched.stats

        def counter(name: str, help_: str, value) -> CounterMetricFamily:
            return CounterMetricFamily(name, help_, value=value)

        def gauge(name: str, help_: str, value) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help_, value=value)

        yield counter("codeforge_generated_tokens", "Tokens generated.", s["generated_tokens"])
        yield counter("codeforge_prompt_tokens", "Prompt tokens prefilled.", s["prompt_tokens"])
        yield counter("codeforge_decode_steps", "Batched decode steps.", s["steps"])
        yield counter("codeforge_decode_step_rows",
                      "Rows summed over decode steps (divided by steps: the mean batch size).",
                      s["step_rows"])
        rows = CounterMetricFamily("codeforge_rows",
                                   "Generation rows (one per prompt and choice) by outcome.",
                                   labels=["outcome"])
        for k in ("admitted", "finished", "cancelled", "timed_out", "failed"):
            rows.add_metric([k], s["rows_" + k])
        yield rows
        yield counter("codeforge_generation_loop_errors", "Failed steps (their rows got a 500).",
                      s["loop_errors"])
        yield gauge("codeforge_queue_length", "Rows waiting for a batch slot.", sched.queue_length())
        yield gauge("codeforge_active_rows", "Rows in the running batch.", sched.active_rows())
        yield gauge("codeforge_active_rows_max", "Most rows ever decoded in one step.", s["max_active"])
        yield gauge("codeforge_batch_slots", "Batch slots (--max-batch).", sched.max_batch)


class _ConnectionCollector:
    """Reads the connection guard's counts (connections.py) at scrape time."""

    def __init__(self, guard):
        self.guard = guard

    def collect(self):
        g = self.guard
        yield GaugeMetricFamily("codeforge_open_connections", "HTTP connections open.", value=len(g.live))
        yield GaugeMetricFamily("codeforge_max_connections",
                                "The cap on open connections (--max-connections).",
                                value=g.limits.max_connections)
        closed = CounterMetricFamily("codeforge_connections_closed",
                                     "Connections the server closed on a slow or surplus client, by reason.",
                                     labels=["reason"])
        for k, v in g.closed.items():
            closed.add_metric([k], v)
        yield closed


class Metrics:
    def __init__(self, sched=None):
        self.registry = CollectorRegistry()
        self.requests = Counter("codeforge_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("codeforge_request_duration_seconds",
                                 "Time from request to the last byte of the response.", ["endpoint"],
                                 buckets=BUCKETS, registry=self.registry)
        self.ttft = Histogram("codeforge_time_to_first_token_seconds",
                              "Time from queueing a row to its first token.",
                              buckets=BUCKETS, registry=self.registry)
        ProcessCollector(registry=self.registry)
        self._sched = None
        if sched is not None:
            self.attach(sched)

    def attach(self, sched) -> None:
        """Report the scheduler's counters (once; the scheduler is made after the metrics it reports to)."""
        if self._sched is None:
            self._sched = sched
            self.registry.register(_SchedulerCollector(sched))

    def attach_connections(self, guard) -> None:
        self.registry.register(_ConnectionCollector(guard))

    def use_routes(self, paths: list[str]) -> None:
        """The app's route table's paths: the labels requests are counted under."""
        self.routes = tuple(paths)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        ep = endpoint_label(path, getattr(self, "routes", ()))
        self.requests.labels(ep, str(status)).inc()
        self.latency.labels(ep).observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def render(self, sched=None) -> str:
        if sched is not None:
            self.attach(sched)
        return generate_latest(self.registry).decode()
