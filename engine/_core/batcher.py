"""The window that gathers what arrives together on one event loop into batches: ``engine serve``'s gatherer and
the adapters' coalescer both build on it (docs/design.md, "Gathering")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Batcher"]

T = TypeVar("T")


class Batcher(Generic[T]):
    """Entries added on one event loop, handed on as batches.

    An entry waits while each pass of the loop brings more, for at most ``window`` seconds from the
    first; then what waits goes to ``send`` as one batch. A batch never holds more than ``most`` items
    (an entry larger than that goes alone). With ``hold``, a window that stops growing while a batch
    sent earlier is still running waits for that batch's end (:meth:`ended`) or its deadline, so that
    batches grow with the load.

    Args:
        send: Told each batch, in the order of its entries; called on the loop, never concurrently.
        window: Seconds the first entry of a batch waits for more, at most.
        most: Items a batch holds at most.
        hold: Whether to wait for running batches (the owner then calls :meth:`ended` once per batch sent).
    """

    def __init__(self, send: Callable[[list[T]], None], *, window: float, most: int, hold: bool = False) -> None:
        self._send = send
        self._window = window
        self._most = most
        self._hold = hold
        self._pending: list[T] = []
        self._count = 0  # items pending
        self._generation = 0  # which chain of passes is current: a flush ends the one under way
        self._seen = 0  # entries pending at the last pass
        self._deadline = 0.0
        self._held: asyncio.TimerHandle | None = None  # the deadline of entries held for a running batch's end
        self._running = 0  # batches sent whose end was not told yet (with hold only)

    def add(self, entry: T, size: int) -> None:
        """Add ``entry`` of ``size`` items (at least one) to the next batch; call it on the loop."""
        if self._pending and self._count + size > self._most:
            self.flush()  # a batch never holds more than the largest
        self._pending.append(entry)
        self._count += size
        if self._count >= self._most:
            self.flush()
        elif len(self._pending) == 1:
            loop = asyncio.get_running_loop()
            self._seen, self._deadline = 1, loop.time() + self._window
            loop.call_soon(self._pass, loop, self._generation)

    def _pass(self, loop: asyncio.AbstractEventLoop, generation: int) -> None:
        """One pass of the loop later: wait one more if the last brought entries; else, while a batch sent
        earlier runs (``hold``), wait for its end, up to the deadline; else send what waits."""
        if generation != self._generation:
            return  # flushed meanwhile
        if loop.time() < self._deadline:
            count = len(self._pending)
            if count > self._seen:
                self._seen = count
                loop.call_soon(self._pass, loop, generation)
                return
            if self._running:
                self._held = loop.call_at(self._deadline, self.flush)
                return
        self.flush()

    def flush(self) -> None:
        """Send what waits now, as one batch (nothing if nothing waits)."""
        entries = self._take()
        if entries:
            if self._hold:
                self._running += 1
            self._send(entries)

    def ended(self) -> None:
        """A batch sent (with ``hold``) has ended its work: entries held for it go now."""
        self._running -= 1
        if self._held is not None:
            self.flush()

    def close(self) -> list[T]:
        """The entries still waiting, taken out of the window: no batch will hold them."""
        return self._take()

    def _take(self) -> list[T]:
        if self._held is not None:
            self._held.cancel()
            self._held = None
        self._generation += 1
        entries, self._pending, self._count = self._pending, [], 0
        return entries
