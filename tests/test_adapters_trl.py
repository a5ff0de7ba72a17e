"""engine.adapters.trl, called as TRL's GRPOTrainer calls a reward function: columns by keyword, once per step.

The sync ``EngineReward`` from the training thread; ``AsyncEngineReward`` on a loop in a daemon thread
while the caller blocks on ``run_coroutine_threadsafe(...).result()``, as TRL runs async reward functions.
"""

from __future__ import annotations

import logging
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
from adapter_support import LoopThread, write_config
from cli_support import RUBRICS
from conftest import add_endpoint_env, add_rubric_env
from servers import Request, Response, Server, score, status

import engine
from engine.adapters import close_engines
from engine.adapters.trl import AsyncEngineReward, EngineReward

PROMPTS = ["What is 2+2?", "What is 3+3?", "What is 4+4?"]
COMPLETIONS = ["4", "7", "8"]  # right, wrong, right



class Metrics:
    """TRL's ``log_metric``: every value logged, by name (TRL averages them: sum over count, over every rank)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def __call__(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    @property
    def logged(self) -> dict[str, float]:
        """What TRL would log for a step on one rank: each name's values averaged."""
        return {name: sum(values) / len(values) for name, values in self.values.items()}


def trl_call(reward: Any, prompts: list[Any], completions: list[Any], **columns: Any) -> Any:
    """Call ``reward`` with TRL's keyword arguments (``completion_ids``, columns, ``trainer_state``, ...)."""
    log_metric = columns.pop("log_metric", Metrics())
    return reward(
        prompts=prompts,
        completions=completions,
        completion_ids=[[1, 2]] * len(prompts),
        **columns,
        trainer_state=object(),
        log_extra=lambda *args: None,
        log_metric=log_metric,
    )


def test_each_row_is_an_item_and_rewards_come_back_in_order(engine_toml: Path) -> None:
    reward = EngineReward(engine_toml, environment="arith")
    assert trl_call(reward, PROMPTS, COMPLETIONS, reference=["4", "6", "8"]) == [1.0, 0.0, 1.0]
    assert reward.__name__ == "arith"  # TRL's metric name
    # the constructor's environment is every row's; built without one, a row's environment column names its own
    environments = ["arith", "twin_a", "twin_b"]
    rewards = trl_call(reward, PROMPTS, COMPLETIONS, reference=["4", "6", "8"], environment=environments)
    assert rewards == [1.0, 0.0, 1.0]
    rewards = trl_call(EngineReward(engine_toml), PROMPTS, COMPLETIONS, reference=["4", "6", "8"],
                       environment=environments)
    assert rewards == [1.0, 0.25, 0.75]


def test_the_task_holds_the_prompt_and_the_rows_columns_and_the_id_is_the_items(envs: Path, engine_toml: Path) -> None:
    seen: list[Any] = []

    def reply(request: Request) -> dict[str, float]:
        seen.append(request.json())
        return {"reward": float(request.json()["task"]["weight"])}

    with Server.json(reply) as server:
        add_endpoint_env(envs, "remote", server.url + "/score")
        reward = EngineReward(engine_toml)
        messages = [[{"role": "assistant", "content": "hi"}], [{"role": "assistant", "content": "yo"}]]
        rewards = trl_call(
            reward, ["p0", "p1"], messages, environment=["remote", "remote"], weight=[0.5, 2], id=["a", "b"]
        )
    assert rewards == [0.5, 2.0]
    bodies = sorted(seen, key=lambda body: body["task"]["prompt"])
    assert bodies == [
        {"task": {"prompt": "p0", "weight": 0.5}, "trajectory": messages[0]},
        {"task": {"prompt": "p1", "weight": 2}, "trajectory": messages[1]},
    ]


def test_a_failed_verification_is_raised_never_zeros(engine_toml: Path) -> None:
    reward = EngineReward(engine_toml, environment="faulty")
    with pytest.raises(engine.VerificationError) as info:
        trl_call(reward, ["a", "b"], ["x", "y"], mode=["ok", "raise"], id=[10, 11])
    assert (info.value.environment, info.value.index, info.value.item_id) == ("faulty", 1, 11)


