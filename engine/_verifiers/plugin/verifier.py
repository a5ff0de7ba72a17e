"""Plugin verifiers: ``module:callable`` inside a digest-pinned environment directory.

This module holds :class:`PluginVerifier`, the side on the event loop: vetting the digest,
importing once, sizing chunks, and turning failures into ``Failure``s. What runs in the
engine's threads is in ``engine._verifiers.plugin.threads``; worker processes are started and
spoken to by ``engine._verifiers.plugin.pool`` and run ``engine._verifiers.plugin.worker``.

The module is imported lazily, on the first item that needs it, once however many items ask at
the same time (and once even if a batch is aborted mid-import: the import finishes in its thread
and the next batch uses it), never before the directory's digest matches its pin, and only from
the snapshot of its sources taken as the digest was computed (``engine._verifiers.plugin.importer``): what runs is
what was pinned, even if a file changes afterwards.

Sync callables run in the engine's bounded thread pool, so they never block the event loop;
``async def`` callables are awaited on the loop. The call timeout covers the first item's import
too. An overrun abandons the thread (Python cannot kill it) and fails the item. Abandoned calls
still running are counted per verifier (``engine._verifiers.plugin.threads.Abandoned``): past
``Limits.max_abandoned`` of them, the verifier fails new calls at once, saying why, instead of
piling up threads that never end.

Each call is handed a task and a trajectory of its own, so a plugin that changes them (adds a key,
appends to a list) changes nothing another item's call sees, nor the caller's batch, under every
executor alike (``engine._core.contract.private``): a string is shared as it is, a task holding no
container is copied flat (the common case, ~0.06 us), anything deeper is copied as deep as it goes.
Its limit: a mutable value that is not a container (a ``bytearray``, a numpy array) in an otherwise
flat task is shared, not copied (telling it apart would cost every flat task a pass over its values).
A reward is a real number (``engine._core.contract.check_reward``): ``"42"`` is an error, not 42.0.

A plugin whose manifest says ``"executor": "process"`` runs in worker processes instead
(``engine._verifiers.plugin.pool``): the engine then only vets the directory's digest, the workers
(``engine._verifiers.plugin.worker``) import the module from the snapshot the engine vetted, and an
overrun or a crash kills a worker, never a thread or the engine.

A round trip between the event loop and a thread costs ~100 us, far more than a cheap plugin's
call, so sync plugins are called a *chunk* of items per round trip, sized from the measured cost per
call. Calls under ``CHEAP_CALL``, and CPU-bound calls (a Python math check), run chunks of up to
~250 ms one at a time on one thread: under the GIL a second thread only slows the first down (for
CPU-bound plugins, process isolation is the way to use more cores). Everything a chunk does to its
items (slicing them, checking them, turning the values into rewards) happens in its thread: done
on the event loop, on the other CPU, it cost a fifth of a cheap plugin's speed in cache misses. A
chunk's thread checks every ~1 ms that its caller still waits, so an abort or a timeout ends it
within that. Calls that wait (blocking I/O, a subprocess) run chunks of up to ~300 ms in parallel
on the thread pool, up to the verifier's concurrency, split finer as a lane nears its end so no
worker idles (measured: 0.90x the ideal rate for 10 ms calls on 64 threads, against 0.61x one item
per round trip). A chunk's timeout is the call timeout: chunks are kept under a tenth of it, so a
chunk overruns only when the item it was running did. Process-executor plugins are chunked the same
way (a round trip to a worker costs ~150 us), their chunks always run in parallel (no GIL between
processes), and their deadline is per item.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from engine._config import Limits
from engine._core import meters
from engine._core.contract import BadItem, MalformedItem, ProcessHint, as_rewards, is_async, private_pair
from engine._core.threads import KeptThread, in_thread, wait_future
from engine._environments.digest import MANIFEST, Pin, Snapshot, pin_verdict, snapshot_directory
from engine._environments.manifest import Environment
from engine._errors import DigestError, Failure
from engine._verifiers.plugin.importer import PluginLoadError, forget, load_plugin, said
from engine._verifiers.plugin.pool import WorkerFailure, WorkerPool, default_workers
from engine._verifiers.plugin.threads import Abandoned, Interrupted, Turns, run_chunk, timed
from engine._verifiers.plugin.wire import Cost, PluginSpec

__all__ = ["PluginVerifier"]

T = TypeVar("T")
CHEAP_CALL = 100e-6  # seconds: calls cheaper than this run in chunks one at a time, on one thread
SERIAL_CHUNK_SECONDS = 0.25  # work per hop for cheap calls: the hop and the chunk's setup cost ~1%
STEP_SECONDS = 0.001  # a chunk's thread checks this often that its caller still waits, and takes turns with the loop
TURN_SHARE = 0.25  # of the timeout, the most a serial chunk waits in all for turns with the loop
PARALLEL_CHUNK_SECONDS = 0.3  # for waiting calls, run in parallel; a lane's last chunks are split finer
CPU_BOUND = 0.5  # a call whose thread is on a CPU more than this share of its time is CPU-bound
PROCESS_CHUNK_SECONDS = 0.05  # work per round trip to a worker process
PROCESS_SPLIT = 4  # a process chunk is at most this fraction of what is left per worker: the end is split finer
# A CPU-bound thread plugin whose calls take at least this long would gain from worker processes: what a
# call costs the engine's process on top (pickling its pair, its share of a round trip) is then a small
# share of it (measured on 2 cores: from ~50 us a call the process executor ran ahead of one thread).
PROCESS_HINT_CALL = 50e-6
MAX_CHUNK = 1 << 18  # items: bounds what one chunk holds (its values and rewards, ~2 MiB of pointers each)


def _ours(exc: BaseException) -> bool:
    """Whether ``exc``, raised where a plugin's code ran, is not the plugin's failure but must pass: a
    ``KeyboardInterrupt`` a signal may have raised, or the event loop cancelling this task (a timeout, an
    abort). A ``CancelledError`` the plugin raised itself, while nothing cancels the task, is its failure."""
    if isinstance(exc, KeyboardInterrupt):
        return _may_be_a_signal()
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() > 0
    return False


def _may_be_a_signal() -> bool:
    """Whether a ``KeyboardInterrupt`` on this thread may be Ctrl-C's: on the main thread, while SIGINT's handler
    raises one (Python's own, or asyncio's runner's on a second Ctrl-C). Under any other (``engine serve``'s,
    the CLI's during a run: they stop the loop instead) it can only be the plugin's own, as in a thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGINT)
    handler = getattr(handler, "func", handler)  # the runner installs a functools.partial of its method
    return handler is signal.default_int_handler or isinstance(getattr(handler, "__self__", None), asyncio.Runner)


