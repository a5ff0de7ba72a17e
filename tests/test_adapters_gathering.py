"""The adapters' gathering of concurrent calls (``engine.adapters._runtime.Coalescer``): each call, one sample
or a group, gets exactly what it would get alone, whatever the calls gathered beside it do."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import engine
from engine.adapters._runtime import coalescer, source_of


def group(environment: str, trajectories: list[str], mode: str = "ok") -> list[dict[str, Any]]:
    return [{"environment": environment, "task": {"prompt": "p", "reference": "1", "mode": mode}, "trajectory": t}
            for t in trajectories]


async def gathered(config: Path, calls: list[list[dict[str, Any]]]) -> tuple[list[Any], int]:
    gather = coalescer(source_of(str(config), None, None))
    outcomes = await asyncio.gather(*(gather.score_many(call) for call in calls), return_exceptions=True)
    return outcomes, gather.batches


def test_a_failing_sample_of_a_group_names_its_place_in_its_own_group(engine_toml: Path) -> None:
    bad = group("faulty", ["a", "b"]) + group("faulty", ["c"], mode="raise")
    calls = [group("arith", ["1", "0", "1"]), bad, group("arith", ["0", "1"])]
    outcomes, batches = asyncio.run(gathered(engine_toml, calls))
    assert outcomes[0] == [1.0, 0.0, 1.0] and outcomes[2] == [0.0, 1.0]
    error = outcomes[1]
    assert isinstance(error, engine.VerificationError)
    assert (error.environment, error.index) == ("faulty", 2)  # the group's third sample, not the batch's item 5
    assert any("3 calls were gathered into one engine batch of 8 items" in note and "own sample 2" in note
               for note in error.__notes__)
    assert batches == 3  # the gathered batch, then the two good calls, each alone


def test_a_call_alone_gets_the_error_as_the_engine_raised_it(engine_toml: Path) -> None:
    outcomes, batches = asyncio.run(gathered(engine_toml, [group("faulty", ["a", "b"], mode="raise")]))
    error = outcomes[0]
    assert isinstance(error, engine.VerificationError) and error.index in (0, 1)
    assert not getattr(error, "__notes__", None)  # nothing was gathered with it
    assert batches == 1


def test_every_failing_call_gets_its_own_error_and_the_rest_their_rewards(engine_toml: Path) -> None:
    calls = [group("faulty", ["x"], mode="raise") if n % 3 == 0 else group("arith", [str(n % 2)]) for n in range(12)]
    outcomes, _ = asyncio.run(gathered(engine_toml, calls))
    for n, outcome in enumerate(outcomes):
        if n % 3 == 0:
            assert isinstance(outcome, engine.VerificationError) and outcome.index == 0, (n, outcome)
        else:
            assert outcome == [float(n % 2)], (n, outcome)
    assert len({id(outcome) for n, outcome in enumerate(outcomes) if n % 3 == 0}) == 4  # no error shared


def test_an_empty_group_is_no_items_and_joins_no_batch(engine_toml: Path) -> None:
    outcomes, batches = asyncio.run(gathered(engine_toml, [[], group("arith", ["1"])]))
    assert outcomes == [[], [1.0]] and batches == 1
