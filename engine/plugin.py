"""Plugin verifiers: ``module:callable`` inside a digest-pinned environment directory.

The module is imported lazily, on the first item that needs it, once however many items ask at
the same time (and once even if a batch is aborted mid-import: the import finishes in its thread
and the next batch uses it), never before the directory's digest matches its pin, and only from
source (``engine.importer``).

Sync callables run in the engine's bounded thread pool, so they never block the event loop;
``async def`` callables are awaited on the loop. The call timeout covers the first item's import
too. An overrun abandons the thread (Python cannot kill it) and fails the item.

A round trip between the event loop and a thread costs ~100 us, far more than a cheap plugin's
call, so sync plugins are called a *chunk* of items per round trip, sized from the measured cost per
call. Calls under ``CHEAP_CALL``, and CPU-bound calls (a Python math check), run ~10 ms chunks one
at a time on one thread: under the GIL a second thread only slows the first down (for CPU-bound
plugins, process isolation is the way to use more cores). Calls that wait (blocking I/O, a
subprocess) run chunks of up to ~300 ms in parallel on the thread pool, up to the verifier's
concurrency, split finer as a lane nears its end so no worker idles (measured: 0.90x the ideal
rate for 10 ms calls on 64 threads, against 0.61x one item per round trip). A chunk's timeout is
the call timeout: chunks are kept under a tenth of it, so a chunk overruns only when the item it
was running did.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter, thread_time
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from .config import Limits
from .digest import digest_directory
from .errors import VerificationError, describe
from .importer import import_from_environment
from .manifest import Environment
from .verifier import MalformedItem, check_reward

__all__ = ["PluginVerifier"]

T = TypeVar("T")
CHEAP_CALL = 100e-6  # seconds: calls cheaper than this run in chunks one at a time, on one thread
SERIAL_CHUNK_SECONDS = 0.01  # work per hop for cheap calls: the hop (~100 us) costs ~1%
PARALLEL_CHUNK_SECONDS = 0.3  # for waiting calls, run in parallel; a lane's last chunks are split finer
CPU_BOUND = 0.5  # a call whose thread is on a CPU more than this share of its time is CPU-bound
MAX_CHUNK = 1 << 16


Cost = tuple[float, float]  # (wall seconds, CPU seconds of the thread) of some calls


def _timed(fn: Callable[..., Any], task: Mapping[str, Any], trajectory: Any) -> tuple[Any, Cost]:
    """``fn(task, trajectory)`` and what it cost, measured in its thread (no hop, no queue)."""
    started, cpu = perf_counter(), thread_time()
    value = fn(task, trajectory)
    return value, (perf_counter() - started, thread_time() - cpu)


def _run_chunk(fn: Callable[..., Any], items: Sequence[Mapping[str, Any]], out: list[Any]) -> Cost:
    """Call ``fn`` on each item into ``out`` (runs in a worker thread); returns what it cost.

    On an exception, ``len(out)`` is the position of the item that raised.
    """
    append = out.append
    started, cpu = perf_counter(), thread_time()
    for item in items:
        try:
            task, trajectory = item["task"], item["trajectory"]
        except (KeyError, TypeError):
            raise MalformedItem(len(out)) from None
        if type(task) is not dict and not isinstance(task, Mapping):
            raise MalformedItem(len(out))
        append(fn(task, trajectory))
    return perf_counter() - started, thread_time() - cpu


def _in_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run ``fn`` in a new daemon thread; its future outlives whoever started it."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def _wait(future: concurrent.futures.Future[T]) -> T:
    """Await ``future``; cancelling the waiter leaves the future (and its thread) running."""
    waiter = asyncio.wrap_future(future)
    waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
    return await asyncio.shield(waiter)


def _is_async(fn: Callable[..., Any]) -> bool:
    # an instance whose __call__ is "async def" is awaited too
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


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
        self._pin = pin
        self._allow_unpinned = allow_unpinned
        self._threads = thread_limiter
        self._fn: Callable[..., Any] | None = None
        self._is_async = False
        self._import_future: concurrent.futures.Future[tuple[Callable[..., Any], str]] | None = None
        self._chunk = 1  # items per call, adapted to the measured cost of a call
        self._serial = False  # whether chunks run one at a time (cheap calls) or in parallel
        # Chunks of one plugin run one at a time: they are cheap Python calls by construction, and
        # under the GIL a second thread only slows the first down (measured: 1.7M vs 2.1M items/s).
        self._chunk_lock = anyio.Lock(fast_acquire=True)
        self.digest: str | None = None  # the digest the module was imported at
        self.retries = 0  # plugins are never retried: a failure is the plugin's answer

    def provenance(self) -> Mapping[str, Any]:
        return {"kind": self.kind, "ref": self.ref, "environment": self.environment.name, "digest": self.digest}

    def _fail(self, reason: str) -> VerificationError:
        return VerificationError(self.kind, self.ref, reason, environment=self.environment.name)

    def _check_digest(self) -> str:
        env = self.environment
        digest = digest_directory(env.path)
        if self._pin is None:
            if not self._allow_unpinned:
                raise self._fail(
                    f"environment {env.name!r} has no pin and allow_unpinned is false; after vetting it, "
                    f'add under [pins]: {env.name} = "{digest}"'
                )
        elif digest != self._pin:
            raise self._fail(
                f"environment {env.name!r} changed since it was pinned: its digest is {digest}, "
                f"the pin is {self._pin}; nothing was imported"
            )
        return digest

    def _import(self) -> tuple[Callable[..., Any], str]:
        """Check the digest, then import the module and find the callable (runs in its own thread)."""
        digest = self._check_digest()
        module_name, _, attr_path = self.ref.partition(":")
        try:
            target: Any = import_from_environment(self.environment.path, self.environment.name, module_name)
        except (Exception, SystemExit) as exc:
            raise self._fail(f"cannot import module {module_name!r}: {describe(exc)}") from exc
        for part in attr_path.split("."):
            try:
                target = getattr(target, part)
            except AttributeError:
                raise self._fail(f"module {module_name!r} has no attribute {attr_path!r}") from None
        if not callable(target):
            raise self._fail(f"{attr_path!r} in module {module_name!r} is a {type(target).__name__}, not callable")
        return target, digest

    async def load(self) -> Callable[..., Any]:
        """The callable, imported on the first call (after the digest check) and cached.

        The import runs in a thread of its own whose result outlives the caller: every caller,
        in this batch or the next, waits for the same import, and an abort while it runs does
        not make the next batch import the module a second time. A failed import is tried
        again by the next caller (the file may have been fixed, and re-vetted).
        """
        if self._fn is not None:
            return self._fn
        future = self._import_future
        if future is None:
            future = self._import_future = _in_thread(self._import, f"engine-import-{self.environment.name}")
        try:
            fn, digest = await _wait(future)
        except Exception:
            if self._import_future is future:
                self._import_future = None
            raise
        self._is_async, self.digest, self._fn = _is_async(fn), digest, fn
        return fn

    def chunk_size(self, share: int) -> int:
        """Items per call: more than one once calls are measured (the first calls go one at a time)."""
        return self._chunk if self._serial else min(self._chunk, share)

    def _measured(self, cost: Cost, items: int) -> None:
        """Size the next chunks, and choose how they run, from what the calls just cost."""
        wall, cpu = cost
        per_call = max(wall / items, 1e-9)
        # Cheap calls, and calls that keep a CPU busy (holding the GIL, as Python code does), gain
        # nothing from a second thread; calls that wait (I/O, a subprocess, sleep) run in parallel.
        self._serial = per_call < CHEAP_CALL or cpu > CPU_BOUND * wall
        budget = min(SERIAL_CHUNK_SECONDS if self._serial else PARALLEL_CHUNK_SECONDS, self.limits.timeout / 10)
        self._chunk = max(1, min(MAX_CHUNK, int(budget / per_call)))

    async def _call(self, fn: Callable[..., Any], task: Mapping[str, Any], trajectory: Any) -> Any:
        if self._is_async:
            return await fn(task, trajectory)
        value, cost = await anyio.to_thread.run_sync(
            _timed, fn, task, trajectory, abandon_on_cancel=True, limiter=self._threads
        )
        self._measured(cost, 1)
        return value

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        importing = self._fn is None
        with anyio.move_on_after(self.limits.timeout) as deadline:
            fn = await self.load()
            importing = False
            try:
                value = await self._call(fn, task, trajectory)
            except (Exception, SystemExit) as exc:  # a plugin's sys.exit() must not end the trainer
                raise self._fail(f"raised {describe(exc)}") from exc
        if deadline.cancelled_caught:
            doing = " importing the module" if importing else ""
            raise self._fail(f"timed out after {self.limits.timeout:g} s{doing}")
        try:
            return check_reward(value)
        except (TypeError, ValueError) as exc:
            raise self._fail(str(exc)) from None

    async def _run(self, fn: Callable[..., Any], items: Sequence[Mapping[str, Any]], out: list[Any]) -> Cost:
        if self._serial:
            async with self._chunk_lock:
                # A fresh thread per chunk, not anyio's pool: measured, a chunk of cheap calls ran ~2x
                # slower on the pool's threads once 64 of them existed (GIL hand-offs), and a thread's
                # start (~100 us) is ~1% of a chunk.
                runner = functools.partial(_run_chunk, fn, items, out)
                return await _wait(_in_thread(runner, f"engine-chunk-{self.environment.name}"))
        return await anyio.to_thread.run_sync(_run_chunk, fn, items, out, abandon_on_cancel=True, limiter=self._threads)

    async def verify_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        fn = await self.load()
        out: list[Any] = []
        with anyio.move_on_after(self.limits.timeout) as deadline:
            try:
                cost = await self._run(fn, items, out)
            except MalformedItem:
                raise
            except (Exception, SystemExit) as exc:
                failure = self._fail(f"raised {describe(exc)}")
                failure.index = len(out)
                raise failure from exc
        if deadline.cancelled_caught:
            failure = self._fail(f"timed out after {self.limits.timeout:g} s")
            failure.index = len(out)
            raise failure
        self._measured(cost, len(items))
        try:
            rewards = list(map(float, out))
            if math.isfinite(math.fsum(rewards)):
                return rewards
        except (TypeError, ValueError, OverflowError):
            pass
        rewards = []
        for position, value in enumerate(out):  # the slow path: check each value, to name a bad one
            try:
                rewards.append(check_reward(value))
            except (TypeError, ValueError) as exc:
                failure = self._fail(str(exc))
                failure.index = position
                raise failure from None
        return rewards
