"""The scheduler: plan a batch's lanes, fan them out under their meters, stop at the first error, report.

Each verifier's share of a batch is a *lane*. A lane runs as many workers as its verifier may
have calls in flight; the workers take item indices from one shared cursor, a chunk at a time
(as many as the verifier asks for), so a batch of a million items is a few hundred tasks, not a
million. Every call holds, in order, a slot of its
verifier (engine-wide, so concurrent batches share it), a token of its verifier's rate limiter,
and a slot of the engine-wide cap on items in flight. A verifier at its limit only makes its own
workers wait: the other lanes keep going (no head-of-line blocking).

Items are grouped into lanes by environment, each environment's name resolved to its verifier and
meter by the caller's :data:`Resolve` (``engine._registry``). A batch that looks like one plugin
environment's (its first and last items agree) is scored optimistically, as one lane, without a
first pass over every item to group them (that pass cost a cheap plugin a tenth of its speed):
its calls check each item's environment where they read it, and stop at the first of another.
The lane then gives back the items from there on and those it has not taken, which are grouped
into new lanes that start at once, in the same task group, while the lane's other calls finish.

A failure of an environment rather than of an item (a pin that does not match, a module that does
not import: ``Failure.of_environment``) names that environment's first item in input order, not
whichever of its racing calls failed first.

The first exception cancels the task group (HTTP requests are closed, queued items never start,
threads are abandoned) and is raised alone, never wrapped in an ``ExceptionGroup``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import eq, itemgetter
from time import perf_counter
from typing import Any

import anyio
import anyio.lowlevel

from engine._core.contract import Items, MalformedItem, Verifier, check_item, is_chunked, item_label, task_of
from engine._core.meters import Meter, ledger, loop_calls
from engine._core.report import BatchResult, VerifierReport
from engine._errors import ConfigError, Failure, VerificationError
from engine._reasons import describe, is_timeout

__all__ = ["Resolve", "score_batch", "total"]

logger = logging.getLogger("engine")

GROUP_SLICE = 1 << 14  # items grouped between two yields to the event loop (~2 ms of work)
_FEW = 8  # environments in a slice picked out one pass each; more are grouped item by item
_ENVIRONMENT = itemgetter("environment")

Resolve = Callable[[str], tuple[Verifier, Meter]]
"""An environment's name -> its verifier and meter: ``ValueError`` if there is no such environment,
``ConfigError`` if its manifest is bad, ``VerificationError`` if it cannot score (the scheduler names the item)."""


@dataclass(eq=False)
class Lane:
    """One verifier's share of a batch: the positions of its items, and what happened to them."""

    verifier: Verifier
    meter: Meter
    width: int  # workers: the verifier's max concurrency
    indices: Sequence[int] = field(default_factory=list)  # a range when the lane is the whole batch
    environment: str | None = None  # set when the lane is a guess: items not of it are given back
    given_back: list[int] = field(default_factory=list)  # its indices it left to other lanes
    latencies: list[float] = field(default_factory=list)  # seconds per item, one entry per call
    latency_items: list[int] = field(default_factory=list)  # items each entry stands for (a chunk's)
    waited: float = 0.0  # seconds calls waited to start (from the lane's start) and for a limit inside them
    busy: float = 0.0  # seconds spent in calls, less their waits and start-up inside (meters.waiting, .starting)
    reward_sum: float = 0.0
    running: int = 0
    peak: int = 0
    ready: float = math.inf  # when its items could first have been called: its workers' start (perf_counter)
    first_start: float = math.inf  # when its first call started (perf_counter), and its last ended
    last_end: float = -math.inf
    startup: list[float] = field(default_factory=list)  # seconds each call that started the verifier up spent so


