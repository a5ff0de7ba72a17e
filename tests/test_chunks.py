"""Cheap sync plugins are called a chunk of items per thread hop: the same answers, the same errors.

Each test scores a batch large enough for chunks to form (the first calls measure the plugin's
cost; later ones take thousands of items at a time) and checks that what comes out is exactly what
item-by-item calls would give: rewards in order, and a failure pinned to the right item.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from asserts import check_error
from conftest import item, plugin_module, process_twin
from polling import eventually

import engine
from engine import EngineConfig, Limits, VerificationError
from engine._core.contract import BadItem, MalformedItem
from engine._verifiers.plugin.in_threads import ThreadExecutor
from engine._verifiers.plugin.verifier import PluginVerifier
from engine._verifiers.plugin.wire import PIECE, encode

SIZE = 20_000
KEY = "cheap/verify:score"


def batch(size: int = SIZE, **special: dict[str, Any]) -> list[dict[str, Any]]:
    """Items n = 0..size-1; ``special`` maps an index (as "at<N>") to extra task fields."""
    items = [item("cheap", f"answer {n}", item_id=f"row-{n}", n=n) for n in range(size)]
    for key, fields in special.items():
        items[int(key.removeprefix("at"))]["task"].update(fields)
    return items


def in_threads(eng: engine.Engine, name: str) -> ThreadExecutor:
    """The executor of environment ``name``'s sync plugin, once it has run: its chunk sizes, lock and counts."""
    verifier = eng._verifier(name)
    assert isinstance(verifier, PluginVerifier)
    executor = verifier._executor
    assert isinstance(executor, ThreadExecutor)
    return executor


async def warm(eng: engine.Engine) -> None:
    """One batch to import the plugin and measure its cost, so the next batch runs in chunks."""
    assert len(await eng.score(batch(2_000))) == 2_000


async def test_chunks_form_and_rewards_stay_in_order(config: EngineConfig, envs: Path) -> None:
    async with engine.Engine(config) as eng:
        await warm(eng)
        result = await eng.run(batch())
        module = plugin_module(envs, "cheap", "verify.py")  # while the engine is open: closing it forgets its modules
    assert result.rewards == [(n % 7) / 7 for n in range(SIZE)]
    report = result.verifiers[0]
    assert report.items == SIZE
    assert len(report.latencies) < SIZE / 10  # one latency per call: the calls were chunks
    assert report.reward_sum == pytest.approx(sum((n % 7) / 7 for n in range(SIZE)))
    assert module.calls == 2_000 + SIZE  # every item called once


async def test_a_rate_limited_plugin_is_called_one_item_at_a_time_once_measured(envs: Path) -> None:
    # A rate spaces calls one item each, however cheap its verifier's calls measure: the rate is high
    # enough (a bucket of a million tokens) that nothing here waits for it.
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={KEY: Limits(max_rate=1e6)})
    async with engine.Engine(config) as eng:
        await warm(eng)
        assert eng._verifier("cheap").chunk_size(SIZE) > 1  # measured: unlimited, its calls would be chunks
        result = await eng.run(batch())
        module = plugin_module(envs, "cheap", "verify.py")  # while the engine is open: closing it forgets its modules
    assert result.rewards == [(n % 7) / 7 for n in range(SIZE)]
    assert result.verifiers[0].latency_items == [1] * SIZE  # one call an item
    assert module.calls == 2_000 + SIZE


async def test_latency_percentiles_are_per_item(config: EngineConfig, envs: Path) -> None:
    # A fresh engine: the first calls go one at a time and wait for the import (tens of ms): start-up,
    # in no latency; then chunks form and the rest of the items take microseconds each. Percentiles
    # count items, so the median is a chunked item's.
    async with engine.Engine(config) as eng:
        result = await eng.run(batch())
    report = result.verifiers[0]
    assert report.items == SIZE and report.startup  # a call an item until calls are measured: one each
    assert sum(report.latency_items) == SIZE - len(report.startup)
    assert len(report.latencies) < SIZE / 10  # still one entry per call
    assert report.latency(50) < 1e-3
    assert report.latency(100) == max(report.latencies)


