"""The one contract every verifier kind resolves to.

A plugin author writes a :data:`VerifyFn` (or its ``async def`` twin). Inside the engine every kind,
plugin, endpoint and rubric, is a :class:`Verifier`: an object with a name and an async ``verify``
of that same shape, so the scheduler never needs to know which kind it is driving.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, overload, runtime_checkable

__all__ = [
    "AsyncVerifyFn",
    "BadReward",
    "ChunkedVerifier",
    "Items",
    "MalformedItem",
    "Verifier",
    "VerifyFn",
    "as_rewards",
    "check_reward",
    "task_of",
]

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

    def chunk_size(self, share: int) -> int:
        """How many items it wants per call: more than 1 only for a :class:`ChunkedVerifier`.

        ``share`` is the lane's items left per worker: a chunk larger than that leaves workers idle
        while the last chunks run, so a verifier whose chunks run in parallel stays within it.
        """
        ...

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        """The reward for one item; raises on any failure (the scheduler names the item)."""
        ...


@runtime_checkable
class ChunkedVerifier(Verifier, Protocol):
    """A verifier that can score several items in one call (a sync plugin: one thread hop a chunk)."""

    async def verify_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The rewards of whole items (mappings with ``environment``, ``task``, ``trajectory``), in order.

        It scores only items of its own environment: at the first of another it stops, and returns
        the rewards of the items before it (the engine had guessed the batch was all one
        environment's, and groups the rest).

        A failure raises ``VerificationError`` whose ``index`` is the failing item's position in
        ``items``, or :class:`MalformedItem` for an item without a task or trajectory.
        """
        ...


class Items(Sequence[Mapping[str, Any]]):
    """The items of a batch at ``positions``, read only where they are used.

    A chunk is handed to the thread that scores it as this view, not as a copy made on the event
    loop: copying touches every item from the loop's CPU, and the thread then reads them from the
    other CPU's cache (measured: ~0.2 us an item, a fifth of a cheap plugin's cost). The thread
    slices what it needs, a step at a time.
    """

    __slots__ = ("_batch", "_positions")

    def __init__(self, batch: Sequence[Mapping[str, Any]], positions: Sequence[int]) -> None:
        self._batch = batch
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> Mapping[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Mapping[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
        picked = self._positions[index]
        if isinstance(picked, int):
            return self._batch[picked]
        if isinstance(picked, range) and picked.step == 1:  # contiguous: one slice of the batch
            return self._batch[picked.start : picked.stop]
        return [self._batch[i] for i in picked]

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return iter(self[:])


class MalformedItem(Exception):
    """The item at ``position`` of a chunk has no task or trajectory (the engine says which)."""

    def __init__(self, position: int) -> None:
        self.position = position
        super().__init__(position)


def task_of(index: int, item: Mapping[str, Any]) -> tuple[Mapping[str, Any], Any]:
    """An item's ``(task, trajectory)``; ``ValueError``/``TypeError`` naming item ``index`` if malformed."""
    try:
        task, trajectory = item["task"], item["trajectory"]
    except KeyError as exc:
        raise ValueError(
            f"item {index} has no {exc.args[0]!r} (an item needs 'environment', 'task', 'trajectory')"
        ) from None
    if type(task) is not dict and not isinstance(task, Mapping):
        raise TypeError(f"item {index}: 'task' is a {type(task).__name__}, not a mapping")
    return task, trajectory


class BadReward(Exception):
    """The value at ``position`` of a chunk's results is not a reward; ``reason`` says why."""

    def __init__(self, position: int, reason: str) -> None:
        self.position, self.reason = position, reason
        super().__init__(position, reason)


def as_rewards(values: Sequence[Any]) -> list[float]:
    """``values`` as rewards (:func:`check_reward` on each); :class:`BadReward` at the first that is not one.

    Fast when every value is good (two passes in C), which is what a chunk of calls returns.
    """
    try:
        rewards = list(map(float, values))
        if math.isfinite(math.fsum(rewards)):
            return rewards
    except (TypeError, ValueError, OverflowError):  # OverflowError: finite values whose sum is not
        pass
    rewards = []
    for position, value in enumerate(values):  # the slow path: check each, to name a bad one
        try:
            rewards.append(check_reward(value))
        except (TypeError, ValueError) as exc:
            raise BadReward(position, str(exc)) from None
    return rewards


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
