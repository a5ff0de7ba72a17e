"""The thread executor's side of a sync plugin: what runs in the engine's threads, not on the event loop.

A chunk of calls (:func:`run_chunk`) or one call (:func:`timed`) runs in a thread, with everything
it does to its items (reading them, copying them, turning values into rewards), and measures what
it cost there. Python cannot stop a thread: a call whose caller gave up on it (a timeout, an abort)
is counted as abandoned (:class:`Abandoned`) until it returns, so the verifier can refuse new calls
while too many still run, and a chunk checks between steps that its caller still waits, so an
abandoned chunk stops within a step.

A chunk of cheap calls keeps a CPU busy in Python, so it holds the GIL, and the event loop that
started it shares that GIL: each time the loop lets go of it (every socket read and write, every
wait for I/O) the chunk's thread takes it, and the loop waits for it back for up to the
interpreter's switch interval (5 ms). A loop serving endpoint calls beside such a chunk crawled,
and the chunk with it (measured: a batch mixing both took 1.9x its two parts run apart, and the
endpoint calls' p99 rose 14-fold). So the two take turns (:class:`Turns`): while the loop has work,
a chunk hands it a turn after each step (~1 ms) and waits until a pass of the loop has nothing else
to run. A chunk alone, or beside a loop with little to do (a trainer's timer), stops asking: the
switch interval bounds what the loop waits then.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from gc import is_tracked
from time import perf_counter, thread_time
from typing import Any, TypeVar

from engine._core.contract import MalformedItem, as_rewards, private_pair
from engine._core.meters import loop_calls
from engine._verifiers.plugin.wire import Cost

__all__ = ["Abandoned", "ThreadCall", "Turns", "run_chunk", "timed"]

T = TypeVar("T")
SHARED = 0.2e-3  # seconds others held the GIL (or the CPU) during one step: the loop has work, so turns begin
BUSY_TURN = 0.5e-3  # seconds of the loop's own CPU time during a turn: it has work, and turns go on
IDLE_PASS = 0.1e-3  # a pass of the loop that used this little CPU time ran nothing but the turn's callback
LONGEST_TURN = 0.01  # seconds a chunk waits at most for the loop to be idle: a busy loop never starves it
TURN_STEPS = 20  # steps a chunk takes turns (unless one finds the loop idle) after it last found the GIL shared


class Turns:
    """A chunk's turns with the event loop it was started from (see the module's docstring).

    Between two steps the chunk's thread calls :meth:`between` with the time its last step lost to
    others (wall time less its CPU time: the GIL held by another thread, or the CPU taken by another
    process). Past ``SHARED``, and for ``TURN_STEPS`` steps after (and its first ``TURN_STEPS``: a
    loop whose work waits for the GIL shows none lost, as it gets none), it asks the loop for a turn
    and waits for it. The loop gives it once a pass of it has used next to no CPU (``IDLE_PASS`` of
    the loop thread's CPU time): a callback that calls itself again each pass until then, or until
    ``longest`` has gone by. A pass that waits without the GIL (a trainer's numpy or tokenizer work,
    a sleep) is idle by that measure: the chunk does not hold up such a loop, so it does not wait
    for it. The chunk waits ``longest`` at most, so a loop held by other code (or not running) delays
    it no more than that a step. While the loop spends CPU time of its own (``slow``) during the
    turns, or the engine has calls of its own in flight on it (``engine._core.meters.LoopCalls``: an
    endpoint's requests, whose every socket read lets go of the GIL, look idle by CPU time while they
    wait for it), they go on; a turn that finds the loop idle ends them, until a step loses time again.

    A chunk waits ``patience`` seconds in all at most, then runs on without turns: a loop never idle
    would make each ~1 ms step wait ``longest``, and the chunk (sized to a tenth of its timeout in
    calls) outlast its timeout, a cheap plugin timing out.
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


def timed(fn: Callable[..., Any], task: Mapping[str, Any], trajectory: Any) -> tuple[float, Cost]:
    """The reward ``fn(task, trajectory)`` returns, and what it cost, measured in its thread (no hop, no queue).

    The value becomes a reward here, in the call's thread and within its timeout, as a chunk's do:
    its ``__float__`` is the plugin's code, which must not run on the event loop. A value that is
    not a reward raises :class:`BadItem`.
    """
    started, cpu = perf_counter(), thread_time()
    reward = as_rewards([fn(task, trajectory)])[0]
    return reward, (perf_counter() - started, thread_time() - cpu)


def run_chunk(
    fn: Callable[..., Any],
    items: Sequence[Mapping[str, Any]],
    out: list[Any],
    environment: str,
    step: int,
    wanted: Callable[[], bool],
    converting: list[int],
    turns: Turns | None = None,
) -> tuple[list[float], Cost]:
    """Call ``fn`` on each item into ``out`` (runs in a worker thread); the rewards, and what they cost.

    Everything a chunk does to its items happens here, in one thread (see ``engine._core.contract.Items``): it slices
    them ``step`` at a time, and between steps stops if its caller no longer waits (an abort, a
    timeout), so an abandoned chunk ends within a step. It stops early, returning fewer rewards,
    at an item of another environment than ``environment`` (the batch was not all one
    environment's). On an exception, ``len(out)`` is the position of the item that raised;
    :class:`BadItem` names an item that cannot be copied, or a value that is not a reward. Once
    every call has returned, ``converting[0]`` is the position of the value being made a reward
    one at a time (its ``__float__`` is the plugin's code, which may overrun the timeout).
    With ``turns``, it takes turns with the event loop between steps; the time it waits for them
    is not in the cost it returns (that sizes its verifier's chunks).
    """
    append = out.append
    at = functools.partial(converting.__setitem__, 0)
    copy, tracked = dict.copy, is_tracked
    started, cpu = perf_counter(), thread_time()
    waited = 0.0  # for turns
    step_wall, step_cpu = started, cpu
    for start in range(0, len(items), step):
        if turns is not None and start:
            wall, used = perf_counter(), thread_time()
            waited += turns.between((wall - step_wall) - (used - step_cpu))
            step_wall, step_cpu = perf_counter(), thread_time()
        if not wanted():
            raise RuntimeError("abandoned")  # nobody waits for this
        for item in items[start : start + step]:
            try:
                task, trajectory, name = item["task"], item["trajectory"], item["environment"]
            except (KeyError, TypeError):
                raise MalformedItem(len(out)) from None
            if name != environment:
                return as_rewards(out, at), (perf_counter() - started - waited, thread_time() - cpu)
            # each call is handed a task and a trajectory of its own: private_pair, inlined for a text
            # and a task with no container in it (a dict the garbage collector does not track)
            if type(task) is dict and type(trajectory) is str and not tracked(task):
                task = copy(task)
            else:
                task, trajectory = private_pair(len(out), task, trajectory)
            append(fn(task, trajectory))
    return as_rewards(out, at), (perf_counter() - started - waited, thread_time() - cpu)


class Abandoned:
    """A verifier's thread calls whose caller gave up (a timeout, an abort) while they still run."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()  # guards count and every call's state

    def call(self) -> ThreadCall:
        return ThreadCall(self)


class Interrupted(Exception):
    """A ``KeyboardInterrupt`` a plugin's code raised in a thread: the plugin's failure, never a Ctrl-C
    (Python delivers signals to the main thread only), carried to the loop as one."""

    def __init__(self, raised: KeyboardInterrupt) -> None:
        self.raised = raised
        super().__init__(raised)


class ThreadCall:
    """One call in a thread: counted as abandoned from when its caller gives up until it returns."""

    __slots__ = ("_abandoned", "_state")

    def __init__(self, abandoned: Abandoned) -> None:
        self._abandoned = abandoned
        self._state = "pending"  # -> running -> done; "given up" before or while running

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread; skipped if its caller already gave up on it."""
        lock = self._abandoned.lock
        with lock:
            if self._state == "given up":
                raise RuntimeError("abandoned before it started")  # nobody waits for this
            self._state = "running"
        try:
            return fn(*args)
        except KeyboardInterrupt as exc:
            raise Interrupted(exc) from exc
        finally:
            with lock:
                if self._state == "abandoned":
                    self._abandoned.count -= 1
                self._state = "done"

    def wanted(self) -> bool:
        """Whether its caller still waits for it (read without the lock: a stale answer costs one step)."""
        return self._state == "running"

    def give_up(self) -> None:
        """Its caller stops waiting (no-op once it is done)."""
        with self._abandoned.lock:
            if self._state == "running":
                self._state = "abandoned"
                self._abandoned.count += 1
            elif self._state == "pending":
                self._state = "given up"
