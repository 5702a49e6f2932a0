"""The gateway's Prometheus metrics (one registry per app, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Counters, gauges and histograms of one gateway app; units in each metric's help text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("agl_gateway_requests", "Requests by route and status", ["route", "status"],
                                registry=r)
        self.in_flight = Gauge("agl_gateway_in_flight", "Model calls in flight upstream", registry=r)
        self.held = Gauge("agl_gateway_held", "Model calls held by a pause", registry=r)
        self.upstream_seconds = Histogram("agl_gateway_upstream_seconds", "Upstream latency (s)", ["route"],
                                          registry=r)
        self.added_seconds = Histogram("agl_gateway_added_seconds", "Latency the gateway adds to a call (s): "
                                       "parsing, lookup, recording, translation", ["route"], registry=r,
                                       buckets=(.0005, .001, .002, .005, .01, .025, .05, .1, .5))
        self.record_seconds = Histogram("agl_gateway_record_seconds", "Redis record-write latency (s)",
                                        registry=r, buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, 1))
        self.tokens = Counter("agl_gateway_tokens", "Tokens in (prompt) and out (response)", ["direction"],
                              registry=r)
        self.pause_seconds = Histogram("agl_gateway_pause_seconds", "Time from pause to resume (s)", registry=r)
        self.drain_seconds = Histogram("agl_gateway_drain_seconds", "Time from pause to drained (s)",
                                       registry=r)
        self.tokens_in, self.tokens_out = self.tokens.labels("in"), self.tokens.labels("out")
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}  # labelled children, looked up once

    def route(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached (``labels()`` takes a lock)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
