"""engine.adapters.slime, called as slime calls ``--custom-rm-path``: ``await custom_rm(args, sample)`` on its
rollout loop (here a loop in a background thread), one sample or, with ``--group-rm``, a list of them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from adapter_support import LoopThread

import engine
from engine.adapters.slime import custom_rm


@dataclass
class Sample:
    """slime's ``Sample``, the fields a reward model reads."""

    prompt: Any
    response: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int | None = None
    group_index: int | None = None


ARGS = object()  # slime's parsed arguments: the adapter reads nothing from them


@pytest.fixture
def slime_env(engine_toml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CONFIG", str(engine_toml))
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "arith")


@pytest.mark.usefixtures("slime_env")
def test_one_sample_and_a_group_each_get_their_rewards_in_order(trainer_loop: LoopThread) -> None:
    one = Sample("2+2?", "4", label="4", index=0)
    assert trainer_loop.call(custom_rm(ARGS, one)) == 1.0
    group = [Sample("n?", str(n), label="3", index=n, group_index=0) for n in range(6)]
    group.append(Sample("p", "", metadata={"environment": "twin_b"}, index=6, group_index=0))
    assert trainer_loop.call(custom_rm(ARGS, group)) == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.75]

    async def concurrently() -> list[Any]:  # slime's per-sample tasks, gathered on its loop
        return await asyncio.gather(*(custom_rm(ARGS, Sample("q", str(n), label="2", index=n)) for n in range(64)))

    assert trainer_loop.call(concurrently()) == [1.0 if n == 2 else 0.0 for n in range(64)]


@pytest.mark.usefixtures("slime_env")
def test_a_failed_sample_raises_for_one_sample_and_for_a_group(trainer_loop: LoopThread) -> None:
    bad = Sample("p", "x", metadata={"environment": "faulty", "mode": "raise"}, index=41)
    with pytest.raises(engine.VerificationError) as info:
        trainer_loop.call(custom_rm(ARGS, bad))
    assert (info.value.environment, info.value.item_id) == ("faulty", 41)
    group = [Sample("p", "x", metadata={"environment": "faulty", "mode": "ok"}, index=n) for n in range(3)] + [bad]
    with pytest.raises(engine.VerificationError) as info:
        trainer_loop.call(custom_rm(ARGS, group))  # never a short list, never a zero
    assert (info.value.index, info.value.item_id) == (3, 41)


def test_the_task_is_the_prompt_label_and_metadata(engine_toml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.adapters.slime import item

    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    prompt = [{"role": "user", "content": "hi"}]
    sample = Sample(prompt, "ok", label="L", metadata={"environment": "e", "k": 1}, index=3)
    assert item(sample) == {
        "environment": "e",
        "task": {"prompt": [{"role": "user", "content": "hi"}], "reference": "L", "k": 1},
        "trajectory": "ok",
        "id": 3,
    }
    with pytest.raises(ValueError, match="ENGINE_ENVIRONMENT"):
        item(Sample("p", "r"))
