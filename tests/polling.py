"""The one way tests wait for something another thread or process does: poll a condition until it holds.

``eventually`` waits on the event loop (a server task keeps running meanwhile); ``wait_until`` blocks
the calling thread. Both fail with ``message`` after ``timeout`` seconds, sized for a loaded 2-core
machine: a condition that holds returns at once, so a generous timeout costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

__all__ = ["POLL_TIMEOUT", "eventually", "wait_until"]

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
