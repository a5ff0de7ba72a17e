"""The one way tests wait for something another thread, process or task does: poll a condition until it holds.

``eventually`` waits on the event loop (a server task keeps running meanwhile); ``wait_until`` blocks
the calling thread. Both fail with ``message`` after ``timeout`` seconds, sized for a loaded 2-core
machine: a condition that holds returns at once, so a generous timeout costs nothing. ``each_pass_until``
looks at every pass of the loop, for a state that lasts only a pass or two; ``started`` waits for tasks
to reach their first wait. None counts the loop's passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["POLL_TIMEOUT", "each_pass_until", "eventually", "started", "wait_until"]

T = TypeVar("T")
POLL_TIMEOUT = 10.0  # seconds
INTERVAL = 0.005  # seconds between two looks


async def eventually(condition: Callable[[], T], timeout: float = POLL_TIMEOUT, message: str = "") -> T:
    """Wait on the event loop until ``condition()`` is truthy; return its value."""
    deadline = anyio.current_time() + timeout
    while not (value := condition()):
        if anyio.current_time() > deadline:
            raise AssertionError(message or f"condition not met within {timeout:g} s")
        await anyio.sleep(INTERVAL)
    return value


def wait_until(condition: Callable[[], T], timeout: float = POLL_TIMEOUT, message: str = "") -> T:
    """Block until ``condition()`` is truthy; return its value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(message or f"condition not met within {timeout:g} s")
        time.sleep(INTERVAL)
    return value


async def each_pass_until(condition: Callable[[], T], timeout: float = POLL_TIMEOUT, message: str = "") -> T:
    """Wait until ``condition()`` is truthy, looking at every pass of the event loop; return its value.

    For a state that lasts a pass or two (a task made and not yet begun), which ``eventually``'s sleeps
    would step over."""
    deadline = anyio.current_time() + timeout
    while not (value := condition()):
        if anyio.current_time() > deadline:
            raise AssertionError(message or f"condition not met within {timeout:g} s")
        await anyio.lowlevel.checkpoint()
    return value


async def started(*coroutines: Coroutine[Any, Any, T]) -> list[asyncio.Task[T]]:
    """``coroutines`` as tasks, once each has run up to its first wait: what each does until then (a request
    read, a call submitted) is done. The last to start sets an event; this waits on it.

    One coroutine's start wakes the caller before what that start schedules for the loop runs (a callback
    it asks for with ``call_soon``): the caller sees the state it left."""
    begun, waiting = asyncio.Event(), [len(coroutines)]

    async def run(coroutine: Coroutine[Any, Any, T]) -> T:
        waiting[0] -= 1
        if not waiting[0]:
            begun.set()
        return await coroutine

    tasks = [asyncio.ensure_future(run(coroutine)) for coroutine in coroutines]
    await begun.wait()
    return tasks
