"""engine.adapters.verl, called as verl's reward loop calls ``compute_score``: once per sample, concurrently,
one asyncio task per sample on the reward worker's loop, ``reward_kwargs`` by keyword."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from conftest import add_endpoint_env
from polling import started, wait_until
from servers import Request, Server

import engine
from engine.adapters._runtime import coalescer, source_of
from engine.adapters.verl import compute_score


async def batches_of(config: Path) -> int:
    """How many engine batches the running loop's per-sample calls to ``config``'s engine became."""
    return coalescer(source_of(str(config), None, None)).batches


def test_1024_concurrent_samples_become_one_engine_batch_and_each_gets_its_own_reward(engine_toml: Path) -> None:
    async def step() -> tuple[list[float], int]:
        calls = [
            compute_score(
                data_source="arith",
                solution_str=str(i),
                ground_truth=str(i if i % 3 else i + 1),
                extra_info={"index": i},
                config=str(engine_toml),
            )
            for i in range(1024)
        ]
        rewards = await asyncio.gather(*calls)
        return rewards, await batches_of(engine_toml)

    rewards, batches = asyncio.run(step())
    assert rewards == [0.0 if i % 3 == 0 else 1.0 for i in range(1024)]
    assert batches == 1


def test_a_failed_item_fails_its_own_call_alone_and_every_other_call_gets_its_own_reward(engine_toml: Path) -> None:
    async def step() -> tuple[list[Any], int]:
        calls = [
            compute_score("faulty", "s", None, {"mode": "raise"}, config=str(engine_toml)) if i == 5
            else compute_score("arith", str(i % 4), "1", config=str(engine_toml))
            for i in range(8)
        ]
        return await asyncio.gather(*calls, return_exceptions=True), await batches_of(engine_toml)

    outcomes, batches = asyncio.run(step())
    error = outcomes[5]
    assert isinstance(error, engine.VerificationError)  # never a zero
    assert (error.environment, error.index, error.kind) == ("faulty", 0, "plugin")  # its own (only) sample
    assert "the plugin blew up" in error.reason
    assert any("8 calls were gathered" in note and "own sample 0" in note for note in error.__notes__)
    # each other call, scored again alone, gets what it would have got had it never been gathered
    assert [o for n, o in enumerate(outcomes) if n != 5] == [1.0 if n % 4 == 1 else 0.0 for n in range(8) if n != 5]
    assert batches == 1 + 8  # a plugin's failure is checked alone too (a thread's chunk holds several calls' items)


def test_misuse_fails_only_the_call_it_belongs_to(engine_toml: Path) -> None:
    async def step() -> list[Any]:
        calls = [compute_score(name, "x", None, config=str(engine_toml)) for name in ("twin_a", "nowhere")]
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(step())
    assert outcomes[0] == 0.25
    assert isinstance(outcomes[1], ValueError) and not isinstance(outcomes[1], engine.VerificationError)
    assert "nowhere" in str(outcomes[1])


def test_the_task_is_the_reference_and_extra_info_and_the_environment_the_data_source(
    envs: Path, engine_toml: Path
) -> None:
    seen: list[Any] = []

    def reply(request: Request) -> dict[str, float]:
        seen.append(request.json())
        return {"reward": 0.5}

    with Server.json(reply) as server:
        add_endpoint_env(envs, "remote", server.url + "/score")
        add_endpoint_env(envs, "other", server.url + "/other")

        async def step() -> list[float]:
            return await asyncio.gather(
                compute_score("remote", "s1", "g1", {"question": "Q?", "split": "train"}, config=str(engine_toml)),
                compute_score("remote", "s2", 7, {"prompt": "P", "question": "Q"}, config=str(engine_toml)),
                compute_score("unused", "s3", "g3", None, config=str(engine_toml), environment="other"),
            )

        assert asyncio.run(step()) == [0.5, 0.5, 0.5]
        wait_until(lambda: server.open_connections == 0)  # the loop's end closed its engine
    bodies = sorted(seen, key=lambda body: body["trajectory"])
    assert bodies == [
        {"task": {"reference": "g1", "prompt": "Q?", "split": "train"}, "trajectory": "s1"},
        {"task": {"reference": 7, "prompt": "P", "question": "Q"}, "trajectory": "s2"},
        {"task": {"reference": "g3"}, "trajectory": "s3"},
    ]
    assert [request.path for request in server.requests].count("/other") == 1


def test_the_engine_comes_from_the_environment_when_reward_kwargs_name_none(
    engine_toml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_CONFIG", str(engine_toml))

    async def step() -> list[float]:
        return await asyncio.gather(*(compute_score("twin_a", "x", None) for _ in range(3)))

    assert asyncio.run(step()) == [0.25] * 3


def test_past_the_largest_batch_the_calls_are_split_and_a_cancelled_caller_leaves_the_others_theirs(
    engine_toml: Path,
) -> None:
    from engine.adapters._runtime import DEFAULT_MAX_BATCH

    count = DEFAULT_MAX_BATCH + 100

    async def step() -> tuple[list[Any], int]:
        # every call has submitted its sample
        tasks = await started(*(compute_score("arith", str(n % 4), "1", config=str(engine_toml)) for n in range(count)))
        tasks[7].cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        return outcomes, await batches_of(engine_toml)

    outcomes, batches = asyncio.run(step())
    assert batches == 2
    assert isinstance(outcomes[7], asyncio.CancelledError)
    assert [o for n, o in enumerate(outcomes) if n != 7] == [1.0 if n % 4 == 1 else 0.0 for n in range(count) if n != 7]


def test_a_numpy_data_source_is_passed_on_as_the_plain_string_it_holds(engine_toml: Path) -> None:
    """verl's streaming path hands ``np.str_`` data sources (and numpy integers in ``extra_info``): scored as
    the environment named, and an unknown one named as written (``'probe'``, not ``np.str_('probe')``)."""
    import numpy as np

    async def step() -> list[Any]:
        calls = [
            compute_score(np.str_("arith"), "4", "4", {"num_turns": np.int64(2)}, config=str(engine_toml)),
            compute_score(np.str_("probe"), "4", "4", {"num_turns": np.int32(2)}, config=str(engine_toml)),
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    scored, unknown = asyncio.run(step())
    assert scored == 1.0
    assert isinstance(unknown, ValueError) and "'probe'" in str(unknown) and "np.str_" not in str(unknown), unknown
