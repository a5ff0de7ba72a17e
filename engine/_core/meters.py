"""Every limit the engine keeps, in one vocabulary: *slots* (how many at once) and a *rate* (how many a second).

Which limits are meters, and how a call's waiting and start-up are told from its time verifying:
docs/design.md, Limits and accounts.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

import anyio

from engine._core.window import Window

if TYPE_CHECKING:
    from aiolimiter import AsyncLimiter

    from engine._config import Limits

__all__ = [
    "Account",
    "Ledger",
    "LoopCalls",
    "Meter",
    "Slots",
    "held",
    "ledger",
    "loop_calls",
    "rate",
    "slots",
    "starting",
    "threads",
    "waiting",
]


def slots(size: int) -> anyio.Semaphore:
    """``size`` slots: at most that many holders at once (and never released past ``size``)."""
    return anyio.Semaphore(size, max_value=size, fast_acquire=True)


def rate(per_second: float) -> AsyncLimiter:
    """A limiter of ``per_second`` calls a second: bursts of up to one second's worth.

    aiolimiter's bucket holds ``max_rate`` tokens, so a rate below one a second is written as one
    call per ``1 / per_second`` seconds (a bucket of less than one token would never grant any).
    """
    from aiolimiter import AsyncLimiter  # only rate-limited verifiers and judges need it

    if per_second >= 1:
        return AsyncLimiter(per_second, 1.0)
    return AsyncLimiter(1, 1 / per_second)


def threads(size: int) -> anyio.CapacityLimiter:
    """``size`` threads at once: the limit the thread executor holds a token of per call in a thread."""
    return anyio.CapacityLimiter(size)


Slots = anyio.Semaphore | Window  # what a call holds: fixed slots, or a window adapting to a quota


@dataclass(frozen=True, eq=False)
class Meter:
    """A caller's limits as live objects: ``slots`` held for a whole call, and an optional ``rate``.

    ``window`` is the adaptive window its calls go through, if any: its ``slots`` (an endpoint's), or the
    judge's a rubric's calls queue for inside the call; what a batch's report shows.
    """

    slots: Slots
    rate: AsyncLimiter | None
    window: Window | None = None

    @classmethod
    def of(cls, max_concurrency: int, max_rate: float | None) -> Meter:
        return cls(slots(max_concurrency), rate(max_rate) if max_rate is not None else None)

    @classmethod
    def adaptive(cls, limits: Limits, sleep: Callable[[float], Awaitable[None]]) -> Meter:
        """A meter whose slots are a :class:`Window` under ``max_concurrency`` (an endpoint's): a ``Retry-After``
        pauses it (waited with ``sleep``) no longer than a retry may wait (``retry_deadline``)."""
        window = Window(limits.max_concurrency, longest_pause=limits.retry_deadline, sleep=sleep)
        return cls(window, rate(limits.max_rate) if limits.max_rate is not None else None, window)

    def through(self, window: Window) -> Meter:
        """This meter, its calls going through ``window`` inside them (a rubric's, through the judge's)."""
        return Meter(self.slots, self.rate, window)

    @classmethod
    def from_limits(cls, limits: Limits) -> Meter:
        return cls.of(limits.max_concurrency, limits.max_rate)

    @property
    def width(self) -> int:
        """How many calls may be in flight at once: its slots."""
        width = self.slots.max_value
        assert width is not None  # slots() always sets it
        return width


class Account(Protocol):
    """What a call tells whoever measures it (the scheduler) about time inside it that is not time in
    the verifier: its own wait for a limit, and its start-up."""

    def paused(self) -> None:
        """The call has begun waiting for a limit: it is not in flight meanwhile."""

    def resumed(self, seconds: float) -> None:
        """The call waited ``seconds`` for a limit, and is in flight again."""

    def started_up(self, seconds: float) -> None:
        """The call spent ``seconds`` starting its verifier up (after :meth:`paused`), and is in flight again."""


class Ledger:
    """Whose account the call a task is making charges (:func:`waiting`, :func:`starting`).

    Set once per task, in its context variable (every task has its own context, so concurrent calls
    each charge their own); the call in progress is then one attribute, changed per call. Setting the
    variable per call instead made a token per call that the garbage collector tracks: at 256
    endpoint calls in flight it doubled the young collections and cost ~5 us a call.
    """

    __slots__ = ("account",)

    def __init__(self) -> None:
        self.account: Account | None = None


_LEDGER: ContextVar[Ledger | None] = ContextVar("engine_ledger", default=None)


def ledger() -> Ledger:
    """A ledger for the calls the current task makes, from now until it ends."""
    book = Ledger()
    _LEDGER.set(book)
    return book


def _account() -> Account | None:
    book = _LEDGER.get()
    return None if book is None else book.account


@contextmanager
def _account_paused(done: Callable[[Account, float], None]) -> Iterator[None]:
    """Time inside a call that is not the call's own: the account is paused, then told how long by ``done``."""
    account = _account()
    if account is None:
        yield
        return
    account.paused()
    started = perf_counter()
    try:
        yield
    finally:
        done(account, perf_counter() - started)


def waiting() -> AbstractContextManager[None]:
    """Wait for a limit inside a call (the judge's slots or rate): the time is the call's account's waiting."""
    return _account_paused(lambda account, seconds: account.resumed(seconds))


@asynccontextmanager
async def held(limit: Slots) -> AsyncIterator[None]:
    """One of ``limit``'s slots held for the block, inside a call: the time queued for it is the call's waiting
    (a limit a verifier keeps itself, the judge's, a worker pool's, is a limit as the scheduler's are)."""
    with waiting():
        await limit.acquire()
    try:
        yield
    finally:
        limit.release()


def starting() -> AbstractContextManager[None]:
    """Start a verifier up inside a call (a plugin's import, a worker's spawn): the time is the call's
    account's start-up, neither waiting nor time verifying. Entered only on the path that starts
    something, so a warm call pays nothing for it."""
    return _account_paused(lambda account, seconds: account.started_up(seconds))


class LoopCalls:
    """How many of the engine's calls that run on one event loop are in flight (an endpoint's request, a
    judge's, an async plugin's; counted by the scheduler around each call of one item).

    A chunk of cheap calls in a thread gives that loop turns at the GIL while any are
    (``engine._verifiers.plugin.turns``; why: docs/design.md, Turns at the GIL).
    """

    __slots__ = ("__weakref__", "count")

    def __init__(self) -> None:
        self.count = 0


_LOOP_CALLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopCalls] = weakref.WeakKeyDictionary()


def loop_calls(loop: asyncio.AbstractEventLoop) -> LoopCalls:
    """The count of the engine's calls in flight on ``loop`` (one per loop, shared by every engine on it)."""
    calls = _LOOP_CALLS.get(loop)
    if calls is None:
        calls = _LOOP_CALLS[loop] = LoopCalls()
    return calls
