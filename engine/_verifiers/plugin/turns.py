"""Turns at the GIL: a chunk of cheap calls in a thread lets the event loop it was started from go first.

The design and its measurements are in docs/design.md, "Turns at the GIL".
"""

from __future__ import annotations

import asyncio
import math
import threading
from time import perf_counter, thread_time

from engine._core.meters import loop_calls

__all__ = ["SHARED", "TURN_STEPS", "Turns"]

SHARED = 0.2e-3  # seconds others held the GIL (or the CPU) during one step: the loop has work, so turns begin
BUSY_TURN = 0.5e-3  # seconds of the loop's own CPU time during a turn: it has work, and turns go on
IDLE_PASS = 0.1e-3  # a pass of the loop that used this little CPU time ran nothing but the turn's callback
LONGEST_TURN = 0.01  # seconds a chunk waits at most for the loop to be idle: a busy loop never starves it
TURN_STEPS = 20  # steps a chunk takes turns (unless one finds the loop idle) after it last found the GIL shared


class Turns:
    """A chunk's turns with the event loop it was started from (docs/design.md, "Turns at the GIL").

    Between two steps the chunk's thread calls :meth:`between` with the time its last step lost to others;
    while the loop has work, it asks the loop for a turn and waits until a pass of the loop is idle, or
    ``longest`` at most, and ``patience`` seconds in all at most.
    """

    __slots__ = (
        "_asked",
        "_asks",
        "_busy",
        "_calls",
        "_cpu",
        "_first",
        "_held",
        "_idle",
        "_left",
        "_longest",
        "_loop",
        "_patience",
        "_slow",
        "_turn",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        longest: float = LONGEST_TURN,
        slow: float = BUSY_TURN,
        patience: float = math.inf,
    ) -> None:
        self._loop = loop
        self._calls = loop_calls(loop)  # the engine's own calls in flight on the loop: while any, turns go on
        self._longest, self._slow, self._patience = longest, slow, patience
        self._turn = threading.Event()
        self._left = TURN_STEPS  # a chunk starts taking turns: the loop may have work waiting already
        self._busy = False  # whether the last turn found the loop with work
        self._asks = 0  # turns asked for: a callback for an earlier one (the chunk went on without it) stops
        self._asked = 0.0  # when the turn was asked for
        # the loop thread's CPU time when the callback first ran for this turn, and at its last pass (None:
        # not yet); and the loop's CPU time between the first pass and the turn given
        self._first: float | None = None
        self._cpu = 0.0
        self._held = 0.0
        self._idle = False  # whether the turn was given by an idle pass (not by the longest wait)

    def _ask(self, turn: int) -> None:  # on the loop, once a pass
        if turn != self._asks:
            return
        cpu = thread_time()
        if self._first is None:
            self._first = cpu
        elif (idle := cpu - self._cpu < IDLE_PASS) or perf_counter() - self._asked > self._longest:
            self._held, self._idle = cpu - self._first, idle
            self._turn.set()
            return
        self._cpu = cpu
        self._loop.call_soon(self._ask, turn)

    def between(self, lost: float) -> float:
        """In the chunk's thread, between steps: let the loop go first if it has been busy; the seconds waited."""
        if self._patience <= 0:
            return 0.0
        engine_calls = self._calls.count
        if lost > SHARED or self._busy or engine_calls:
            self._left = TURN_STEPS
        elif self._left:
            self._left -= 1
        else:
            return 0.0
        self._asks += 1  # first: a callback of the last turn still running stops before it can give this one
        started = self._asked = perf_counter()
        self._first, self._held, self._idle = None, 0.0, False
        self._turn.clear()
        try:
            self._loop.call_soon_threadsafe(self._ask, self._asks)
        except RuntimeError:  # the loop is closed: there is nobody to take turns with
            self._left = 0
            return 0.0
        given = self._turn.wait(min(self._longest, self._patience))
        waited = perf_counter() - started
        # the loop spent CPU time of its own while the chunk waited: it has work, and turns go on. A turn
        # not given (a loop held by other code, or not running) says nothing: time lost in steps will.
        self._busy = given and self._held >= self._slow
        if given and self._idle and not self._busy and not engine_calls:  # the loop had nothing to do: no turns
            self._left = 0
        self._patience -= waited
        return waited