async def test_a_chunk_holds_items_of_several_lanes_apart(config: EngineConfig) -> None:
    # items of two environments interleaved: each lane's chunks are index lists, not slices
    items = [item("cheap", "x", n=n) if n % 3 else item("twin_a", "x") for n in range(6_000)]
    async with engine.Engine(config) as eng:
        await warm(eng)
        rewards = await eng.score(items)
    assert rewards == [(n % 7) / 7 if n % 3 else 0.25 for n in range(6_000)]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("raise", "raised ArithmeticError: cannot score item 13577 (at verify.py:40, in _score)"),  # where it raised
        ("nan", "returned nan, which is not a finite number"),
        ("none", "returned None (NoneType), which is not a real number"),
        ("text", "returned 'high' (str), which is not a real number"),
        ("numeric_text", "returned '0.5' (str), which is not a real number"),  # an extracted answer is not a score
    ],
)
async def test_a_failure_inside_a_chunk_names_its_item(config: EngineConfig, mode: str, reason: str) -> None:
    async with engine.Engine(config) as eng:
        await warm(eng)
        with pytest.raises(VerificationError) as info:
            await eng.score(batch(at13577={"mode": mode}))
        err = info.value
        assert (err.kind, err.ref, err.environment) == ("plugin", "verify:score", "cheap")
        assert (err.index, err.item_id) == (13577, "row-13577")
        assert err.reason == reason
        if mode == "raise":
            assert isinstance(err.__cause__, ArithmeticError)
        assert await eng.score(batch(3_000)) == [(n % 7) / 7 for n in range(3_000)]  # usable afterwards


async def test_an_int_is_a_reward_inside_a_chunk(config: EngineConfig) -> None:
    async with engine.Engine(config) as eng:
        await warm(eng)
        rewards = await eng.score(batch(at11={"mode": "int"}))
    assert rewards[10:12] == [(10 % 7) / 7, 1.0]
    assert all(type(r) is float for r in rewards)


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_finite_rewards_whose_sum_overflows_are_accepted(envs: Path, executor: str) -> None:
    # a chunk's rewards are checked with one sum, which overflows here: each value is still finite
    name = process_twin(envs, "cheap", workers=1) if executor == "process" else "cheap"
    config = EngineConfig(environments=envs, allow_unpinned=True)
    items = [item(name, n=n, **({"mode": "huge"} if n in (10, 11) else {})) for n in range(SIZE)]
    async with engine.Engine(config) as eng:
        await eng.score(items[:2_000])  # chunks form after this
        rewards = await eng.score(items)
    assert rewards[9:13] == [(9 % 7) / 7, 1e308, 1e308, (12 % 7) / 7]


async def test_a_malformed_item_inside_a_chunk_is_the_callers_error(config: EngineConfig) -> None:
    items = batch()
    del items[9_001]["trajectory"]
    items[9_002]["task"] = "not a mapping"
    async with engine.Engine(config) as eng:
        await warm(eng)
        with pytest.raises(ValueError, match=r"item 9001 has no 'trajectory'"):
            await eng.score(items)
        items[9_001]["trajectory"] = "back"
        with pytest.raises(TypeError, match=r"item 9002: 'task' is a str, not a mapping"):
            await eng.score(items)


async def test_a_hanging_call_inside_a_chunk_times_out_naming_its_item(envs: Path) -> None:
    timeout = 1.0  # a second: the warm-up's first calls, one at a time in threads, may overrun less under load
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={KEY: Limits(timeout=timeout)})
    async with engine.Engine(config) as eng:
        await warm(eng)
        with pytest.raises(VerificationError) as info:
            await eng.score(batch(at15000={"mode": "hang", "seconds": 10}))  # far past the timeout, even stalled
    assert (info.value.index, info.value.reason) == (15000, f"timed out after {timeout:g} s")


async def test_chunks_of_one_plugin_never_run_at_once(envs: Path) -> None:
    # a short timeout keeps chunks short (under a tenth of it), so the batch takes several (and it is long
    # enough for a loaded machine: a chunk may also wait up to a quarter of it for turns at the GIL)
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={KEY: Limits(timeout=1.0)})
    async with engine.Engine(config) as eng:
        await warm(eng)  # single calls, up to 64 at once, while the cost is measured
        module = plugin_module(envs, "cheap", "verify.py")
        module.max_running = 0
        result = await eng.run(batch(200_000))
    # several workers held chunks at once (all but the one running waited for the plugin's thread: its waiting, about
    # a chunk's time at least, and none of them in flight meanwhile)...
    report = result.verifiers[0]
    assert report.waited >= 0.5 * min(map(float.__mul__, report.latencies, report.latency_items))
    assert report.peak_in_flight == 1
    assert module.max_running == 1  # ...but under the GIL a second thread only slows the first down
    assert module.calls == 202_000


