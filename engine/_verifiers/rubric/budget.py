"""The judge's budgets: what one open engine's judging has spent, over every rubric and per rubric, against its limits.

The rules (which reply fails, what is in flight, how far a run can overshoot): docs/design.md, The judge (Budgets).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine._config import JudgeConfig, Limits
from engine._errors import Failure, Overspent

__all__ = ["JUDGE", "Budget", "Prices"]

JUDGE = "judge"  # the budget of [judge], over every rubric (a rubric's is named by its owner/name)
_TOKENS, _SPEND = "tokens", "spend"


@dataclass(frozen=True)
class Prices:
    """What the judge's tokens cost, per million input (prompt) and output (completion) tokens."""

    input: float
    output: float

    def of(self, prompt_tokens: int, completion_tokens: int) -> float:
        """What ``prompt_tokens`` in and ``completion_tokens`` out cost."""
        return (prompt_tokens * self.input + completion_tokens * self.output) / 1e6


@dataclass(frozen=True)
class _Limit:
    name: str  # JUDGE or the rubric's owner/name
    tokens: int | None
    spend: float | None


@dataclass
class _Spent:
    tokens: int = 0
    spend: float = 0.0


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Budget:
    """One engine's judge spending: ``check`` before each request is sent, ``charge`` each reply's ``usage``.

    Spent is counted over the engine's life (one ``async with``; one ``engine serve``, which is one job), never
    reset: the reply that crosses a budget fails its item, and no request is sent under that budget again.
    """

    def __init__(self, judge: JudgeConfig, refs: Mapping[str, Limits]) -> None:
        price_in, price_out = judge.price_per_million_input, judge.price_per_million_output
        self.prices = Prices(price_in, price_out) if price_in is not None and price_out is not None else None
        self._judge = _Limit(JUDGE, judge.token_budget, judge.spend_budget)
        self._rubrics = {
            key: _Limit(key, limits.token_budget, limits.spend_budget)
            for key, limits in refs.items()
            if limits.token_budget is not None or limits.spend_budget is not None
        }
        self._spent: dict[str, _Spent] = {JUDGE: _Spent()}  # JUDGE: every rubric's; each budgeted rubric's own

    def _limits(self, key: str) -> list[_Limit]:
        """The budgets rubric ``key`` spends under: the judge's, its own."""
        limits = [self._judge] if self._judge.tokens is not None or self._judge.spend is not None else []
        own = self._rubrics.get(key)
        return [*limits, own] if own is not None else limits

    def check(self, key: str) -> None:
        """Before a request for rubric ``key``: ``Overspent`` if a budget it spends under has nothing left."""
        for limit in self._limits(key):
            self._over(limit, lambda spent, most: spent >= most)

    def charge(self, key: str, usage: Any) -> None:
        """Count a reply's ``usage`` for rubric ``key``; ``Overspent`` if it took a budget past its limit, ``Failure``
        if a budget applies and the reply says no usable counts (what it cost is unknown: the budget cannot be kept).
        """
        limits = self._limits(key)
        counts = _counts(usage)
        if counts is None:
            if limits:
                raise Failure(
                    "the judge's reply has no usage object with whole prompt_tokens and completion_tokens, so "
                    f"the {_names(limits)} cannot be kept (a server that does not report usage cannot judge "
                    "under a budget)"
                )
            return
        prompt, completion, total = counts
        spend = self.prices.of(prompt, completion) if self.prices is not None else 0.0
        for name in {JUDGE, *(limit.name for limit in limits)}:
            spent = self._spent.setdefault(name, _Spent())
            spent.tokens += total
            spent.spend += spend
        for limit in limits:
            self._over(limit, lambda spent, most: spent > most)

    def _over(self, limit: _Limit, past: Callable[[float, float], bool]) -> None:
        spent = self._spent.setdefault(limit.name, _Spent())
        whose = "the judge's" if limit.name == JUDGE else f"rubric {limit.name}'s"
        if limit.tokens is not None and past(spent.tokens, limit.tokens):
            raise Overspent(
                f"{whose} token budget of {limit.tokens:,} is spent ({spent.tokens:,} tokens used by this engine)",
                budget=limit.name, measure=_TOKENS, limit=limit.tokens, spent=spent.tokens,
            )
        if limit.spend is not None and past(spent.spend, limit.spend):
            raise Overspent(
                f"{whose} spend budget of {limit.spend:g} is spent ({spent.spend:.6g} used by this engine)",
                budget=limit.name, measure=_SPEND, limit=limit.spend, spent=spent.spend,
            )


def _counts(usage: Any) -> tuple[int, int, int] | None:
    """A reply's ``(prompt, completion, total)`` tokens, total as reported (else their sum); None if not given."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (_whole(prompt) and _whole(completion)):
        return None
    assert isinstance(prompt, int) and isinstance(completion, int)  # _whole's
    total = usage.get("total_tokens", prompt + completion)
    if not _whole(total):
        return None
    # a total under its parts is a peer's lie: the budget counts no fewer tokens than it was billed
    return prompt, completion, max(total, prompt + completion)


def _names(limits: list[_Limit]) -> str:
    return " and ".join("judge's budget" if limit.name == JUDGE else f"{limit.name}'s budget" for limit in limits)
