"""What a batch tells its caller besides the rewards: per-verifier figures and provenance."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchResult", "VerifierReport", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by the nearest-rank method; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class VerifierReport:
    """One verifier's share of a batch.

    ``provenance`` says what scored the items (kind, ref, and the environment digest or the rubric
    version); ``latencies`` are seconds per call; ``waited`` is the total time items spent waiting
    for a limit (concurrency, rate, the engine-wide cap) and ``busy`` the total time in the verifier.
    """

    kind: str
    ref: str
    key: str
    provenance: Mapping[str, Any]
    items: int = 0
    reward_sum: float = 0.0
    latencies: list[float] = field(default_factory=list)
    waited: float = 0.0
    busy: float = 0.0
    peak_in_flight: int = 0
    retries: int = 0

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.items if self.items else math.nan

    def latency(self, q: float) -> float:
        """The ``q``-th percentile of call latency, in seconds."""
        return percentile(self.latencies, q)


@dataclass
class BatchResult:
    """The rewards of a batch, in input order, with the reports of the verifiers that scored it."""

    rewards: list[float]
    verifiers: list[VerifierReport]
    elapsed: float
    verifier_of: list[int] = field(repr=False)  # item index -> position in ``verifiers``
    usage: Mapping[str, int] = field(default_factory=dict)  # judge tokens spent on this batch

    def provenance(self, index: int) -> Mapping[str, Any]:
        """What scored item ``index``."""
        return self.verifiers[self.verifier_of[index]].provenance