def test_skip_batch_gives_none_for_every_row_and_logs_the_error(
    engine_toml: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reward = EngineReward(engine_toml, environment="faulty", on_error="skip_batch")
    metrics = Metrics()
    with caplog.at_level(logging.ERROR, logger="engine"):
        rewards = trl_call(reward, ["a", "b", "c"], ["x", "y", "z"], mode=["ok", "raise", "ok"], log_metric=metrics)
    assert rewards == [None, None, None]
    skipped = [r for r in caplog.records if r.name == "engine" and "skipped its batch of 3 rows" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.ERROR
    assert "the plugin blew up" in skipped[0].getMessage()
    assert metrics.values == {"engine/faulty/skip_rate": [1.0]}  # one skipped batch on this rank
    assert trl_call(reward, ["a"], ["x"], mode=["ok"], log_metric=metrics) == [0.5]
    assert metrics.values["engine/faulty/skip_rate"] == [1.0, 0.0]  # averaged over ranks and steps: the rate
    # misuse is not a verification error: it is raised, whatever on_error says
    with pytest.raises(ValueError, match="unknown environment"):
        trl_call(EngineReward(engine_toml, on_error="skip_batch"), ["a"], ["x"], environment=["nowhere"])


def test_log_metric_gets_per_item_means_weighted_by_items_and_only_the_meaningful_ones(engine_toml: Path) -> None:
    reward = EngineReward(engine_toml, environment="arith")
    metrics = Metrics()
    trl_call(reward, PROMPTS, COMPLETIONS, reference=["4", "6", "8"], log_metric=metrics)
    # once per item: TRL's average over every value of every rank is then the mean over all ranks' items
    assert metrics.values == {"engine/arith/verify:score/reward_mean": [2 / 3] * 3}
    # no count (TRL averages counts over ranks), no percentile, no retries nor judge tokens for a plugin, and
    # no skip rate under on_error="raise" (a failure ends training)
    second = Metrics()
    trl_call(reward, PROMPTS[:1], COMPLETIONS[:1], reference=["4"], log_metric=second)
    assert second.values == {"engine/arith/verify:score/reward_mean": [1.0]}  # each call logs its own batch


def test_an_endpoints_retries_are_logged_per_item(envs: Path, engine_toml: Path) -> None:
    calls = {"n": 0}

    async def reply(request: Request) -> Response:
        calls["n"] += 1
        if calls["n"] == 1:
            return status(503, retry_after="0")  # transient: retried at once
        return Response.json({"reward": 0.5})

    with Server(reply) as server:
        add_endpoint_env(envs, "remote", server.url + "/score")
        engine_toml.write_text(engine_toml.read_text() + "[defaults]\nmax_concurrency = 1\n")
        reward = EngineReward(engine_toml, environment="remote", on_error="skip_batch")
        metrics = Metrics()
        assert trl_call(reward, ["p0", "p1"], ["a", "b"], log_metric=metrics) == [0.5, 0.5]
    key = f"engine/{server.url}/score/"
    assert metrics.values == {
        key + "reward_mean": [0.5, 0.5],
        key + "retries_per_item": [0.5, 0.5],  # one retry over two items
        "engine/remote/skip_rate": [0.0],
    }


def test_a_rubrics_judge_tokens_and_retries_are_logged_per_item(envs: Path, tmp_path: Path) -> None:
    rubrics = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, rubrics)
    add_rubric_env(envs, "graded", "alice/arithmetic-correctness@1")

    def reply(request: Request) -> Response:
        return score(1, usage={"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105})

    with Server.judge(default=reply) as judge:
        config = write_config(envs, rubrics=f'"{rubrics}"')
        config.write_text(config.read_text() + f'[judge]\nbase_url = "{judge.base_url}"\nmodel = "judge-test"\n')
        reward = EngineReward(config, environment="graded")
        metrics = Metrics()
        try:
            # three distinct items: repeats of one would be judged once (the judge's in-batch dedup)
            rewards = trl_call(reward, ["6 * 7?", "7 * 6?", "2 * 21?"], ["42"] * 3, reference=["42"] * 3,
                               log_metric=metrics)
        finally:
            close_engines()
    assert rewards == [1.0, 1.0, 1.0]
    key = "engine/alice/arithmetic-correctness/"
    assert metrics.values == {
        key + "reward_mean": [1.0] * 3,
        key + "retries_per_item": [0.0] * 3,
        key + "judge_tokens_per_item": [105.0] * 3,
    }


def test_it_pickles_as_its_arguments_and_scores_where_it_lands(engine_toml: Path) -> None:
    reward = EngineReward(engine_toml, environment="arith", on_error="skip_batch")
    again = pickle.loads(pickle.dumps(reward))
    assert type(again) is EngineReward
    assert (again.environment, again.on_error, again.__name__) == ("arith", "skip_batch", "arith")
    assert trl_call(again, PROMPTS, COMPLETIONS, reference=["4", "6", "8"]) == [1.0, 0.0, 1.0]
    async_reward = pickle.loads(pickle.dumps(AsyncEngineReward(engine_toml, environment="arith")))
    assert type(async_reward) is AsyncEngineReward
    config = engine.EngineConfig(environments=engine_toml.parent / "envs", allow_unpinned=True)
    with pytest.raises(TypeError, match="pass its file's path"):
        pickle.dumps(EngineReward(config, environment="arith"))


def test_arguments_are_checked_when_it_is_built(engine_toml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="on_error"):
        EngineReward(engine_toml, on_error="zero")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        EngineReward(engine_toml, url="http://127.0.0.1:1")
    with pytest.raises(TypeError, match="environment_column"):
        EngineReward(engine_toml, environment_column="")
    with pytest.raises(ValueError, match="TRL's own arguments"):
        EngineReward(engine_toml, environment_column="environments")
    monkeypatch.delenv("ENGINE_CONFIG", raising=False)
    monkeypatch.delenv("ENGINE_URL", raising=False)
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    with pytest.raises(ValueError, match="ENGINE_CONFIG"):
        EngineReward(environment="arith")
    monkeypatch.setenv("ENGINE_CONFIG", str(engine_toml))
    assert trl_call(EngineReward(environment="twin_a"), ["p"], ["c"]) == [0.25]


def test_configuration_errors_are_raised_when_it_is_built_not_at_the_first_step(
    engine_toml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    with pytest.raises(engine.ConfigError, match="config file not found"):
        EngineReward(engine_toml.parent / "missing.toml", environment="arith")
    broken = engine_toml.parent / "broken.toml"
    broken.write_text("environments = [\n")
    with pytest.raises(engine.ConfigError, match="not valid TOML"):
        EngineReward(broken, environment="arith")
    monkeypatch.setenv("ENGINE_CONFIG", str(broken))  # the variable's file is read as well
    with pytest.raises(engine.ConfigError, match="not valid TOML"):
        EngineReward(environment="arith")
    with pytest.raises(ValueError, match="unknown environment 'nowhere'"):
        EngineReward(engine_toml, environment="nowhere")
    (engine_toml.parent / "envs" / "torn").mkdir()
    (engine_toml.parent / "envs" / "torn" / "manifest.json").write_text("{")
    with pytest.raises(engine.ManifestError, match="invalid JSON"):
        EngineReward(engine_toml, environment="torn")
    with pytest.raises(ValueError, match=r"no environment: .*ENGINE_ENVIRONMENT"):
        EngineReward(engine_toml, environment_column=None)  # nothing could ever name one
    # no environment and the default column: legal (the dataset's rows name theirs), found at the step
    reward = EngineReward(engine_toml)
    with pytest.raises(ValueError, match="no environment for row 0"):
        trl_call(reward, ["p"], ["c"])
    assert trl_call(reward, ["p"], ["c"], environment=["twin_a"]) == [0.25]


def test_engine_environment_is_read_when_it_is_built(engine_toml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "twin_b")
    reward = EngineReward(engine_toml)
    assert (reward.environment, reward.__name__) == ("twin_b", "twin_b")
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "twin_a")  # read once: a later change is not this reward's
    assert trl_call(reward, ["p", "q"], ["c", "d"]) == [0.75, 0.75]
    assert trl_call(reward, ["p"], ["c"], environment=[None]) == [0.75]  # a row without one takes it too
    assert EngineReward(engine_toml, environment="arith").environment == "arith"  # the argument wins
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "nowhere")
    with pytest.raises(ValueError, match="unknown environment 'nowhere'"):
        EngineReward(engine_toml)


def test_trls_own_context_is_never_part_of_a_task(envs: Path, engine_toml: Path) -> None:
    """TRL 1.16.0 passes ``environments`` (environment_factory's instances, one per row) beside the columns."""
    seen: list[Any] = []

    def reply(request: Request) -> dict[str, float]:
        seen.append(request.json()["task"])
        return {"reward": 1.0}

    class CounterEnv:  # what an environment_factory makes: not JSON, not a task's data
        def reset(self) -> None:
            pass

    with Server.json(reply) as server:
        add_endpoint_env(envs, "remote", server.url + "/score")
        reward = EngineReward(engine_toml, environment="remote")
        rewards = trl_call(reward, ["p0", "p1"], ["a", "b"], weight=[1, 2], environments=[CounterEnv(), CounterEnv()])
    assert rewards == [1.0, 1.0]
    tasks = sorted(seen, key=lambda task: task["prompt"])
    assert tasks == [{"prompt": "p0", "weight": 1}, {"prompt": "p1", "weight": 2}]


def test_environment_is_every_rows_and_the_column_serves_a_reward_built_without_one(engine_toml: Path) -> None:
    # two rewards built for two environments, beside a dataset whose `environment` column names a third (TRL's
    # dict environment_factory routes rows by it): each scores its own, never the column's as if it were its own
    lengths, exact = EngineReward(engine_toml, environment="twin_a"), EngineReward(engine_toml, environment="arith")
    assert trl_call(lengths, ["p"], ["4"], reference=["4"], environment=["twin_b"]) == [0.25]
    assert trl_call(exact, ["p"], ["4"], reference=["4"], environment=["twin_b"]) == [1.0]
    # without environment=, the column names each row's (by default TRL's routing column, or another one)
    by_row = EngineReward(engine_toml)
    rewards = trl_call(by_row, ["p", "q"], ["4", "4"], reference=["4", "4"], environment=["twin_b", "arith"])
    assert rewards == [0.75, 1.0]
    other = EngineReward(engine_toml, environment_column="engine_environment")
    rewards = trl_call(other, ["p", "q"], ["4", "4"], reference=["4", "4"], environment=["tools", "tools"],
                       engine_environment=["twin_b", "arith"])
    assert rewards == [0.75, 1.0]
    fixed = EngineReward(engine_toml, environment="arith", environment_column=None)  # the column joins the task
    assert trl_call(fixed, ["p"], ["4"], reference=["4"], environment=["tools"]) == [1.0]
    with pytest.raises(ValueError, match="unknown environment 'tools'"):  # TRL's name is no engine environment
        trl_call(by_row, ["p"], ["c"], environment=["tools"])


def test_the_async_reward_runs_on_trls_daemon_thread_loop(engine_toml: Path, trainer_loop: LoopThread) -> None:
    reward = AsyncEngineReward(engine_toml, environment="arith")
    metrics = Metrics()
    for _ in range(2):  # its engine is opened once, on that loop, and kept
        rewards = trainer_loop.call(
            reward(
                prompts=PROMPTS,
                completions=COMPLETIONS,
                completion_ids=None,
                reference=["4", "6", "8"],
                trainer_state=None,
                log_metric=metrics,
            )
        )
        assert rewards == [1.0, 0.0, 1.0]
    assert metrics.values["engine/arith/verify:score/reward_mean"] == [2 / 3] * 6
    failing = AsyncEngineReward(engine_toml, environment="faulty")
    with pytest.raises(engine.VerificationError):
        trainer_loop.call(failing(prompts=["a"], completions=["x"], mode=["raise"]))
    skipping = AsyncEngineReward(engine_toml, environment="faulty", on_error="skip_batch")
    assert trainer_loop.call(skipping(prompts=["a", "b"], completions=["x", "y"], mode=["raise", "ok"])) == [None, None]
