"""The scheduler end to end: order, per-verifier and global limits, no head-of-line blocking, aborts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import traceback
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from conftest import add_endpoint_env, item, loaded_module, plugin_module
from polling import eventually
from servers import Request, Response, Server

import engine
from engine import EngineConfig, Limits, VerificationError
from engine._core import scheduler
from engine._core.meters import loop_calls

HOLD = 4.0  # seconds a handler waits for a condition before it answers anyway (and the test's asserts fail)


def reward_from_task(request: Request) -> dict[str, Any]:
    return {"reward": request.json()["task"]["r"]}


async def test_mixed_batch_in_input_order(envs: Path) -> None:
    with Server.json(reward_from_task) as server:
        add_endpoint_env(envs, "remote", server.url + "/score")
        config = EngineConfig(environments=envs, allow_unpinned=True)
        items: list[dict[str, Any]] = []
        expected: list[float] = []
        for i in range(40):
            match i % 5:
                case 0:  # sync plugin with a relative import
                    items.append(item("arith", str(i), reference=str(i if i % 10 else -1)))
                    expected.append(1.0 if i % 10 else 0.0)
                case 1:  # async plugin
                    items.append(item("arith_async", str(i), reference=str(i if i % 3 else -1)))
                    expected.append(1.0 if i % 3 else 0.0)
                case 2:  # dotted module and attribute
                    items.append(item("length", "x" * i))
                    expected.append(i / 100)
                case 3:  # endpoint
                    items.append(item("remote", "t", r=i / 1000))
                    expected.append(i / 1000)
                case _:
                    items.append(item("twin_b" if i % 2 else "twin_a"))
                    expected.append(0.75 if i % 2 else 0.25)
        async with engine.Engine(config) as eng:
            rewards = await eng.score(items)
        assert rewards == expected
        assert len(set(rewards)) > 10  # the rewards differ, so the order is really checked
        assert len(server.requests) == 8


async def test_per_verifier_limit_for_a_plugin(envs: Path) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={"spy/spy:score": Limits(max_concurrency=3)})
    async with engine.Engine(config) as eng:
        assert await eng.score([item("spy", sleep=0.02)] * 24) == [1.0] * 24
        spy = plugin_module(envs, "spy", "spy.py")  # while the engine is open: closing it forgets its modules
    assert spy.calls == 24
    assert spy.max_running == 3


async def test_per_verifier_limit_for_an_endpoint(envs: Path) -> None:
    async def slowish(request: Request) -> Response:
        await asyncio.sleep(0.02)
        return Response.json({"reward": 0.5})

    with Server(slowish) as server:
        url = server.url + "/score"
        add_endpoint_env(envs, "remote", url)
        config = EngineConfig(environments=envs, refs={url: Limits(max_concurrency=5)})
        async with engine.Engine(config) as eng:
            assert await eng.score([item("remote")] * 30) == [0.5] * 30
    assert len(server.requests) == 30
    assert server.max_in_flight == 5


async def test_limit_is_shared_by_concurrent_batches(envs: Path) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={"spy/spy:score": Limits(max_concurrency=2)})
    async with engine.Engine(config) as eng:
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(eng.score, [item("spy", sleep=0.02)] * 6)
        spy = plugin_module(envs, "spy", "spy.py")  # while the engine is open: closing it forgets its modules
    assert spy.calls == 18
    assert spy.max_running == 2


async def test_global_cap_on_items_in_flight(envs: Path) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True, max_in_flight=4)
    async with engine.Engine(config) as eng:
        assert await eng.score([item("spy", sleep=0.02)] * 20) == [1.0] * 20
        spy = plugin_module(envs, "spy", "spy.py")  # while the engine is open: closing it forgets its modules
    assert spy.max_running == 4


async def test_global_cap_holds_across_verifiers(envs: Path) -> None:
    async def slowish(request: Request) -> Response:
        await asyncio.sleep(0.02)
        return Response.json({"reward": 1.0 if request.path == "/a" else 2.0})

    with Server(slowish) as server:
        # two URLs are two verifiers, each allowed 64 calls at once; the engine allows 4 in all
        add_endpoint_env(envs, "remote_a", server.url + "/a")
        add_endpoint_env(envs, "remote_b", server.url + "/b")
        config = EngineConfig(environments=envs, max_in_flight=4)
        items = [item("remote_a" if i % 2 else "remote_b") for i in range(24)]
        async with engine.Engine(config) as eng:
            assert await eng.score(items) == [1.0 if i % 2 else 2.0 for i in range(24)]
    assert {r.path for r in server.requests} == {"/a", "/b"}
    assert server.max_in_flight == 4


async def test_a_verifier_at_its_limit_does_not_hold_back_another(envs: Path) -> None:
    """While the slow endpoint (one call at a time) holds its first request, every plugin item completes."""
    seen: dict[str, Any] = {}

    async def slow(request: Request) -> Response:
        if "spy_calls" not in seen:
            # hold the first request until the fast lane is done: all 20 spy calls made, none running
            def fast_lane_done() -> bool:
                spy = loaded_module(envs, "spy", "spy.py")
                return spy is not None and spy.calls == 20 and spy.running == 0

            with contextlib.suppress(AssertionError):
                await eventually(fast_lane_done, HOLD)
            spy = loaded_module(envs, "spy", "spy.py")
            seen["spy_calls"] = spy.calls if spy is not None else 0
            seen["spy_running"] = spy.running if spy is not None else None
        return Response.json({"reward": 0.5})

    with Server(slow) as server:
        url = server.url + "/slow"
        add_endpoint_env(envs, "remote", url)
        config = EngineConfig(environments=envs, allow_unpinned=True, refs={url: Limits(max_concurrency=1)})
        items = [item("remote")] * 3 + [item("spy", sleep=0.001)] * 20
        async with engine.Engine(config) as eng:
            rewards = await eng.score(items)
    assert rewards == [0.5] * 3 + [1.0] * 20
    assert seen == {"spy_calls": 20, "spy_running": 0}
    assert server.max_in_flight == 1
    assert len(server.requests) == 3


@pytest.mark.timeout(30)  # the slow requests are held 30 s: an abort that waited for them fails here
async def test_abort_with_a_hundred_slow_siblings(envs: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder: dict[str, Server] = {}

    async def handler(request: Request) -> Response:
        server = holder["server"]
        if request.path == "/bad":
            # answer 400 only once the 100 slow requests (and this one) are in flight
            with contextlib.suppress(AssertionError):
                await eventually(lambda: server.in_flight >= 101, HOLD)
            return Response(400, b"this item is malformed")
        await asyncio.sleep(30)
        return Response.json({"reward": 1.0})

    with Server(handler) as server:
        holder["server"] = server
        slow_url, bad_url = server.url + "/slow", server.url + "/bad"
        add_endpoint_env(envs, "slow", slow_url)
        add_endpoint_env(envs, "remote", bad_url)
        config = EngineConfig(environments=envs, refs={slow_url: Limits(max_concurrency=100)})
        items = [item("slow", item_id=f"s{i}") for i in range(50)]
        items += [item("remote", item_id="bad")]
        items += [item("slow", item_id=f"s{i}") for i in range(50, 100)]
        with caplog.at_level(logging.ERROR, logger="engine"):
            async with engine.Engine(config) as eng:
                with pytest.raises(VerificationError) as info:
                    await eng.score(items)
                # the 100 held requests were cancelled: their connections are closed
                await eventually(lambda: server.in_flight == 0)
                await eventually(lambda: server.closed >= 100)
        await eventually(lambda: server.open_connections == 0)
    err = info.value
    assert type(err) is VerificationError  # alone, never inside an ExceptionGroup
    assert not isinstance(err, BaseExceptionGroup)
    assert (err.kind, err.ref, err.environment, err.index, err.item_id) == ("endpoint", bad_url, "remote", 50, "bad")
    assert "HTTP 400: this item is malformed" in str(err)
    assert server.max_in_flight == 101
    assert len(server.requests) == 101
    records = [r for r in caplog.records if r.name == "engine" and r.levelno >= logging.ERROR]
    assert len(records) == 1
    assert bad_url in records[0].getMessage()


async def test_one_error_log_record_naming_the_verifier(config: EngineConfig, caplog: pytest.LogCaptureFixture) -> None:
    items = [item("faulty", mode="ok")] * 5 + [item("faulty", item_id="x", mode="raise")] + [item("twin_a")] * 5
    with caplog.at_level(logging.DEBUG, logger="engine"):
        async with engine.Engine(config) as eng:
            with pytest.raises(VerificationError):
                await eng.score(items)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    record = errors[0]
    assert (record.name, record.levelname) == ("engine", "ERROR")
    message = record.getMessage()
    assert "'faults:by_task'" in message
    assert "'faulty'" in message
    assert "Boom" in message


async def test_plugin_failure_stops_an_endpoint_lane_and_queued_items_never_start(envs: Path, tmp_path: Path) -> None:
    cue = tmp_path / "cue"

    async def hold(request: Request) -> Response:
        server = holder["server"]
        if server.in_flight >= 2:
            cue.touch()  # both allowed requests are held: now the plugin item fails
        await asyncio.sleep(30)
        return Response.json({"reward": 1.0})

    holder: dict[str, Server] = {}
    with Server(hold) as server:
        holder["server"] = server
        url = server.url + "/score"
        add_endpoint_env(envs, "remote", url)
        config = EngineConfig(environments=envs, allow_unpinned=True, refs={url: Limits(max_concurrency=2)})
        items = [item("remote")] * 20 + [item("fail_when", item_id="f", when=str(cue))]
        async with engine.Engine(config) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.score(items)
            await eventually(lambda: server.in_flight == 0)
        await eventually(lambda: server.open_connections == 0)
    err = info.value
    assert (err.kind, err.environment, err.index, err.item_id) == ("plugin", "fail_when", 20, "f")
    assert type(err.__cause__).__name__ == "Cue"
    assert len(server.requests) == 2  # the 18 queued endpoint items never started


async def test_rate_limit_spaces_the_calls_after_the_burst(envs: Path) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={"twin_a/verify:score": Limits(max_rate=40)})
    async with engine.Engine(config) as eng:
        start = anyio.current_time()
        assert await eng.score([item("twin_a")] * 50) == [0.25] * 50
        elapsed = anyio.current_time() - start
        # a full bucket lets 40 through at once; the other 10 wait for tokens at 40 per second
        assert elapsed >= 0.2


async def test_a_rate_below_one_per_second_is_allowed(envs: Path) -> None:
    """A leaky bucket of max_rate tokens would never hold one token at a rate below 1/s."""
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={"twin_a/verify:score": Limits(max_rate=0.5)})
    async with engine.Engine(config) as eng:
        assert await eng.score([item("twin_a")]) == [0.25]


@pytest.mark.parametrize("environment", ["faulty", "faulty_async"])  # a chunked sync plugin and an async one
async def test_an_items_route_visits_each_engine_module_once(envs: Path, environment: str) -> None:
    """From ``Engine.run`` to the verifier that failed, the error's traceback passes through each of the
    engine's modules in one stretch: the scheduler plans and calls on its own, never back into the engine."""
    batch = [item(environment, mode="ok")] * 50 + [item(environment, mode="raise")]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        with pytest.raises(VerificationError) as caught:
            await eng.score(batch)
    package = Path(engine.__file__).parent
    frames = traceback.extract_tb(caught.value.__traceback__)
    route = [frame.filename for frame in frames if Path(frame.filename).is_relative_to(package)]
    stretches = [name for position, name in enumerate(route) if position == 0 or route[position - 1] != name]
    assert stretches[0].endswith("_engine.py") and any(name.endswith("scheduler.py") for name in stretches)
    assert len(stretches) == len(set(stretches)), stretches


