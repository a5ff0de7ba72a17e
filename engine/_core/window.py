"""A concurrency window that adapts to a server's quota: it shrinks on 429 (or 503 with ``Retry-After``) and grows
back while calls succeed, never past the configured ``max_concurrency`` (its ceiling) nor below 1.

The policy is pure functions (:func:`shrunk`, :func:`grown`), tested as such; :class:`Window` applies it, with the
semaphore interface the scheduler and the judge hold around a call (``acquire``/``release``/``max_value``), and is
told each try's outcome by the one POST (``engine._http.post``). Why and how: docs/design.md, "The adaptive window".
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType

__all__ = ["DECREASE", "FIRST_WINDOW", "GROWTH", "RAMP_STEP", "Window", "grown", "opened", "shrunk"]

DECREASE = 0.5  # the window's share kept on a throttle (Reno's): 0.75 took twice the rounds of 429s to come down
GROWTH = 0.25  # slots added per window's worth of successes (additive growth, below twice the last shrink's window)


FIRST_WINDOW = 8  # first tries a fresh window lets in at once: a quota's 429s come back before it has grown far
RAMP_STEP = 0.5  # seconds without an answer after which a ramping window doubles (calls the server holds)


def opened(width: int, elapsed: float, ceiling: int) -> int:
    """A ramping window's width ``elapsed`` seconds after its last answer (or growth): doubled every ``RAMP_STEP``
    (from 8, a ceiling of 128 is open after 0.4 s however long the server holds the calls), never past ``ceiling``."""
    doublings = min(32, max(0, int(elapsed / RAMP_STEP)))
    return min(ceiling, width << doublings)


RATE_SPAN = 1.0  # seconds of successes a recovering window paces its sends by


def spacing(successes: int, span: float) -> float:
    """Seconds between sends while a window recovers from a throttle: the rate the server answered over the last
    ``span`` seconds (``successes`` of them); none yet, none (the throttle's ``Retry-After`` was waited already)."""
    return span / successes if successes > 0 and span > 0 else 0.0


def shrunk(limit: float) -> float:
    """The window after a throttle: ``DECREASE`` of ``limit``, a whole number, never below 1."""
    return max(1.0, math.floor(limit * DECREASE))


def grown(limit: float, ceiling: int, peak: float) -> float:
    """The window after one success: additive (+``GROWTH`` a window's worth) up to twice ``peak`` (the window at the
    last shrink), then doubling a window's worth (slow start: the quota has lifted); never past ``ceiling``."""
    step = 1.0 if limit >= 2 * peak else GROWTH / limit
    return min(float(ceiling), limit + step)


class Window:
    """Up to ``ceiling`` holders at once, fewer while the server throttles: the live width is :attr:`size`.

    Holders are tasks. A try answered with a throttle parks its holder (its slot is free for others) until
    its retry is admitted again (:meth:`readmit`), so a retry waits behind the window like a new call; a
    holder's release frees whatever it holds (nothing, if parked), so an abort leaves the window consistent.
    A throttle from a try sent before the last shrink (an older ``epoch``) does not shrink it again; every
    ``Retry-After`` (capped at ``longest_pause`` seconds) pauses new calls' first tries until it has passed
    (:meth:`paused`, waited with ``sleep``; a retry waits out its own answer's, in the retry driver).
    """

    def __init__(
        self,
        ceiling: int,
        *,
        longest_pause: float,
        ramp: bool = True,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_value = ceiling
        self.limit = float(ceiling)
        self.peak = float(ceiling)
        self.epoch = 0  # shrinks so far: a try's answer counts only if it was sent in the current one
        self.resume_at = 0.0  # clock() before which no try is sent
        self.throttles = 0
        # until the first throttle a window ramps up from FIRST_WINDOW: +1 a success (doubling each round trip,
        # as TCP's slow start) and doubling every RAMP_STEP regardless, to the ceiling (then it is as fixed slots)
        self._width = min(ceiling, FIRST_WINDOW) if ramp else ceiling
        self._width_at: float | None = None  # clock() when _width was last doubled (None: no call yet)
        self._ramping = self._width < ceiling
        self._timer: asyncio.TimerHandle | None = None
        # after a shrink, until a window's worth of successes: sends spaced at the rate the server answered, so a
        # pause's end or a slot freed by a throttle does not send a burst into the emptied quota
        self._successes: deque[float] = deque()  # clock() of each success within RATE_SPAN
        self._recovering = 0  # successes still to come before sends are no longer spaced
        self._next_send = 0.0
        self._longest_pause = longest_pause
        self._clock = clock
        self._sleep = sleep
        self._holders: set[asyncio.Task[object]] = set()
        self._parked: set[asyncio.Task[object]] = set()
        self._waiters: deque[tuple[asyncio.Task[object], asyncio.Future[None]]] = deque()

    @property
    def size(self) -> int:
        """How many may hold it now."""
        return min(int(self.limit), self._ramped())

    @property
    def shown(self) -> int:
        """The window a quota has taught (the ceiling until a throttle): what stats show, the ramp left out."""
        return int(self.limit)

    def _ramped(self) -> int:
        """What the ramp from ``FIRST_WINDOW`` lets in now (the ceiling once it is over)."""
        if not self._ramping:
            return self.max_value
        now = self._clock()
        if self._width_at is None:
            self._width_at = now
        width = opened(self._width, now - self._width_at, self.max_value)
        if width > self._width:
            self._width, self._width_at = width, now
        if width >= self.max_value:
            self._ramping = False
        return width

    @property
    def in_use(self) -> int:
        return len(self._holders)

    def _open(self) -> bool:
        return len(self._holders) < self.size

    async def acquire(self) -> None:
        """Hold a slot: at once if one is free, else in turn."""
        task = _task()
        if not self._waiters and self._open():
            self._holders.add(task)
            return
        await self._wait(task, own=True)

    async def readmit(self) -> None:
        """Before a retry: if the current task's last try was throttled, wait for a slot again (else nothing)."""
        task = _task()
        if task in self._parked:
            await self._wait(task, own=False)
        await self._spaced()

    async def _spaced(self) -> None:
        """While recovering from a throttle: wait for this send's turn, spaced at the rate the server answers."""
        if self._recovering <= 0:
            return
        now = self._clock()
        while self._successes and self._successes[0] < now - RATE_SPAN:
            self._successes.popleft()
        span = min(RATE_SPAN, now - self._successes[0]) if self._successes else 0.0
        at = max(now, self._next_send)
        self._next_send = at + spacing(len(self._successes), span)
        if at > now:
            await self._sleep(at - now)

    async def paused(self) -> None:
        """Before a call's first try: wait out the ``Retry-After`` the latest throttled try was told, then, if a
        shrink since this task took its slot leaves the window over-full, wait for a slot again (not yet sent:
        the tries already sent finish, the rest are not sent into the quota that shrank it)."""
        if (left := self.resume_at - self._clock()) > 0:
            await self._sleep(left)
        await self._spaced()
        task = _task()
        if task in self._holders and len(self._holders) > self.size:
            self._holders.discard(task)
            self._parked.add(task)
            await self._wait(task, own=False)

    async def _wait(self, task: asyncio.Task[object], *, own: bool) -> None:
        """Wait in turn for a slot; ``own``: cancelled once handed one, give it back (no holder's release follows)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((task, future))
        self._wake()
        try:
            await future
        except BaseException:
            if not future.done() or future.cancelled():
                self._drop(future)
            elif own:
                self.release()
            raise

    def _drop(self, future: asyncio.Future[None]) -> None:
        future.cancel()
        self._waiters = deque(pair for pair in self._waiters if pair[1] is not future)

    def release(self) -> None:
        """Give back what the current task holds (nothing, if its last try was throttled and not retried)."""
        task = _task()
        if task in self._parked:
            self._parked.discard(task)
            return
        self._holders.discard(task)
        self._wake()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def _wake(self) -> None:
        """Hand free slots to waiters in turn."""
        waiters = self._waiters
        while waiters and self._open():
            task, future = waiters.popleft()
            if future.done():  # cancelled meanwhile
                continue
            self._parked.discard(task)
            self._holders.add(task)
            future.set_result(None)
        if waiters and self._ramping and self._timer is None:  # the ramp's next doubling lets more in
            self._timer = asyncio.get_running_loop().call_later(RAMP_STEP, self._ramp_on)

    def _ramp_on(self) -> None:
        self._timer = None
        self._wake()

    def answered(self, epoch: int) -> None:
        """A try sent in ``epoch`` succeeded: grow, if no shrink came since it was sent."""
        if self._ramping:  # an answer: the doubling by time (for calls the server holds) waits another step
            self._width, self._width_at = min(self.max_value, self._width + 1), self._clock()
            self._ramping = self._width < self.max_value
            self._wake()
            return
        now = self._clock()
        self._successes.append(now)
        while self._successes[0] < now - RATE_SPAN:
            self._successes.popleft()
        self._recovering -= 1
        if epoch == self.epoch and self.limit < self.max_value:
            before = int(self.limit)
            self.limit = grown(self.limit, self.max_value, self.peak)
            if int(self.limit) > before:
                self._wake()

    def throttled(self, epoch: int, retry_after: float | None) -> None:
        """A try sent in ``epoch`` was throttled: pause for its ``Retry-After``, shrink once per epoch, and park
        the current task's slot until its retry is admitted."""
        self.throttles += 1
        if retry_after is not None and retry_after > 0:
            self.resume_at = max(self.resume_at, self._clock() + min(retry_after, self._longest_pause))
        if epoch == self.epoch:
            self.peak = self.limit = float(self.size)  # a throttle during the ramp shrinks what it had let in
            self._ramping = False
            self.limit = shrunk(self.limit)
            self.epoch += 1
            self._recovering = max(1, int(self.limit))
        task = _task()
        if task in self._holders:
            self._holders.discard(task)
            self._parked.add(task)
        self._wake()


def _task() -> asyncio.Task[object]:
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("a Window is held by a task")
    return task
