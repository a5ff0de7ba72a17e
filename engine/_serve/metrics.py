"""The service's figures for ``GET /metrics``, in Prometheus's text format (prometheus-client).

Per verifier (labels ``kind`` and ``verifier``, the key its limits are configured under: a plugin's
``environment/module:callable``, a rubric's ``owner/name``, an endpoint's URL), from the
``BatchResult`` each batch returns and the ``VerificationError`` each failed one raises: items
scored, errors by type (and those that were timeouts), retries, the most calls one batch had in
flight, the items' latency as a histogram, and what its calls spent (a judge's requests and tokens).
Per route: requests by status, and their latency. Requests the gatherer took into engine batches it
shares out (``engine._serve.gather``), and those batches, are counted: more requests than batches is
gathering at work; per plugin, what its items take on its recent batches' mean says whether its requests are
gathered. Items admitted and requests in progress are gauges of the moment.

The figures are kept in plain counters and exposed by a collector of our own: a chunk of a cheap
plugin's items shares one latency, added to a bucket as many times at once (prometheus-client's
``Histogram.observe`` would be called once per item). Its registry is the service's own, not
prometheus-client's global one.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from engine._core.report import BatchResult
from engine._core.stats import error_key, timed_out
from engine._errors import VerificationError
from engine._serve.limits import GATHER_CALL

__all__ = ["BUCKETS", "Metrics"]

# seconds: a cheap plugin's microseconds up to a slow judge's minute
BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
Labels = tuple[str, ...]


class _Histogram:
    """Counts per bucket of ``BUCKETS`` (and one past the last), with their sum."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def add(self, seconds: float, items: int = 1) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += items
        self.sum += seconds * items

    def cumulative(self) -> list[tuple[str, float]]:
        total, out = 0, []
        for bound, count in zip((*BUCKETS, math.inf), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == math.inf else repr(bound), float(total)))
        return out


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
        self.items: Counter[Labels] = Counter()
        self.errors: Counter[Labels] = Counter()  # kind, verifier, type
        self.timeouts: Counter[Labels] = Counter()
        self.retries: Counter[Labels] = Counter()
        self.peak_in_flight: dict[Labels, int] = {}
        self.spent: Counter[Labels] = Counter()  # kind, verifier, what
        self.latency: dict[Labels, _Histogram] = {}
        self.requests: Counter[Labels] = Counter()  # route, status
        self.request_latency: dict[Labels, _Histogram] = {}
        self.registry.register(self)  # a collector is anything with collect()

    def batch(self, result: BatchResult) -> None:
        """Add a scored batch's reports."""
        for report in result.verifiers:
            key = (report.kind, report.key)
            self.items[key] += report.items
            self.retries[key] += report.retries
            self.peak_in_flight[key] = report.peak_in_flight
            histogram = self.latency.get(key)
            if histogram is None:
                histogram = self.latency[key] = _Histogram()
            for seconds, items in zip(*report.latency_sample(), strict=True):
                histogram.add(seconds, items)
            for what, amount in report.spent.items():
                self.spent[(*key, what)] += amount

    def failed(self, exc: VerificationError) -> None:
        """Count a batch's failure against the verifier it names."""
        key = (exc.kind, error_key(exc))
        self.errors[(*key, type(exc).__name__)] += 1
        if timed_out(exc):
            self.timeouts[key] += 1

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, str(status))] += 1
        histogram = self.request_latency.get((route,))
        if histogram is None:
            histogram = self.request_latency[(route,)] = _Histogram()
        histogram.add(seconds)

    def exposition(self) -> bytes:
        """The text ``/metrics`` answers."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        verifier = ["kind", "verifier"]
        yield _counter("engine_verifier_items", "Items scored, per verifier.", verifier, self.items)
        yield _counter("engine_verifier_errors", "Batches failed by the verifier, per error type.",
                       [*verifier, "type"], self.errors)
        yield _counter("engine_verifier_timeouts", "Batches failed by a verifier's call timing out.",
                       verifier, self.timeouts)
        yield _counter("engine_verifier_retries", "Transient failures retried by the verifier.", verifier, self.retries)
        yield _counter("engine_verifier_spent", "What the verifier's calls spent (a judge's requests and tokens).",
                       [*verifier, "what"], self.spent)
        peak = GaugeMetricFamily("engine_verifier_peak_in_flight",
                                 "Most calls the verifier had in flight at once, in its latest batch.", labels=verifier)
        for key, value in self.peak_in_flight.items():
            peak.add_metric(list(key), value)
        yield peak
        yield _histogram("engine_verifier_latency_seconds", "Seconds per item in the verifier.", verifier,
                         self.latency)
        yield _counter("engine_http_requests", "Requests answered, per route and status.", ["route", "status"],
                       self.requests)
        yield _histogram("engine_http_request_seconds", "Seconds per request, per route.", ["route"],
                         self.request_latency)
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


def _counter(name: str, doc: str, labels: list[str], values: Counter[Labels]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in values.items():
        family.add_metric(list(key), value)
    return family


def _histogram(name: str, doc: str, labels: list[str], values: dict[Labels, _Histogram]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for key, histogram in values.items():
        family.add_metric(list(key), histogram.cumulative(), histogram.sum)
    return family
