"""Batches that look like one plugin environment's (first and last items agree) are scored without a
first pass to group them: every item must still be scored once, by its own environment's verifier.

The engine guesses, runs one lane whose calls check each item's environment as they read it, and
hands what a call stops at to new lanes. These tests put items of other environments where a guess
meets them: inside a chunk, at a chunk's edge, in the first calls (one item each, before chunks
form), and under the process executor, plus malformed items and a failure that must still abort
at once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import item, plugin_module, process_twin

import engine
from engine import EngineConfig, VerificationError

SIZE = 20_000


def cheap(n: int) -> dict[str, Any]:
    return item("cheap", f"answer {n}", item_id=f"row-{n}", n=n)


def reward(n: int) -> float:
    return (n % 7) / 7


def mixed(size: int, others: dict[int, str]) -> tuple[list[dict[str, Any]], list[float]]:
    """``size`` cheap items, except at the positions in ``others`` (an environment each); and their rewards."""
    twins = {"twin_a": 0.25, "twin_b": 0.75}
    items = [item(others[n], item_id=f"row-{n}") if n in others else cheap(n) for n in range(size)]
    return items, [twins[others[n]] if n in others else reward(n) for n in range(size)]


async def warm(eng: engine.Engine) -> None:
    """Import the plugin and measure its cost, so the next batches run in chunks."""
    assert await eng.score([cheap(n) for n in range(2_000)]) == [reward(n) for n in range(2_000)]


@pytest.mark.parametrize(
    "others",
    [
        {5_000: "twin_a"},  # inside the one chunk
        {1: "twin_a", 5_000: "twin_b", 5_001: "twin_b", 12_000: "twin_a", SIZE - 2: "twin_a"},
        {n: "twin_a" for n in range(1, SIZE - 1, 2)},  # every other item
    ],
    ids=["one", "several", "interleaved"],
)
async def test_items_of_other_environments_in_a_guessed_batch(envs: Path, others: dict[int, str]) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True)
    items, expected = mixed(SIZE, others)
    async with engine.Engine(config) as eng:
        await warm(eng)
        result = await eng.run(items)
        module = plugin_module(envs, "cheap", "verify.py")  # while the engine is open: closing it forgets its modules
    assert result.rewards == expected
    counts = {name: list(others.values()).count(name) for name in ("twin_a", "twin_b")}
    reports = {report.provenance["environment"]: report for report in result.verifiers}
    assert {name: report.items for name, report in reports.items()} == {
        "cheap": SIZE - len(others),
        **{name: count for name, count in counts.items() if count},
    }
    assert reports["cheap"].reward_sum == pytest.approx(sum(r for n, r in enumerate(expected) if n not in others))
    for n in (0, 1, 5_000, 5_001, 12_000, SIZE - 2, SIZE - 1):
        assert result.provenance(n)["environment"] == others.get(n, "cheap")
    # every cheap item was called once: none twice, none skipped
    assert module.calls == 2_000 + SIZE - len(others)


async def test_other_environments_before_chunks_form(envs: Path) -> None:
    # a fresh engine calls a plugin one item at a time until it has measured it
    items, expected = mixed(40, {3: "twin_a", 4: "twin_b", 20: "twin_a"})
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        result = await eng.run(items)
        module = plugin_module(envs, "cheap", "verify.py")  # while the engine is open: closing it forgets its modules
    assert result.rewards == expected
    assert sorted(report.items for report in result.verifiers) == [1, 2, 37]
    assert module.calls == 37


async def test_other_environments_under_the_process_executor(envs: Path) -> None:
    name = process_twin(envs, "cheap", workers=1)
    process = [item(name, n=n) for n in range(6_000)]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        assert await eng.score(process[:500]) == [reward(n) for n in range(500)]  # start, and measure
        batch = [*process]
        batch[3_000] = item("twin_a")
        batch[3_001] = item("cheap", n=3)
        result = await eng.run(batch)
    expected = [reward(n) for n in range(6_000)]
    expected[3_000], expected[3_001] = 0.25, reward(3)
    assert result.rewards == expected
    assert sorted(report.items for report in result.verifiers) == [1, 1, 5_998]


@pytest.mark.parametrize(
    ("bad", "error", "text"),
    [
        (item("no_such_environment"), ValueError, "item 700: unknown environment 'no_such_environment'"),
        (item("x" * 300), ValueError, "item 700: 'environment' must be an environment's directory name"),
        (["environment", "task"], TypeError, "item 700 is a list, not a mapping"),
        ({"task": {}, "trajectory": ""}, ValueError, "item 700 has no 'environment'"),
        ({"environment": "../cheap", "task": {}, "trajectory": ""}, ValueError, "item 700: 'environment'"),
        ({"environment": "cheap", "trajectory": ""}, ValueError, "item 700 has no 'task'"),
        ({"environment": "cheap", "task": {}}, ValueError, "item 700 has no 'trajectory'"),
        ({"environment": "cheap", "task": "2+2", "trajectory": ""}, TypeError, "item 700: 'task' is a str"),
    ],
)
async def test_a_malformed_item_in_a_guessed_batch_is_named(
    envs: Path, bad: Any, error: type[Exception], text: str
) -> None:
    items = [cheap(n) for n in range(2_000)]
    items[700] = bad
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        for _ in range(2):  # before chunks form, and in a chunk
            with pytest.raises(error) as info:
                await eng.score(items)
            assert not isinstance(info.value, VerificationError)
            assert text in str(info.value)
            await warm(eng)
        assert await eng.score(items[:700]) == [reward(n) for n in range(700)]  # still usable


@pytest.mark.parametrize("name", ["no_such_environment", "x" * 300])
async def test_a_guessed_environment_that_does_not_exist_is_named_with_its_item(envs: Path, name: str) -> None:
    # the first and last items agree: the engine guesses the batch is all that environment's
    items = [item(name, item_id="first"), cheap(1), item(name, item_id="last")]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        with pytest.raises(ValueError, match=r"^item 0 \(id 'first'\): ") as info:
            await eng.score(items)
        assert not isinstance(info.value, VerificationError)
        assert name in str(info.value)
        assert await eng.score([cheap(1)]) == [reward(1)]  # still usable


@pytest.mark.timeout(8)  # the guessed lane's calls take 10 s: waiting for them fails here
async def test_a_failure_in_another_environment_aborts_at_once(envs: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the guessed lane's calls hold their threads for 10 s; the failing item must not wait for them
    items = [item("spy", sleep=10.0) for _ in range(8)]
    items[4] = item("faulty", mode="raise", item_id="bad")
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        with caplog.at_level(logging.ERROR, logger="engine"), pytest.raises(VerificationError) as info:
            await eng.score(items)
    assert (info.value.environment, info.value.index, info.value.item_id) == ("faulty", 4, "bad")
    records = [r for r in caplog.records if r.name == "engine" and r.levelno >= logging.ERROR]
    assert len(records) == 1
