"""The one window gathering entries into batches (``engine._core.batcher``), on a real event loop: what arrives
together goes together, no batch holds more than its most, a held window waits for the batch running, and a
closed window sends nothing more. ``engine serve``'s gatherer and the adapters' coalescer are tested on it in
test_serve_gather.py and test_adapters_gathering.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine._core.batcher import Batcher

pytestmark = pytest.mark.timeout(60)

NEVER = 3600.0  # seconds: a window whose deadline no test reaches


class Sent:
    """The batches a window sent, in order; ``wait(n)`` until there are ``n``."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self._changed = asyncio.Event()

    def __call__(self, entries: list[Any]) -> None:
        self.batches.append(entries)
        self._changed.set()

    async def wait(self, count: int) -> list[list[Any]]:
        while len(self.batches) < count:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 30)
        return self.batches


async def test_entries_added_together_go_as_one_batch_in_their_order() -> None:
    sent = Sent()
    window: Batcher[str] = Batcher(sent, window=NEVER, most=100)
    for name in "abcde":
        window.add(name, 1)
    assert sent.batches == []  # they wait for the loop's next pass to bring more
    assert await sent.wait(1) == [list("abcde")]


async def test_a_window_grows_while_each_pass_of_the_loop_brings_more() -> None:
    sent = Sent()
    window: Batcher[int] = Batcher(sent, window=NEVER, most=100)
    for n in range(0, 20, 2):  # two entries, then a pass of the loop: each pass has brought more
        window.add(n, 1)
        window.add(n + 1, 1)
        await asyncio.sleep(0)
    assert await sent.wait(1) == [list(range(20))]  # the pass that brought none sent them, together


async def test_a_batch_never_holds_more_than_its_most_and_a_larger_entry_goes_alone() -> None:
    sent = Sent()
    window: Batcher[str] = Batcher(sent, window=NEVER, most=5)
    window.add("three", 3)
    window.add("two", 2)  # five: full, sent at once
    assert sent.batches == [["three", "two"]]
    window.add("four", 4)
    window.add("also four", 4)  # eight would be over: the four before it goes first
    assert sent.batches == [["three", "two"], ["four"]]
    window.add("nine", 9)  # larger than any batch: the one waiting goes, then it alone
    assert sent.batches == [["three", "two"], ["four"], ["also four"], ["nine"]]
    window.add("one", 1)
    assert await sent.wait(5) == [["three", "two"], ["four"], ["also four"], ["nine"], ["one"]]


async def test_a_window_ends_at_its_deadline_however_long_it_keeps_growing() -> None:
    sent = Sent()
    window: Batcher[int] = Batcher(sent, window=0.01, most=10**9)
    stop = asyncio.Event()

    async def steady() -> None:  # more entries every pass of the loop: the window would grow for ever
        n = 0
        while not stop.is_set():
            window.add(n, 1)
            window.add(n + 1, 1)
            n += 2
            await asyncio.sleep(0)

    feeding = asyncio.ensure_future(steady())
    try:
        batches = await sent.wait(2)
    finally:
        stop.set()
        await feeding
    assert len(batches[0]) > 1 and batches[1][0] == batches[0][-1] + 1  # in order, none lost between them


async def test_a_held_window_waits_for_the_running_batch_to_end_then_sends_what_arrived() -> None:
    sent = Sent()
    window: Batcher[str] = Batcher(sent, window=NEVER, most=100, hold=True)
    window.add("first", 1)
    assert await sent.wait(1) == [["first"]]  # nothing running: it goes after the passes that brought none
    window.add("second", 1)
    window.add("third", 1)
    await asyncio.sleep(0.05)  # passes of the loop for a window that holds nothing to send it (none should)
    assert sent.batches == [["first"]]
    window.ended()  # the first batch ended: what waited for it goes now, as one batch
    assert sent.batches == [["first"], ["second", "third"]]


async def test_a_held_window_still_goes_at_its_deadline() -> None:
    sent = Sent()
    window: Batcher[str] = Batcher(sent, window=0.01, most=100, hold=True)
    window.add("first", 1)
    await sent.wait(1)
    window.add("second", 1)  # the first batch never ends
    assert await sent.wait(2) == [["first"], ["second"]]


async def test_close_takes_what_waits_and_nothing_is_sent_after() -> None:
    sent = Sent()
    window: Batcher[str] = Batcher(sent, window=0.01, most=100, hold=True)
    window.add("a", 1)
    window.add("b", 1)
    assert window.close() == ["a", "b"]
    assert window.close() == []
    window.flush()  # nothing waits: nothing is sent
    await asyncio.sleep(0.05)  # past the window's deadline: the chain of passes it had begun sends nothing
    assert sent.batches == []
    window.add("c", 1)  # a window closed is empty, not dead
    assert await sent.wait(1) == [["c"]]
