"""The process executor: a plugin's chunks sent to worker processes of its own, sized per worker.

Workers start when first needed, each holds one chunk at a time, and a killed or dead one is
replaced when next needed. The design is in docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from engine._config import Limits
from engine._core import meters
from engine._core.contract import BadItem
from engine._core.threads import in_thread, wait_future
from engine._verifiers.plugin.executor import MAX_CHUNK, CallFailed, Cost, Executor
from engine._verifiers.plugin.wire import PluginSpec
from engine._verifiers.plugin.worker_client import CLOSE_GRACE, WorkerClient, how_it_ended

__all__ = ["ProcessExecutor", "WorkerPool"]

T = TypeVar("T")
PROCESS_CHUNK_SECONDS = 0.05  # work per round trip to a worker process
PROCESS_SPLIT = 4  # a process chunk is at most this fraction of what is left per worker: the end is split finer

logger = logging.getLogger("engine")


class ProcessExecutor(Executor):
    """Calls a plugin in up to ``workers`` worker processes, importing it from ``sources`` (the vetted snapshot)."""

    def __init__(self, spec: PluginSpec, sources: Mapping[str, bytes], limits: Limits, workers: int) -> None:
        self._environment = spec.environment
        self._limits = limits
        self._workers = workers
        self._pool = WorkerPool(spec, sources, workers, limits.timeout)
        self._chunk = 1  # items per call, adapted to the measured cost of a call
        self._costs = (0.0, 0.0)  # wall seconds and items of recent calls, each halved at every measurement

    def chunk_size(self, share: int) -> int:
        """Items per round trip: more than one once calls are measured (the first calls go one at a time).

        ``share`` is the lane's items left per task, rounded up, and a lane has ``max_concurrency``
        tasks. They take their chunks at once but only ``workers`` of them run at a time (the rest wait
        for a worker holding theirs): chunks are sized from what is surely left per *worker*, a
        ``PROCESS_SPLIT``th of it, so they shrink only near the end (and a batch of a few items still
        goes one item to each worker). Sized per task, as a thread lane's, the last third of a batch
        went in ever smaller chunks, ~650 round trips for 10,000 items of 1 ms, whose ~0.8 ms each of
        the engine's own CPU was taken from the workers' cores.
        """
        left = (share - 1) * self._limits.max_concurrency + 1  # at least this many: share was rounded up
        return max(1, min(self._chunk, left // self._workers // PROCESS_SPLIT))

    def _measured(self, cost: Cost, items: int) -> None:
        """Size the next chunks from what the calls just cost.

        A call's cost over the last chunks, weighted by their items: the few items a batch ends on (their
        wall time mostly a worker's wake-up) do not shrink the next batch's chunks 100-fold. Each worker
        has its own interpreter: chunks always run in parallel.
        """
        wall, _ = cost
        spent = self._costs
        self._costs = (spent[0] / 2 + wall, spent[1] / 2 + items)
        per_call = max(self._costs[0] / self._costs[1], 1e-9)
        budget = min(PROCESS_CHUNK_SECONDS, self._limits.timeout / 10)
        self._chunk = max(1, min(MAX_CHUNK, int(budget / per_call)))

    @property
    def worker_pids(self) -> list[int]:
        return self._pool.pids

    async def warm(self) -> None:
        await self._pool.warm()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):  # the engine may be closing because its task was cancelled
            await self._pool.aclose()

    async def call(self, task: Mapping[str, Any], trajectory: Any, deadline: float) -> float:
        item = {"environment": self._environment, "task": task, "trajectory": trajectory}
        return (await self.call_chunk([item]))[0]

    async def call_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The rewards of ``items`` (up to the first of another environment) from a worker process, in one
        round trip. The items are read, and their rewards made, in the worker's thread (``WorkerPool.call``):
        the event loop's part is the same for any number of them."""
        try:
            rewards, cost = await self._pool.call(items)
        except BadItem as exc:  # a task that cannot be read as a dict, or pickled
            raise CallFailed(exc.reason, exc.position) from exc.__cause__
        if rewards:
            self._measured(cost, len(rewards))
        return rewards


