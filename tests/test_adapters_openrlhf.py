"""engine.adapters.openrlhf, used as OpenRLHF uses ``--reward.remote_url /path/to/file.py``: the file loaded by
its path (``importlib.util.spec_from_file_location``), configured by environment variables, its
``reward_func(queries, prompts, labels)`` called per sample from the actors' loops through ``asyncio.to_thread``."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from cli_support import invoke
from conftest import add_env

import engine

STRICT = """
def score(task, trajectory):
    if task["reference"] == "boom":
        raise ValueError("no reference may be boom")
    return 1.0
"""


def load_by_path(path: Path) -> ModuleType:
    """The file loaded as OpenRLHF loads a ``.py`` remote_url: by path, under a name of its own."""
    spec = importlib.util.spec_from_file_location("openrlhf_reward_func", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def adapter_file(tmp_path: Path) -> Path:
    ran = invoke("adapters", "openrlhf-path", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    path = Path(ran.stdout.strip())
    assert path.is_file() and path.name == "openrlhf.py"
    return path


@pytest.fixture
def reward_func(adapter_file: Path, engine_toml: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ENGINE_CONFIG", str(engine_toml))
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "arith")
    return load_by_path(adapter_file).reward_func


def test_per_sample_calls_from_threads_get_their_rewards(reward_func: Any) -> None:
    async def actor() -> list[Any]:  # each sample through asyncio.to_thread, as the vLLM actors call it
        calls = [asyncio.to_thread(reward_func, [f"Q{n}: {n}"], [f"Q{n}: "], ["3"]) for n in range(16)]
        return await asyncio.gather(*calls)

    answers = asyncio.run(actor())
    assert [answer["rewards"] for answer in answers] == [[1.0 if n == 3 else 0.0] for n in range(16)]
    assert all(answer["scores"] == answer["rewards"] and answer["extra_logs"] == {} for answer in answers)


def test_a_batch_of_queries_keeps_its_order_and_a_query_not_starting_with_its_prompt_is_the_trajectory(
    reward_func: Any,
) -> None:
    queries = ["What is 1+1? 2", "What is 2+2? 5", "4"]
    prompts = ["What is 1+1? ", "What is 2+2? ", "unrelated prompt"]
    assert reward_func(queries, prompts, ["2", "4", "4"])["rewards"] == [1.0, 0.0, 1.0]


def test_a_failed_verification_is_raised(reward_func: Any, envs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_env(envs, "strict", "plugin", "verify:score")
    (envs / "strict" / "verify.py").write_text(STRICT)
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "strict")
    assert reward_func(["p x", "p y"], ["p ", "p "], ["x", "y"])["rewards"] == [1.0, 1.0]
    with pytest.raises(engine.VerificationError) as info:
        reward_func(["p x", "p y"], ["p ", "p "], ["x", "boom"])
    assert (info.value.environment, info.value.index) == ("strict", 1)
    assert "no reference may be boom" in info.value.reason


def test_a_failure_is_logged_at_error_on_the_engine_logger_before_it_is_raised(
    reward_func: Any, envs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenRLHF logs what reward_func raises at INFO only: the engine's own ERROR line is the one to find."""
    add_env(envs, "strict", "plugin", "verify:score")
    (envs / "strict" / "verify.py").write_text(STRICT)
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "strict")
    with caplog.at_level("ERROR", logger="engine"), pytest.raises(engine.VerificationError):
        reward_func(["p y"], ["p "], ["boom"])
    mine = [r for r in caplog.records if r.getMessage().startswith("engine: OpenRLHF's reward_func failed")]
    assert len(mine) == 1 and mine[0].levelname == "ERROR" and mine[0].name == "engine"
    assert "VerificationError" in mine[0].getMessage() and "no reference may be boom" in mine[0].getMessage()


def test_without_an_environment_it_says_which_variable(reward_func: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_ENVIRONMENT")
    with pytest.raises(ValueError, match="ENGINE_ENVIRONMENT"):
        reward_func(["q"], ["q"], ["l"])


def test_without_an_environment_it_names_the_sample_whose_label_needs_one(
    reward_func: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``engine serve``'s /get_reward does: the two share one mapping of OpenRLHF's samples."""
    monkeypatch.delenv("ENGINE_ENVIRONMENT")
    labels = [{"environment": "arith", "task": {"reference": "1"}}, "2"]  # an item, then a reference
    with pytest.raises(ValueError, match=r"^sample 1: its label is not an item .*ENGINE_ENVIRONMENT is not set"):
        reward_func(["p 1", "p 2"], ["p ", "p "], labels)
    assert reward_func(["p 1"], ["p "], labels[:1])["rewards"] == [1.0]  # an item needs no environment


def test_a_label_that_is_an_item_names_its_environment_task_and_id(reward_func: Any) -> None:
    import orjson

    labels = [
        orjson.dumps({"environment": "twin_b", "task": {}, "id": "x1"}).decode(),  # a string holding an item
        {"environment": "arith", "task": {"reference": "9"}},  # an object
        "{not json",  # a reference that starts with a brace: arith's, and no match
    ]
    assert reward_func(["p 1", "p 9", "p 9"], ["p ", "p ", "p "], labels)["rewards"] == [0.75, 1.0, 0.0]
