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
from engine._verifiers.plugin.thread_calls import Abandoned, Interrupted, run_chunk, timed
from engine._verifiers.plugin.turns import Turns

__all__ = ["ThreadExecutor"]

T = TypeVar("T")
CHEAP_CALL = 100e-6  # seconds: calls cheaper than this run in chunks one at a time, on one thread
SERIAL_CHUNK_SECONDS = 0.25  # work per hop for cheap calls: the hop and the chunk's setup cost ~1%
STEP_SECONDS = 0.001  # a chunk's thread checks this often that its caller still waits, and takes turns with the loop
TURN_SHARE = 0.25  # of the timeout, the most a serial chunk waits in all for turns with the loop
PARALLEL_CHUNK_SECONDS = 0.3  # for waiting calls, run in parallel; a lane's last chunks are split finer
CPU_BOUND = 0.5  # a call whose thread is on a CPU more than this share of its time is CPU-bound
# A CPU-bound thread plugin whose calls take at least this long would gain from worker processes: what a
# call costs the engine's process on top (pickling its pair, its share of a round trip) is then a small
# share of it (measured on 2 cores: from ~50 us a call the process executor ran ahead of one thread).
PROCESS_HINT_CALL = 50e-6


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
        # wall and CPU seconds, and items, of recent calls, each halved at every measurement: the last weigh most
        self._costs = (0.0, 0.0, 0.0)
        self._serial = False  # whether chunks run one at a time (cheap calls) or in parallel

    def chunk_size(self, share: int) -> int:
        """More than one once calls are measured; a parallel chunk at most the lane's ``share`` per task."""
        return self._chunk if self._serial else min(self._chunk, share)

    def _measured(self, cost: Cost, items: int) -> None:
        """Size the next chunks, and choose how they run, from what the calls just cost."""
        wall, cpu = cost
        spent = self._costs
        self._costs = (spent[0] / 2 + wall, spent[1] / 2 + cpu, spent[2] / 2 + items)  # for process_hint()
        per_call = max(wall / items, 1e-9)
        # Cheap calls, and calls that keep a CPU busy (holding the GIL, as Python code does), gain
        # nothing from a second thread; calls that wait (I/O, a subprocess, sleep) run in parallel.
        self._serial = per_call < CHEAP_CALL or cpu > CPU_BOUND * wall
        budget = min(SERIAL_CHUNK_SECONDS if self._serial else PARALLEL_CHUNK_SECONDS, self._limits.timeout / 10)
        self._chunk = max(1, min(MAX_CHUNK, int(budget / per_call)))
        self._step = max(1, min(self._chunk, int(STEP_SECONDS / per_call)))

    def process_hint(self) -> ProcessHint | None:
        """A hint that worker processes would use more cores, if its calls so far say so; else None.

        Its measured calls must be CPU-bound (on a CPU more than ``CPU_BOUND`` of their time, the rule
        that runs them one at a time) and take at least ``PROCESS_HINT_CALL`` each, on a machine where
        this process may use more than one core. The calls are weighed by their items, halved at each
        measurement: a batch's first calls, one item each in parallel threads, shared the GIL and look
        less CPU-bound than the chunks after them.
        """
        wall, cpu, items = self._costs
        cores = default_workers()
        if not items or cores < 2 or cpu <= CPU_BOUND * wall or wall / items < PROCESS_HINT_CALL:
            return None
        return ProcessHint(wall / items, cpu / wall, cores)

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
        out: list[Any] = []
        converting = [-1]  # the value being made a reward, once every call has returned
        serial = self._serial
        # A serial chunk's timeout starts once it runs: the chunks queued before it (each up to a tenth of
        # the timeout in calls, and a quarter in turns) are not its time, and a lane may queue dozens. Nor
        # are they its latency: the time queued is waiting for a limit of the verifier's own, as a worker
        # pool's is (concurrent batches of a cheap plugin reported ms an item that took us).
        async with meters.held(self._chunk_lock) if serial else contextlib.nullcontext():
            self._check_abandoned()  # here: the chunk before it in line may have just been abandoned
            with anyio.move_on_after(self._limits.timeout) as deadline:
                try:
                    rewards, cost = await self._run(items, out, converting, serial)
                except MalformedItem:
                    raise
                except BadItem as exc:  # chained as a single call's is: a value's __float__ is the plugin's code
                    raise CallFailed(exc.reason, exc.position) from exc.__cause__
                except BaseException as exc:  # the call at len(out) raised: SystemExit or any other, but ours
                    if must_pass(exc):
                        raise
                    raise CallFailed(f"raised {safely_described(_plugins(exc))}", len(out)) from _plugins(exc)
        if deadline.cancelled_caught:
            # the call running at the deadline: the one after the last that returned, as the loop reads it now
            # (a loop that comes late may find a later one; one that finds every call returned blames the last)
            at = converting[0] if converting[0] >= 0 else min(len(out), len(items) - 1)
            raise CallFailed(f"timed out after {self._limits.timeout:g} s", at, timed_out=True)
        if rewards:
            self._measured(cost, len(rewards))
        return rewards

    async def _run(
        self, items: Sequence[Mapping[str, Any]], out: list[Any], converting: list[int], serial: bool
    ) -> tuple[list[float], Cost]:
        call = self._abandoned.call()
        # serial chunks keep a CPU busy under the GIL: they take turns with the loop; parallel ones mostly wait.
        # Their calls are a tenth of the timeout at most; their turns, a quarter: they end well within it.
        turns = Turns(asyncio.get_running_loop(), patience=self._limits.timeout * TURN_SHARE) if serial else None
        job = functools.partial(
            call.run, run_chunk, self._fn, items, out, self._environment, self._step, call.wanted, converting, turns
        )
        try:
            if serial:
                return await wait_future(self._serial_thread.submit(job))
            async with self._limiter:
                return await wait_future(self._threads.submit(job))
        finally:
            call.give_up()