@pytest.mark.parametrize("size", [3, 3_000])  # one item per call, and chunks of a cheap plugin
async def test_errors_name_an_item_by_its_place_in_the_stream(envs: Path, size: int) -> None:
    """``first_index``: a caller scoring a stream a chunk at a time hears of the item by its place in the stream."""
    config = EngineConfig(environments=envs, allow_unpinned=True)
    items = [item("faulty", mode="ok") for _ in range(size)]
    items[size - 2] = item("faulty", item_id="bad", mode="raise")
    async with engine.Engine(config) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.run(items, first_index=1_000)
        assert (info.value.index, info.value.item_id) == (1_000 + size - 2, "bad")
        assert f"on item {1_000 + size - 2} (id 'bad')" in str(info.value)
        with pytest.raises(ValueError, match=r"^item 1001 has no 'task'"):
            await eng.score([item("faulty", mode="ok"), {"environment": "faulty", "trajectory": ""}], first_index=1_000)
        for wrong in (-1, 1.5, True):
            with pytest.raises(ValueError, match="first_index must be a whole number >= 0"):
                await eng.score(items[:1], first_index=wrong)
    with engine.BlockingEngine(config) as blocking, pytest.raises(VerificationError) as info:
        blocking.score(items, first_index=7)
    assert info.value.index == 7 + size - 2


