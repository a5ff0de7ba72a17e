"""The scheduler: fan a batch out over its verifiers, under their limits, and stop at the first error.

Each verifier's share of a batch is a *lane*. A lane runs as many workers as its verifier may
have calls in flight; the workers take item indices from one shared cursor, a chunk at a time
(as many as the verifier asks for), so a batch of a million items is a few hundred tasks, not a
million. Every call holds, in order, a slot of its
verifier (engine-wide, so concurrent batches share it), a token of its verifier's rate limiter,
and a slot of the engine-wide cap on items in flight. A verifier at its limit only makes its own
workers wait: the other lanes keep going (no head-of-line blocking).

A batch that looks like one environment's is scored optimistically, as one lane, without a first
pass over every item to group them (that pass cost a cheap plugin a tenth of its speed): its calls
check each item's environment where they read it, and stop at the first of another. The lane then
gives back the items from there on and those it has not taken, and the engine groups them into
new lanes that start at once, in the same task group, while the lane's other calls finish.

The first exception cancels the task group (HTTP requests are closed, queued items never start,
threads are abandoned) and is raised alone, never wrapped in an ``ExceptionGroup``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING

import anyio
from aiolimiter import AsyncLimiter

from engine._core.contract import Verifier

if TYPE_CHECKING:  # config imports the judge, which takes its rate limiter from here
    from engine._config import Limits

__all__ = ["Gate", "Lane", "in_flight_cap", "rate_limiter", "run_lanes", "total"]

logger = logging.getLogger("engine")


def _semaphore(size: int) -> anyio.Semaphore:
    # fast_acquire: an uncontended acquire does not yield to the event loop (cheap per item)
    return anyio.Semaphore(size, max_value=size, fast_acquire=True)


def rate_limiter(per_second: float) -> AsyncLimiter:
    """A limiter of ``per_second`` calls a second: bursts of up to one second's worth.

    aiolimiter's bucket holds ``max_rate`` tokens, so a rate below one a second is written as one
    call per ``1 / per_second`` seconds (a bucket of less than one token would never grant any).
    """
    if per_second >= 1:
        return AsyncLimiter(per_second, 1.0)
    return AsyncLimiter(1, 1 / per_second)


@dataclass(eq=False)
class Gate:
    """A verifier's limits as live objects, shared by every batch one engine scores."""

    slots: anyio.Semaphore
    rate: AsyncLimiter | None

    @classmethod
    def from_limits(cls, limits: Limits) -> Gate:
        rate = rate_limiter(limits.max_rate) if limits.max_rate is not None else None
        return cls(_semaphore(limits.max_concurrency), rate)


@dataclass(eq=False)
class Lane:
    """One verifier's share of a batch: the positions of its items, and what happened to them."""

    verifier: Verifier
    gate: Gate
    width: int  # workers: the verifier's max concurrency
    indices: Sequence[int] = field(default_factory=list)  # a range when the lane is the whole batch
    environment: str | None = None  # set when the lane is a guess: items not of it are given back
    given_back: list[int] = field(default_factory=list)  # its indices it left to other lanes
    latencies: list[float] = field(default_factory=list)  # seconds per item, one entry per call
    latency_items: list[int] = field(default_factory=list)  # items each entry stands for (a chunk's)
    waited: float = 0.0  # seconds items spent waiting for a limit
    busy: float = 0.0  # seconds spent in calls
    reward_sum: float = 0.0
    running: int = 0
    peak: int = 0


def total(rewards: Sequence[float]) -> float:
    """The sum of ``rewards``: exact (``math.fsum``), or as ``sum`` gives it where ``fsum`` raises (overflow)."""
    try:
        return math.fsum(rewards)
    except (OverflowError, ValueError):
        return sum(rewards)


def in_flight_cap(size: int) -> anyio.Semaphore:
    """The engine-wide cap on items in flight."""
    return _semaphore(size)


Call = Callable[[Lane, Sequence[int]], Awaitable[list[float]]]
Regroup = Callable[[list[int]], list[Lane]]


class _Todo:
    """A lane's indices not yet taken, shared by its workers; ``take`` slices, so a range stays a range."""

    def __init__(self, indices: Sequence[int]) -> None:
        self._indices = indices
        self._next = 0

    def share(self, workers: int) -> int:
        """Indices left per worker, rounded up."""
        return max(1, -(-(len(self._indices) - self._next) // workers))

    def rest(self) -> Sequence[int]:
        """The indices not taken yet, which no worker will take now."""
        rest, self._next = self._indices[self._next :], len(self._indices)
        return rest

    def take(self, count: int) -> Sequence[int]:
        start = self._next
        self._next = min(start + count, len(self._indices))
        return self._indices[start : self._next]


def _one(share: int) -> int:
    return 1


async def run_lanes(
    results: list[float], lanes: list[Lane], call: Call, in_flight: anyio.Semaphore, regroup: Regroup
) -> None:
    """``call(lane, chunk)`` over every index of every lane, each reward into ``results``; or the first error.

    A worker takes as many indices at a time as its verifier asks for (``chunk_size``): cheap sync
    plugins run a chunk per thread hop, everything else one item per call. A chunk holds one slot of
    each limit, as one call in flight; a rate-limited verifier is called one item at a time.

    A call that returns fewer rewards than its chunk has items met an item of another environment
    there: the rest of the chunk, and every index its lane has not taken, go to ``regroup``, whose
    lanes start at once and are appended to ``lanes``.
    """
    failure: Exception | None = None

    async def worker(lane: Lane, todo: _Todo) -> None:
        gate = lane.gate
        chunk_size = _one if gate.rate is not None else lane.verifier.chunk_size
        while chunk := todo.take(chunk_size(todo.share(lane.width))):
            queued = perf_counter()
            async with gate.slots:
                if gate.rate is not None:
                    await gate.rate.acquire()
                async with in_flight:
                    started = perf_counter()
                    lane.waited += started - queued
                    lane.running += 1
                    lane.peak = max(lane.peak, lane.running)
                    try:
                        rewards = await call(lane, chunk)
                    finally:
                        lane.running -= 1
                    seconds = perf_counter() - started
                    lane.busy += seconds
                    if rewards:
                        lane.latencies.append(seconds / len(rewards))
                        lane.latency_items.append(len(rewards))
            if len(rewards) < len(chunk):  # an item of another environment: give back the rest
                left = [*chunk[len(rewards) :], *todo.rest()]
                lane.given_back += left
                chunk = chunk[: len(rewards)]
                for more in regroup(left):
                    lanes.append(more)
                    start(more)
            if isinstance(chunk, range):  # contiguous: one slice assignment
                results[chunk.start : chunk.stop] = rewards
            else:
                for index, reward in zip(chunk, rewards, strict=True):
                    results[index] = reward
            lane.reward_sum += total(rewards)

    async def guarded(lane: Lane, todo: _Todo) -> None:
        nonlocal failure
        try:
            await worker(lane, todo)
        except Exception as exc:
            if failure is None:
                failure = exc
            tg.cancel_scope.cancel()

    def start(lane: Lane) -> None:
        todo = _Todo(lane.indices)
        chunk = 1 if lane.gate.rate is not None else lane.verifier.chunk_size(todo.share(lane.width))
        chunks = -(-len(lane.indices) // chunk)
        for _ in range(min(lane.width, chunks, in_flight.max_value or 1)):  # no more workers than work
            tg.start_soon(guarded, lane, todo)

    async with anyio.create_task_group() as tg:
        for lane in list(lanes):
            start(lane)
    if failure is not None:
        logger.error("batch aborted: %s", failure)
        raise failure
