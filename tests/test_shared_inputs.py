"""A plugin that changes what it is handed changes nothing else: no other item's reward, not the caller's batch.

GRPO groups share one task object between the rollouts of a prompt. Each plugin call is handed
its own copy of the item's task and trajectory, under every executor: in the engine's threads, on
its event loop (``async def``), and in worker processes (where the items of a chunk, pickled
together, would otherwise share one unpickled task). The plugin here scores 1.0 only if what it is
handed is as the caller made it, then changes all of it.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from conftest import add_env, process_twin

import engine
from engine import EngineConfig, VerificationError

MUTATES = """\
def _fresh(task, trajectory):
    if "seen" in task or task.get("answer") != "4" or task.get("nested", {"marks": []})["marks"]:
        return False
    if isinstance(trajectory, list):
        return len(trajectory) == 1 and trajectory[0]["content"] == "hi"
    if isinstance(trajectory, dict):
        return trajectory["content"] == "hi"
    return True


def _score(task, trajectory):
    fresh = _fresh(task, trajectory)
    task["seen"] = True
    task["answer"] = "changed"
    if "nested" in task:
        task["nested"]["marks"].append(1)
    if isinstance(trajectory, list):
        trajectory[0]["content"] = "changed"
        trajectory.append({"role": "plugin", "content": "more"})
    elif isinstance(trajectory, dict):
        trajectory["content"] = "changed"
    return 1.0 if fresh else 0.0
"""
SYNC = MUTATES + "\n\ndef score(task, trajectory):\n    return _score(task, trajectory)\n"
ASYNC = MUTATES + "\n\nasync def score(task, trajectory):\n    return _score(task, trajectory)\n"
EXECUTORS = ["thread", "async", "process"]

TASKS = {"flat": lambda: {"answer": "4"}, "nested": lambda: {"answer": "4", "nested": {"marks": []}}}
TRAJECTORIES = {
    "text": lambda: "hi",
    "message": lambda: {"role": "assistant", "content": "hi"},
    "messages": lambda: [{"role": "assistant", "content": "hi"}],
}


def mutating_env(envs: Path, executor: str) -> str:
    name = add_env(envs, "mutates_async" if executor == "async" else "mutates", "plugin", "verify:score")
    (envs / name / "verify.py").write_text(ASYNC if executor == "async" else SYNC)
    return process_twin(envs, name, workers=1) if executor == "process" else name


def groups(name: str, count: int, task: str, trajectory: str) -> list[dict[str, Any]]:
    """``count`` groups of four rollouts, the four sharing one task object and one trajectory object."""
    items = []
    for group in range(count):
        shared_task, shared_trajectory = TASKS[task](), TRAJECTORIES[trajectory]()
        items += [
            {"environment": name, "task": shared_task, "trajectory": shared_trajectory, "id": f"g{group}-{n}"}
            for n in range(4)
        ]
    return items


@pytest.mark.parametrize("trajectory", list(TRAJECTORIES))
@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("executor", EXECUTORS)
async def test_a_group_sharing_a_task_gets_the_same_rewards_under_every_executor(
    envs: Path, executor: str, task: str, trajectory: str
) -> None:
    name = mutating_env(envs, executor)
    items = groups(name, 1, task, trajectory)
    before = copy.deepcopy(items)
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        assert await eng.score(items) == [1.0, 1.0, 1.0, 1.0]  # it was [1, 0, 0, 0] in threads
        assert items == before  # the caller's batch is as it was
        assert await eng.score(items) == [1.0, 1.0, 1.0, 1.0]  # and scores the same again


@pytest.mark.timeout(20)  # a worker process starts, and 6,000 calls
@pytest.mark.parametrize("trajectory", ["text", "messages"])
@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_groups_sharing_tasks_inside_chunks(envs: Path, executor: str, task: str, trajectory: str) -> None:
    name = mutating_env(envs, executor)
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        assert await eng.score(groups(name, 500, task, trajectory)) == [1.0] * 2_000  # chunks form after this
        assert eng._verifier(name).chunk_size(4_000) > 1
        items = groups(name, 1_000, task, trajectory)
        before = copy.deepcopy(items)
        assert await eng.score(items) == [1.0] * 4_000
        assert items == before


class TrainerTask(Mapping[str, Any]):
    """A mapping class of the trainer's own script: a worker process cannot import it (see ``trainer_task``)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@pytest.fixture
def trainer_task(monkeypatch: pytest.MonkeyPatch) -> type[TrainerTask]:
    """:class:`TrainerTask` as if defined in the trainer's ``__main__`` (it pickles here by that name)."""
    monkeypatch.setattr(TrainerTask, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "TrainerTask", TrainerTask, raising=False)
    return TrainerTask


@pytest.mark.parametrize("mapping", ["read_only", "trainers"])
@pytest.mark.parametrize("executor", EXECUTORS)
async def test_a_task_of_another_mapping_type_is_handed_as_a_dict(
    envs: Path, executor: str, mapping: str, trainer_task: type[TrainerTask]
) -> None:
    """Under every executor: a worker process was handed the mapping itself, which did not pickle (a
    ``MappingProxyType``) or did not unpickle there (a class of the trainer's ``__main__``)."""
    name = mutating_env(envs, executor)
    data = {"answer": "4", "nested": {"marks": []}}
    task = MappingProxyType(data) if mapping == "read_only" else trainer_task(data)
    items = [{"environment": name, "task": task, "trajectory": "hi"} for _ in range(3)]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        assert await eng.score(items) == [1.0, 1.0, 1.0]
        assert await eng.score(items[:1]) == [1.0]  # a lone item too
    assert dict(task) == {"answer": "4", "nested": {"marks": []}}


@pytest.mark.parametrize(
    ("executor", "reason"),
    [
        ("thread", "cannot copy the item for the plugin: TypeError: cannot pickle '_thread.lock' object"),
        ("process", "cannot pass the item to a worker process: TypeError: cannot pickle '_thread.lock' object"),
    ],
)
async def test_an_item_that_cannot_be_copied_fails_naming_it(envs: Path, executor: str, reason: str) -> None:
    name = mutating_env(envs, executor)
    items = groups(name, 1, "flat", "text")
    items[2] = {**items[2], "task": {"answer": "4", "lock": threading.Lock()}}
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.score(items)
    assert (info.value.index, info.value.item_id, info.value.reason) == (2, "g0-2", reason)
