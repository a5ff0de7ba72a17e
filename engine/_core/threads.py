"""Threads whose result outlives whoever waits for it.

The event loop may stop waiting for blocking work (a timeout, an abort) that it cannot stop: an
import, a chunk of plugin calls, a worker process's round trip. Such work runs in a thread of its
own whose future stays valid after its waiter is cancelled, so the next caller can wait for the
same result (an import done once) and nothing logs a result that was never retrieved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["in_thread", "wait_future"]

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


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """Await ``future``; cancelling the waiter leaves the future (and its thread) running."""
    waiter = asyncio.wrap_future(future)
    waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
    return await asyncio.shield(waiter)
