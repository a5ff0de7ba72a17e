"""The service's figures for ``GET /metrics``, in Prometheus's text format (prometheus-client).

Per verifier (labels ``kind`` and ``verifier``, its key), what the engine's one accumulator of figures holds
(docs/design.md, "Figures"); per route, requests by status and their latency; the gatherer's counts and the
gauges of the moment, read when asked. A collector of our own, on the service's own registry.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from engine._core.report import BatchResult, LatencyHistogram, VerifierTotals, add_reports
from engine._errors import VerificationError
from engine._serve.limits import GATHER_CALL

__all__ = ["BUCKETS", "Metrics"]

# seconds: a cheap plugin's microseconds up to a slow judge's minute
# the one histogram's buckets are read off at these bounds, each to within its ~2% (docs/design.md, "Figures")
_LATENCY_DOC = "Seconds per {} (each counted within ~2% of a bucket's bound)."
BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
Labels = tuple[str, ...]


class Metrics:
    """Everything ``/metrics`` shows; ``gauges`` and ``counters`` are read when it is asked (items admitted,
    requests open; requests gathered, kept by the gatherer: counted here, its hot path would pay a call)."""

    def __init__(
        self,
        gauges: Callable[[], dict[str, tuple[str, float]]] | None = None,
        counters: Callable[[], dict[str, tuple[str, float]]] | None = None,
        item_costs: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._gauges = gauges or dict
        self._counters = counters or dict
        self._item_costs = item_costs or dict
        self.verifiers: dict[str, VerifierTotals] = {}  # verifier key -> its figures
        self.requests: Counter[Labels] = Counter()  # route, status
        self.request_latency: dict[str, LatencyHistogram] = {}  # route -> its requests' seconds
        self.registry.register(self)  # a collector is anything with collect()

    def batch(self, result: BatchResult) -> None:
        """Add a scored batch's reports."""
        add_reports(self.verifiers, result)

    def failed(self, exc: VerificationError) -> None:
        """Count a batch's failure against the verifier it names."""
        totals = self.verifiers.get(exc.key)
        if totals is None:
            totals = self.verifiers[exc.key] = VerifierTotals(exc.kind, exc.ref)
        totals.failed(exc)

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, str(status))] += 1
        histogram = self.request_latency.get(route)
        if histogram is None:
            histogram = self.request_latency[route] = LatencyHistogram()
        histogram.add(seconds)

    def exposition(self) -> bytes:
        """The text ``/metrics`` answers."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        verifier = ["kind", "verifier"]
        totals = [((t.kind, key), t) for key, t in self.verifiers.items()]
        yield _counter("engine_verifier_items", "Items scored, per verifier.", verifier,
                       {labels: t.items for labels, t in totals})
        yield _counter("engine_verifier_errors", "Batches failed by the verifier, per error type.",
                       [*verifier, "type"],
                       {(*labels, kind): count for labels, t in totals for kind, count in t.errors.items()})
        yield _counter("engine_verifier_timeouts", "Batches failed by a verifier's call timing out.", verifier,
                       {labels: t.timeouts for labels, t in totals})
        yield _counter("engine_verifier_retries", "Transient failures retried by the verifier.", verifier,
                       {labels: t.retries for labels, t in totals})
        yield _counter("engine_verifier_spent", "What the verifier's calls spent (a judge's requests and tokens).",
                       [*verifier, "what"],
                       {(*labels, what): amount for labels, t in totals for what, amount in t.spent.items()})
        yield _counter("engine_verifier_cache_hits", "Items served from the verdict cache, per verifier (a rubric's).",
                       verifier, {labels: t.cache_hits for labels, t in totals})
        yield _counter("engine_verifier_deduped",
                       "Items that shared the reward of an identical item of their batch, per verifier (a rubric's).",
                       verifier, {labels: t.deduped for labels, t in totals})
        rate = GaugeMetricFamily("engine_verifier_cache_hit_rate",
                                 "Of the verifier's items, the share served from the verdict cache.", labels=verifier)
        for labels, t in totals:
            if t.items:
                rate.add_metric(list(labels), t.cache_hit_rate)
        yield rate
        peak = GaugeMetricFamily("engine_verifier_peak_in_flight",
                                 "Most calls the verifier had in flight at once, in its latest batch.", labels=verifier)
        for labels, t in totals:
            peak.add_metric(list(labels), t.latest_peak_in_flight)
        yield peak
        window = GaugeMetricFamily("engine_verifier_window",
                                   "Calls the verifier's adaptive window let in flight at once, as its latest batch "
                                   "ended: max_concurrency, less while the server answers 429.", labels=verifier)
        for labels, t in totals:
            if t.window is not None:
                window.add_metric(list(labels), t.window)
        yield window
        yield _histogram("engine_verifier_latency_seconds", _LATENCY_DOC.format("item in the verifier"), verifier,
                         {labels: t.latency for labels, t in totals})
        yield _counter("engine_http_requests", "Requests answered, per route and status.", ["route", "status"],
                       self.requests)
        yield _histogram("engine_http_request_seconds", _LATENCY_DOC.format("request, per route"), ["route"],
                         {(route,): histogram for route, histogram in self.request_latency.items()})
        cost = GaugeMetricFamily("engine_gather_item_seconds",
                                 "Seconds an item of the plugin takes, its recent batches' mean: requests are gathered "
                                 f"while it is at most {GATHER_CALL:g}.", labels=["verifier"])
        for verifier_key, seconds in self._item_costs().items():
            cost.add_metric([verifier_key], seconds)
        yield cost
        for name, (doc, amount) in self._counters().items():
            yield CounterMetricFamily(name, doc, value=amount)
        for name, (doc, amount) in self._gauges().items():
            yield GaugeMetricFamily(name, doc, value=amount)


def _counter(name: str, doc: str, labels: list[str], values: Mapping[Labels, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in values.items():
        family.add_metric(list(key), value)
    return family


def _histogram(
    name: str, doc: str, labels: list[str], values: Mapping[Labels, LatencyHistogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    bounds = [*(repr(bound) for bound in BUCKETS), "+Inf"]
    for key, histogram in values.items():
        counts = histogram.at_most(BUCKETS)
        family.add_metric(list(key), [(bound, float(count)) for bound, count in zip(bounds, counts, strict=True)],
                          histogram.seconds)
    return family