class _Call:
    """One call's account (``meters.Account``): a wait for a limit inside it is waiting, and its verifier's
    start-up is start-up; in neither is it in flight.

    A call that waits as it begins (a judge's slot, before it has yielded) was never in flight: the
    peak its start raised is taken back, unless another call has started since.
    """

    __slots__ = ("lane", "raised", "startup", "waited")

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.waited = 0.0
        self.startup = 0.0
        self.raised: tuple[int, int] | None = None  # (the peak before its start, the peak its start set)

    def started(self) -> None:
        lane = self.lane
        lane.running += 1
        if lane.running > lane.peak:
            self.raised, lane.peak = (lane.peak, lane.running), lane.running

    def paused(self) -> None:
        lane = self.lane
        if self.raised is not None and lane.peak == lane.running == self.raised[1]:
            lane.peak = self.raised[0]
        self.raised = None
        lane.running -= 1

    def resumed(self, seconds: float) -> None:
        lane = self.lane
        lane.running += 1
        lane.peak = max(lane.peak, lane.running)
        self.waited += seconds

    def started_up(self, seconds: float) -> None:
        self.resumed(0.0)
        self.startup += seconds


def total(rewards: Sequence[float]) -> float:
    """The sum of ``rewards``: exact (``math.fsum``), or as ``sum`` gives it where ``fsum`` raises (overflow)."""
    try:
        return math.fsum(rewards)
    except (OverflowError, ValueError):
        return sum(rewards)


def _failed(verifier: Verifier, exc: Exception, index: int, item: Mapping[str, Any]) -> VerificationError:
    """The one ``VerificationError`` for ``exc``, raised by ``verifier`` on item ``index``: named here, once.

    A verifier raises :class:`Failure` (its reason in words) or anything else (described by
    ``engine._reasons``); it never knows where its item sits in the batch, and the scheduler does.
    """
    error = VerificationError(
        verifier.kind,
        verifier.ref,
        describe(exc),  # a Failure's own reason
        key=verifier.key,
        environment=item["environment"],
        index=index,
        item_id=item.get("id"),
        timed_out=is_timeout(exc),
        cannot_load=isinstance(exc, Failure) and exc.of_environment,
    )
    if error.cannot_load:
        error.add_note(
            f"environment {item['environment']!r} cannot load its verifier, so none of its items can be scored; "
            "the error names the first of them in the batch"
        )
    return error


async def _group(items: list[Any], positions: Sequence[int], first: int) -> dict[str, list[int]]:
    """The items at ``positions`` by environment, in order of first appearance; ``TypeError``/``ValueError``
    naming a malformed one (by its position plus ``first``, the batch's first item's).

    The pass yields to the event loop every ``GROUP_SLICE`` items: grouping a batch of 300,000
    held the loop ~45 ms, which is the caller's loop (a trainer's work, other batches' calls).
    A slice's few environments are picked out in C, one pass each (~2x faster than a Python loop
    over the items); a slice of many is grouped item by item.
    """
    groups: defaultdict[str, list[int]] = defaultdict(list)
    batch = items.__getitem__
    try:
        for start in range(0, len(positions), GROUP_SLICE):
            if start:
                await anyio.lowlevel.checkpoint()
            part = positions[start : start + GROUP_SLICE]
            names = list(map(_ENVIRONMENT, map(batch, part)))
            kinds = dict.fromkeys(names)
            if len(kinds) == 1:
                groups[names[0]].extend(part)
            elif len(kinds) <= _FEW and all(type(name) is str for name in kinds):  # by ==: names only (not nan)
                for name in kinds:
                    groups[name].extend(compress(part, map(eq, names, repeat(name))))
            else:
                for index, name in zip(part, names, strict=True):
                    groups[name].append(index)
    except (KeyError, TypeError, IndexError):
        for index in positions:  # something is malformed: find it, and say what
            check_item(first + index, items[index])
        raise AssertionError("unreachable: an item failed the fast path but passes the check") from None
    for indices in groups.values():
        check_item(first + indices[0], items[indices[0]])
    return dict(groups)


