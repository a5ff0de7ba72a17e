"""What a batch tells its caller besides the rewards: per-verifier figures and provenance."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine._errors import VerificationError

__all__ = [
    "LATENCY_SAMPLE",
    "BatchResult",
    "LatencyHistogram",
    "VerifierReport",
    "VerifierTotals",
    "add_amounts",
    "add_reports",
    "percentile",
]

LATENCY_SAMPLE = 4096  # latencies the figures take from one report (VerifierReport.latency_sample)


def percentile(values: Sequence[float], q: float, weights: Sequence[int] | None = None) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by the nearest-rank method; NaN when empty.

    ``weights``: how many items each value stands for (one each when omitted).
    """
    if not values:
        return math.nan
    pairs = sorted(zip(values, weights or [1] * len(values), strict=True))
    rank = max(1, math.ceil(q / 100 * sum(weight for _, weight in pairs)))
    seen = 0
    for value, weight in pairs:
        seen += weight
        if seen >= rank:
            return value
    raise AssertionError("unreachable: the ranks add up to the total")


@dataclass
class VerifierReport:
    """One verifier's share of a batch.

    ``provenance`` says what scored the items (kind, ref, and the environment digest or the rubric
    version); ``latencies`` are seconds per item, one entry per call, and ``latency_items`` how many
    items each entry stands for (a chunk of a cheap plugin's items shares its call's average);
    ``waited`` is the total time calls waited, from the moment their items could first have been
    called (their lane's start), for a limit (concurrency, the verifier's own included, rate, the
    engine-wide cap, and the verifier's own inside a call: the judge's or a worker pool's), and
    ``busy`` the total time in the verifier; both are sums over calls that ran at the same time
    (one span per call, a chunk's as one), not wall time. ``active`` is the wall time from its
    first call's start to its last call's end. ``startup`` holds, for each call that started the
    verifier up or waited on that (a plugin's import, a worker process's spawn, ``meters.starting``),
    the seconds it spent so: not in ``busy``; nor is the call in ``latencies`` (the rest of it is
    start-up's too: the calls an import releases at once, each a thread's first), so its items are
    in ``items`` alone. ``spent`` is what its calls cost (a judge's requests and tokens; empty for
    other kinds). ``cache_hits`` counts its items served from the verdict cache, ``deduped`` those that
    shared the reward of an identical item of the batch (a rubric's; both are among ``items``, with no call).
    ``window`` is the adaptive concurrency window its calls went through as the batch ended (an endpoint's,
    the judge's for a rubric; ``engine._core.window``), None for a kind without one.
    """

    kind: str
    ref: str
    key: str
    provenance: Mapping[str, Any]
    items: int = 0
    reward_sum: float = 0.0
    latencies: list[float] = field(default_factory=list)
    latency_items: list[int] = field(default_factory=list)
    waited: float = 0.0
    busy: float = 0.0
    peak_in_flight: int = 0
    retries: int = 0
    active: float = 0.0
    startup: list[float] = field(default_factory=list)
    spent: Mapping[str, float] = field(default_factory=dict)
    cache_hits: int = 0
    deduped: int = 0
    window: int | None = None

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.items if self.items else math.nan

    def latency(self, q: float) -> float:
        """The ``q``-th percentile of the items' latency, in seconds."""
        return percentile(self.latencies, q, self.latency_items or None)

    def latency_sample(self) -> tuple[Sequence[float], Sequence[int]]:
        """The latencies thinned to at most ``LATENCY_SAMPLE`` evenly spread entries, each with the items of the
        stride of calls it was picked from: what :class:`VerifierTotals` adds per report (docs/design.md, "Figures").
        """
        latencies, weights = self.latencies, self.latency_items
        stride = -(-len(latencies) // LATENCY_SAMPLE)
        if stride <= 1:
            return latencies, weights or [1] * len(latencies)
        if not weights:  # one item each: a stride's count, the last one's what is left
            counts = [stride] * -(-len(latencies) // stride)
            counts[-1] = len(latencies) - stride * (len(counts) - 1)
        else:
            counts = [sum(weights[start : start + stride]) for start in range(0, len(weights), stride)]
        return latencies[::stride], counts


@dataclass
class BatchResult:
    """The rewards of a batch, in input order, with the reports of the verifiers that scored it."""

    rewards: list[float]
    verifiers: list[VerifierReport]
    elapsed: float
    verifier_of: list[int] = field(repr=False)  # item index -> position in ``verifiers``
    usage: Mapping[str, float] = field(default_factory=dict)  # judge tokens (and spend) spent on this batch
    # item index -> unix time of the judge call whose cached verdict it was served (only items served so)
    cached: Mapping[int, float] = field(default_factory=dict, repr=False)

    def provenance(self, index: int) -> Mapping[str, Any]:
        """What scored item ``index``; with ``cached``, the unix time of the judge call, if its verdict came from the
        verdict cache."""
        provenance = self.verifiers[self.verifier_of[index]].provenance
        if self.cached and (when := self.cached.get(index)) is not None:
            return {**provenance, "cached": when}
        return provenance


class LatencyHistogram:
    """Latencies in log-spaced buckets: constant memory however many calls, percentiles within ~2%.

    The one histogram of the engine's figures (docs/design.md, "Figures"). Bucket ``k`` holds latencies in
    ``[2**(k/16), 2**((k+1)/16))`` microseconds; a percentile is reported as its bucket's midpoint.
    ``seconds`` is the latencies' sum, each times the items it stands for.
    """

    STEPS = 16  # buckets per doubling: each spans 4.4%, so the midpoint is within 2.2%

    def __init__(self, counts: Mapping[int, int] | None = None, seconds: float = 0.0) -> None:
        self.counts: dict[int, int] = dict(counts or {})
        self.seconds = seconds

    def add(self, seconds: float, items: int = 1) -> None:
        self.extend((seconds,), (items,))

    def extend(self, latencies: Sequence[float], items: Sequence[int] | None = None) -> None:
        """Add each latency, standing for ``items[i]`` items (one each when omitted)."""
        weights = items or [1] * len(latencies)
        counts, steps, log2 = self.counts, self.STEPS, math.log2  # a report's sample is 4,096 of them: no calls
        for seconds, count in zip(latencies, weights, strict=True):
            bucket = int(log2(max(seconds * 1e6, 1.0)) * steps)
            counts[bucket] = counts.get(bucket, 0) + count
        self.seconds += math.fsum(map(operator.mul, latencies, weights))

    def merge(self, other: LatencyHistogram) -> None:
        """Add another histogram's latencies."""
        counts = self.counts
        for bucket, count in other.counts.items():
            counts[bucket] = counts.get(bucket, 0) + count
        self.seconds += other.seconds

    def _midpoint(self, bucket: int) -> float:
        return float(2 ** ((bucket + 0.5) / self.STEPS) / 1e6)

    def at_most(self, bounds: Sequence[float]) -> list[int]:
        """For each of the ascending ``bounds`` (seconds), the items at or under it, then all of them: a
        Prometheus histogram's cumulative buckets (each bucket of this one goes by its midpoint)."""
        under = [0] * (len(bounds) + 1)
        for bucket, count in self.counts.items():
            under[bisect.bisect_left(bounds, self._midpoint(bucket))] += count
        return list(itertools.accumulate(under))

    def coarse(self, per_doubling: int = 1) -> list[tuple[float, float, int]]:
        """The histogram in ``per_doubling`` buckets per doubling (a divisor of ``STEPS``), to be shown:
        ``(low, high, items)`` with bounds in seconds, from the lowest non-empty bucket to the highest
        (empty ones between them included, so the shape shows its gaps)."""
        if self.STEPS % per_doubling:
            raise ValueError(f"per_doubling must divide {self.STEPS}, got {per_doubling}")
        width = self.STEPS // per_doubling
        merged: dict[int, int] = {}
        for bucket, count in self.counts.items():
            merged[bucket // width] = merged.get(bucket // width, 0) + count
        if not merged:
            return []
        return [
            (2 ** (k / per_doubling) / 1e6, 2 ** ((k + 1) / per_doubling) / 1e6, merged.get(k, 0))
            for k in range(min(merged), max(merged) + 1)
        ]

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) in seconds; NaN when empty."""
        total = sum(self.counts.values())
        if not total:
            return math.nan
        rank = max(1, math.ceil(q / 100 * total))
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return self._midpoint(bucket)
        raise AssertionError("unreachable: the ranks add up to the total")


@dataclass
class VerifierTotals:
    """One verifier's figures added up over its reports and the errors of the batches it failed, in constant
    memory: the one accumulator of figures (docs/design.md, "Figures"), which a backfill's summary, ``engine
    bench``, ``Engine.stats`` and ``engine serve``'s ``/metrics`` each read.

    ``peak_in_flight`` is the most of any report, ``latest_peak_in_flight`` its latest report's; the start-up
    figures are over the calls that started the verifier up; ``errors`` counts failed batches by error type,
    ``timeouts`` those that ran out of time; ``window`` is its latest report's (None: it has none).
    """

    kind: str
    ref: str
    items: int = 0
    reward_sum: float = 0.0
    retries: int = 0
    waited: float = 0.0
    busy: float = 0.0
    peak_in_flight: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    active: float = 0.0
    latest_peak_in_flight: int = 0
    startup_calls: int = 0
    startup_seconds: float = 0.0
    startup_longest: float = 0.0
    spent: dict[str, float] = field(default_factory=dict)  # counts, and "spend" (money: not whole)
    errors: Counter[str] = field(default_factory=Counter)
    timeouts: int = 0
    cache_hits: int = 0
    deduped: int = 0
    window: int | None = None

    @property
    def cache_hit_rate(self) -> float:
        """Of its items, the share served from the verdict cache; NaN with none."""
        return self.cache_hits / self.items if self.items else math.nan

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.items if self.items else math.nan

    def add(self, report: VerifierReport) -> None:
        """Add a batch's report (its latencies thinned: :meth:`VerifierReport.latency_sample`)."""
        self.items += report.items
        self.reward_sum += report.reward_sum
        self.retries += report.retries
        self.waited += report.waited
        self.busy += report.busy
        self.active += report.active
        self.peak_in_flight = max(self.peak_in_flight, report.peak_in_flight)
        self.latest_peak_in_flight = report.peak_in_flight
        if report.startup:
            self.startup_calls += len(report.startup)
            self.startup_seconds += sum(report.startup)
            self.startup_longest = max(self.startup_longest, *report.startup)
        add_amounts(self.spent, report.spent)
        self.cache_hits += report.cache_hits
        self.deduped += report.deduped
        self.latency.extend(*report.latency_sample())
        if report.window is not None:
            self.window = report.window

    def failed(self, error: VerificationError) -> None:
        """Count a batch that ``error``, naming this verifier, aborted (its items gave no rewards: none counted)."""
        self.errors[type(error).__name__] += 1
        if error.timed_out:
            self.timeouts += 1

    def merge(self, other: VerifierTotals) -> None:
        """Add another run's totals of the same verifier (a Ray actor's, a block's, a benchmark's run)."""
        self.items += other.items
        self.reward_sum += other.reward_sum
        self.retries += other.retries
        self.waited += other.waited
        self.busy += other.busy
        self.active += other.active
        self.peak_in_flight = max(self.peak_in_flight, other.peak_in_flight)
        self.latest_peak_in_flight = other.latest_peak_in_flight
        self.startup_calls += other.startup_calls
        self.startup_seconds += other.startup_seconds
        self.startup_longest = max(self.startup_longest, other.startup_longest)
        add_amounts(self.spent, other.spent)
        self.errors.update(other.errors)
        self.timeouts += other.timeouts
        self.cache_hits += other.cache_hits
        self.deduped += other.deduped
        self.latency.merge(other.latency)
        if other.window is not None:
            self.window = other.window

    def to_json(self) -> dict[str, Any]:
        """The figures a backfill's state keeps (and a Ray actor sends): what its summary shows."""
        return {
            "kind": self.kind,
            "ref": self.ref,
            "items": self.items,
            "reward_sum": self.reward_sum,
            "retries": self.retries,
            "waited": self.waited,
            "busy": self.busy,
            "peak_in_flight": self.peak_in_flight,
            "latency": {str(bucket): count for bucket, count in self.latency.counts.items()},
            "spent": dict(self.spent),
            "cache_hits": self.cache_hits,
            "deduped": self.deduped,
        }

    @classmethod
    def from_json(cls, data: Any) -> VerifierTotals:
        """The totals :meth:`to_json` wrote; ``ValueError`` for anything else (they come back from a file
        a user can edit: a wrong shape must be refused here, not fail later with a traceback)."""
        # "spent" and _JSON_ADDED are optional: a state written before they were kept has none
        if not isinstance(data, dict) or set(data) - {"spent", *_JSON_ADDED} != set(_JSON_FIELDS) - set(_JSON_ADDED):
            raise ValueError("not a verifier's totals: its fields differ")
        data = {**dict.fromkeys(_JSON_ADDED, 0), **data}  # a state written before they were counted: none
        spent = data.get("spent", {})
        if not isinstance(spent, dict) or not all(
            isinstance(name, str) and type(amount) in (int, float) and math.isfinite(amount) and amount >= 0
            for name, amount in spent.items()
        ):
            raise ValueError("not a verifier's totals: its spent is not amounts >= 0 by name")
        if any(isinstance(data[key], bool) or not isinstance(data[key], kind) for key, kind in _JSON_FIELDS.items()):
            raise ValueError("not a verifier's totals: a field has the wrong type")
        latency = data["latency"]
        if not all(
            isinstance(bucket, str) and _BUCKET.fullmatch(bucket) and type(count) is int and count >= 0
            for bucket, count in latency.items()
        ):
            raise ValueError("not a verifier's totals: its latency histogram is not one")
        histogram = LatencyHistogram({int(bucket): count for bucket, count in latency.items()})
        fields = {key: data[key] for key in ("items", "reward_sum", "retries", "waited", "busy", "peak_in_flight",
                                             *_JSON_ADDED)}
        return cls(data["kind"], data["ref"], latency=histogram, spent=dict(spent), **fields)


# what VerifierTotals.to_json writes: each field and its JSON type(s); a histogram bucket's key
_JSON_FIELDS: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "ref": str,
    "items": int,
    "reward_sum": (int, float),
    "retries": int,
    "waited": (int, float),
    "busy": (int, float),
    "peak_in_flight": int,
    "latency": dict,
    "cache_hits": int,
    "deduped": int,
}
_JSON_ADDED = ("cache_hits", "deduped")  # fields a state written by an older engine lacks
_BUCKET = re.compile(r"-?[0-9]{1,6}")


def add_amounts(into: dict[str, float], amounts: Mapping[str, float]) -> None:
    """Add ``amounts`` (what was spent, by name) into ``into``: a Counter's update, for amounts not all whole."""
    for name, amount in amounts.items():
        into[name] = into.get(name, 0) + amount


def add_reports(totals: dict[str, VerifierTotals], result: BatchResult) -> None:
    """Add a batch's verifier reports into ``totals``, keyed by verifier key (``VerifierReport.key``)."""
    for report in result.verifiers:
        total = totals.get(report.key)
        if total is None:
            total = totals[report.key] = VerifierTotals(report.kind, report.ref)
        total.add(report)
