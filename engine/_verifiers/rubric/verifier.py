"""A rubric environment's verifier: one resolved rubric version, graded by the engine's judge."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine._verifiers.rubric.judge import Judge, Usage
from engine._verifiers.rubric.registry import Rubric

__all__ = ["RubricVerifier"]


class RubricVerifier:
    """One resolved rubric version, graded by a judge: the ``Verifier`` of a rubric environment.

    The version is fixed when this is built, so every item it grades uses the same text even if a
    newer version is added meanwhile; build one per batch to pick up new versions. ``usage`` is
    what this verifier's items cost.
    """

    kind = "rubric"
    chunker: None = None  # one HTTP request per item

    def __init__(self, rubric: Rubric, judge: Judge) -> None:
        self.rubric = rubric
        self.judge = judge
        self.ref = rubric.ref
        self.key = f"{rubric.owner}/{rubric.name}"
        self.usage = Usage()

    @property
    def retries(self) -> int:
        return self.usage.retries

    def spent(self) -> Mapping[str, int]:
        return self.usage.as_dict()

    async def load(self) -> None:
        pass  # its rubric was resolved when it was built, and the judge is the engine's

    async def aclose(self) -> None:
        pass  # the judge, and its connections, are the engine's

    def provenance(self) -> Mapping[str, Any]:
        rubric = self.rubric
        return {"kind": self.kind, "ref": self.ref, "version": rubric.version, "digest": rubric.digest}

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        return await self.judge.grade(self.rubric, task, trajectory, usage=self.usage)
