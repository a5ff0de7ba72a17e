"""The engine's one thread mechanism: daemon threads kept between jobs, whose futures outlive their waiters.

Work the event loop may stop waiting for but cannot stop (an import, a plugin's calls, a worker
process's round trip) runs here; a daemon thread never holds up the interpreter's exit. The design
is in docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable
from time import monotonic
from typing import Any, TypeVar

__all__ = ["IDLE_SECONDS", "KeptThread", "ThreadPool", "in_thread", "wait_future"]

T = TypeVar("T")
IDLE_SECONDS = 10.0  # a pool's thread idle this long ends when the pool is next used (anyio's rule)

_Job = tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None  # None: the thread ends


class KeptThread:
    """One daemon thread that runs the jobs it is given one at a time, in order, kept between them.

    The thread starts with the first job. :meth:`submit` and :meth:`close` may be called from any thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # the last job's future, weakly: what it holds (a chunk's rewards) is not kept here once its waiter is done
        self._last: weakref.ref[concurrent.futures.Future[Any]] | None = None
        self._lock = threading.Lock()
        self.closed = False

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` once the jobs before it are done; after :meth:`close`, on a thread that ends after it."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if not self.closed:
                self._last = weakref.ref(future)
                self._jobs.put((fn, future))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                    self._thread.start()
                return future
        return in_thread(fn, self.name)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every job it was given to be done; whether they are."""
        last = self._last() if self._last is not None else None  # gone: done, and nobody waits for it
        return last is None or not concurrent.futures.wait([last], timeout).not_done

    def close(self) -> None:
        """Let the thread end once it has run what it was given."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._jobs.put(None)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the thread to end (once closed)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            del job, fn, future  # nothing of a finished job is kept while the thread waits for the next


def in_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run ``fn`` in a new daemon thread that ends after it; its future outlives whoever started it."""
    thread = KeptThread(name)
    future = thread.submit(fn)
    thread.close()
    return future


class ThreadPool:
    """Daemon threads kept between jobs: a job runs on an idle one, or on a new one if none is idle.

    At most ``keep`` threads stay idle (None: any number); one past that ends as its job does, so with
    ``keep=1`` a job nobody waits for any more (it may run for ever) never holds up the next. A thread
    idle for ``idle_seconds`` (None: for ever) ends when the pool is next used. After :meth:`close`, a
    job runs on a thread that ends after it.
    """

    def __init__(self, name: str, *, keep: int | None = None, idle_seconds: float | None = IDLE_SECONDS) -> None:
        self.name = name
        self._keep = keep
        self._idle_seconds = idle_seconds
        self._idle: list[tuple[KeptThread, float]] = []  # with when each went idle; the last, most recently
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on an idle thread of the pool, or on a new one."""
        with self._lock:
            if self._closed:
                return in_thread(fn, self.name)
            self._end_idle_since(monotonic())
            thread = self._idle.pop()[0] if self._idle else KeptThread(self.name)
        future = thread.submit(fn)
        # Added before any waiter's callback (wait_future's): the thread is idle again before its waiter
        # wakes, so a waiter that submits its next job at once finds it, instead of starting another.
        future.add_done_callback(lambda _: self._rest(thread))
        return future

    def _rest(self, thread: KeptThread) -> None:
        with self._lock:
            if self._closed or (self._keep is not None and len(self._idle) >= self._keep):
                thread.close()
            else:
                self._idle.append((thread, monotonic()))

    def _end_idle_since(self, now: float) -> None:
        """End the threads idle for ``idle_seconds`` (the oldest stand first)."""
        if self._idle_seconds is None:
            return
        ended = 0
        for _, since in self._idle:
            if now - since < self._idle_seconds:
                break
            ended += 1
        for thread, _ in self._idle[:ended]:
            thread.close()
        del self._idle[:ended]

    def close(self) -> None:
        """End its idle threads; the busy ones end after their jobs."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for thread, _ in idle:
            thread.close()


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """Await ``future``; cancelling the waiter leaves the future (and its thread) running."""
    waiter = asyncio.wrap_future(future)
    waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
    return await asyncio.shield(waiter)
