"""The scheduler: plan a batch's lanes, fan them out under their meters, stop at the first error, report.

A lane is one verifier's share of a batch, run by as many workers as it may have calls in flight,
each taking a chunk of items at a time: docs/design.md, The scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import eq, itemgetter
from time import perf_counter
from typing import Any

import anyio
import anyio.lowlevel

from engine._core.book import Book, Call, total
from engine._core.contract import (
    Chunker,
    Items,
    MalformedItem,
    SiftingVerifier,
    Verifier,
    check_item,
    item_label,
    task_of,
)
from engine._core.meters import Meter, ledger, loop_calls
from engine._core.report import BatchResult, VerifierReport, add_amounts
from engine._errors import BudgetError, ConfigError, Failure, Overspent, VerificationError
from engine._reasons import describe, is_timeout

__all__ = ["Completions", "Resolve", "aborts_unlogged", "completions", "log_abort", "score_batch", "total"]

logger = logging.getLogger("engine")
_LOG_ABORTS = ContextVar("engine_log_aborts", default=True)  # aborts_unlogged() sets it False

GROUP_SLICE = 1 << 14  # items grouped between two yields to the event loop (~2 ms of work)
_FEW = 8  # environments in a slice picked out one pass each; more are grouped item by item
_ENVIRONMENT = itemgetter("environment")

Resolve = Callable[[str], tuple[Verifier, Meter]]
"""An environment's name -> its verifier and meter: ``ValueError`` if there is no such environment,
``ConfigError`` if its manifest is bad, ``VerificationError`` if it cannot score (the scheduler names the item)."""


def log_abort(exc: BaseException) -> None:
    """The one ERROR line of a failed batch, on the ``engine`` logger: ``batch aborted: <the error>``."""
    logger.error("batch aborted: %s", exc)


@contextlib.contextmanager
def aborts_unlogged() -> Iterator[None]:
    """Batches scored in this context (this task, and what it awaits) log no ``batch aborted`` line.

    For a caller whose batch's failure is not the failure its user sees: the service's gathered batch
    (the failing request's own error is logged, by :func:`log_abort`, once), an environment check's example.
    """
    token = _LOG_ABORTS.set(False)
    try:
        yield
    finally:
        _LOG_ABORTS.reset(token)


class Completions:
    """The items of the batches a task scores under :func:`completions` whose calls have returned, told to
    ``tell`` as calls return: at most once every ``every`` seconds, and never later than that after a call
    returned (a backfill's progress inside a batch: a stall after a burst still shows the burst)."""

    __slots__ = ("_due", "_every", "_later", "items", "tell")

    def __init__(self, tell: Callable[[int], None], every: float) -> None:
        self.items = 0
        self.tell = tell
        self._every = every
        self._due = 0.0  # when telling is allowed again (perf_counter): the first call to return is told at once
        self._later: asyncio.TimerHandle | None = None  # a tell put off until then

    def add(self, items: int) -> None:
        """A call returned the rewards of ``items`` items (once a call: a chunk's are added at once)."""
        self.items += items
        if self._later is not None:  # a tell is due already: it will say these too
            return
        now = perf_counter()
        if now >= self._due:
            self._told(now)
        else:
            self._later = asyncio.get_running_loop().call_later(self._due - now, self._told_later)

    def _told(self, now: float) -> None:
        self._due = now + self._every
        self.tell(self.items)

    def _told_later(self) -> None:
        self._later = None
        self._told(perf_counter())

    def close(self) -> None:
        """Tell nothing more (the batches are over: their caller says what follows)."""
        if self._later is not None:
            self._later.cancel()
            self._later = None


# Set by the caller around Engine.run, read once per batch: a public argument would be one more for every
# caller of Engine.run, and a callback per item would cost a cheap plugin's items a call each.
_COMPLETIONS: ContextVar[Completions | None] = ContextVar("engine_completions", default=None)


@contextlib.contextmanager
def completions(tell: Callable[[int], None], every: float) -> Iterator[Completions]:
    """Count the items of every batch the current task scores in the block (:class:`Completions`)."""
    counter = Completions(tell, every)
    token = _COMPLETIONS.set(counter)
    try:
        yield counter
    finally:
        _COMPLETIONS.reset(token)
        counter.close()


@dataclass(eq=False)
class Lane:
    """One verifier's share of a batch: the positions of its items, who takes them, and its book."""

    verifier: Verifier
    meter: Meter
    width: int  # workers: as many as its verifier may have calls in flight
    chunker: Chunker | None  # what takes its items several to a call; None: one item a call
    indices: Sequence[int]  # a range when the lane is the whole batch
    environment: str | None = None  # set when the lane is a guess: items not of it are given back
    given_back: list[int] = field(default_factory=list)  # its indices it left to other lanes
    book: Book = field(default_factory=Book)
    # items served without a call of their own (a rubric's: from the cache, or copies of an identical item's)
    served: list[int] = field(default_factory=list)
    served_sum: float = 0.0
    hits: int = 0
    deduped: int = 0

    def chunk_size(self, share: int) -> int:
        """Items its next call takes (``share``: its items left per worker); more than one go to its chunker."""
        return 1 if self.chunker is None else self.chunker.chunk_size(share)


def _failed(verifier: Verifier, exc: Exception, index: int, item: Mapping[str, Any]) -> VerificationError:
    """The one ``VerificationError`` for ``exc``, raised by ``verifier`` on item ``index``: named here, once.

    A verifier raises :class:`Failure` (its reason in words) or anything else (described by
    ``engine._reasons``); it never knows where its item sits in the batch, and the scheduler does.
    """
    # a judge's spent budget is its own type, keyed on by callers (its fields say whose, and how much)
    error = (BudgetError if isinstance(exc, Overspent) else VerificationError)(
        verifier.kind,
        verifier.ref,
        describe(exc),  # a Failure's own reason
        **(exc.fields() if isinstance(exc, Overspent) else {}),
        key=verifier.key,
        environment=item["environment"],
        index=index,
        item_id=item.get("id"),
        timed_out=is_timeout(exc),
        cannot_load=isinstance(exc, Failure) and exc.of_environment,
        plugin_frames=exc.frames if isinstance(exc, Failure) else (),
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

    It yields to the event loop every ``GROUP_SLICE`` items. A slice's few environments are picked
    out in C, one pass each; a slice of many is grouped item by item.
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


class _Cursor:
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
        self.completions = _COMPLETIONS.get()
        self.cached: dict[int, float] = {}  # index of an item served from the cache -> its verdict's call time
        self.copies: list[tuple[Lane, list[int], list[int]]] = []  # per lane, items sharing an earlier item's reward
        self.sifting: list[SiftingVerifier] = []  # verifiers told when the batch is over

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
                # a rate spaces its calls one item each: then even a verifier that takes chunks is given none
                chunker = verifier.chunker if meter.rate is None else None
                lanes[verifier] = Lane(verifier, meter, meter.width, chunker, indices, name if guess else None)
                self.retries_before.setdefault(verifier, verifier.retries)
            else:  # two environments with one verifier (the same endpoint URL): one lane, one limit
                lane.indices = sorted([*lane.indices, *indices])
        return list(lanes.values())

    async def plan(self) -> None:
        """The batch's first lanes: one guessed lane if it looks like one environment's whose verifier takes
        chunks (a plugin's: a pass to group it would cost a tenth of its work), else lanes grouped first."""
        items = self.items
        guess = _guess(items, self.first)
        if guess is not None and self._resolved(0)[0].chunker is not None:
            self.lanes = self._lanes({guess: range(len(items))}, guess=True)
        else:
            self.lanes = await self._sift(self._lanes(await _group(items, range(len(items)), self.first)))

    async def regroup(self, left: list[int]) -> list[Lane]:
        """Lanes for items a guessed lane gave back (the batch was not all one environment's)."""
        return await self._sift(self._lanes(await _group(self.items, left, self.first)))

    async def _sift(self, lanes: list[Lane]) -> list[Lane]:
        """``lanes``, each of a sifting verifier (a rubric's) left with the items it must call: the cache's hits
        are put in place now, and items identical to an earlier one take its reward once the batch is scored."""
        for lane in lanes:
            verifier = lane.verifier
            if not isinstance(verifier, SiftingVerifier):
                continue
            try:
                sifted = await verifier.sift(self.items, lane.indices, self.first)
            except Failure as exc:
                index = lane.indices[exc.position or 0]
                raise _failed(verifier, exc, self.first + index, self.items[index]) from exc.__cause__
            if sifted is None:
                continue
            if verifier not in self.sifting:
                self.sifting.append(verifier)
            lane.indices = sifted.call
            if sifted.hits:
                _put(self.rewards, sifted.hits, sifted.hit_rewards)
                self.cached.update(zip(sifted.hits, sifted.hit_times, strict=True))
                lane.served += sifted.hits
                lane.served_sum += total(sifted.hit_rewards)
                lane.hits += len(sifted.hits)
                if self.completions is not None:
                    self.completions.add(len(sifted.hits))
            if sifted.copies:
                self.copies.append((lane, sifted.copies, sifted.originals))
        return lanes

    def _copy(self) -> None:
        """Each copy's reward from its original's, now that every call has returned."""
        rewards = self.rewards
        for lane, copies, originals in self.copies:
            values = list(map(rewards.__getitem__, originals))
            _put(rewards, copies, values)
            lane.served += copies
            lane.served_sum += total(values)
            lane.deduped += len(copies)
            if self.completions is not None:
                self.completions.add(len(copies))

    def _first_of(self, lane: Lane) -> int:
        """The position of the batch's first item of ``lane``'s environment(s), in input order: what an
        environment's failure (``Failure.of_environment``) names, whichever of its racing calls failed first.

        A lane may not hold its environment's first item (a guessed lane gives back the items of
        another environment a chunk at a time, to as many new lanes): the batch is searched, on
        this failure's path only.
        """
        items = self.items
        names = {lane.environment} if lane.environment is not None else {items[i]["environment"] for i in lane.indices}
        for index, item in enumerate(items):
            if isinstance(item, Mapping) and isinstance(name := item.get("environment"), str) and name in names:
                return index
        raise AssertionError("unreachable: a lane's items are the batch's")

    async def call_chunk(self, lane: Lane, chunk: Sequence[int]) -> list[float]:
        """The rewards of ``chunk`` from its lane's chunker; fewer if an item of another environment ends it."""
        chunker = lane.chunker
        assert chunker is not None  # a chunk of more than one item is asked for by a chunker only
        items = self.items
        try:
            return await chunker.verify_chunk(Items(items, chunk))
        except MalformedItem as exc:
            index = chunk[exc.position]
            check_item(self.first + index, items[index])  # raises, naming the item,
            task_of(self.first + index, items[index])  # here or here
            raise AssertionError("unreachable: the chunk runner and task_of disagree") from exc
        except Failure as exc:
            # a position the verifier could not know names the chunk's first item (its reason says so)
            position = exc.position if exc.position is not None and 0 <= exc.position < len(chunk) else 0
            index = self._first_of(lane) if exc.of_environment else chunk[position]
            raise _failed(lane.verifier, exc, self.first + index, items[index]) from exc.__cause__
        except Exception as exc:  # as for one item: which item it was is unknown, so the first
            raise _failed(lane.verifier, exc, self.first + chunk[0], items[chunk[0]]) from exc

    async def call_one(self, lane: Lane, chunk: Sequence[int]) -> list[float]:
        """The reward of ``chunk``'s one item from its lane's verifier; none if it is of another environment."""
        index = chunk[0]
        item = self.items[index]
        if lane.environment is not None and (
            not isinstance(item, Mapping) or item.get("environment") != lane.environment
        ):
            return []  # not the guessed environment's: the rest of the batch is regrouped
        task, trajectory = task_of(self.first + index, item)
        calls = self.loop_calls
        calls.count += 1  # the loop has work of the engine's own: cheap chunks in threads give it turns
        try:
            return [await lane.verifier.verify(task, trajectory)]
        except Failure as exc:
            if exc.of_environment:  # whichever of its calls failed first, the environment's first item is named
                index = self._first_of(lane)
                item = self.items[index]
            raise _failed(lane.verifier, exc, self.first + index, item) from exc.__cause__
        except Exception as exc:
            raise _failed(lane.verifier, exc, self.first + index, item) from exc
        finally:
            calls.count -= 1

    async def run(self) -> None:
        """Every index of every lane called, a chunk at a time, each reward into ``rewards``; or the first error.

        A call that returns fewer rewards than its chunk has items met an item of another environment
        there: the rest of the chunk, and every index its lane has not taken, go to :meth:`regroup`,
        whose lanes start at once and are appended to ``lanes``.
        """
        failure: Exception | None = None
        results, lanes, in_flight, completions = self.rewards, self.lanes, self.in_flight, self.completions
        call_one, call_chunk = self.call_one, self.call_chunk

        async def worker(lane: Lane, cursor: _Cursor) -> None:
            meter, book, width, charges = lane.meter, lane.book, lane.width, ledger()
            while chunk := cursor.take(size := lane.chunk_size(cursor.share(width))):
                async with meter.slots:
                    if meter.rate is not None:
                        await meter.rate.acquire()
                    async with in_flight:
                        charges.account = call = Call(book)  # the verifier's own limits (a judge's) are its waiting too
                        try:
                            rewards = await (call_chunk(lane, chunk) if size > 1 else call_one(lane, chunk))
                        finally:
                            charges.account = None
                            call.end()
                        book.add(call, rewards)
                if len(rewards) < len(chunk):  # an item of another environment: give back the rest
                    left = [*chunk[len(rewards) :], *cursor.rest()]
                    lane.given_back += left
                    chunk = chunk[: len(rewards)]
                    for more in await self.regroup(left):
                        lanes.append(more)
                        start(more)
                _put(results, chunk, rewards)
                if completions is not None:
                    completions.add(len(rewards))

        async def guarded(lane: Lane, cursor: _Cursor) -> None:
            nonlocal failure
            try:
                await worker(lane, cursor)
            except Exception as exc:
                if failure is None:
                    failure = exc
                tg.cancel_scope.cancel()

        def start(lane: Lane) -> None:
            cursor = _Cursor(lane.indices)
            chunks = -(-len(lane.indices) // lane.chunk_size(cursor.share(lane.width)))
            lane.book.open()
            for _ in range(min(lane.width, chunks, in_flight.max_value or 1)):  # no more workers than work
                tg.start_soon(guarded, lane, cursor)

        try:
            async with anyio.create_task_group() as tg:
                for lane in list(lanes):
                    start(lane)
        finally:
            for verifier in self.sifting:  # scored or aborted: what its calls returned is kept
                verifier.finish()
        if failure is None:
            self._copy()
        else:
            if _LOG_ABORTS.get():
                log_abort(failure)
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
        usage: dict[str, float] = {}
        for position, (v, its) in enumerate(by_verifier.items()):
            spent = dict(v.spent())  # a rubric's verifier is this batch's: so is what it spent
            add_amounts(usage, spent)
            if position:
                for lane in its:
                    _put(verifier_of, lane.indices, [position] * len(lane.indices))
                    _put(verifier_of, lane.served, [position] * len(lane.served))
            books = [lane.book for lane in its]
            reports.append(
                VerifierReport(
                    kind=v.kind,
                    ref=v.ref,
                    key=v.key,
                    provenance=v.provenance(),
                    items=sum(len(lane.indices) + len(lane.served) for lane in its),
                    reward_sum=total([book.reward_sum for book in books] + [lane.served_sum for lane in its]),
                    latencies=list(chain.from_iterable(book.latencies for book in books)),  # one a call: joined in C
                    latency_items=list(chain.from_iterable(book.latency_items for book in books)),
                    waited=sum(book.waited for book in books),
                    busy=sum(book.busy for book in books),
                    peak_in_flight=max(book.peak for book in books),
                    retries=v.retries - self.retries_before[v],
                    active=max(0.0, max(book.last_end for book in books) - min(book.first_start for book in books)),
                    startup=[seconds for book in books for seconds in book.startup],
                    spent=spent,
                    cache_hits=sum(lane.hits for lane in its),
                    # and those another batch's call in flight answered (a sifting verifier is this batch's)
                    deduped=sum(lane.deduped for lane in its) + sum(s.shared for s in self.sifting if s is v),
                    window=None if (window := its[0].meter.window) is None else window.shown,
                )
            )
        return BatchResult(self.rewards, reports, elapsed, verifier_of=verifier_of, usage=dict(usage),
                           cached=self.cached)


async def score_batch(
    items: Iterable[Mapping[str, Any]], resolve: Resolve, in_flight: anyio.Semaphore, *, first_index: int = 0
) -> BatchResult:
    """Score a batch: its rewards in input order, with a report per verifier; or the first error.

    Args:
        items: the batch, scored as it is if it is a list (it must not change meanwhile), else listed once.
        resolve: each environment's verifier and meter.
        in_flight: the engine-wide cap on calls in flight.
        first_index: the place of the batch's first item in the caller's stream, which errors name items by.

    Returns:
        The rewards in input order, with one report per verifier.

    Raises:
        VerificationError: the first call that failed, naming its verifier and item; the rest were cancelled.
        ValueError: an item is malformed, or of no environment (``TypeError`` too, for an item of the wrong type).
        ConfigError: an environment's manifest is bad.
    """
    batch = _Batch(items if type(items) is list else list(items), resolve, in_flight, first_index)
    try:
        await batch.plan()
    except VerificationError as exc:
        if _LOG_ABORTS.get():
            log_abort(exc)
        raise
    started = perf_counter()
    await batch.run()
    return batch.result(perf_counter() - started)
