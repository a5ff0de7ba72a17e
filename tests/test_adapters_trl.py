"""engine.adapters.trl, called as TRL's GRPOTrainer calls a reward function: columns by keyword, once per step.

The sync ``EngineReward`` from the training thread; ``AsyncEngineReward`` on a loop in a daemon thread
while the caller blocks on ``run_coroutine_threadsafe(...).result()``, as TRL runs async reward functions.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
from adapter_support import LoopThread
from conftest import add_endpoint_env
from servers import Request, Server

import engine
from engine.adapters.trl import AsyncEngineReward, EngineReward

PROMPTS = ["What is 2+2?", "What is 3+3?", "What is 4+4?"]
COMPLETIONS = ["4", "7", "8"]  # right, wrong, right



class Metrics:
    """TRL's ``log_metric``: what was logged, by name."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def __call__(self, name: str, value: float) -> None:
        self.logged[name] = value


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
    # a row's environment column wins over the constructor's
    environments = ["arith", "twin_a", "twin_b"]
    rewards = trl_call(reward, PROMPTS, COMPLETIONS, reference=["4", "6", "8"], environment=environments)
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
    assert metrics.logged["engine/faulty/faults:by_task/errors"] == 1.0
    # misuse is not a verification error: it is raised, whatever on_error says
    with pytest.raises(ValueError, match="unknown environment"):
        trl_call(reward, ["a"], ["x"], environment=["nowhere"])


def test_log_metric_gets_the_figures_that_average_across_ranks(engine_toml: Path) -> None:
    reward = EngineReward(engine_toml, environment="arith")
    metrics = Metrics()
    trl_call(reward, PROMPTS, COMPLETIONS, reference=["4", "6", "8"], log_metric=metrics)
    prefix = "engine/arith/verify:score/"
    assert metrics.logged == {
        f"{prefix}items": 3.0,
        f"{prefix}reward_mean": 2 / 3,
        f"{prefix}errors": 0.0,
        f"{prefix}retries": 0.0,
        f"{prefix}timeouts": 0.0,
        f"{prefix}judge_tokens": 0.0,
    }  # no percentile: they do not average
    second = Metrics()
    trl_call(reward, PROMPTS[:1], COMPLETIONS[:1], reference=["4"], log_metric=second)
    assert second.logged[f"{prefix}items"] == 1.0  # each step logs its own window


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
    monkeypatch.delenv("ENGINE_CONFIG", raising=False)
    monkeypatch.delenv("ENGINE_URL", raising=False)
    with pytest.raises(ValueError, match="ENGINE_CONFIG"):
        EngineReward()
    monkeypatch.setenv("ENGINE_CONFIG", str(engine_toml))
    assert trl_call(EngineReward(environment="twin_a"), ["p"], ["c"]) == [0.25]
    with pytest.raises(ValueError, match="no environment"):
        trl_call(EngineReward(engine_toml), ["p"], ["c"])


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
    assert metrics.logged["engine/arith/verify:score/items"] == 3.0
    failing = AsyncEngineReward(engine_toml, environment="faulty")
    with pytest.raises(engine.VerificationError):
        trainer_loop.call(failing(prompts=["a"], completions=["x"], mode=["raise"]))
    skipping = AsyncEngineReward(engine_toml, environment="faulty", on_error="skip_batch")
    assert trainer_loop.call(skipping(prompts=["a", "b"], completions=["x", "y"], mode=["raise", "ok"])) == [None, None]
