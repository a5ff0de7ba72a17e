"""The engine's figures over a window of batches, as flat metrics a trainer logs (``Engine.stats``).

Built only from what a batch tells its caller (its reports, or the ``VerificationError`` that aborted it),
into the one accumulator of figures (``VerifierTotals``: docs/design.md, "Figures"); keys are
``engine/<verifier key>/<figure>``.
"""

from __future__ import annotations

from collections.abc import Awaitable

from engine._core.report import BatchResult, VerifierTotals, add_reports
from engine._errors import VerificationError

__all__ = ["FIGURES", "SUMMED", "Stats"]

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
    "judge_spend",
    "cache_hits",
    "cache_hit_rate",
    "deduped",
    "window",
)
# the figures that add up across ranks (a sum of counts); reward_mean averages weighted by items, and
# the percentiles and the hit rate do not average at all
SUMMED = frozenset({"items", "errors", "retries", "timeouts", "judge_tokens", "judge_spend", "cache_hits", "deduped"})


def _figures(totals: VerifierTotals) -> dict[str, float]:
    """Its figures; ``window`` only for a verifier with one (an endpoint, a rubric: the judge's)."""
    figures = {
        "items": float(totals.items),
        "reward_mean": totals.mean_reward,
        "errors": float(totals.errors.total()),
        "retries": float(totals.retries),
        "timeouts": float(totals.timeouts),
        "latency_p50_s": totals.latency.percentile(50),
        "latency_p99_s": totals.latency.percentile(99),
        "judge_tokens": float(totals.spent.get("total_tokens", 0)),
        "judge_spend": float(totals.spent.get("spend", 0)),  # at the judge's prices; 0 without them
        "cache_hits": float(totals.cache_hits),
        "cache_hit_rate": totals.cache_hit_rate,
        "deduped": float(totals.deduped),
    }
    if totals.window is not None:
        figures["window"] = float(totals.window)
    return figures


class Stats:
    """Per-verifier figures over the batches since the last :meth:`snapshot` that reset them.

    Not thread-safe: feed and read it from one thread (the engine's event loop's).
    """

    def __init__(self) -> None:
        self._windows: dict[str, VerifierTotals] = {}

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
        add_reports(self._windows, result)

    def failed(self, error: VerificationError) -> None:
        """Count a batch that ``error`` aborted: one error of its verifier (a timeout if it ran out of time).

        The items scored before the abort are not counted: their batch gave no rewards.
        """
        window = self._windows.get(error.key)
        if window is None:
            window = self._windows[error.key] = VerifierTotals(error.kind, error.ref)
        window.failed(error)

    def snapshot(self, reset: bool = True) -> dict[str, float]:
        """``engine/<verifier>/<figure>`` for every verifier seen in the window; ``reset`` starts a new one.

        A verifier without items in the window has NaN for its mean and its percentiles.
        """
        out = {
            f"engine/{key}/{name}": value
            for key, window in self._windows.items()
            for name, value in _figures(window).items()
        }
        if reset:
            self._windows = {}
        return out