class WorkerPool:
    """Up to ``size`` worker processes of one plugin, started when first needed and replaced when lost.

    Each caller holds one worker for one chunk. ``call`` raises :class:`CallFailed` for every
    way a chunk can fail, with the failing item's position in the chunk.
    """

    def __init__(self, spec: PluginSpec, sources: Mapping[str, bytes], size: int, timeout: float) -> None:
        self.spec = spec
        self.sources = sources  # what every worker imports: the snapshot the engine vetted
        self.size = size
        self.timeout = timeout
        self._slots = meters.slots(size)  # a caller holding one has a worker, or room to start one
        self._idle: list[WorkerClient] = []
        self._workers: set[WorkerClient] = set()  # not yet closed
        self._numbers = itertools.count()
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """The process ids of its workers that are not closed yet (started or starting)."""
        return sorted(w.pid for w in self._workers if not w.closed and w.pid is not None)

    async def _in_thread(self, worker: WorkerClient, fn: Callable[[], T]) -> T:
        """``fn`` (a blocking method of ``worker``) in its thread; cancelling the caller kills the worker."""
        try:
            return await wait_future(worker.submit(fn))
        except BaseException as exc:
            if not isinstance(exc, Exception):  # cancelled: the call is abandoned, so is its worker
                worker.kill()
            raise

    async def _take(self) -> WorkerClient:
        """An idle worker, or a new one once it has imported the plugin (the caller holds a slot)."""
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        while self._idle:
            worker = self._idle.pop()
            if worker.alive():
                worker.busy = True
                return worker
            code = worker.close()
            logger.warning(
                "plugin %r of environment %r: %s; starting another",
                self.spec.ref,
                self.spec.environment,
                how_it_ended(worker.pid or 0, code, " while idle").removeprefix("its "),
            )
            self._workers.discard(worker)
        self._workers = {w for w in self._workers if not w.closed}
        worker = WorkerClient(self.spec, self.sources, next(self._numbers))
        worker.busy = True
        self._workers.add(worker)
        try:
            with meters.starting():  # its spawn until it has imported the plugin: start-up, not verifying
                await self._in_thread(worker, functools.partial(worker.start, self.timeout))
        except CallFailed as exc:  # it could not import the plugin: the environment's failure, not an item's
            exc.of_environment = True
            raise
        return worker

    def _give_back(self, worker: WorkerClient) -> None:
        # A killed worker stays busy until its thread has closed it: nobody else may touch its pipe.
        if worker.usable and not self._closed:
            worker.busy = False
            self._idle.append(worker)

    async def call(self, items: Sequence[Mapping[str, Any]]) -> tuple[list[float], Cost]:
        """The rewards of ``items`` (up to the first of another environment) and what the calls cost, from
        one worker in one round trip. The items are read in the worker's thread (``WorkerClient.call``): what the
        event loop does here is the same for one item as for a chunk of 100,000.

        Queued for a free worker is waiting (``meters.waiting``), as for any limit: not time in the plugin.
        """
        async with meters.held(self._slots):
            worker = await self._take()
            try:
                return await self._in_thread(worker, functools.partial(worker.call, items, self.timeout))
            finally:
                self._give_back(worker)

    async def warm(self) -> None:
        """Start a worker if none runs: the plugin imports (or the reason it does not is raised)."""
        async with self._slots:
            self._give_back(await self._take())

    async def aclose(self) -> None:
        """Stop every worker: idle ones exit when their pipe closes, busy ones are killed; all are reaped."""
        self._closed = True
        workers, self._workers, self._idle = list(self._workers), set(), []
        for worker in workers:
            if worker.busy:
                worker.kill()
            elif not worker.closed:
                worker.conn.close()  # no job uses it: the worker reads EOF and exits (all at once)

        def finish() -> None:
            for worker in workers:
                worker.thread.wait(CLOSE_GRACE)  # a killed worker's job ends as soon as it sees it die
                worker.close(grace=CLOSE_GRACE)
                worker.thread.join(CLOSE_GRACE)

        await wait_future(in_thread(finish, f"engine-worker-close-{self.spec.environment}"))
