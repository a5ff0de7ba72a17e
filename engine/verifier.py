"""The one contract every verifier kind resolves to.

A plugin author writes a :data:`VerifyFn` (or its ``async def`` twin). Inside the engine every kind,
plugin, endpoint and rubric, is a :class:`Verifier`: an object with a name and an async ``verify``
of that same shape, so the scheduler never needs to know which kind it is driving.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

__all__ = ["AsyncVerifyFn", "Verifier", "VerifyFn", "check_reward"]

VerifyFn = Callable[[Mapping[str, Any], Any], float]
AsyncVerifyFn = Callable[[Mapping[str, Any], Any], Awaitable[float]]


class Verifier(Protocol):
    """A resolved verifier, as the scheduler sees it."""

    @property
    def kind(self) -> str: ...

    @property
    def ref(self) -> str: ...

    @property
    def key(self) -> str:
        """The name its limits are configured under (``engine.config``)."""
        ...

    @property
    def retries(self) -> int:
        """Transient failures retried so far, over the verifier's life."""
        ...

    def provenance(self) -> Mapping[str, Any]:
        """What scores the items: kind, ref, and the environment digest or rubric version."""
        ...

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        """The reward for one item; raises on any failure (the scheduler names the item)."""
        ...


def check_reward(value: Any) -> float:
    """``float(value)`` for a reward, refusing NaN and the infinities.

    Raises ``TypeError``/``ValueError`` with a message that shows the offending value.
    """
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"returned {value!r} ({type(value).__name__}), which float() refuses") from None
    if not math.isfinite(reward):
        raise ValueError(f"returned {value!r}, which is not a finite number")
    return reward
