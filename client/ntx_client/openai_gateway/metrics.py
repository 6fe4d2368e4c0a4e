"""GET /metrics: the gateway's own counters and, asked at each scrape, every daemon's Status.

The gateway's series are `ntx_openai_*`; the daemons' are `ntx_daemon_*` with a `target` label
(one per daemon behind the gateway), so one scrape shows the whole set of hosts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ntx_proto.states import ServingState


class _DaemonStatus:
    """A collector that reports the statuses handed to it for the scrape in progress."""

    def __init__(self):
        self.statuses: list[tuple[str, object]] = []

    def collect(self):
        up = GaugeMetricFamily("ntx_daemon_up", "1 when the daemon answered Status and serves its model",
                               labels=["target"])
        gauges = {name: GaugeMetricFamily(f"ntx_daemon_{name}", doc, labels=["target"]) for name, doc in (
            ("live_requests", "requests holding a KV-cache slot"),
            ("queued_requests", "requests waiting for a slot"),
            ("free_slots", "free KV-cache slots"),
            ("batch_size", "sequences in the last step"),
            ("tokens_per_second", "tokens generated per second, over the last seconds"),
            ("memory_bytes", "resident set of the daemon"))}
        counters = {name: CounterMetricFamily(f"ntx_daemon_{name}", doc, labels=["target"]) for name, doc in (
            ("requests", "requests the daemon accepted"),
            ("tokens_generated", "tokens the daemon generated"),
            ("steps", "engine steps the daemon ran"),
            ("prompt_tokens", "prompt tokens of the requests the daemon admitted"),
            ("prefill_tokens", "prompt tokens run through the model (the rest came from the prefix cache)"),
            ("prefix_hit_tokens", "prompt tokens taken from the prefix cache"),
            ("prefix_evictions", "cached sequences dropped to make room"))}
        tier_bytes = GaugeMetricFamily("ntx_daemon_tier_bytes", "bytes of layers placed in each tier",
                                       labels=["target", "tier"])
        tier_rate = GaugeMetricFamily("ntx_daemon_tier_bytes_per_second", "bytes per second streamed from each tier",
                                      labels=["target", "tier"])
        for target, s in self.statuses:
            if isinstance(s, BaseException):
                up.add_metric([target], 0)
                continue
            up.add_metric([target], 1 if s.state == ServingState.SERVING else 0)
            for name, g in gauges.items():
                g.add_metric([target], getattr(s, name))
            counters["requests"].add_metric([target], s.requests_total)
            counters["tokens_generated"].add_metric([target], s.tokens_generated_total)
            counters["steps"].add_metric([target], s.steps)
            counters["prompt_tokens"].add_metric([target], s.prompt_tokens_total)
            counters["prefill_tokens"].add_metric([target], s.prefill_tokens_total)
            counters["prefix_hit_tokens"].add_metric([target], s.prefix_hit_tokens_total)
            counters["prefix_evictions"].add_metric([target], s.prefix_evictions_total)
            for t in s.tiers:
                tier_bytes.add_metric([target, t.name], t.bytes)
                tier_rate.add_metric([target, t.name], t.bytes_per_second)
        yield up
        yield from gauges.values()
        yield from counters.values()
        yield tier_bytes
        yield tier_rate


class Metrics:
    """The gateway's series, in a registry of its own (two gateways in one process do not mix)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ntx_openai_requests", "HTTP requests answered, by route name and status",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("ntx_openai_tokens", "tokens of finished requests", ["kind"], registry=r)
        self.in_flight = Gauge("ntx_openai_in_flight_requests", "generations being served now", registry=r)
        self.seconds = Histogram("ntx_openai_request_seconds", "time from request to last token", ["endpoint"],
                                 registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.first_token = Histogram("ntx_openai_time_to_first_token_seconds", "time from request to first token "
                                     "(streaming)", ["endpoint"], registry=r,
                                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self._daemons = _DaemonStatus()
        r.register(self._daemons)

    def done(self, endpoint: str, status: int, usage: dict | None, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if usage is not None:
            self.tokens.labels("prompt").inc(usage["prompt_tokens"])
            self.tokens.labels("completion").inc(usage["completion_tokens"])
            self.seconds.labels(endpoint).observe(seconds)

    def failed(self, endpoint: str, status: int) -> None:
        """A request refused or failed before its generation finished; `endpoint` is its route's
        name, never anything the client chose (each label value is a series kept for good)."""
        self.requests.labels(endpoint, str(status)).inc()

    def render(self, statuses) -> tuple[bytes, str]:
        self._daemons.statuses = statuses
        try:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        finally:
            self._daemons.statuses = []
