"""``Engine.stats()``: per-verifier figures over the window since the last reset, keyed for a trainer's logs.

Real plugin environments, a real endpoint server and a real judge on 127.0.0.1; the figures are
checked against what the batches did (their items, rewards, retries, failures and tokens).
"""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import pytest
from conftest import SleepRecorder, add_endpoint_env, add_rubric_env, item
from servers import Request, Response, Server, score

from engine import BlockingEngine, Engine, EngineConfig, JudgeConfig, Limits, VerificationError

FIGURES = ["items", "reward_mean", "errors", "retries", "timeouts", "latency_p50_s", "latency_p99_s", "judge_tokens",
           "judge_spend", "cache_hits", "cache_hit_rate", "deduped"]
RUBRICS = Path(__file__).parent / "rubrics"


def figures(stats: dict[str, float], key: str, *, window: bool = False) -> dict[str, float]:
    """The figures of verifier ``key`` in a snapshot (every one of them must be there; ``window``: an endpoint's
    or a rubric's, which go through an adaptive window, have that figure too)."""
    prefix = f"engine/{key}/"
    mine = {name.removeprefix(prefix): value for name, value in stats.items() if name.startswith(prefix)}
    assert sorted(mine) == sorted([*FIGURES, *(["window"] if window else [])]), sorted(stats)
    return mine


async def test_a_window_holds_each_verifiers_items_mean_and_latency(config: EngineConfig) -> None:
    async with Engine(config) as eng:
        assert eng.stats() == {}  # nothing scored yet
        await eng.score([item("arith", "4", reference="4"), item("arith", "5", reference="4"), item("twin_a")])
        await eng.score([item("arith", "7", reference="7")] * 3)
        stats = eng.stats()
        assert eng.stats() == {}  # reset: a new window
        await eng.score([item("twin_a")])
        kept = eng.stats(reset=False)
        assert eng.stats(reset=False) == kept  # not reset: the same window
    assert sorted(stats) == sorted(f"engine/{key}/{name}" for key in ("arith/verify:score", "twin_a/verify:score")
                                   for name in FIGURES)
    arith = figures(stats, "arith/verify:score")
    assert (arith["items"], arith["reward_mean"], arith["errors"], arith["retries"]) == (5, 4 / 5, 0, 0)
    assert (arith["timeouts"], arith["judge_tokens"]) == (0, 0)
    assert 0 < arith["latency_p50_s"] <= arith["latency_p99_s"] < 30
    assert figures(stats, "twin_a/verify:score")["reward_mean"] == 0.25
    assert figures(kept, "twin_a/verify:score")["items"] == 1
    assert all(isinstance(value, float) for value in stats.values())


async def test_a_failed_batch_is_an_error_of_its_verifier_and_a_timeout_when_it_ran_out_of_time(
    envs: Path,
) -> None:
    key = "faulty/faults:by_task"
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={key: Limits(timeout=0.2)})
    async with Engine(config) as eng:
        await eng.load("faulty")  # its import is not within a call's 0.2 s: the calls below return at once
        assert await eng.score([item("faulty", mode="ok")] * 2) == [0.5, 0.5]
        with pytest.raises(VerificationError):
            await eng.score([item("faulty", mode="ok"), item("faulty", mode="raise")])
        with pytest.raises(VerificationError) as info:
            await eng.score([item("faulty", mode="hang", seconds=5.0)])
        assert info.value.reason.startswith("timed out")
        stats = figures(eng.stats(), key)
    # the failed batches' items are not counted (they gave no rewards); each failure is one error
    assert (stats["items"], stats["reward_mean"], stats["errors"], stats["timeouts"]) == (2, 0.5, 2, 1)


async def test_an_endpoint_is_keyed_by_its_url_and_counts_its_retries_and_timeouts(
    envs: Path, sleeps: SleepRecorder
) -> None:
    answers = [Response(503, b"busy"), Response.json({"reward": 0.75})]

    async def handle(request: Request) -> Response:
        if request.json()["task"].get("slow"):
            await asyncio.sleep(5)
        return answers.pop(0) if len(answers) > 1 else answers[0]

    with Server(handle) as server:
        url = server.url + "/score"
        add_endpoint_env(envs, "remote", url)
        # a second: the first call connects (the slow one then hangs five times as long)
        config = EngineConfig(environments=envs, refs={url: Limits(timeout=1.0, max_attempts=2)})
        async with Engine(config, sleep=sleeps) as eng:
            assert await eng.score([item("remote")]) == [0.75]
            with pytest.raises(VerificationError) as info:
                await eng.score([item("remote", slow=True)])
            assert "timed out" in info.value.reason
            stats = figures(eng.stats(), url, window=True)
    assert (stats["items"], stats["reward_mean"], stats["retries"], stats["errors"], stats["timeouts"]) == (
        1, 0.75, 1, 1, 1,
    )
    assert stats["window"] == 64  # never throttled: its max_concurrency (the default)


async def test_a_rubric_counts_its_judges_tokens_under_owner_and_name(envs: Path, tmp_path: Path) -> None:
    rubrics = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, rubrics)
    add_rubric_env(envs, "graded", "alice/arithmetic-correctness@1")

    def reply(request: Request) -> Response:
        return score(1, usage={"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105})

    with Server.judge(default=reply) as judge:
        config = EngineConfig(
            environments=envs, rubrics=rubrics, judge=JudgeConfig(base_url=judge.base_url, model="judge-test")
        )
        async with Engine(config) as eng:
            await eng.score([item("graded", "42", prompt="6 * 7?", reference="42")] * 3)
            stats = figures(eng.stats(), "alice/arithmetic-correctness", window=True)  # the key drops the version pin
    # three identical items: one judge call, two deduped
    assert (stats["items"], stats["reward_mean"], stats["judge_tokens"], stats["deduped"]) == (3, 1.0, 105, 2)
    assert (stats["cache_hits"], stats["cache_hit_rate"]) == (0, 0.0)
    assert stats["window"] == 32  # the judge's, never throttled: its max_concurrency (the default)


def test_the_blocking_engine_gives_the_same_figures(config: EngineConfig) -> None:
    with BlockingEngine(config) as eng:
        eng.score([item("twin_b"), item("twin_b")])
        with pytest.raises(VerificationError):
            eng.score([item("faulty", mode="raise")])
        stats = eng.stats()
        assert eng.stats() == {}
    twin = figures(stats, "twin_b/verify:score")
    assert (twin["items"], twin["reward_mean"], twin["errors"]) == (2, 0.75, 0)
    faulty = figures(stats, "faulty/faults:by_task")
    assert (faulty["items"], faulty["errors"], faulty["timeouts"]) == (0, 1, 0)
    assert math.isnan(faulty["reward_mean"]) and math.isnan(faulty["latency_p50_s"])  # no item: no mean


