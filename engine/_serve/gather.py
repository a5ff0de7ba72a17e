"""``engine serve``'s gathering: small plugin-only requests from many clients scored as one engine batch, each
request still getting exactly what it would get alone (what is gathered and why: docs/design.md, "Gathering")."""

from __future__ import annotations

import asyncio
import bisect
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine._core.batcher import Batcher
from engine._core.report import BatchResult, VerifierReport
from engine._core.scheduler import aborts_unlogged, log_abort, total
from engine._errors import VerificationError
from engine._serve.limits import GATHER_CALL, GATHER_ITEMS, MAX_GATHERED

__all__ = ["GATHER_WINDOW", "SLOW", "WATCH_AFTER", "Gatherer", "Gone", "Scorer", "hung_up"]

SLOW = 1.0  # seconds an item is taken to cost after its verifier timed out (halved by each batch measured after)
GATHER_WINDOW = 0.002  # seconds the first request of a gathered batch waits for more, at most
WATCH_AFTER = 0.05  # seconds a gathered batch runs before its clients are watched for a hang-up

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]


class Scorer(Protocol):
    """What the service scores with: an open ``Engine``."""

    async def run(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> BatchResult: ...

    def environment(self, name: str) -> Any: ...


_UNKNOWN: Any = object()  # an environment not looked up yet


class Gone(Exception):
    """The client hung up before its answer: nothing is sent."""


async def hung_up(receive: Receive) -> bool:
    """Whether the client hung up (its body was read already: ``receive`` waits for the hang-up)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    return True


@dataclass(eq=False)
class _Request:
    """One request's items waiting in (or scored by) a gathered batch."""

    items: list[Any]
    first_index: int
    receive: Receive
    future: asyncio.Future[BatchResult]
    start: int = 0  # its first item's place in the gathered batch


@dataclass(eq=False)
class _Batch:
    requests: list[_Request]
    waiting: int  # requests still waiting for their answer
    task: asyncio.Task[None] | None = None
    watchers: list[asyncio.Task[bool]] = field(default_factory=list)
    done: bool = False  # its engine call ended
    scoring: bool = True  # counted in the window's running batches


class Gatherer:
    """Gathers small plugin-only requests on one event loop into engine batches.

    ``scored`` and ``failed`` are told of each engine batch's result or failure (the service's metrics).
    The service's batches that are not gathered go through :meth:`scored` and :meth:`failed` too: every
    batch counted once, and every plugin's batch measured (whether its requests may be gathered).
    """

    def __init__(
        self,
        engine: Scorer,
        scored: Callable[[BatchResult], None],
        failed: Callable[[VerificationError], None],
        *,
        most: int = GATHER_ITEMS,
    ) -> None:
        self.engine = engine
        self._most = most  # items a request may have to be gathered (0: none is)
        self._scored = scored
        self._failed = failed
        self._keys: dict[str, str | None] = {}  # environment name -> its plugin's verifier key (None: no plugin)
        self._costs: dict[str, float] = {}  # verifier key -> seconds an item, recent batches' mean (decaying)
        # while a gathered batch is in the engine, what arrives waits for its end: batches grow with the load
        self._window = Batcher(self._start, window=GATHER_WINDOW, most=MAX_GATHERED, hold=True)
        self._running: set[asyncio.Task[None]] = set()
        self.batches = 0  # engine batches started for gathered requests (tests and benchmarks read it)
        self.gathered = 0  # requests those batches took

    def takes(self, items: list[Any], first_index: Any) -> bool:
        """Whether ``items`` may share a batch: few, each a mapping naming a plugin's environment (and a
        valid ``first_index``: one that is not is the engine's to refuse)."""
        if not 0 < len(items) <= self._most or type(first_index) is not int or first_index < 0:
            return False
        keys, costs = self._keys, self._costs
        for item in items:
            if type(item) is not dict:
                return False
            name = item.get("environment")
            if not isinstance(name, str):
                return False
            key = keys.get(name, _UNKNOWN)
            if key is _UNKNOWN:
                try:
                    environment = self.engine.environment(name)
                    key = keys[name] = environment.verifier_key if environment.verifier.kind == "plugin" else None
                except Exception:  # not an environment: scored alone, where the engine says why
                    return False
            if key is None or not costs.get(key, SLOW) <= GATHER_CALL:  # not measured yet: alone, first
                return False
        return True

    @property
    def costs(self) -> Mapping[str, float]:
        """Per plugin (its verifier key), the seconds an item took on its recent batches' mean."""
        return self._costs

    def scored(self, result: BatchResult, means: list[float] | None = None) -> None:
        """A batch was scored (gathered or not): told to ``scored`` (the metrics), and what its plugins took an
        item learnt (``means``: per report, when known already)."""
        self._scored(result)
        costs = self._costs
        for report, mean in zip(result.verifiers, means or _means(result), strict=True):
            if report.kind == "plugin" and report.items:
                old = costs.get(report.key)
                costs[report.key] = mean if old is None else (old + mean) / 2

    def failed(self, exc: VerificationError) -> None:
        """A batch failed on a request's item: told to ``failed`` (the metrics), and a timeout makes its plugin
        slow (until batches measure it again)."""
        self._failed(exc)
        self._slow_if_timed_out(exc)

    def _slow_if_timed_out(self, exc: VerificationError) -> None:
        if exc.kind == "plugin" and exc.timed_out:
            self._costs[exc.key] = SLOW

    async def run(self, items: list[Any], first_index: int, receive: Receive) -> BatchResult:
        """``items``' result, scored in a gathered batch; ``Gone`` if the client hung up meanwhile."""
        request = _Request(items, first_index, receive, asyncio.get_running_loop().create_future())
        self._window.add(request, len(items))
        return await request.future

    def _start(self, requests: list[_Request]) -> None:
        """The window sends ``requests``: one engine batch, scored in a task of its own."""
        batch = _Batch(requests, len(requests))
        batch.task = task = asyncio.get_running_loop().create_task(self._score(batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        task.add_done_callback(lambda _: self._ended(batch))
        for request in requests:
            request.future.add_done_callback(lambda _, batch=batch: self._answered(batch))  # type: ignore[misc]
        self.batches += 1
        self.gathered += len(requests)

    def _ended(self, batch: _Batch) -> None:
        """A gathered batch's task ended: whoever still waits is gone. Its own ``finally`` says so too, but a task
        cancelled before its first step (by ``aclose``) never runs it, and its requests would wait forever."""
        for request in batch.requests:
            if not request.future.done():
                request.future.set_exception(Gone())
        self._scored_batch(batch)

    def _scored_batch(self, batch: _Batch) -> None:
        """A gathered batch's engine call ended (or its task ended before it began): the requests held for
        it go now."""
        if not batch.scoring:
            return
        batch.scoring = False
        self._window.ended()

    def _answered(self, batch: _Batch) -> None:
        """A request of ``batch`` has its answer: if it came before the batch's end, that request is gone."""
        if batch.done:
            return
        batch.waiting -= 1
        if batch.waiting == 0 and batch.task is not None:
            batch.task.cancel()  # nobody reads its answer

    def _watch(self, batch: _Batch) -> None:
        """The batch has run a while: watch its clients for a hang-up."""
        for request in batch.requests:
            if not request.future.done():
                watcher = asyncio.ensure_future(hung_up(request.receive))
                watcher.add_done_callback(lambda done, request=request: _hang_up(request, done))  # type: ignore[misc]
                batch.watchers.append(watcher)

    async def _score(self, batch: _Batch) -> None:
        timer = asyncio.get_running_loop().call_later(WATCH_AFTER, self._watch, batch)
        try:
            await self._answer(batch)
        except Exception as exc:  # a bug: every request still waiting is answered it (a 500), never a reward
            for request in batch.requests:
                if not request.future.done():
                    request.future.set_exception(exc)
        finally:  # cancelled (every client gone, or the service closing): whoever still waits is gone
            timer.cancel()
            for watcher in batch.watchers:
                watcher.cancel()
            for request in batch.requests:
                if not request.future.done():
                    request.future.set_exception(Gone())

    async def _answer(self, batch: _Batch) -> None:
        requests = batch.requests
        items: list[Any] = []
        for request in requests:
            request.start = len(items)
            items += request.items
        try:
            try:
                # its failure is logged as the request that gets it (_split_failure), or as each scored alone: once
                with aborts_unlogged():
                    result = await self.engine.run(items)
            finally:
                batch.done = True  # from here a request that goes away cancels only its own work
                self._scored_batch(batch)
        except VerificationError as exc:
            await self._split_failure(requests, exc)
            return
        except (ValueError, TypeError):
            await self._alone(requests)  # each request's own error, or its own result
            return
        if len(result.rewards) != len(items):  # never pair rewards with the wrong requests
            raise RuntimeError(f"the engine returned {len(result.rewards)} rewards for {len(items)} items")
        parts = _Parts(result)
        self.scored(result, parts.mean)
        waiting = [request for request in requests if not request.future.done()]
        for request in waiting:  # the first still waiting carries the batch's retries, start-up and spending
            request.future.set_result(parts.of(request.start, len(request.items), request is waiting[0]))

    async def _split_failure(self, requests: list[_Request], exc: VerificationError) -> None:
        """The failing item's request gets the error, in its own terms; the others are scored alone. The
        metrics count the error once, as the request that gets it (one scored alone counts its own)."""
        starts = [request.start for request in requests]
        place = exc.index
        if place is None or exc.environment is None or not 0 <= place < starts[-1] + len(requests[-1].items):
            await self._alone(requests)  # the error names no item of the batch: each request learns its own
            return
        if exc.timed_out:  # its time was not its item's alone: a chunk of cheap calls holds others' items too
            self._slow_if_timed_out(exc)  # uncounted (no request fails), but its plugin is gathered no more
            await self._alone(requests)
            return
        owner = requests[bisect.bisect_right(starts, place) - 1]
        self.failed(exc)
        own = exc.at_item(exc.environment, owner.first_index + place - owner.start, exc.item_id)
        own.__cause__ = exc.__cause__
        log_abort(own)  # the line its batch alone would have logged: its own item's index
        if not owner.future.done():
            owner.future.set_exception(own)
        await self._alone([request for request in requests if request is not owner])

    async def _alone(self, requests: list[_Request]) -> None:
        """Each request scored as a batch of its own, as if it had never been gathered."""
        if requests:
            await asyncio.gather(*(self._one(request) for request in requests))

    async def _one(self, request: _Request) -> None:
        if request.future.done():
            return  # gone meanwhile
        task = asyncio.ensure_future(self.engine.run(request.items, first_index=request.first_index))
        request.future.add_done_callback(lambda _: task.cancel())  # gone: its work stops (once done, a no-op)
        try:
            result = await task
        except VerificationError as exc:
            self.failed(exc)
            if not request.future.done():
                request.future.set_exception(exc)
            return
        except asyncio.CancelledError:
            if request.future.done():
                return  # its request went away
            raise
        except (ValueError, TypeError) as exc:
            if not request.future.done():
                request.future.set_exception(exc)
            return
        self.scored(result)
        if not request.future.done():
            request.future.set_result(result)

    async def aclose(self) -> None:
        """Cancel the batches under way (the server has answered or cancelled every request), and close the
        window: a request still in it is ``Gone``, and no batch starts after this (the engine closes next)."""
        for request in self._window.close():  # the pass of the loop under way, if any, sends nothing
            if not request.future.done():
                request.future.set_exception(Gone())
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.wait(list(self._running))


def _hang_up(request: _Request, watcher: asyncio.Task[bool]) -> None:
    if not watcher.cancelled() and watcher.exception() is None and not request.future.done():
        request.future.set_exception(Gone())


class _Parts:
    """A gathered batch's result cut into each request's own."""

    def __init__(self, result: BatchResult) -> None:
        self.result = result
        # per verifier, the mean seconds an item took: a request's items were in one of its calls (often its
        # only one: a gathered batch of a cheap plugin is one chunk), so their latency is not told apart
        self.mean = _means(result)

    def of(self, start: int, count: int, first: bool) -> BatchResult:
        """The result of the items at ``start`` .. ``start + count``; ``first``: the batch's first request still
        waiting, which carries what cannot be shared out (retries, startup, what the calls spent, the judge's usage)."""
        result = self.result
        rewards = result.rewards[start:start + count]
        usage = result.usage if first else {}
        # its items served from the verdict cache (none, at no cost, in a batch without hits)
        cached = {i - start: when for i, when in result.cached.items() if start <= i < start + count} \
            if result.cached else {}
        # reward sums as the engine makes them (``total``: exact), so a request's are those a batch of its own has
        if len(result.verifiers) == 1:  # one verifier scored the batch (the usual gathered batch): no lookups
            report = _part(result.verifiers[0], self.mean[0], count, total(rewards), first, len(cached))
            return BatchResult(rewards, [report], result.elapsed, [0] * count, usage, cached=cached)
        mine: dict[int, int] = {}
        verifier_of = []
        theirs: list[list[float]] = []  # per verifier of the request, its rewards
        for reward, which in zip(rewards, result.verifier_of[start:start + count], strict=True):
            local = mine.get(which)
            if local is None:
                local = mine[which] = len(mine)
                theirs.append([])
            theirs[local].append(reward)
            verifier_of.append(local)
        hits = Counter(verifier_of[i] for i in cached)
        reports = [
            _part(result.verifiers[which], self.mean[which], len(theirs[local]), total(theirs[local]), first,
                  hits[local])
            for which, local in mine.items()
        ]
        return BatchResult(rewards, reports, result.elapsed, verifier_of, usage, cached=cached)


def _means(result: BatchResult) -> list[float]:
    """Per report, the mean seconds an item took: its time in the verifier over its items (the same as its
    calls' latencies weighted by their items, read in one step, not a pass over a large batch's calls)."""
    return [report.busy / report.items if report.items else 0.0 for report in result.verifiers]


def _part(
    report: VerifierReport, mean: float, items: int, reward_sum: float, first: bool, hits: int
) -> VerifierReport:
    """A verifier's report for ``items`` of its batch's: those items' count and rewards, the batch's timing.

    ``latencies`` is the batch's mean seconds an item took, standing for these items; ``waited`` and
    ``busy`` this share of the batch's (so a request's figures add up to the batch's); ``active`` and
    ``peak_in_flight`` are the batch's; ``retries``, ``startup`` and ``spent`` go to the batch's first
    request still waiting alone, and so do its ``deduped`` items (an item's copies may be in other requests);
    ``hits`` are these items' served from the verdict cache.
    """
    share = items / report.items if report.items else 0.0
    return VerifierReport(
        report.kind,
        report.ref,
        report.key,
        report.provenance,
        items=items,
        reward_sum=reward_sum,
        latencies=[mean],
        latency_items=[items],
        waited=report.waited * share,
        busy=report.busy * share,
        peak_in_flight=report.peak_in_flight,
        retries=report.retries if first else 0,
        active=report.active,
        startup=report.startup if first else [],
        spent=report.spent if first else {},
        cache_hits=hits,
        deduped=report.deduped if first else 0,
        window=report.window,
    )
