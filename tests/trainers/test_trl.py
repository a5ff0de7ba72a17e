"""TRL 1.16.0's own ``GRPOTrainer``, unmodified, trained for two steps on CPU with the engine's rewards.

A tiny Llama and a word-level tokenizer are built in code and saved where TRL loads a model from (nothing
comes from a hub: ``HF_HUB_OFFLINE``). The ``rowcode`` plugin's reward encodes its row and its completion,
so that what TRL recorded of each step (``GRPOTrainer._logs``: the rows it gathered, the rewards it took
from each reward function, the advantages it computed) shows each reward reached its own row, in order.
Run in the TRL venv only (``ENGINE_TRAINER=trl``; see tests/trainers/README.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trl_support
from trl_support import add_row_env, expected_reward, prompt_of, row_of, trainer_for

trl_support.offline()  # before TRL or transformers is imported

import torch  # noqa: E402
import trl  # noqa: E402
from test_serve import Service, servable, start_service, stop  # noqa: E402

import engine  # noqa: E402
from engine.adapters import close_engines  # noqa: E402
from engine.adapters.trl import AsyncEngineReward, EngineReward  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),  # a trainer built and two steps taken, on a loaded 2-core machine
    # the trainer's own deprecations (TRL's GRPOConfig sets a transformers argument renamed since): theirs to fix
    pytest.mark.filterwarnings("ignore::FutureWarning:transformers"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:trl"),
]
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "trl-token"


def test_the_pinned_release_is_the_one_running() -> None:
    assert trl.__version__ == "1.16.0"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trl_support.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def rows_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the ``rowcode`` plugin appends each call to (the service's plugin too: it inherits it)."""
    path = tmp_path / "rows.jsonl"
    monkeypatch.setenv("ENGINE_TEST_ROW_LOG", str(path))
    return path


@pytest.fixture
def rowcode(envs: Path, engine_toml: Path) -> Iterator[Path]:
    """A config whose environments include ``rowcode``; the adapters' engines closed after."""
    add_row_env(envs)
    yield engine_toml
    close_engines()


@pytest.fixture
def service(envs: Path, tmp_path: Path, rows_log: Path) -> Iterator[Service]:
    """An ``engine serve`` over this test's environments (``rowcode`` among them), with a token."""
    add_row_env(servable(envs))
    running = start_service(tmp_path, "", token=TOKEN)
    yield running
    close_engines()
    stop(running)


def rows(count: int, **columns: Any) -> list[dict[str, Any]]:
    """``count`` dataset rows: a prompt that names its row, the row's number, and ``fail`` (False: a test sets it)."""
    return [{"prompt": prompt_of(n), "row": n, "fail": False, **columns} for n in range(count)]


def logged(trainer: Any, step: int) -> dict[str, Any]:
    """What TRL logged at ``step`` (its ``log_history``, as the trainer's loggers got it)."""
    [entry] = [e for e in trainer.state.log_history if e.get("step") == step and "loss" in e]
    return entry


def assert_rewards_intact_and_in_order(recorder: trl_support.Recorder, name: str, steps: int = 2) -> None:
    """Every reward TRL received from ``name`` is the one its own row and completion have, at its place."""
    assert len(recorder.steps) == steps
    for step in recorder.steps:
        received = step["rewards"][name]
        assert len(received) == len(step["prompts"]) == len(step["completions"]) > 0
        assert received == expected_of(step)


def expected_of(step: dict[str, Any]) -> list[float]:
    """The rewards the ``rowcode`` plugin gives the rows and completions TRL kept of a step, in its order."""
    return [expected_reward(row_of(p), c) for p, c in zip(step["prompts"], step["completions"], strict=True)]