def _named(environments: list[str]) -> list[dict[str, Any]]:
    return [{"environment": name, "task": {"prompt": "p"}, "trajectory": "t"} for name in environments]


@pytest.mark.parametrize("kinds", [2, scheduler._FEW + 3])  # picked out in C, and item by item
async def test_grouping_keeps_first_appearance_and_input_order_across_slices(kinds: int) -> None:
    size = 2 * scheduler.GROUP_SLICE + 5
    names = [f"env{(i * 7 + i // 3) % kinds}" for i in range(size)]
    names[-1] = "late"  # an environment first seen in the last slice
    groups = await scheduler._group(_named(names), range(size), 0)
    expected: dict[str, list[int]] = {}
    for position, name in enumerate(names):
        expected.setdefault(name, []).append(position)
    assert list(groups) == list(expected)  # lanes (and reports) come in order of first appearance
    assert groups == expected


async def test_grouping_a_large_batch_lets_the_loop_run_other_tasks() -> None:
    items = _named(["a", "b"] * scheduler.GROUP_SLICE)  # two slices
    ran: list[int] = []
    grouped = False

    async def other() -> None:
        while not grouped:
            ran.append(1)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await anyio.lowlevel.checkpoint()  # the other task has started
        before = len(ran)
        await scheduler._group(items, range(len(items)), 0)
        during = len(ran) - before
        grouped = True
    assert during >= 1  # it ran between the two slices, not only once the grouping was done