def _put(into: list[Any], positions: Sequence[int], values: Sequence[Any]) -> None:
    """``into[positions[i]] = values[i]`` for each ``i``, in C: a chunk's rewards are up to 2**18 of them,
    written on the event loop (in a Python loop, ~10 ms for the largest)."""
    assert len(positions) == len(values)
    if isinstance(positions, range) and positions.step == 1:  # contiguous: one slice assignment
        into[positions.start : positions.stop] = values
    else:
        deque(map(into.__setitem__, positions, values), maxlen=0)


def _guess(items: list[Any], first: int) -> str | None:
    """The environment of a batch that looks like one environment's: its first and last items agree."""
    if not items:
        return None
    name = check_item(first, items[0])
    last = items[-1]
    return name if isinstance(last, Mapping) and last.get("environment") == name else None


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


class _Batch:
    """One batch being scored: its items, its lanes, and each verifier's retries before it began."""

    def __init__(self, items: list[Any], resolve: Resolve, in_flight: anyio.Semaphore, first: int) -> None:
        self.items = items
        self.first = first  # the position errors name the first item by
        self.resolve = resolve
        self.in_flight = in_flight
        self.lanes: list[Lane] = []
        self.retries_before: dict[Verifier, int] = {}
        self.rewards = [math.nan] * len(items)
        self.loop_calls = loop_calls(asyncio.get_running_loop())

    def _resolved(self, index: int) -> tuple[Verifier, Meter]:
        """The verifier and meter of item ``index``'s environment; errors name the item."""
        item = self.items[index]
        try:
            return self.resolve(item["environment"])
        except VerificationError as exc:  # before any call: a rubric that cannot be resolved
            raise exc.at_item(item["environment"], self.first + index, item.get("id")) from exc.__cause__
        except ConfigError:  # its manifest is bad: the error names the file
            raise
        except ValueError as exc:
            raise ValueError(f"{item_label(self.first + index, item)}: {exc}") from None

    def _lanes(self, groups: Mapping[str, Sequence[int]], guess: bool = False) -> list[Lane]:
        """A lane per verifier for ``groups`` (environment -> positions); ``guess``: the one group is a guess."""
        lanes: dict[Verifier, Lane] = {}
        for name, indices in groups.items():
            verifier, meter = self._resolved(indices[0])
            lane = lanes.get(verifier)
            if lane is None:
                lanes[verifier] = Lane(verifier, meter, meter.width, indices, name if guess else None)
                self.retries_before.setdefault(verifier, verifier.retries)
            else:  # two environments with one verifier (the same endpoint URL): one lane, one limit
                lane.indices = sorted([*lane.indices, *indices])
        return list(lanes.values())

    async def plan(self) -> None:
        """The batch's first lanes: one guessed lane if it looks like one plugin environment's, else grouped.

        A guess pays only for plugins, where a pass over the batch to group it costs a tenth of
        the work; for the other kinds it costs nothing next to a call, and grouping first keeps
        a malformed batch from sending any request (or spending any judge tokens).
        """
        items = self.items
        guess = _guess(items, self.first)
        if guess is not None and is_chunked(self._resolved(0)[0]):
            self.lanes = self._lanes({guess: range(len(items))}, guess=True)
        else:
            self.lanes = self._lanes(await _group(items, range(len(items)), self.first))

    async def regroup(self, left: list[int]) -> list[Lane]:
        """Lanes for items a guessed lane gave back (the batch was not all one environment's)."""
        return self._lanes(await _group(self.items, left, self.first))

    def _first_of(self, lane: Lane) -> int:
        """The position of the batch's first item of ``lane``'s environment(s), in input order.

        What an environment's failure (``Failure.of_environment``) names: every item of it fails
        alike, and its calls race, so naming the call that failed first would name a different
        item each run. A lane may not hold its environment's first item (a guessed lane gives back
        the items of another environment a chunk at a time, to as many new lanes): the batch is
        searched, on this failure's path only.
        """
        items = self.items
        names = {lane.environment} if lane.environment is not None else {items[i]["environment"] for i in lane.indices}
        for index, item in enumerate(items):
            if isinstance(item, Mapping) and isinstance(name := item.get("environment"), str) and name in names:
                return index
        raise AssertionError("unreachable: a lane's items are the batch's")

    async def call(self, lane: Lane, chunk: Sequence[int]) -> list[float]:
        """The rewards of ``chunk`` from its lane's verifier; fewer if an item of another environment ends it."""
        v = lane.verifier
        items = self.items
        if len(chunk) > 1 or v.chunk_size(1) > 1:  # serial chunk mode: even a lone item is a chunk
            assert is_chunked(v)  # only they ask for chunks
            try:
                return await v.verify_chunk(Items(items, chunk))
            except MalformedItem as exc:
                index = chunk[exc.position]
                check_item(self.first + index, items[index])  # raises, naming the item,
                task_of(self.first + index, items[index])  # here or here
                raise AssertionError("unreachable: the chunk runner and task_of disagree") from exc
            except Failure as exc:
                # a position the verifier could not know names the chunk's first item (its reason says so)
                position = exc.position if exc.position is not None and 0 <= exc.position < len(chunk) else 0
                index = self._first_of(lane) if exc.of_environment else chunk[position]
                raise _failed(v, exc, self.first + index, items[index]) from exc.__cause__
            except Exception as exc:  # as for one item: which item it was is unknown, so the first
                raise _failed(v, exc, self.first + chunk[0], items[chunk[0]]) from exc
        index = chunk[0]
        item = items[index]
        if lane.environment is not None and (
            not isinstance(item, Mapping) or item.get("environment") != lane.environment
        ):
            return []  # not the guessed environment's: the rest of the batch is regrouped
        task, trajectory = task_of(self.first + index, item)
        calls = self.loop_calls
        calls.count += 1  # the loop has work of the engine's own: cheap chunks in threads give it turns
        try:
            return [await v.verify(task, trajectory)]
        except Failure as exc:
            if exc.of_environment:  # whichever of its calls failed first, the environment's first item is named
                index = self._first_of(lane)
                item = items[index]
            raise _failed(v, exc, self.first + index, item) from exc.__cause__
        except Exception as exc:
            raise _failed(v, exc, self.first + index, item) from exc
        finally:
            calls.count -= 1

    async def run(self) -> None:
        """``call(lane, chunk)`` over every index of every lane, each reward into ``rewards``; or the first error.

        A worker takes as many indices at a time as its verifier asks for (``chunk_size``): cheap sync
        plugins run a chunk per thread hop, everything else one item per call. A chunk holds one slot of
        each limit, as one call in flight; a rate-limited verifier is called one item at a time.

        A call that returns fewer rewards than its chunk has items met an item of another environment
        there: the rest of the chunk, and every index its lane has not taken, go to :meth:`regroup`,
        whose lanes start at once and are appended to ``lanes``.
        """
        failure: Exception | None = None
        results, lanes, in_flight, call = self.rewards, self.lanes, self.in_flight, self.call

        async def worker(lane: Lane, todo: _Todo) -> None:
            meter, book = lane.meter, ledger()  # this task's calls charge their accounts through it
            chunk_size = _one if meter.rate is not None else lane.verifier.chunk_size
            while chunk := todo.take(chunk_size(todo.share(lane.width))):
                # A call's items waited from the lane's start: behind its own limit (a lane has only
                # as many workers as its max_concurrency, so they wait in the to-do list), the other
                # limits, and earlier calls; one wait per call, as busy is one span per call.
                async with meter.slots:
                    if meter.rate is not None:
                        await meter.rate.acquire()
                    async with in_flight:
                        started = perf_counter()
                        lane.first_start, inside = min(lane.first_start, started), _Call(lane)
                        inside.started()
                        book.account = inside  # the verifier's own limits (a judge's) are waiting too
                        try:
                            rewards = await call(lane, chunk)
                        finally:
                            book.account = None
                            lane.running -= 1
                        lane.last_end = ended = perf_counter()
                        seconds = ended - started - inside.waited - inside.startup
                        lane.waited += started - lane.ready + inside.waited
                        lane.busy += seconds
                        if inside.startup:  # it started the verifier up (an import, a worker): not its latency
                            lane.startup.append(inside.startup)
                        if rewards:
                            lane.latencies.append(seconds / len(rewards))
                            lane.latency_items.append(len(rewards))
                if len(rewards) < len(chunk):  # an item of another environment: give back the rest
                    left = [*chunk[len(rewards) :], *todo.rest()]
                    lane.given_back += left
                    chunk = chunk[: len(rewards)]
                    for more in await self.regroup(left):
                        lanes.append(more)
                        start(more)
                _put(results, chunk, rewards)
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
            chunk = 1 if lane.meter.rate is not None else lane.verifier.chunk_size(todo.share(lane.width))
            chunks = -(-len(lane.indices) // chunk)
            lane.ready = perf_counter()
            for _ in range(min(lane.width, chunks, in_flight.max_value or 1)):  # no more workers than work
                tg.start_soon(guarded, lane, todo)

        async with anyio.create_task_group() as tg:
            for lane in list(lanes):
                start(lane)
        if failure is not None:
            logger.error("batch aborted: %s", failure)
            raise failure

    def result(self, elapsed: float) -> BatchResult:
        """The batch's result: one report per verifier, whose items may have run in several lanes."""
        by_verifier: dict[Verifier, list[Lane]] = {}
        for lane in self.lanes:
            if lane.given_back:  # a guess that was wrong: the items it scored are the others
                given_back = set(lane.given_back)
                lane.indices = [index for index in lane.indices if index not in given_back]
            by_verifier.setdefault(lane.verifier, []).append(lane)
        verifier_of = [0] * len(self.rewards)
        reports = []
        usage: Counter[str] = Counter()
        for position, (v, its) in enumerate(by_verifier.items()):
            spent = dict(v.spent())  # a rubric's verifier is this batch's: so is what it spent
            usage.update(spent)
            if position:
                for lane in its:
                    _put(verifier_of, lane.indices, [position] * len(lane.indices))
            reports.append(
                VerifierReport(
                    kind=v.kind,
                    ref=v.ref,
                    key=v.key,
                    provenance=v.provenance(),
                    items=sum(len(lane.indices) for lane in its),
                    reward_sum=total([lane.reward_sum for lane in its]),
                    latencies=list(chain.from_iterable(lane.latencies for lane in its)),  # one a call: joined in C
                    latency_items=list(chain.from_iterable(lane.latency_items for lane in its)),
                    waited=sum(lane.waited for lane in its),
                    busy=sum(lane.busy for lane in its),
                    peak_in_flight=max(lane.peak for lane in its),
                    retries=v.retries - self.retries_before[v],
                    active=max(0.0, max(lane.last_end for lane in its) - min(lane.first_start for lane in its)),
                    startup=[seconds for lane in its for seconds in lane.startup],
                    spent=spent,
                )
            )
        return BatchResult(self.rewards, reports, elapsed, verifier_of=verifier_of, usage=dict(usage))


async def score_batch(
    items: Iterable[Mapping[str, Any]], resolve: Resolve, in_flight: anyio.Semaphore, *, first_index: int = 0
) -> BatchResult:
    """Score a batch: its rewards in input order, with a report per verifier; or the first error.

    ``resolve`` names each environment's verifier and meter; ``in_flight`` is the engine-wide cap
    on calls in flight. A list is scored as it is (copying a large batch costs a cheap plugin ~5%
    of its speed): it must not change while it is being scored. Errors name item ``i`` as item
    ``first_index + i``: a stream scored a chunk at a time names its items' places in the stream.
    """
    batch = _Batch(items if type(items) is list else list(items), resolve, in_flight, first_index)
    try:
        await batch.plan()
    except VerificationError as exc:
        logger.error("batch aborted: %s", exc)
        raise
    started = perf_counter()
    await batch.run()
    return batch.result(perf_counter() - started)
