"""A rubric environment's verifier: one resolved rubric version, graded by the engine's judge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine._cache.store import VerdictStore
from engine._core.contract import Sifted
from engine._verifiers.rubric.judge import Judge, Usage
from engine._verifiers.rubric.prompt import PROMPT_VERSION
from engine._verifiers.rubric.registry import Rubric
from engine._verifiers.rubric.verdicts import InFlight, Verdicts

__all__ = ["RubricVerifier"]


class RubricVerifier:
    """One resolved rubric version, graded by a judge: the ``Verifier`` of a rubric environment.

    The version is fixed when this is built, so every item it grades uses the same text even if a
    newer version is added meanwhile; build one per batch to pick up new versions. ``usage`` is
    what this verifier's items cost. Unless the judge's ``dedupe`` is off, identical items are judged once (in
    the batch, and with ``in_flight``, the engine's calls in flight, across its batches) and verdicts are kept in
    ``store`` (the engine's cache, if it has one): ``engine._verifiers.rubric.verdicts``.
    """

    kind = "rubric"
    chunker: None = None  # one HTTP request per item

    def __init__(
        self, rubric: Rubric, judge: Judge, store: VerdictStore | None = None, in_flight: InFlight | None = None
    ) -> None:
        self.rubric = rubric
        self.judge = judge
        self.ref = rubric.ref
        self.key = f"{rubric.owner}/{rubric.name}"
        self.usage = Usage()
        self.verdicts = Verdicts(judge, rubric, self.key, store) if judge.config.dedupe else None
        self.in_flight = in_flight if in_flight is not None else InFlight()  # the engine's, shared by its batches
        self.shared = 0  # items given the reward of another batch's call in flight, with no call of their own

    @property
    def retries(self) -> int:
        return self.usage.retries

    def spent(self) -> Mapping[str, float]:
        spent: dict[str, float] = dict(self.usage.as_dict())
        prices = self.judge.budget.prices
        if prices is not None:  # what its tokens cost, in the prices' currency
            spent["spend"] = prices.of(self.usage.prompt_tokens, self.usage.completion_tokens)
        return spent

    async def load(self) -> None:
        pass  # its rubric was resolved when it was built, and the judge is the engine's

    async def aclose(self) -> None:
        pass  # the judge, and its connections, are the engine's

    def provenance(self) -> Mapping[str, Any]:
        rubric, judge = self.rubric, self.judge.config
        return {
            "kind": self.kind, "ref": self.ref, "version": rubric.version, "digest": rubric.digest,
            "prompt": PROMPT_VERSION, "model": judge.model,
            "judge": {"model": judge.model, "base_url": judge.base_url, "temperature": judge.temperature,
                      "max_tokens": judge.max_tokens, "response_format": judge.response_format},
        }

    async def sift(self, items: Sequence[Mapping[str, Any]], indices: Sequence[int], first: int) -> Sifted | None:
        return None if self.verdicts is None else await self.verdicts.sift(items, indices, first)

    def finish(self) -> None:
        if self.verdicts is not None:
            self.verdicts.finish()

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        verdicts = self.verdicts
        if verdicts is None:
            return await self.judge.grade(self.rubric, task, trajectory, usage=self.usage)
        body = self.judge.request_body(self.rubric, task, trajectory)

        async def call() -> float:
            return await self.judge.grade(self.rubric, task, trajectory, usage=self.usage, body=body)

        reward, shared = await self.in_flight.judged(verdicts.key(body), call)
        if shared:
            self.shared += 1
        else:
            verdicts.scored(body, reward)
        return reward