async def test_a_malformed_item_in_a_later_slice_is_named() -> None:
    items: list[Any] = _named(["a"] * (scheduler.GROUP_SLICE + 3))
    items[scheduler.GROUP_SLICE + 1] = {"task": {}, "trajectory": "t"}
    with pytest.raises(ValueError, match=f"item {scheduler.GROUP_SLICE + 1 + 10}"):
        await scheduler._group(items, range(len(items)), 10)


async def test_an_environment_not_equal_to_itself_is_named_among_a_few() -> None:
    # A few environments in a slice are picked out by ==: an item whose environment is not equal to
    # itself (nan) was in no group, and the grouping failed with an IndexError instead of naming it.
    items: list[Any] = _named(["a", "b", "a", "b"])
    items[2]["environment"] = float("nan")
    with pytest.raises(ValueError, match=r"^item 12: 'environment' must be an environment's directory name, got nan"):
        await scheduler._group(items, range(len(items)), 10)


async def test_the_engines_calls_on_the_loop_are_counted_while_in_flight(envs: Path) -> None:
    released = threading.Event()

    async def held(request: Request) -> Response:
        while not released.is_set():  # the server's own loop: a thread's event, polled
            await asyncio.sleep(0.005)
        return Response.json({"reward": 0.5} if request.json()["task"].get("ok") else {"reward": "high"})

    async def score(eng: engine.Engine, batch: list[dict[str, Any]], fails: bool) -> None:
        if fails:
            with pytest.raises(VerificationError):
                await eng.score(batch)
        else:
            assert await eng.score(batch) == [0.5] * len(batch)

    with Server(held) as server:
        add_endpoint_env(envs, "remote", server.url + "/score")
        async with engine.Engine(EngineConfig(environments=envs)) as eng:
            calls = loop_calls(asyncio.get_running_loop())  # what a cheap chunk in a thread gives turns for
            cases = (([item("remote", ok=True)] * 3, False), ([item("remote", ok=k) for k in (1, 0)], True))
            for batch, fails in cases:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(score, eng, batch, fails)
                    size = len(batch)
                    await eventually(lambda: calls.count == size, message="the calls were not counted")  # noqa: B023
                    released.set()
                assert calls.count == 0  # each counted out: the failure, and the calls it cancelled too
                released.clear()