def plugin_saw(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_grpo_trains_two_steps_on_engine_rewards_each_its_own_rows(
    tiny_model: Path, rowcode: Path, rows_log: Path, tmp_path: Path
) -> None:
    reward = EngineReward(rowcode, environment="rowcode")
    trainer, recorder = trainer_for(tiny_model, [reward], rows(8), tmp_path / "out")
    trainer.train()
    assert trainer.state.global_step == 2
    assert_rewards_intact_and_in_order(recorder, "rowcode")
    # the plugin scored each row once, and what it saw is what TRL generated
    seen = plugin_saw(rows_log)
    trl_rows = [(row_of(p), trl_support.completion_text(c)) for s in recorder.steps
                for p, c in zip(s["prompts"], s["completions"], strict=True)]
    assert sorted((r["row"], r["said"]) for r in seen) == sorted(trl_rows)
    assert {r["prompt"] for r in seen} == {prompt_of(n) for n, _ in trl_rows}
    assert all(r["task"] == ["fail", "prompt", "row"] for r in seen)  # the row's columns, TRL's context in none
    for step, kept in enumerate(recorder.steps, start=1):  # the engine's figure is TRL's own mean
        assert logged(trainer, step)["engine/rowcode/verify:score/reward_mean"] == pytest.approx(
            sum(kept["rewards"]["rowcode"]) / len(kept["rewards"]["rowcode"]), abs=1e-4
        )
        assert not any(key.endswith(("judge_tokens_per_item", "retries_per_item", "skip_rate", "/items"))
                       for key in logged(trainer, step))  # none that means nothing for a plugin


def test_engine_environment_and_engine_config_serve_a_reward_built_without_arguments(
    tiny_model: Path, rowcode: Path, rows_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_CONFIG", str(rowcode))
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "rowcode")
    reward = EngineReward()  # as the README says every adapter does: both from the variables
    assert reward.__name__ == "rowcode"
    trainer, recorder = trainer_for(tiny_model, [reward], rows(8), tmp_path / "out")
    trainer.train()
    assert_rewards_intact_and_in_order(recorder, "rowcode")


def test_a_configuration_error_is_raised_before_the_trainer_is_built(
    tmp_path: Path, rowcode: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    with pytest.raises(engine.ConfigError, match="config file not found"):
        EngineReward(tmp_path / "nowhere.toml", environment="rowcode")
    with pytest.raises(ValueError, match="unknown environment 'math'"):
        EngineReward(rowcode, environment="math")
    monkeypatch.delenv("ENGINE_CONFIG", raising=False)
    monkeypatch.delenv("ENGINE_URL", raising=False)
    with pytest.raises(ValueError, match="no engine configured"):
        EngineReward(environment="rowcode")


def test_the_async_reward_on_trls_own_loop(tiny_model: Path, rowcode: Path, rows_log: Path, tmp_path: Path) -> None:
    reward = AsyncEngineReward(rowcode, environment="rowcode")
    trainer, recorder = trainer_for(tiny_model, [reward], rows(8), tmp_path / "out")
    trainer.train()
    assert_rewards_intact_and_in_order(recorder, "rowcode")


def test_grpo_through_engine_serve(tiny_model: Path, service: Service, rows_log: Path, tmp_path: Path) -> None:
    reward = EngineReward(url=service.url, token=TOKEN, environment="rowcode")
    trainer, recorder = trainer_for(tiny_model, [reward], rows(8), tmp_path / "out")
    trainer.train()
    assert trainer.state.global_step == 2
    assert_rewards_intact_and_in_order(recorder, "rowcode")
    assert len(plugin_saw(rows_log)) == 8  # scored in the service's process, each row once


@pytest.mark.parametrize("through", ["process", "service"])
def test_a_failing_item_ends_training_with_the_error_never_a_number(
    tiny_model: Path, envs: Path, engine_toml: Path, tmp_path: Path, rows_log: Path, through: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    add_row_env(servable(envs))
    running = start_service(tmp_path, "", token=TOKEN) if through == "service" else None
    try:
        source: dict[str, Any] = {"url": running.url, "token": TOKEN} if running else {"config": engine_toml}
        reward = EngineReward(**source, environment="rowcode")
        data = rows(8)
        data[1]["fail"] = True  # step 1's batch: rows 0 and 1, two completions each
        trainer, recorder = trainer_for(tiny_model, [reward], data, tmp_path / "out")
        with caplog.at_level(logging.ERROR, logger="engine"), pytest.raises(engine.VerificationError) as info:
            trainer.train()
    finally:
        close_engines()
        if running is not None:
            stop(running)
    assert info.value.environment == "rowcode"
    assert info.value.index in (2, 3)  # one of row 1's two completions (the first to fail)
    assert "row 1 fails on purpose" in str(info.value)
    assert trainer.state.global_step == 0 and recorder.steps == []  # no step took a reward
    # what the page tells a user to look for: the error's own words end the traceback, and in process the
    # engine's ERROR line says the same (engine serve logs none: the client raises it in the trainer)
    said = f"plugin verifier 'verify:score' (environment 'rowcode') failed on item {info.value.index}: raised"
    assert str(info.value).startswith(said)
    if running is None:
        aborted = [r.levelno for r in caplog.records if r.getMessage().startswith("batch aborted: " + said)]
        assert aborted == [logging.ERROR]


def test_skip_batch_alone_zeroes_the_advantage_and_the_optimiser_still_steps(
    tiny_model: Path, rowcode: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reward = EngineReward(rowcode, environment="rowcode", on_error="skip_batch")
    data = rows(8)
    data[0]["fail"] = True  # step 1 skipped, step 2 scored
    trainer, recorder = trainer_for(tiny_model, [reward], data, tmp_path / "out")
    with caplog.at_level(logging.ERROR, logger="engine"):
        trainer.train()
    line = "reward function 'rowcode' skipped its batch of 4 rows (None for each): plugin verifier 'verify:score'"
    assert [r.levelno for r in caplog.records if r.getMessage().startswith(line)] == [logging.ERROR]
    assert trainer.state.global_step == 2
    first, second = recorder.steps
    assert all(math.isnan(value) for value in first["rewards"]["rowcode"])  # None, which TRL made NaN
    assert first["advantages"] == [0.0] * 4  # TRL zeroes an unscorable row's advantage
    assert logged(trainer, 1)["grad_norm"] == 0.0  # nothing to learn from, but the step is taken
    assert logged(trainer, 1)["rewards/rowcode/mean"] is None  # TRL logs no mean of NaNs
    assert logged(trainer, 1)["engine/rowcode/skip_rate"] == 1.0
    assert logged(trainer, 2)["engine/rowcode/skip_rate"] == 0.0
    assert second["rewards"]["rowcode"] == expected_of(second)


def length_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """A second reward function: the completion's length in characters."""
    return [float(len(c)) for c in completions]


def test_skip_batch_beside_another_reward_trains_the_rows_on_that_one_alone(
    tiny_model: Path, rowcode: Path, tmp_path: Path
) -> None:
    reward = EngineReward(rowcode, environment="rowcode", on_error="skip_batch")
    data = rows(8)
    data[0]["fail"] = True
    trainer, recorder = trainer_for(tiny_model, [reward, length_reward], data, tmp_path / "out")
    trainer.train()
    first = recorder.steps[0]
    lengths = first["rewards"]["length_reward"]
    assert all(math.isnan(value) for value in first["rewards"]["rowcode"])
    # TRL sums the reward functions skipping NaN: the skipped rows' reward is the other function's alone
    assert logged(trainer, 1)["reward"] == pytest.approx(sum(lengths) / len(lengths))
    # and their advantage is computed from it (per group of 2 generations: (r - mean) / (std + 1e-4))
    for group in range(2):
        a, b = lengths[2 * group : 2 * group + 2]
        std = torch.tensor([a, b]).std().item()
        wanted = [(a - (a + b) / 2) / (std + 1e-4), (b - (a + b) / 2) / (std + 1e-4)]
        assert first["advantages"][2 * group : 2 * group + 2] == pytest.approx(wanted, abs=1e-4)
    assert logged(trainer, 1)["rewards/rowcode/mean"] is None


@pytest.mark.parametrize("failure", ["wrong token", "connection refused"])
def test_a_service_failure_ends_training_even_under_skip_batch(
    tiny_model: Path, service: Service, tmp_path: Path, failure: str
) -> None:
    if failure == "wrong token":
        reward = EngineReward(url=service.url, token="not-" + TOKEN, environment="rowcode", on_error="skip_batch")
    else:
        closed = f"http://127.0.0.1:{trl_support.free_port()}"
        reward = EngineReward(url=closed, environment="rowcode", on_error="skip_batch")
    trainer, recorder = trainer_for(tiny_model, [reward], rows(8), tmp_path / "out")
    with pytest.raises(engine.ServiceError) as info:
        trainer.train()
    assert info.value.status == (401 if failure == "wrong token" else None)
    assert trainer.state.global_step == 0 and recorder.steps == []


class CounterEnv:
    """An ``environment_factory`` environment, as TRL's docs write one: ``reset`` and one tool."""

    def reset(self, **row: Any) -> None:
        self.count = 0

    def increment(self, step: int) -> int:
        """Add ``step`` to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter's new value.
        """
        self.count += step
        return self.count


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template TRL can call tools through (Qwen 2.5's, shipped with TRL)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    directory = tmp_path_factory.mktemp("tiny-chat") / "model"
    return trl_support.build_tiny_model(directory, chat_template=qwen2_5_chat_template)


def chat_rows(count: int, **columns: Any) -> list[dict[str, Any]]:
    return [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows(count, **columns)]


@pytest.mark.parametrize(
    ("factory", "columns", "arguments"),
    [
        pytest.param(CounterEnv, {}, {"environment": "rowcode"}, id="one factory"),
        # the dict form routes rows by their `environment` column, which names the engine's environment too
        pytest.param({"rowcode": CounterEnv}, {"environment": "rowcode"}, {}, id="dict, one name for both"),
        # TRL's names are not the engine's: the engine reads no column (or another one)
        pytest.param({"counter": CounterEnv}, {"environment": "counter"},
                     {"environment": "rowcode", "environment_column": None}, id="dict, names apart"),
    ],
)
@pytest.mark.parametrize("through", ["process", "service"])
def test_environment_factory_rows_score_without_trls_environments_in_their_tasks(
    chat_model: Path, envs: Path, engine_toml: Path, tmp_path: Path, rows_log: Path,
    factory: Any, columns: dict[str, Any], arguments: dict[str, Any], through: str,
) -> None:
    add_row_env(servable(envs))
    running = start_service(tmp_path, "", token=TOKEN) if through == "service" else None
    try:
        source: dict[str, Any] = {"url": running.url, "token": TOKEN} if running else {"config": engine_toml}
        reward = EngineReward(**source, **arguments, name="rowcode")
        trainer, recorder = trainer_for(chat_model, [reward], chat_rows(8, **columns), tmp_path / "out",
                                        environment_factory=factory)
        trainer.train()
    finally:
        close_engines()
        if running is not None:
            stop(running)
    assert trainer.state.global_step == 2
    assert all(isinstance(c, list) for s in recorder.steps for c in s["completions"])  # messages, as TRL made them
    assert_rewards_intact_and_in_order(recorder, "rowcode")
    seen = plugin_saw(rows_log)
    assert len(seen) == 8
    # the task is the row's columns: TRL's `environments` (its CounterEnv instances) in none; the `environment`
    # column only where the engine does not read it
    read_by_engine = arguments.get("environment_column", "environment") == "environment"
    wanted = {"prompt", "row", "fail"} | ({"environment"} if columns and not read_by_engine else set())
    assert all(set(r["task"]) == wanted for r in seen)


def torchrun(
    tmp_path: Path, model: Path, reward: dict[str, Any], data: list[dict[str, Any]], **variables: str
) -> tuple[subprocess.CompletedProcess[str], dict[int, dict[str, Any]]]:
    """``torchrun --nproc_per_node 2 trl_support.py SPEC`` on 127.0.0.1 (gloo, CPU), with ``variables`` set;
    each rank's result."""
    result = tmp_path / "result"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "reward": reward, "rows": data,
                                "output_dir": str(tmp_path / "out"), "result": str(result)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tests/trainers")]),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **variables}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(trl_support.free_port()),
               str(ROOT / "tests/trainers/trl_support.py"), str(spec)]
    ran = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    results = {rank: json.loads(Path(f"{result}.{rank}").read_text())
               for rank in range(2) if Path(f"{result}.{rank}").exists()}
    return ran, results


def two_rank_rows() -> list[dict[str, Any]]:
    """16 rows, 4 a step (2 a rank, 2 completions each): row 2 (rank 1's at step 1) fails; row 7 (rank 1's
    at step 2) is another environment's, so that the two ranks score unequal shares of ``rowcode``."""
    data = rows(16, environment="rowcode")
    data[2]["fail"] = True
    data[7]["environment"] = "rowtwin"
    return data


def test_two_ranks_log_rates_and_item_weighted_means_and_rewards_reach_their_rows(
    tiny_model: Path, service: Service, envs: Path, rows_log: Path, tmp_path: Path
) -> None:
    add_row_env(envs, "rowtwin")
    reward = {"url": service.url, "token": TOKEN, "on_error": "skip_batch", "name": "engine"}
    ran, results = torchrun(tmp_path, tiny_model, reward, two_rank_rows())
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert sorted(results) == [0, 1] and all(r["world_size"] == 2 and r["global_step"] == 2 for r in results.values())
    steps = results[0]["steps"]
    assert steps == results[1]["steps"]  # what TRL gathered from both ranks, the same on each
    first, second = steps
    # step 1: rank 0's rows 0 and 1 scored, rank 1's batch (rows 2 and 3) skipped: None, which TRL made NaN
    assert [row_of(p) for p in first["prompts"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    scored = expected_of(first)[:4]
    assert first["rewards"]["engine"][:4] == scored
    assert all(math.isnan(value) for value in first["rewards"]["engine"][4:])
    assert first["advantages"][4:] == [0.0] * 4
    for rank in (0, 1):  # TRL averages log_metric's values over the ranks: a rate stays a rate
        step1, step2 = (logged_in(results[rank]["log_history"], step) for step in (1, 2))
        assert step1["engine/engine/skip_rate"] == 0.5  # one rank's batch of two
        assert step2["engine/engine/skip_rate"] == 0.0
        assert step1["engine/rowcode/verify:score/reward_mean"] == pytest.approx(sum(scored) / 4, abs=1e-4)
        # step 2: rowcode scored 4 items on rank 0 and 2 on rank 1; the mean is over the 6, not of the ranks' means
        received = second["rewards"]["engine"]
        assert [row_of(p) for p in second["prompts"]] == [4, 4, 5, 5, 6, 6, 7, 7]
        assert received == expected_of(second)
        over_items = sum(received[:6]) / 6
        of_ranks = (sum(received[:4]) / 4 + sum(received[4:6]) / 2) / 2
        assert step2["engine/rowcode/verify:score/reward_mean"] == pytest.approx(over_items, abs=1e-4)
        assert abs(over_items - of_ranks) > 0.1  # (so the figure above could not have been the ranks' mean)
        assert step2["engine/rowtwin/verify:score/reward_mean"] == pytest.approx(sum(received[6:]) / 2, abs=1e-4)
        assert not any(key.endswith("/items") for key in step2)  # a count averaged over ranks means nothing
    kept = [r for r in plugin_saw(rows_log) if r["row"] not in (2, 3)]  # row 3 may be scored before the abort
    assert sorted(r["row"] for r in kept) == [0, 0, 1, 1, 4, 4, 5, 5, 6, 6, 7, 7]


def logged_in(history: list[dict[str, Any]], step: int) -> dict[str, Any]:
    [entry] = [e for e in history if e.get("step") == step and "loss" in e]
    return entry


def test_two_ranks_a_failure_on_one_rank_ends_training(
    tiny_model: Path, rowcode: Path, envs: Path, rows_log: Path, tmp_path: Path
) -> None:
    add_row_env(envs, "rowtwin")
    # as docs/trainers/trl.md launches it: EngineReward() reads both variables on each rank
    variables = {"ENGINE_CONFIG": str(rowcode), "ENGINE_ENVIRONMENT": "rowcode"}
    ran, results = torchrun(tmp_path, tiny_model, {}, two_rank_rows(), **variables)
    assert ran.returncode != 0
    outcome = results[1]["outcome"]  # rank 1's batch held row 2; rank 0 was stopped by torchrun
    assert (outcome["error"], outcome["environment"]) == ("VerificationError", "rowcode")
    assert outcome["index"] in (0, 1) and "row 2 fails on purpose" in outcome["text"]
    assert results[1]["global_step"] == 0 and results[1]["steps"] == []
    last_line = "engine._errors.VerificationError: plugin verifier 'verify:score' (environment 'rowcode') failed on"
    assert last_line in ran.stderr  # the page's words for what ends the traceback


def test_the_example_script_trains_on_the_math_environment(tiny_model: Path, tmp_path: Path) -> None:
    """examples/trainers/trl_grpo.py, run as a user runs it, on the tiny model for 2 steps."""
    env = {**os.environ, "ENGINE_EXAMPLE_MODEL": str(tiny_model), "ENGINE_EXAMPLE_MAX_STEPS": "2",
           "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    ran = subprocess.run([sys.executable, str(ROOT / "examples/trainers/trl_grpo.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-4000:]
    logs = [line for line in ran.stdout.splitlines() if "'loss'" in line]
    assert len(logs) == 2  # one line per step, TRL's
    assert all("'engine/math/verify:score/reward_mean'" in line and "'rewards/math/mean'" in line for line in logs)
    assert "judge_tokens" not in ran.stdout and "/items'" not in ran.stdout


# --- docs/trainers/trl.md: every block run or parsed ----------------------------------------------------

DOC = ROOT / "docs/trainers/trl.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture
def examples_dir(tmp_path: Path) -> Path:
    """A directory holding the examples' engine.toml and its environments, as a user's project would."""
    work = tmp_path / "work"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("envs", "rubrics"):
        shutil.copytree(ROOT / "examples" / name, work / name, ignore=ignore)
    shutil.copy(ROOT / "examples/engine.toml", work / "engine.toml")
    return work


def run_block(code: str, work: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A block run as its reader would, in a directory with ``engine.toml``: ``model`` and ``args`` theirs."""
    monkeypatch.chdir(work)
    namespace: dict[str, Any] = {"model": str(model), "args": trl_support.grpo_args(work / "out")}
    try:
        exec(compile(code, str(DOC), "exec"), namespace)
    finally:
        close_engines()
    return namespace


def test_the_pages_first_block_trains_on_math_with_its_answer_column(
    tiny_model: Path, examples_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = blocks("python")[0]
    assert 'environment="math"' in first and '"answer"' in first
    trained = run_block(first, examples_dir, tiny_model, monkeypatch)
    trainer = trained["trainer"]
    assert trainer.state.global_step == 2
    assert all("engine/math/verify:score/reward_mean" in logged(trainer, step) for step in (1, 2))
    # as the README had it, with a `reference` column: math-verify's environment reads `answer`
    with pytest.raises(engine.VerificationError, match="KeyError: 'answer'"):
        run_block(first.replace('"answer"', '"reference"'), examples_dir, tiny_model, monkeypatch)


def test_the_pages_other_blocks_build_what_they_say(
    tiny_model: Path, examples_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    monkeypatch.setenv("ENGINE_TOKEN", TOKEN)
    built = []
    for code in blocks("python")[1:]:
        prelude = "from engine.adapters.trl import EngineReward\n"  # the page's first block imports it
        namespace = run_block(prelude + code, examples_dir, tiny_model, monkeypatch)
        built.append({name: (r.environment, r.environment_column, r.on_error, r._source.url)
                      for name, r in namespace.items() if isinstance(r, EngineReward)})
    assert built == [
        {"reward": ("math", None, "raise", None), "per_row": (None, "engine_environment", "raise", None)},
        {"reward": ("math", "environment", "skip_batch", None)},
        {"reward": ("math", "environment", "raise", "http://127.0.0.1:8000")},
    ]


def test_the_pages_launch_line_is_the_one_the_two_rank_test_runs() -> None:
    [launch] = blocks("bash")
    words = shlex.split(launch.strip())
    variables = dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))
    command = [word for word in words if word.split("=", 1)[0] not in variables]
    assert set(variables) == {"ENGINE_CONFIG", "ENGINE_ENVIRONMENT"}  # what test_two_ranks_a_failure... sets
    assert command == ["torchrun", "--nproc_per_node", "2", "train.py"]