def _raised(exc: BaseException) -> BaseException:
    """What the plugin raised: a ``KeyboardInterrupt`` a thread carried as :class:`Interrupted` is itself."""
    return exc.raised if isinstance(exc, Interrupted) else exc


class PluginVerifier:
    """One plugin environment's callable, imported on first use and cached for the engine's life."""

    kind = "plugin"

    def __init__(
        self,
        environment: Environment,
        limits: Limits,
        *,
        pin: str | None,
        allow_unpinned: bool,
        thread_limiter: anyio.CapacityLimiter,
    ) -> None:
        self.environment = environment
        self.ref = environment.verifier.ref
        self.key = environment.verifier_key
        self.limits = limits
        self.executor = environment.verifier.executor
        self._process = self.executor == "process"
        self.workers = (environment.verifier.workers or default_workers()) if self._process else None
        self._pin = pin
        self._allow_unpinned = allow_unpinned
        self._threads = thread_limiter
        self._fn: Callable[..., Any] | None = None
        self._is_async = False
        self._pool: WorkerPool | None = None  # process executor: created once the digest is vetted
        self._closed = False
        self._import_future: concurrent.futures.Future[tuple[Callable[..., Any] | None, Snapshot]] | None = None
        self._imported: list[Snapshot] = []  # every snapshot an import was tried from: forgotten at close
        self._chunk = 1  # items per call, adapted to the measured cost of a call
        self._step = 1  # items between a chunk's checks that it is still wanted
        # wall and CPU seconds, and items, of recent calls, each halved at every measurement: the last weigh most
        self._costs = (0.0, 0.0, 0.0)
        self._serial = False  # whether chunks run one at a time (cheap calls) or in parallel
        # Chunks of one plugin run one at a time: they are cheap Python calls by construction, and
        # under the GIL a second thread only slows the first down (measured: 1.7M vs 2.1M items/s).
        self._chunk_lock = meters.slots(1)
        self._serial_thread = KeptThread(f"engine-chunk-{environment.name}")  # where they run, kept between chunks
        self._abandoned = Abandoned()
        self.digest: str | None = None  # the digest the module was imported (or vetted) at
        self.retries = 0  # plugins are never retried: a failure is the plugin's answer

    def provenance(self) -> Mapping[str, Any]:
        return {"kind": self.kind, "ref": self.ref, "environment": self.environment.name, "digest": self.digest}

    def spent(self) -> Mapping[str, int]:
        return {}  # a plugin's calls cost only time, which the scheduler measures

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of its worker processes (process executor; none before the first call)."""
        return self._pool.pids if self._pool is not None else []

    def _fail(self, reason: str, position: int | None = None, *, timed_out: bool = False) -> Failure:
        """The failure of this verifier; ``position``, the failing item's place in its chunk, if one is known."""
        return Failure(reason, position=position, timed_out=timed_out)

    def _check_digest(self) -> Snapshot:
        """The environment's snapshot, once its digest matches the pin: what is imported, and only that.

        The manifest the digest hashed must be the one the verifier was configured from (the
        environment's, read earlier): else a manifest swapped in between would pick a callable, an
        executor or a worker count nobody vetted, under a digest that matches the pin.
        """
        env = self.environment
        try:
            snapshot = snapshot_directory(env.path)
        except DigestError as exc:
            raise self._fail(f"environment {env.name!r} cannot be vetted: {exc.reason}; nothing was imported") from None
        if snapshot.manifest != env.manifest_bytes:  # the verifier would be one the digest did not cover
            raise self._fail(
                f"environment {env.name!r}: {MANIFEST} changed after it was read; nothing was imported (the verifier "
                "is configured from the manifest the engine read, so it must be the manifest hashed; a new engine "
                "reads it again)"
            )
        digest = snapshot.digest
        verdict = pin_verdict(digest, self._pin, required=not self._allow_unpinned)
        if verdict is Pin.MISSING:
            raise self._fail(
                f"environment {env.name!r} has no pin and allow_unpinned is false; after vetting it, "
                f'add under [pins]: {env.name} = "{digest}"'
            )
        if verdict is Pin.CHANGED:
            raise self._fail(
                f"environment {env.name!r} changed since it was pinned: its digest is {digest}, "
                f"the pin is {self._pin}; nothing was imported"
            )
        return snapshot

    def _import(self) -> tuple[Callable[..., Any] | None, Snapshot]:
        """Check the digest, then import the module from the snapshot checked and find the callable
        (runs in its own thread).

        A process-executor plugin is not imported into the engine's process at all: each worker
        imports it from the snapshot vetted here, which the engine hands it.
        """
        snapshot = self._check_digest()
        if self._process:
            return None, snapshot
        self._imported.append(snapshot)
        try:
            return load_plugin(snapshot, self.environment.name, self.ref), snapshot
        except PluginLoadError as exc:
            raise self._fail(exc.reason) from exc.__cause__

    async def _loaded(self) -> None:
        """The callable imported (or, for the process executor, the directory vetted), once.

        The import runs in a thread of its own whose result outlives the caller: every caller,
        in this batch or the next, waits for the same import, and an abort while it runs does
        not make the next batch import the module a second time. A failed import is tried
        again by the next caller (the file may have been fixed, and re-vetted).
        """
        if self._closed:
            raise RuntimeError("this plugin's engine is closed")
        if self.digest is not None:
            return
        future = self._import_future
        if future is None:
            future = self._import_future = in_thread(self._import, f"engine-import-{self.environment.name}")
        try:
            with meters.starting():  # the digest check and import: start-up, not verifying (nor this call's latency)
                fn, snapshot = await wait_future(future)
        except Exception as exc:
            if self._import_future is future:
                self._import_future = None
            if isinstance(exc, Failure):  # the digest or the import: the environment's failure, not an item's
                exc.of_environment = True
            raise
        if fn is not None:
            self._is_async, self._fn = is_async(fn), fn
        elif self._pool is None:
            env = self.environment
            spec = PluginSpec(os.path.abspath(env.path), env.name, self.ref, snapshot.digest)
            assert self.workers is not None  # set for the process executor
            self._pool = WorkerPool(spec, snapshot.sources, self.workers, self.limits.timeout)
        self.digest = snapshot.digest

    async def load(self) -> None:
        """Make the plugin ready to call, or raise ``Failure`` saying why it cannot be.

        Thread executor: the module is imported. Process executor: a worker process runs and has
        imported it.
        """
        await self._loaded()
        if self._pool is not None:
            try:
                await self._pool.warm()
            except WorkerFailure as exc:
                raise self._failure(exc) from exc.cause

    def _forget(self) -> None:
        """Unregister the private packages its imports made (``engine._verifiers.plugin.importer.forget``)."""
        for snapshot in self._imported:
            forget(snapshot)

    async def aclose(self) -> None:
        """Stop its worker processes, if it has any (threads cannot be stopped: abandoned ones end on their own),
        and forget its imported module, so an engine's plugin does not outlive it (a trainer may open many).

        A call still running in an abandoned thread keeps the module objects it uses; only the import
        system's entries go (a sibling module it imports lazily from then on is not found). An import
        still running is forgotten when it ends.
        """
        self._closed = True
        self._serial_thread.close()
        future = self._import_future
        if future is not None and not future.done():
            future.add_done_callback(lambda _: self._forget())
        self._forget()
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.CancelScope(shield=True):  # the engine may be closing because its task was cancelled
                await pool.aclose()

    def chunk_size(self, share: int) -> int:
        """Items per call: more than one once calls are measured (the first calls go one at a time).

        ``share`` is the lane's items left per task, rounded up, and a lane has ``max_concurrency``
        tasks. A process lane's tasks take their chunks at once but only ``workers`` of them run at a
        time (the rest wait for a worker holding theirs): its chunks are sized from what is surely
        left per *worker*, a ``PROCESS_SPLIT``th of it, so they shrink only near the end (and a batch
        of a few items still goes one item to each worker). Sized per task, as a thread lane's, the
        last third of a batch went in ever smaller chunks, ~650 round trips for 10,000 items of 1 ms,
        whose ~0.8 ms each of the engine's own CPU was taken from the workers' cores.
        """
        if self._process:
            assert self.workers is not None  # set for the process executor
            left = (share - 1) * self.limits.max_concurrency + 1  # at least this many: share was rounded up
            return max(1, min(self._chunk, left // self.workers // PROCESS_SPLIT))
        return self._chunk if self._serial else min(self._chunk, share)

    def _measured(self, cost: Cost, items: int) -> None:
        """Size the next chunks, and choose how they run, from what the calls just cost."""
        wall, cpu = cost
        spent = self._costs
        self._costs = (spent[0] / 2 + wall, spent[1] / 2 + cpu, spent[2] / 2 + items)  # for process_hint() too
        per_call = max(wall / items, 1e-9)
        if self._process:  # each worker has its own interpreter: chunks always run in parallel
            # A call's cost over the last chunks, weighted by their items: the few items a batch ends on
            # (their wall time mostly a worker's wake-up) do not shrink the next batch's chunks 100-fold.
            per_call = max(self._costs[0] / self._costs[2], 1e-9)
            budget = PROCESS_CHUNK_SECONDS
        else:
            # Cheap calls, and calls that keep a CPU busy (holding the GIL, as Python code does), gain
            # nothing from a second thread; calls that wait (I/O, a subprocess, sleep) run in parallel.
            self._serial = per_call < CHEAP_CALL or cpu > CPU_BOUND * wall
            budget = SERIAL_CHUNK_SECONDS if self._serial else PARALLEL_CHUNK_SECONDS
        budget = min(budget, self.limits.timeout / 10)
        self._chunk = max(1, min(MAX_CHUNK, int(budget / per_call)))
        self._step = max(1, min(self._chunk, int(STEP_SECONDS / per_call)))

    def process_hint(self) -> ProcessHint | None:
        """A hint that worker processes would use more cores, if its calls so far say so; else None.

        For a sync thread-executor plugin whose measured calls are CPU-bound (on a CPU more than
        ``CPU_BOUND`` of their time, the rule that runs them one at a time) and take at least
        ``PROCESS_HINT_CALL`` each, on a machine where this process may use more than one core. The
        calls are weighed by their items, halved at each measurement: a batch's first calls, one item
        each in parallel threads, shared the GIL and look less CPU-bound than the chunks after them.
        """
        wall, cpu, items = self._costs
        cores = default_workers()
        if self._process or self._is_async or not items or cores < 2:
            return None
        if cpu <= CPU_BOUND * wall or wall / items < PROCESS_HINT_CALL:
            return None
        return ProcessHint(wall / items, cpu / wall, cores)

    def _check_abandoned(self) -> None:
        """Refuse to start a thread call while too many abandoned ones still run."""
        count, most = self._abandoned.count, self.limits.max_abandoned
        if count > most:
            raise self._fail(
                f"{count} of its calls that timed out or were cut short by an abort are still running in "
                f"threads; refusing to start more until they finish (max_abandoned={most})"
            )

    async def _in_pool_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine's thread pool, counted as abandoned if the caller gives up on it."""
        call = self._abandoned.call()
        try:
            return await anyio.to_thread.run_sync(call.run, fn, *args, abandon_on_cancel=True, limiter=self._threads)
        finally:
            call.give_up()

    async def _call(self, fn: Callable[..., Any], task: Mapping[str, Any], trajectory: Any) -> float:
        """The reward of one call; :class:`BadItem` if its value is not one."""
        if self._is_async:  # its value's code (__float__) runs on the loop, as the plugin's own code does
            return as_rewards([await fn(task, trajectory)])[0]
        reward, cost = await self._in_pool_thread(timed, fn, task, trajectory)
        self._measured(cost, 1)
        return reward

    def _failure(self, exc: WorkerFailure) -> Failure:
        failure = self._fail(exc.reason, exc.position, timed_out=exc.timed_out)
        failure.of_environment = exc.of_environment  # a worker that could not import the plugin
        return failure

    async def _in_process(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The rewards of ``items`` (up to the first of another environment) from a worker process, in one
        round trip. The items are read, and their rewards made, in the worker's thread (``WorkerPool.call``):
        the event loop's part is the same for any number of them."""
        with anyio.move_on_after(self.limits.timeout) as deadline:
            await self._loaded()
        if deadline.cancelled_caught:
            failure = self._fail(f"timed out after {self.limits.timeout:g} s checking the environment's digest",
                                 timed_out=True)
            failure.of_environment = True
            raise failure
        pool = self._pool
        if pool is None:
            raise RuntimeError("this plugin's engine is closed")
        try:
            rewards, cost = await pool.call(items)
        except WorkerFailure as exc:
            raise self._failure(exc) from exc.cause
        except BadItem as exc:  # a task that cannot be read as a dict
            raise self._fail(exc.reason, exc.position) from exc.__cause__
        if rewards:
            self._measured(cost, len(rewards))
        return rewards

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        if self._process:
            item = {"environment": self.environment.name, "task": task, "trajectory": trajectory}
            return (await self._in_process([item]))[0]
        try:
            task, trajectory = private_pair(0, task, trajectory)
        except BadItem as exc:
            raise self._fail(exc.reason) from exc.__cause__
        importing = self._fn is None
        with anyio.move_on_after(self.limits.timeout) as deadline:
            await self._loaded()
            importing = False
            fn = self._fn
            assert fn is not None  # imported
            self._check_abandoned()
            try:
                return await self._call(fn, task, trajectory)
            except BadItem as exc:  # its value is not a reward
                raise self._fail(exc.reason) from exc.__cause__
            except BaseException as exc:  # a plugin's sys.exit(), or any BaseException, must not end the trainer
                if _ours(exc):
                    raise
                raise self._fail(f"raised {said(_raised(exc))}") from _raised(exc)
        assert deadline.cancelled_caught  # the only way here: the block returns or raises otherwise
        doing = " importing the module" if importing else ""
        failure = self._fail(f"timed out after {self.limits.timeout:g} s{doing}", timed_out=True)
        failure.of_environment = importing
        raise failure

    async def _run(
        self,
        fn: Callable[..., Any],
        items: Sequence[Mapping[str, Any]],
        out: list[Any],
        converting: list[int],
        serial: bool,
    ) -> tuple[list[float], Cost]:
        call = self._abandoned.call()
        # serial chunks keep a CPU busy under the GIL: they take turns with the loop; parallel ones mostly wait.
        # Their calls are a tenth of the timeout at most; their turns, a quarter: they end well within it.
        turns = Turns(asyncio.get_running_loop(), patience=self.limits.timeout * TURN_SHARE) if serial else None
        runner = functools.partial(
            call.run, run_chunk, fn, items, out, self.environment.name, self._step, call.wanted, converting, turns
        )
        try:
            if serial:
                # A thread of the plugin's own, not anyio's pool: measured, a chunk of cheap calls ran
                # ~2x slower on the pool's threads once 64 of them existed (GIL hand-offs). It is kept
                # between chunks: a thread's start (~150 us) was two thirds of a one-item batch.
                return await wait_future(self._serial_thread.submit(runner))
            return await anyio.to_thread.run_sync(runner, abandon_on_cancel=True, limiter=self._threads)
        finally:
            call.give_up()

    async def verify_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        if self._process:
            return await self._in_process(items)
        await self._loaded()
        fn = self._fn
        assert fn is not None  # imported
        out: list[Any] = []
        converting = [-1]  # the value being made a reward, once every call has returned
        serial = self._serial
        # A serial chunk's timeout starts once it runs: the chunks queued before it (each up to a tenth of
        # the timeout in calls, and a quarter in turns) are not its time, and a lane may queue dozens. Nor
        # are they its latency: the time queued is waiting for a limit of the verifier's own, as a worker
        # pool's is (concurrent batches of a cheap plugin reported ms an item that took us).
        async with meters.held(self._chunk_lock) if serial else contextlib.nullcontext():
            self._check_abandoned()  # here: the chunk before it in line may have just been abandoned
            with anyio.move_on_after(self.limits.timeout) as deadline:
                try:
                    rewards, cost = await self._run(fn, items, out, converting, serial)
                except MalformedItem:
                    raise
                except BadItem as exc:
                    raise self._fail(exc.reason, exc.position) from None
                except BaseException as exc:  # the call at len(out) raised: SystemExit or any other, but ours
                    if _ours(exc):
                        raise
                    raise self._fail(f"raised {said(_raised(exc))}", len(out)) from _raised(exc)
        if deadline.cancelled_caught:
            # the call running at the deadline: the one after the last that returned, as the loop reads it now
            # (a loop that comes late may find a later one; one that finds every call returned blames the last)
            at = converting[0] if converting[0] >= 0 else min(len(out), len(items) - 1)
            raise self._fail(f"timed out after {self.limits.timeout:g} s", at, timed_out=True)
        if rewards:
            self._measured(cost, len(rewards))
        return rewards