@pytest.mark.timeout(20)
async def test_an_abandoned_chunk_stops_within_a_step(config: EngineConfig, envs: Path) -> None:
    # 400,000 cheap items: after the warm-up, chunks of 250 ms of calls (tens of thousands of items);
    # another environment's item fails and aborts the batch while the first chunk runs. The
    # chunk's thread cannot be killed, but it stops at its next check (every ~10 ms of calls, a
    # "step", sized from the measured cost of a call) instead of running to the end of its chunk.
    items = [item("cheap", "x", n=n) for n in range(400_000)] + [item("faulty", mode="raise")]
    async with engine.Engine(config) as eng:
        await warm(eng)
        executor = in_threads(eng, "cheap")
        step, chunk = executor._step, executor._chunk  # what the batch's first chunk runs with
        assert chunk >= 10 * step  # so "within two steps" is far from "to the chunk's end"
        module = plugin_module(envs, "cheap", "verify.py")
        with pytest.raises(VerificationError, match="the plugin blew up"):
            await eng.score(items)
        at_abort = module.calls
        seen = {"calls": at_abort, "since": anyio.current_time()}

        def stopped_calling() -> bool:  # the abandoned thread made no call for 50 ms
            now, calls = anyio.current_time(), module.calls
            if calls != seen["calls"]:
                seen.update(calls=calls, since=now)
            return now - seen["since"] >= 0.05

        await eventually(stopped_calling, 10, message="the abandoned thread never stopped calling")
        last = seen["calls"]
    # at most the step it was in (it checks between steps) and one more (its check may read a stale flag)
    assert last - at_abort <= 2 * step, (at_abort, last, step, chunk)


def calls_of(mode: str, seconds: float, count: int) -> list[dict[str, Any]]:
    return [item("cheap", "x", n=n, mode=mode, seconds=seconds) for n in range(count)]


async def test_calls_that_wait_run_in_parallel_chunks(config: EngineConfig, envs: Path) -> None:
    async with engine.Engine(config) as eng:
        assert await eng.score(calls_of("wait", 0.004, 64)) == [1.0] * 64  # measured: waiting, ~4 ms
        module = plugin_module(envs, "cheap", "verify.py")
        module.max_running = 0
        result = await eng.run(calls_of("wait", 0.004, 1_000))
    assert result.rewards == [1.0] * 1_000
    assert module.max_running >= 32  # many threads waiting at once
    assert len(result.verifiers[0].latencies) < 1_000  # in chunks: fewer round trips than items


CPU_BOUND_TRIES = 20  # batches: on a loaded machine a spinning thread may get under half a CPU for a while
SPIN_ITEMS, WIDTH = 400, 64  # parallel chunks hold at most ceil(400 / 64) = 7 items: 58 chunks or more


async def test_cpu_bound_calls_run_one_chunk_at_a_time(config: EngineConfig, envs: Path) -> None:
    """Calls that keep a CPU busy run in long chunks one at a time, once a measurement shows them CPU-bound.

    Run in parallel, a lane's chunks would be cut to its share per worker (7 items here), so many
    more chunks: their count tells the two apart (running at most one at a time does not, as a
    3.5 ms chunk often ends before the GIL changes hands anyway). The measurement is the calls'
    CPU time against their wall time: on a machine busy with other work (CI) a spinning thread
    gets less than half a CPU for a while and looks like it waits. So the batch is scored again,
    a bounded number of times, until one runs serially; an engine that never tells CPU-bound
    calls apart fails every try.
    """
    chunks: list[int] = []
    async with engine.Engine(config) as eng:
        for _ in range(CPU_BOUND_TRIES):
            assert await eng.score(calls_of("spin", 0.0005, 64)) == [1.0] * 64  # measured
            module = plugin_module(envs, "cheap", "verify.py")
            module.max_running = 0
            result = await eng.run(calls_of("spin", 0.0005, SPIN_ITEMS))
            assert result.rewards == [1.0] * SPIN_ITEMS
            chunks.append(len(result.verifiers[0].latencies))
            if module.max_running == 1 and chunks[-1] < SPIN_ITEMS // -(-SPIN_ITEMS // WIDTH):
                break
        else:
            raise AssertionError(f"never one long chunk at a time: chunks per batch {chunks}")


