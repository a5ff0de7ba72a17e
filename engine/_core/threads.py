"""Threads whose result outlives whoever waits for it.

The event loop may stop waiting for blocking work (a timeout, an abort) that it cannot stop: an
import, a chunk of plugin calls, a worker process's round trip. Such work runs in a thread of its
own whose future stays valid after its waiter is cancelled, so the next caller can wait for the
same result (an import done once) and nothing logs a result that was never retrieved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["KeptThread", "in_thread", "wait_future"]

T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
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


_Job = tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None  # None: the thread ends


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    while (job := jobs.get()) is not None:
        fn, future = job
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
        del job, fn, future  # nothing of a finished job is kept while the thread waits for the next


class KeptThread:
    """One daemon thread that runs work one piece at a time, kept between pieces.

    A thread per piece costs its start (~100-150 us: most of a one-item batch of a cheap plugin); a
    kept one, two wake-ups. A piece its caller stopped waiting for (a timeout, an abort) may still run,
    for ever if it hangs: the next piece then gets a new thread, and the old one ends once its piece
    does. Call :meth:`submit` and :meth:`close` from one thread (the event loop's).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job] | None = None
        self._last: concurrent.futures.Future[Any] | None = None
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the thread once what it runs now is done (on a new thread if that is still running).

        After :meth:`close` (a batch that waited its turn while the engine closed) ``fn`` still runs,
        on a thread that ends after it: nobody would close a thread kept from then on.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._jobs is None or (self._last is not None and not self._last.done()):
            self._retire()  # a thread still busy with work nobody waits for ends after it
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name=self._name, daemon=True).start()
        self._last = future
        self._jobs.put((fn, future))
        if self._closed:
            self._retire()
        return future

    def close(self) -> None:
        """Let the thread end once it has run what it was given; a later piece gets a thread of its own."""
        self._closed = True
        self._retire()

    def _retire(self) -> None:
        """Let the current thread end once it has run what it was given."""
        jobs, self._jobs, self._last = self._jobs, None, None
        if jobs is not None:
            jobs.put(None)


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """Await ``future``; cancelling the waiter leaves the future (and its thread) running."""
    waiter = asyncio.wrap_future(future)
    waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
    return await asyncio.shield(waiter)
