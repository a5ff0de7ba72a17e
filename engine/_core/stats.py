"""The engine's figures over a window of batches, as flat metrics a trainer logs (``Engine.stats``).

Built only from what a batch tells its caller (a :class:`BatchResult`'s verifier reports) and from
the :class:`VerificationError` that aborts one, so that anything holding those (the engine itself,
an adapter, a client of a remote engine) can feed the same accumulator. Memory is constant however
many batches a window holds: latencies go into a :class:`LatencyHistogram`.

Keys are ``engine/<verifier>/<figure>``, ``<verifier>`` being the verifier's key, the name the config's
``[refs."..."]`` tables give it (``arith/verify:score``, an endpoint's URL, a rubric's ``owner/name``):
stable across runs and rubric versions, and one per verifier (two environments that both ship
``verify:score`` stay apart; one endpoint serving two environments is one verifier, as its limits are).
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable
from dataclasses import dataclass, field

from engine._core.report import BatchResult, LatencyHistogram
from engine._errors import VerificationError

__all__ = ["FIGURES", "SUMMED", "Stats", "error_key", "timed_out"]

# every figure, in the order a snapshot lists them
FIGURES = (
    "items",
    "reward_mean",
    "errors",
    "retries",
    "timeouts",
    "latency_p50_s",
    "latency_p99_s",
    "judge_tokens",
)
# the figures that add up across ranks (a sum of counts); reward_mean averages weighted by items, and
# the percentiles do not average at all
SUMMED = frozenset({"items", "errors", "retries", "timeouts", "judge_tokens"})

# a reason that says the call ran out of time: a plugin's or an endpoint's own timeout, one of httpx's,
# or the last try of an endpoint's retries (``engine._reasons.describe`` writes them all)
_TIMED_OUT = re.compile(r"(?:gave up after \d+ attempts?; last: )?timed out\b")


def timed_out(error: VerificationError) -> bool:
    """Whether ``error`` is its verifier running out of time (the engine's own words for it, not a plugin's)."""
    return _TIMED_OUT.match(error.reason) is not None


def error_key(error: VerificationError) -> str:
    """The key of the verifier ``error`` names, as its reports are keyed (``Environment.verifier_key``)."""
    if error.kind == "plugin" and error.environment is not None:
        return f"{error.environment}/{error.ref}"
    if error.kind == "rubric":
        return error.ref.partition("@")[0]
    return error.ref


@dataclass
class _Window:
    """One verifier's figures since the last reset."""

    items: int = 0
    reward_sum: float = 0.0
    errors: int = 0
    retries: int = 0
    timeouts: int = 0
    judge_tokens: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def figures(self) -> dict[str, float]:
        return {
            "items": float(self.items),
            "reward_mean": self.reward_sum / self.items if self.items else math.nan,
            "errors": float(self.errors),
            "retries": float(self.retries),
            "timeouts": float(self.timeouts),
            "latency_p50_s": self.latency.percentile(50),
            "latency_p99_s": self.latency.percentile(99),
            "judge_tokens": float(self.judge_tokens),
        }


class Stats:
    """Per-verifier figures over the batches since the last :meth:`snapshot` that reset them.

    Not thread-safe: feed and read it from one thread (the engine's event loop's).
    """

    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}

    def _window(self, key: str) -> _Window:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window()
        return window

    async def counted(self, batch: Awaitable[BatchResult]) -> BatchResult:
        """``await batch``, counted: its reports (:meth:`add`), or the error that aborted it (:meth:`failed`)."""
        try:
            result = await batch
        except VerificationError as exc:
            self.failed(exc)
            raise
        self.add(result)
        return result

    def add(self, result: BatchResult) -> None:
        """Count a batch that was scored."""
        for report in result.verifiers:
            window = self._window(report.key)
            window.items += report.items
            window.reward_sum += report.reward_sum
            window.retries += report.retries
            window.judge_tokens += report.spent.get("total_tokens", 0)
            window.latency.extend(*report.latency_sample())

    def failed(self, error: VerificationError) -> None:
        """Count a batch that ``error`` aborted: one error of its verifier (a timeout if it ran out of time).

        The items scored before the abort are not counted: their batch gave no rewards.
        """
        window = self._window(error_key(error))
        window.errors += 1
        if timed_out(error):
            window.timeouts += 1

    def snapshot(self, reset: bool = True) -> dict[str, float]:
        """``engine/<verifier>/<figure>`` for every verifier seen in the window; ``reset`` starts a new one.

        A verifier without items in the window has NaN for its mean and its percentiles.
        """
        out = {
            f"engine/{key}/{name}": value
            for key, window in self._windows.items()
            for name, value in window.figures().items()
        }
        if reset:
            self._windows = {}
        return out