class Watched(Mapping[str, Any]):
    """A task that notes the thread of every read of it in ``readers``, and can refuse to be read."""

    def __init__(self, fields: dict[str, Any], readers: set[int], broken: bool = False) -> None:
        self._fields, self._readers, self._broken = fields, readers, broken

    def _read(self) -> None:
        self._readers.add(threading.get_ident())
        if self._broken:
            raise OSError("the task's store is gone")

    def __getitem__(self, key: str) -> Any:
        self._read()
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        self._read()
        return iter(self._fields)

    def __len__(self) -> int:
        self._read()
        return len(self._fields)


async def test_a_process_plugins_items_are_read_off_the_event_loop(envs: Path) -> None:
    """Every item of a process call is read (and its pair built and pickled) in the worker's thread.

    Before, each of a lane's 64 tasks built its chunk's pairs on the event loop before its first
    await, which held the loop ~200 ms at the start of every 200k-item batch.
    """
    name = process_twin(envs, "cheap", workers=1)
    readers: set[int] = set()
    items = [{**item(name, n=n), "task": Watched({"n": n}, readers)} for n in range(SIZE)]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        first = await eng.score(items[:2_000])  # one item a call at first, then chunks
        assert eng._verifier(name).chunk_size(SIZE) > 1
        rewards = await eng.score(items)
    assert first == [(n % 7) / 7 for n in range(2_000)]
    assert rewards == [(n % 7) / 7 for n in range(SIZE)]
    assert readers  # the tasks were read, each item's
    assert threading.get_ident() not in readers  # and never on the loop's thread (this test's)


def test_a_chunks_bad_items_are_named_by_their_place_in_the_chunk_not_in_its_piece() -> None:
    """What a process chunk sends is built and pickled :data:`PIECE` items at a time: a failure in a later piece
    names the item's place in the chunk (the chunk's size given here, so the places are exact)."""
    items = [item("cheap", n=n) for n in range(3 * PIECE)]
    count, pieces = encode(items, "cheap")
    assert (count, len(pieces)) == (3 * PIECE, 3)
    broken = [*items]
    broken[PIECE + 1] = {**items[PIECE + 1], "task": Watched({"n": 0}, set(), broken=True)}
    with pytest.raises(BadItem) as bad:
        encode(broken, "cheap")
    assert bad.value.position == PIECE + 1 and "cannot read the item's task" in bad.value.reason
    broken = [*items]
    broken[2 * PIECE + 2] = {key: value for key, value in items[2 * PIECE + 2].items() if key != "trajectory"}
    with pytest.raises(MalformedItem) as malformed:
        encode(broken, "cheap")
    assert malformed.value.position == 2 * PIECE + 2
    broken = [*items]
    broken[2 * PIECE + 5] = item("cheap", n=0, lock=threading.Lock())
    with pytest.raises(BadItem) as unpicklable:
        encode(broken, "cheap")
    assert unpicklable.value.position == 2 * PIECE + 5 and "cannot pass the item" in unpicklable.value.reason


async def test_a_process_chunks_bad_items_are_named_past_its_first_piece(envs: Path) -> None:
    """A chunk's pairs are built and pickled a piece at a time: a failure names the item, not its place in a piece.

    The bad items stand past the first piece, in the first chunk wherever the chunk measured just before
    reaches that far (its size is the machine's: a loaded one measures calls slower, and makes chunks smaller;
    the test above fixes the chunk, and the places in it)."""
    name = process_twin(envs, "cheap", workers=1)
    items = [item(name, f"answer {n}", item_id=f"row-{n}", n=n) for n in range(SIZE)]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        await eng.score(items[:2_000])
        chunk = eng._verifier(name).chunk_size(SIZE)
        assert chunk > 1
        task_at, trajectory_at, lock_at = (PIECE + 1 + k * 900 for k in range(3))
        broken = [*items]
        broken[task_at] = {**items[task_at], "task": Watched({"n": task_at}, set(), broken=True)}
        with pytest.raises(VerificationError) as info:
            await eng.score(broken)
        check_error(
            info.value, "verify:score", "cannot read the item's task", kind="plugin", environment=name, index=task_at,
            item_id=f"row-{task_at}",
        )
        broken = [*items]
        broken[trajectory_at] = {key: value for key, value in items[trajectory_at].items() if key != "trajectory"}
        with pytest.raises(ValueError, match=rf"item {trajectory_at} has no 'trajectory'"):
            await eng.score(broken)
        unpicklable = [*items]
        unpicklable[lock_at] = item(name, item_id=f"row-{lock_at}", n=lock_at, lock=threading.Lock())
        with pytest.raises(VerificationError) as info:
            await eng.score(unpicklable)
        check_error(
            info.value, "verify:score", "cannot pass the item", kind="plugin", environment=name, index=lock_at,
            item_id=f"row-{lock_at}",
        )
        assert await eng.score(items) == [(n % 7) / 7 for n in range(SIZE)]  # its worker still scores


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_process_lane_is_chunked_per_worker_not_per_task(envs: Path, workers: int) -> None:
    """A lane's 64 tasks take chunks at once, but only its workers run them: chunks are sized per worker.

    Sized per task, the last part of each batch went to the workers in ever smaller chunks (~400 round
    trips here, each costing the engine's process CPU its workers could have used); sized from a
    worker's share, split finer only at the end, it takes ~90-110 (of which the last 64 items, one each).
    """
    name = process_twin(envs, "cheap", workers=workers)
    items = [item(name, n=n) for n in range(SIZE)]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        await eng.score(items[:2_000])  # chunks are sized after this
        result = await eng.run(items)
    assert result.rewards == [(n % 7) / 7 for n in range(SIZE)]
    assert len(result.verifiers[0].latencies) < 200  # one latency per round trip


