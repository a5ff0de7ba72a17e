"""A chunk of cheap calls and the event loop take turns at the GIL: the loop's ready work goes first.

``Turns`` is exercised with a real event loop running in a thread of its own, as the engine's
loop runs beside a chunk's thread; the loop is kept busy by a chain of callbacks, each a pass of
the loop that spends CPU time (holding the GIL, as Python code does) or that sleeps (letting go of
it, as numpy or a tokenizer does).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from engine._core.meters import loop_calls
from engine._verifiers.plugin.turns import SHARED, TURN_STEPS, Turns

PASS = 0.002  # seconds each callback of a busy chain holds the loop: well past an idle pass


def spend(seconds: float) -> None:
    """Keep this thread on a CPU (and the GIL) for ``seconds`` of its own CPU time, then let go of the GIL a
    moment, as a real loop's socket waits do: a thread that only lets go of it for the instant of a
    ``select(0)`` between passes keeps every other thread from it (CPython gives the GIL to a waiter only
    after a switch interval in which it did not change hands), and the test's own thread would never run."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass
    time.sleep(0.0005)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def busy_chain(
    loop: asyncio.AbstractEventLoop, passes: int | None, log: list[str], work: Callable[[float], None] = spend
) -> threading.Event:
    """Keep ``loop`` busy for ``passes`` passes (or until the returned event is set), one callback a pass."""
    stop = threading.Event()

    def step(left: int | None) -> None:
        work(PASS)
        if left == 1 or stop.is_set():
            log.append("chain done")
            return
        loop.call_soon(step, None if left is None else left - 1)

    loop.call_soon_threadsafe(step, passes)
    return stop


def test_a_busy_loop_finishes_its_work_before_the_chunk_goes_on(loop: asyncio.AbstractEventLoop) -> None:
    log: list[str] = []
    busy_chain(loop, 20, log)
    turns = Turns(loop, longest=60.0)
    turns.between(1.0)
    log.append("turn")
    assert log == ["chain done", "turn"]


def test_a_loop_that_waits_without_the_gil_gives_turns_at_once_and_they_stop(loop: asyncio.AbstractEventLoop) -> None:
    log: list[str] = []
    stop = busy_chain(loop, None, log, work=time.sleep)  # busy, but not holding the GIL: nothing to wait for
    turns = Turns(loop, longest=60.0)
    try:
        asked = [asks(turns) for _ in range(4 * TURN_STEPS)]
        # the first turn is asked and given while the loop still sleeps through its passes; turns then stop
        # once one finds the loop idle (at once when quiet; on a loaded machine a pass may show the loop's
        # CPU time past the busy mark, and the next turns are asked too) and stay stopped
        assert asked[0] and not asked[-1]
        stopped = asked.index(False)
        assert asked == [True] * stopped + [False] * (len(asked) - stopped)
        assert log == []
    finally:
        stop.set()


def test_a_loop_busy_for_longer_than_the_longest_turn_still_gives_one(loop: asyncio.AbstractEventLoop) -> None:
    log: list[str] = []
    stop = busy_chain(loop, None, log)
    turns = Turns(loop, longest=0.05)
    try:
        assert turns.between(1.0) > 0
        assert log == []  # the chain still runs: the chunk was not starved
    finally:
        stop.set()


def asks(turns: Turns, lost: float = 0.0) -> bool:
    """Whether the chunk asked the loop for a turn between two steps (``between`` returns 0.0 only if not)."""
    return turns.between(lost) > 0


def test_a_chunk_starts_by_taking_a_turn_and_stops_once_one_finds_the_loop_idle(
    loop: asyncio.AbstractEventLoop,
) -> None:
    turns = Turns(loop, longest=60.0, slow=60.0)  # every turn counts as idle: the loop had nothing of its own
    # a loop whose work waits for the GIL shows no time lost to it: the first turn is asked anyway
    assert [asks(turns) for _ in range(3)] == [True, False, False]


def test_a_turn_not_given_keeps_the_count_of_turns(loop: asyncio.AbstractEventLoop) -> None:
    log: list[str] = []
    stop = busy_chain(loop, None, log)  # never idle: no turn is given within the longest wait
    turns = Turns(loop, longest=0.005, slow=60.0)
    try:
        assert [asks(turns) for _ in range(TURN_STEPS + 1)] == [True] * TURN_STEPS + [False]
    finally:
        stop.set()


def test_a_turn_the_loop_was_slow_to_give_keeps_the_turns_going(loop: asyncio.AbstractEventLoop) -> None:
    turns = Turns(loop, longest=60.0, slow=0.0)  # every turn counts as slow: the loop had work of its own
    assert all(asks(turns) for _ in range(3 * TURN_STEPS))


def test_time_lost_to_others_starts_turns_again(loop: asyncio.AbstractEventLoop) -> None:
    turns = Turns(loop, longest=60.0, slow=60.0)
    while asks(turns):
        pass
    assert asks(turns, lost=2 * SHARED)
    assert not asks(turns)  # the loop was idle when it gave that turn: none until a step loses time again



def test_a_closed_loop_is_not_waited_for() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    turns = Turns(loop)
    assert turns.between(1.0) == 0.0
    assert turns.between(1.0) == 0.0


def test_a_chunk_goes_on_without_a_turn_from_a_loop_that_does_not_run() -> None:
    loop = asyncio.new_event_loop()  # open, but nothing runs it (or other code holds it): the turn never comes
    try:
        turns = Turns(loop, longest=0.05)
        assert turns.between(1.0) >= 0.05  # it waited the longest turn, and no more than that: it returned
    finally:
        loop.close()


def test_turns_go_on_while_the_engine_has_calls_in_flight_on_the_loop(loop: asyncio.AbstractEventLoop) -> None:
    # an endpoint's requests wait for their answers, and each read lets go of the GIL: the loop looks idle
    turns = Turns(loop, longest=60.0, slow=60.0)
    calls = loop_calls(loop)
    calls.count += 1
    try:
        assert all(asks(turns) for _ in range(3 * TURN_STEPS))
    finally:
        calls.count -= 1
    assert [asks(turns) for _ in range(3)] == [True, False, False]  # none in flight: the next idle turn ends them
