"""The thread executor: a sync plugin's calls on the engine's daemon threads, a chunk of items a hop once measured.

Cheap and CPU-bound calls run in chunks one at a time on a kept thread (taking turns with the loop);
calls that wait run in chunks in parallel. The design is in docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from engine._config import Limits
from engine._core import meters
from engine._core.contract import BadItem, MalformedItem, ProcessHint
from engine._core.threads import ThreadPool, wait_future
from engine._verifiers.plugin.executor import MAX_CHUNK, CallFailed, Cost, Executor, must_pass, own_pair
from engine._verifiers.plugin.importer import safely_described
from engine._verifiers.plugin.launcher import default_workers
from engine._verifiers.plugin.thread_calls import Abandoned, Interrupted, run_chunk, run_chunk_unqueued, timed
from engine._verifiers.plugin.turns import Turns

__all__ = ["ThreadExecutor"]

T = TypeVar("T")
CHEAP_CALL = 100e-6  # seconds: calls cheaper than this run in chunks one at a time, on one thread
SERIAL_CHUNK_SECONDS = 0.25  # work per hop for cheap calls: the hop and the chunk's setup cost ~1%
STEP_SECONDS = 0.001  # a chunk's thread checks this often that its caller still waits, and takes turns with the loop
TURN_SHARE = 0.25  # of the timeout, the most a serial chunk waits in all for turns with the loop
PARALLEL_CHUNK_SECONDS = 0.3  # for waiting calls, run in parallel; a lane's last chunks are split finer
CPU_BOUND = 0.5  # a call whose thread is on a CPU more than this share of its time is CPU-bound
# The process hint: warm calls, one at a time in one thread (as a CPU-bound plugin's run under the GIL), are
# timed until they sum to this: ~50 calls of a 5 ms plugin, ~2,800 of a 90 us one (the cheapest that can gain on
# 2 cores), a mean that one cold call does not move much.
HINT_SECONDS = 0.25
# What the process executor adds to an item in the engine's own process, which is one core: bench_cores measured
# 5-23 us of its CPU an item (benchmarks/README.md, target 4), 17-33 us on a loaded 2-core machine, and a ~7 us
# plugin fell from 148k to 92k items/s in processes on 2 cores (~15 us an item more). Near the highest.
PROCESS_ITEM_COST = 30e-6
PROCESS_HINT_GAIN = 1.5  # the least gain in items/s worth a hint: following one changes the plugin's isolation


def process_gain(call_seconds: float, cores: int) -> float:
    """The items/s worker processes would give a CPU-bound plugin, as a multiple of one thread's.

    Args:
        call_seconds: A call's wall time, calls run one at a time in one thread (one thread's items/s is its inverse).
        cores: The cores worker processes would use, one worker each.

    Returns:
        ``cores`` workers each make a call at a time, and every item costs the engine's process
        ``PROCESS_ITEM_COST`` more, on the same cores; that process is one core, so it bounds the items/s too.
    """
    return min(cores * call_seconds / (call_seconds + PROCESS_ITEM_COST), call_seconds / PROCESS_ITEM_COST)


def hint_from(wall: float, cpu: float, calls: int, cores: int) -> ProcessHint | None:
    """The process hint that ``calls`` warm calls, one at a time, taking ``wall`` and ``cpu`` seconds in all, give.

    Args:
        wall: Their wall time, summed, less what they waited for a CPU (runnable, on a loaded machine).
        cpu: Their thread's CPU time, summed.
        calls: How many were measured.
        cores: The cores worker processes would use.

    Returns:
        A hint if they are CPU-bound (on a CPU more than ``CPU_BOUND`` of their time) and processes would
        give at least ``PROCESS_HINT_GAIN`` times one thread's items/s (:func:`process_gain`); else None.
    """
    if calls < 1 or wall <= 0 or cpu <= CPU_BOUND * wall:
        return None
    gain = process_gain(wall / calls, cores)
    return ProcessHint(wall / calls, cpu / wall, cores, calls, gain) if gain >= PROCESS_HINT_GAIN else None


def _plugins(exc: BaseException) -> BaseException:
    """What the plugin raised: a ``KeyboardInterrupt`` a thread carried as :class:`Interrupted` is itself."""
    return exc.raised if isinstance(exc, Interrupted) else exc


class ThreadExecutor(Executor):
    """Calls ``fn`` of environment ``environment`` in threads, at most ``limiter``'s at once (serial chunks aside)."""

    def __init__(
        self, fn: Callable[..., Any], environment: str, limits: Limits, limiter: anyio.CapacityLimiter
    ) -> None:
        self._fn = fn
        self._environment = environment
        self._limits = limits
        self._limiter = limiter
        self._threads = ThreadPool(f"engine-plugin-{environment}")  # single calls and parallel chunks
        # Serial chunks run on a thread of the plugin's own, kept between chunks: measured, a chunk of cheap
        # calls ran ~2x slower on a shared pool's threads once 64 of them existed (GIL hand-offs), and a
        # thread's start (~150 us) was two thirds of a one-item batch. A chunk abandoned there and still
        # running does not hold up the next: that one gets another thread, and one of the two is kept.
        self._serial_thread = ThreadPool(f"engine-chunk-{environment}", keep=1, idle_seconds=None)
        # Chunks of one plugin run one at a time: they are cheap Python calls by construction, and
        # under the GIL a second thread only slows the first down (measured: 1.7M vs 2.1M items/s).
        self._chunk_lock = meters.slots(1)
        self._abandoned = Abandoned()
        self._chunk = 1  # items per call, adapted to the measured cost of a call
        self._step = 1  # items between a chunk's checks that it is still wanted
        self._serial = False  # whether chunks run one at a time (cheap calls) or in parallel

    def chunk_size(self, share: int) -> int:
        """More than one once calls are measured; a parallel chunk at most the lane's ``share`` per task."""
        return self._chunk if self._serial else min(self._chunk, share)

    def _measured(self, cost: Cost, items: int) -> None:
        """Size the next chunks, and choose how they run, from what the calls just cost."""
        wall, cpu = cost
        per_call = max(wall / items, 1e-9)
        # Cheap calls, and calls that keep a CPU busy (holding the GIL, as Python code does), gain
        # nothing from a second thread; calls that wait (I/O, a subprocess, sleep) run in parallel.
        self._serial = per_call < CHEAP_CALL or cpu > CPU_BOUND * wall
        budget = min(SERIAL_CHUNK_SECONDS if self._serial else PARALLEL_CHUNK_SECONDS, self._limits.timeout / 10)
        self._chunk = max(1, min(MAX_CHUNK, int(budget / per_call)))
        self._step = max(1, min(self._chunk, int(STEP_SECONDS / per_call)))

    async def process_hint(self, items: Sequence[Mapping[str, Any]]) -> ProcessHint | None:
        """A hint that worker processes would gain it cores, from warm calls of ``items``; else None.

        The calls run in serial chunks, as cheap and CPU-bound ones do, cycling through ``items``: a first
        call (start-up's: lazy imports, caches filled), then timed ones until they sum to ``HINT_SECONDS``;
        :func:`hint_from` decides. Their wall time leaves out what they waited for a CPU, a loaded machine's
        (``run_chunk_unqueued``). If the first call alone gives no hint, no more are made: it costs at least
        what a warm one does (too cheap, warm ones are too), and one that mostly waits (an endpoint's round
        trip, a sleep) would cost a slow plugin's calls to no purpose.

        Raises:
            CallFailed: A call failed; its ``position`` is the item's in ``items``.
            ValueError: ``items`` is empty, or holds an item of another environment.
        """
        if not items:
            raise ValueError("process_hint needs at least one item to call")
        cores, at = default_workers(), 0

        async def calls(size: int) -> Cost:
            nonlocal at
            chunk = [items[(at + i) % len(items)] for i in range(size)]
            try:
                rewards, cost = await self._chunk_call(chunk, True, run_chunk_unqueued)
            except CallFailed as exc:
                where = None if exc.position is None else (at + exc.position) % len(items)
                raise CallFailed(exc.reason, where, timed_out=exc.timed_out) from exc.__cause__
            if len(rewards) < size:
                raise ValueError(f"process_hint was handed an item of another environment than {self._environment!r}")
            at = (at + size) % len(items)
            return cost

        first = await calls(1)
        if hint_from(*first, 1, cores) is None:  # too cheap, or waiting: warm calls would be too
            return None
        wall = cpu = 0.0
        measured = 0
        per_call = first[0]  # > 0: else no hint
        while wall < HINT_SECONDS:  # chunks of what is left, as chunk sizes go: each well within the timeout
            size = max(1, min(MAX_CHUNK, int(min(HINT_SECONDS - wall, self._limits.timeout / 10) / per_call)))
            spent, used = await calls(size)
            wall, cpu, measured = wall + spent, cpu + used, measured + size
            per_call = max(spent / size, 1e-9)
        return hint_from(wall, cpu, measured, cores)

    async def aclose(self) -> None:
        self._threads.close()
        self._serial_thread.close()

    def _check_abandoned(self) -> None:
        """Refuse to start a thread call while too many abandoned ones still run."""
        count, most = self._abandoned.count, self._limits.max_abandoned
        if count > most:
            raise CallFailed(
                f"{count} of its calls that timed out or were cut short by an abort are still running in "
                f"threads; refusing to start more until they finish (max_abandoned={most})"
            )

    async def call(self, task: Mapping[str, Any], trajectory: Any, deadline: float) -> float:
        task, trajectory = own_pair(task, trajectory)
        with anyio.CancelScope(deadline=deadline):
            self._check_abandoned()
            call = self._abandoned.call()
            try:
                async with self._limiter:
                    job = functools.partial(call.run, timed, self._fn, task, trajectory)
                    reward, cost = await wait_future(self._threads.submit(job))
            except BadItem as exc:  # its value is not a reward
                raise CallFailed(exc.reason) from exc.__cause__
            except BaseException as exc:  # a plugin's sys.exit(), or any BaseException, must not end the trainer
                if must_pass(exc):
                    raise
                raise CallFailed(f"raised {safely_described(_plugins(exc))}") from _plugins(exc)
            finally:
                call.give_up()
            self._measured(cost, 1)
            return reward
        raise CallFailed(f"timed out after {self._limits.timeout:g} s", timed_out=True)

    async def call_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        rewards, cost = await self._chunk_call(items, self._serial)
        if rewards:
            self._measured(cost, len(rewards))
        return rewards

    async def _chunk_call(
        self,
        items: Sequence[Mapping[str, Any]],
        serial: bool,
        runner: Callable[..., tuple[list[float], Cost]] = run_chunk,
    ) -> tuple[list[float], Cost]:
        """The rewards of ``items`` (up to the first of another environment) and what they cost, one chunk's call
        (by ``runner``: :func:`run_chunk`'s arguments and result)."""
        out: list[Any] = []
        converting = [-1]  # the value being made a reward, once every call has returned
        # A serial chunk's timeout starts once it runs: the chunks queued before it (each up to a tenth of
        # the timeout in calls, and a quarter in turns) are not its time, and a lane may queue dozens. Nor
        # are they its latency: the time queued is waiting for a limit of the verifier's own, as a worker
        # pool's is (concurrent batches of a cheap plugin reported ms an item that took us).
        async with meters.held(self._chunk_lock) if serial else contextlib.nullcontext():
            self._check_abandoned()  # here: the chunk before it in line may have just been abandoned
            with anyio.move_on_after(self._limits.timeout):
                try:
                    return await self._run(items, out, converting, serial, runner)
                except MalformedItem:
                    raise
                except BadItem as exc:  # chained as a single call's is: a value's __float__ is the plugin's code
                    raise CallFailed(exc.reason, exc.position) from exc.__cause__
                except BaseException as exc:  # the call at len(out) raised: SystemExit or any other, but ours
                    if must_pass(exc):
                        raise
                    raise CallFailed(f"raised {safely_described(_plugins(exc))}", len(out)) from _plugins(exc)
        # only a deadline gets here. The call running at it: the one after the last that returned, as the loop
        # reads it now (a loop that comes late may find a later one; one that finds every call returned blames the last)
        at = converting[0] if converting[0] >= 0 else min(len(out), len(items) - 1)
        raise CallFailed(f"timed out after {self._limits.timeout:g} s", at, timed_out=True)

    async def _run(
        self,
        items: Sequence[Mapping[str, Any]],
        out: list[Any],
        converting: list[int],
        serial: bool,
        runner: Callable[..., tuple[list[float], Cost]] = run_chunk,
    ) -> tuple[list[float], Cost]:
        call = self._abandoned.call()
        # serial chunks keep a CPU busy under the GIL: they take turns with the loop; parallel ones mostly wait.
        # Their calls are a tenth of the timeout at most; their turns, a quarter: they end well within it.
        turns = Turns(asyncio.get_running_loop(), patience=self._limits.timeout * TURN_SHARE) if serial else None
        job = functools.partial(
            call.run, runner, self._fn, items, out, self._environment, self._step, call.wanted, converting, turns
        )
        try:
            if serial:
                return await wait_future(self._serial_thread.submit(job))
            async with self._limiter:
                return await wait_future(self._threads.submit(job))
        finally:
            call.give_up()