# --- a chunk's timeout is its own time: not the chunks before it, nor its turns with a busy loop ---


@pytest.mark.timeout(90)  # a second and a half of calls, one chunk at a time: minutes on a loaded machine's worst day
async def test_chunks_queued_behind_each_other_do_not_time_out(envs: Path) -> None:
    # Each chunk holds a tenth of the timeout in calls, and a lane's workers each take one: dozens wait
    # for the chunk lock at once. Counted from when they were taken, the later ones timed out (a cheap
    # plugin failing a batch), though none ran for more than a tenth of the timeout. (A timeout of a second:
    # shorter ones leave a loaded machine's stalls no room.)
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={KEY: Limits(timeout=1.0)})
    async with engine.Engine(config) as eng:
        await warm(eng)
        executor = in_threads(eng, "cheap")
        size = 15 * executor._chunk  # chunks of a tenth of the timeout: one and a half timeouts in calls, in all
        result = await eng.run([item("cheap", "x", n=n) for n in range(size)])
    assert result.rewards == [(n % 7) / 7 for n in range(size)]
    # the chunks queued for the plugin's thread (its waiting, not its latency): more than a timeout of it in all
    assert result.verifiers[0].waited > 1.0


async def test_a_chunk_beside_a_loop_that_is_never_idle_ends_within_its_timeout(envs: Path) -> None:
    # A trainer's own work on the engine's loop (here: 3 ms of it, that lets go of the GIL, every pass)
    # never leaves a pass idle, so each turn the chunk asks for lasts the longest turn (10 ms), after
    # each ~1 ms step: a chunk of a tenth of its timeout in calls took longer than the timeout in all.
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={KEY: Limits(timeout=1.0)})
    trainer_done = False

    async def trainer() -> None:
        while not trainer_done:
            time.sleep(0.003)  # the point: sync work holding the loop
            await anyio.lowlevel.checkpoint()

    async with engine.Engine(config) as eng, anyio.create_task_group() as tg:
        await warm(eng)
        executor = in_threads(eng, "cheap")
        size = executor._chunk  # one chunk: nothing queues for the chunk lock
        tg.start_soon(trainer)
        try:
            result = await eng.run([item("cheap", "x", n=n) for n in range(size)])
        finally:
            trainer_done = True
    assert result.rewards == [(n % 7) / 7 for n in range(size)]
    assert len(result.verifiers[0].latencies) == 1  # one chunk


async def test_a_chunk_that_waited_while_the_engine_closed_leaves_no_thread(envs: Path) -> None:
    # A batch waiting for the chunk lock while the engine closes runs its chunk once the lock is free:
    # on the plugin's kept thread, which closing had already let go, a new thread was kept for ever.
    shutil.copytree(envs / "cheap", envs / "closing")  # its threads' name is this test's alone
    config = EngineConfig(environments=envs, allow_unpinned=True)
    results: dict[str, list[float]] = {}

    def chunk_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == "engine-chunk-closing"]

    async with anyio.create_task_group() as tg, engine.Engine(config) as eng:
        assert len(await eng.score([item("closing", "x", n=n) for n in range(2_000)])) == 2_000  # chunks now
        executor = in_threads(eng, "closing")
        module = plugin_module(envs, "closing", "verify.py")

        async def score(name: str, items: list[dict[str, Any]]) -> None:
            results[name] = await eng.score(items)

        tg.start_soon(score, "first", [item("closing", "x", n=0, mode="hang", seconds=0.5), item("closing", n=1)])
        await eventually(lambda: module.running, message="the first chunk never started")
        tg.start_soon(score, "second", [item("closing", "x", n=n) for n in range(3)])
        await eventually(lambda: executor._chunk_lock.statistics().tasks_waiting, message="nothing waited")
    # closed, the second batch still waiting for the first's chunk; the task group then waits for both
    assert results == {"first": [1.0, 1 / 7], "second": [0.0, 1 / 7, 2 / 7]}
    await eventually(lambda: not chunk_threads(), message=f"threads left: {chunk_threads()}")


