"""A lane's book: each call's account, kept as it runs, and the sums a ``VerifierReport`` is made of
(docs/design.md, The scheduler)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from time import perf_counter

__all__ = ["Book", "Call", "total"]


def total(rewards: Sequence[float]) -> float:
    """The sum of ``rewards``: exact (``math.fsum``), or as ``sum`` gives it where ``fsum`` raises (overflow)."""
    try:
        return math.fsum(rewards)
    except (OverflowError, ValueError):
        return sum(rewards)


class Book:
    """One lane's figures, added up call by call: what its calls waited, spent in the verifier and started up,
    their latencies, their peak in flight and their rewards' sum."""

    __slots__ = (
        "busy",
        "first_start",
        "last_end",
        "latencies",
        "latency_items",
        "peak",
        "ready",
        "reward_sum",
        "running",
        "startup",
        "waited",
    )

    def __init__(self) -> None:
        self.waited = 0.0  # seconds calls waited to start (from the lane's start) and for a limit inside them
        self.busy = 0.0  # seconds spent in calls, less their waits and start-up inside (meters.waiting, .starting)
        self.latencies: list[float] = []  # seconds per item, one entry per call (start-up calls none)
        self.latency_items: list[int] = []  # items each entry stands for (a chunk's)
        self.startup: list[float] = []  # seconds each call that started the verifier up spent so
        self.reward_sum = 0.0
        self.running = 0
        self.peak = 0
        self.ready = math.inf  # when its items could first have been called: its workers' start (perf_counter)
        self.first_start = math.inf  # when its first call started (perf_counter), and its last ended
        self.last_end = -math.inf

    def open(self) -> None:
        """Its items may be called from now on: a call's wait to start is counted from here."""
        self.ready = perf_counter()

    def add(self, call: Call, rewards: Sequence[float]) -> None:
        """Add a call that returned ``rewards`` (fewer than its items if it met another environment's)."""
        self.last_end = call.ended
        seconds = call.ended - call.started - call.waited - call.startup
        self.waited += call.started - self.ready + call.waited  # one wait a call, as busy is one span a call
        self.busy += seconds
        if call.startup:  # it started the verifier up, or waited on that (an import, a worker): start-up
            self.startup.append(call.startup)
        elif rewards:  # nor its latency: after an import, 64 calls of a 10 us plugin took 46-93 ms each (p99 23 ms)
            self.latencies.append(seconds / len(rewards))
            self.latency_items.append(len(rewards))
        if rewards:
            self.reward_sum += total(rewards)


class Call:
    """One call's account (``meters.Account``), from its start: a wait for a limit inside it is waiting,
    and its verifier's start-up is start-up; in neither is it in flight.

    A call that waits as it begins (a judge's slot, before it has yielded) was never in flight: the
    peak its start raised is taken back, unless another call has started since.
    """

    __slots__ = ("book", "ended", "raised", "started", "startup", "waited")

    def __init__(self, book: Book) -> None:
        self.book = book
        self.waited = 0.0
        self.startup = 0.0
        self.raised: tuple[int, int] | None = None  # (the peak before its start, the peak its start set)
        book.running += 1
        if book.running > book.peak:
            self.raised, book.peak = (book.peak, book.running), book.running
        self.started = self.ended = perf_counter()
        book.first_start = min(book.first_start, self.started)

    def end(self) -> None:
        """The call has returned or raised: it is no longer in flight."""
        self.ended = perf_counter()
        self.book.running -= 1

    def paused(self) -> None:
        book = self.book
        if self.raised is not None and book.peak == book.running == self.raised[1]:
            book.peak = self.raised[0]
        self.raised = None
        book.running -= 1

    def resumed(self, seconds: float) -> None:
        book = self.book
        book.running += 1
        book.peak = max(book.peak, book.running)
        self.waited += seconds

    def started_up(self, seconds: float) -> None:
        self.resumed(0.0)
        self.startup += seconds
