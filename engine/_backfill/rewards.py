"""The distribution of a backfill's rewards, in constant memory: what ``engine score``'s summary shows of them.

Added to a batch at a time (one sort and a few bisections in C), kept in the checkpoint so that a resumed run
still describes its whole output, and merged across a Ray job's blocks.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BINS", "Rewards"]

BINS = 10  # bins of the histogram over [0, 1]: [k/10, (k+1)/10), the last one closed at 1.0
_EDGES = [k / BINS for k in range(1, BINS)]  # the bins' inner edges
_FIELDS = ("count", "reward_sum", "zeros", "ones", "min", "max", "bins", "below", "above")


@dataclass
class Rewards:
    """How many rewards, their sum, how many are exactly 0.0 and exactly 1.0, their least and greatest,
    and a histogram: :data:`BINS` bins over [0, 1], and counts of those below 0 and above 1.

    ``low`` and ``high`` are NaN while it is empty; the sum (and so the mean) is infinite if it overflowed, NaN
    once such a sum was kept in JSON.
    """

    count: int = 0
    reward_sum: float = 0.0
    zeros: int = 0
    ones: int = 0
    low: float = math.nan
    high: float = math.nan
    bins: list[int] = field(default_factory=lambda: [0] * BINS)
    below: int = 0
    above: int = 0

    @property
    def mean(self) -> float:
        return self.reward_sum / self.count if self.count else math.nan

    def add(self, rewards: Sequence[float]) -> None:
        """Count a batch's rewards (finite floats, as a verification gives them)."""
        ordered = sorted(rewards)
        if not ordered:
            return
        count = len(ordered)
        zero_from, zero_to = bisect_left(ordered, 0.0), bisect_right(ordered, 0.0)
        one_from, one_to = bisect_left(ordered, 1.0), bisect_right(ordered, 1.0)
        edges = [zero_from, *(bisect_left(ordered, edge, zero_from, one_from) for edge in _EDGES), one_to]
        for k in range(BINS):
            self.bins[k] += edges[k + 1] - edges[k]
        self.count += count
        self.reward_sum += sum(ordered)  # not fsum: a mean to four places, at a sixth of the cost per chunk
        self.zeros += zero_to - zero_from
        self.ones += one_to - one_from
        self.below += zero_from
        self.above += count - one_to
        self.low = ordered[0] if math.isnan(self.low) else min(self.low, ordered[0])
        self.high = ordered[-1] if math.isnan(self.high) else max(self.high, ordered[-1])

    def merge(self, other: Rewards) -> None:
        """Add another part's rewards (a Ray block's, the rows a resumed run scored before)."""
        if not other.count:
            return
        self.count += other.count
        self.reward_sum += other.reward_sum
        self.zeros += other.zeros
        self.ones += other.ones
        self.bins = [mine + theirs for mine, theirs in zip(self.bins, other.bins, strict=True)]
        self.below += other.below
        self.above += other.above
        self.low = other.low if math.isnan(self.low) else min(self.low, other.low)
        self.high = other.high if math.isnan(self.high) else max(self.high, other.high)

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON (a checkpoint's, a Ray block's): ``min`` and ``max`` null while it is empty."""
        empty = not self.count
        return {
            "count": self.count,
            "reward_sum": self.reward_sum if math.isfinite(self.reward_sum) else None,  # JSON has no inf
            "zeros": self.zeros,
            "ones": self.ones,
            "min": None if empty else self.low,
            "max": None if empty else self.high,
            "bins": list(self.bins),
            "below": self.below,
            "above": self.above,
        }

    @classmethod
    def from_json(cls, data: Any) -> Rewards:
        """The figures :meth:`to_json` wrote; ``ValueError`` for anything else (a state file is a file a user
        can edit: a wrong shape is refused here, never shown as a distribution)."""
        if not isinstance(data, dict) or set(data) != set(_FIELDS):
            raise ValueError("not a distribution of rewards: its fields differ")
        counts = [data[key] for key in ("count", "zeros", "ones", "below", "above")]
        bins = data["bins"]
        if not isinstance(bins, list) or len(bins) != BINS:
            raise ValueError(f"not a distribution of rewards: 'bins' is not a list of {BINS} counts")
        if not all(type(value) is int and value >= 0 for value in (*counts, *bins)):
            raise ValueError("not a distribution of rewards: a count is not a whole number >= 0")
        count, low, high = data["count"], data["min"], data["max"]
        reward_sum = data["reward_sum"]
        if reward_sum is not None and not _finite(reward_sum):
            raise ValueError("not a distribution of rewards: its sum is not a number")
        bounded = _finite(low) and _finite(high) and low <= high if count else (low, high) == (None, None)
        if not bounded:
            raise ValueError("not a distribution of rewards: its min and max are not what its count says")
        if sum(bins) + data["below"] + data["above"] != count or data["zeros"] + data["ones"] > count:
            raise ValueError("not a distribution of rewards: its counts do not add up")
        low, high = (math.nan, math.nan) if not count else (float(low), float(high))
        reward_sum = math.nan if reward_sum is None else float(reward_sum)  # None: it overflowed, its sign unknown
        return cls(count, reward_sum, data["zeros"], data["ones"], low, high, list(bins), data["below"],
                   data["above"])


def _finite(value: Any) -> bool:
    """A JSON number that is finite (a bool is not a number here)."""
    return type(value) in (int, float) and math.isfinite(value)