async def test_a_chunk_hanging_on_the_kept_thread_holds_up_no_later_batch(envs: Path, tmp_path: Path) -> None:
    shutil.copytree(envs / "cheap", envs / "hanging")  # its threads' name is this test's alone
    key = "hanging/verify:score"
    # a timeout of a second (the warm-up's first calls, one at a time in threads, may overrun less under load); the
    # hanging calls hang until both have timed out and a third batch has been refused: then the test releases them
    timeout = 1.0
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={key: Limits(timeout=timeout, max_abandoned=1)})
    release = tmp_path / "release"

    def chunk_threads() -> int:
        return sum(t.name == "engine-chunk-hanging" for t in threading.enumerate())

    def hanging() -> list[dict[str, Any]]:
        hangs = item("hanging", "x", n=0, mode="hang", release=str(release), seconds=60)
        return [hangs, *[item("hanging", n=n) for n in range(1, 50)]]

    expected = [(n % 7) / 7 for n in range(100)]
    async with engine.Engine(config) as eng:
        assert len(await eng.score([item("hanging", "x", n=n) for n in range(2_000)])) == 2_000  # chunks now
        executor = in_threads(eng, "hanging")
        for abandoned in (1, 2):
            with pytest.raises(VerificationError) as info:
                await eng.score(hanging())
            assert (info.value.index, info.value.reason) == (0, f"timed out after {timeout:g} s")
            assert executor._abandoned.count == abandoned
            if abandoned == 1:  # the next batch runs at once, on a thread of its own
                assert await eng.score([item("hanging", n=n) for n in range(100)]) == expected
                assert chunk_threads() == 2
        with pytest.raises(VerificationError, match=r"2 of its calls .* \(max_abandoned=1\)"):
            await eng.score([item("hanging", n=n) for n in range(100)])
        release.touch()
        await eventually(lambda: executor._abandoned.count == 0, message="the hung calls never counted as ended")
        assert await eng.score([item("hanging", n=n) for n in range(100)]) == expected
        await eventually(lambda: chunk_threads() == 1, message="the hung chunks' threads did not end")


async def test_a_chunk_in_line_behind_one_that_hangs_is_refused_once_that_one_is_abandoned(envs: Path) -> None:
    shutil.copytree(envs / "cheap", envs / "hanging")
    # a timeout of a second: its warm-up's first calls, one at a time in threads, overran half a second on a loaded
    # machine (two suites at once); the hanging call outlasts it tenfold
    timeout = 1.0
    config = EngineConfig(
        environments=envs, allow_unpinned=True, refs={"hanging/verify:score": Limits(timeout=timeout, max_abandoned=0)}
    )
    async with engine.Engine(config) as eng:
        assert len(await eng.score([item("hanging", "x", n=n) for n in range(2_000)])) == 2_000  # chunks now
        executor = in_threads(eng, "hanging")
        outcomes: dict[str, BaseException | list[float]] = {}

        async def score(name: str, items: list[dict[str, Any]]) -> None:
            try:
                outcomes[name] = await eng.score(items)
            except VerificationError as exc:
                outcomes[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(score, "hangs", [item("hanging", "x", n=0, mode="hang", seconds=10.0)])
            await eventually(lambda: executor._chunk_lock.value == 0, message="the hanging chunk never started")
            tg.start_soon(score, "in line", [item("hanging", n=n) for n in range(1, 50)])
    hangs, in_line = outcomes["hangs"], outcomes["in line"]
    assert isinstance(hangs, VerificationError) and hangs.reason == f"timed out after {timeout:g} s"
    # it waited for the plugin's thread while the first hung, and was not started once that one was abandoned
    assert isinstance(in_line, VerificationError)
    assert "refusing to start more until they finish (max_abandoned=0)" in in_line.reason
