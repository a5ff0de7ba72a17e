"""engine.adapters.verifiers: ``engine_reward(task=..., trace=...)`` awaited as verifiers v1 awaits a reward
function, the task a mapping or a model with ``model_dump()``, the trace's ``last_reply`` the trajectory
(verifiers' own classes: tests/trainers/test_verifiers.py, in its venv)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import engine
from engine.adapters.verifiers import engine_reward, item


class Model:
    """A pydantic-style object: what ``model_dump()`` returns is its content."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def model_dump(self, **options: Any) -> dict[str, Any]:
        return dict(self.fields)


class Trace:
    """A v1 trace's reading face: ``last_reply`` (the model's final reply), and messages that are not scored."""

    def __init__(self, last_reply: Any) -> None:
        self.last_reply = last_reply
        self.messages = [{"role": "user", "content": "not this"}]


@pytest.fixture(autouse=True)
def configured(engine_toml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CONFIG", str(engine_toml))
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)


def test_rewards_for_concurrent_traces_in_order() -> None:
    async def rollouts() -> list[float]:
        return await asyncio.gather(
            engine_reward(task={"environment": "arith", "answer": "4", "prompt": "2+2?"}, trace=Trace("4")),
            engine_reward(task=Model(environment="arith", answer="4"), trace=Trace("5")),
            engine_reward(task={"environment": "twin_b"}, trace=Trace("")),
        )

    assert asyncio.run(rollouts()) == [1.0, 0.0, 0.75]


def test_a_failed_verification_is_raised_so_verifiers_marks_the_trace_failed() -> None:
    async def rollout() -> float:
        task = {"environment": "faulty", "mode": "raise", "id": "t-7"}
        return await engine_reward(task=task, trace=Trace(""))

    with pytest.raises(engine.VerificationError) as info:
        asyncio.run(rollout())
    assert (info.value.environment, info.value.item_id) == ("faulty", "t-7")


def test_the_item_of_a_task_and_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    assert item({"environment": "e", "answer": 3, "info": {"k": 1}, "id": 9}, Trace("done")) == {
        "environment": "e",
        "task": {"reference": 3, "info": {"k": 1}},
        "trajectory": "done",
        "id": 9,
    }
    both = item({"environment": "e", "answer": 3, "reference": 4}, Trace(""))
    assert both["task"] == {"answer": 3, "reference": 4}
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "fallback")
    fallback = {"environment": "fallback", "task": {"prompt": "p"}, "trajectory": "r"}
    assert item(Model(prompt="p"), Trace("r")) == fallback
    with pytest.raises(TypeError, match="TaskData"):
        item(["not", "a", "task"], Trace("x"))
    for not_a_trace in ({"completion": "4"}, {"messages": []}, "raw", Trace(["a", "list"])):
        with pytest.raises(TypeError, match="last_reply"):  # v1 passes its Trace: any other shape is misuse
            item({"environment": "e"}, not_a_trace)
