# ruff: noqa: F811  (the fixtures imported from engine_fixtures are parameters of the tests below)
"""verifiers 0.4.0's own scoring (``Task.score``, the reward plugged by its own config models) on v1 traces
made by its own client and message graph (tests/trainers/verifiers_support.py), against the adapter in
process (``ENGINE_CONFIG``) and against a real ``engine serve`` (``ENGINE_URL``).

Run in the verifiers venv: ``ENGINE_TRAINER=verifiers pytest tests/trainers/test_verifiers.py``.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import verifiers
import verifiers.v1 as vf
from engine_fixtures import configured, envs_with_arithmetic, in_process, served  # noqa: F401  (fixtures)
from verifiers_support import Problem, as_json, model_server, reward_of, roll_and_score, task_config

from engine import _json

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "trainers" / "verifiers.md"
EXAMPLE = ROOT / "examples" / "trainers" / "verifiers_eval.py"
QUESTION = re.compile(r"What is (\d+) ([+*-]) (\d+)\?")


def test_the_pinned_release() -> None:
    assert verifiers.__version__ == "0.4.0"  # the release tests/trainers/requirements-verifiers.txt pins


def doc_blocks(language: str) -> list[str]:
    """The fenced ``language`` blocks of docs/trainers/verifiers.md."""
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)


def plugged() -> vf.TaskConfig:
    """The task config of the page's TOML: the reward plugged as a run's config plugs it."""
    (block,) = doc_blocks("toml")
    return task_config(block)


def answer(messages: list[dict[str, str]]) -> str:
    """The model: right about sums and products, one off about differences."""
    question = next(m["content"] for m in messages if m["role"] == "user")  # a second turn asks "are you sure?"
    found = QUESTION.search(question)
    assert found is not None, question
    left, op, right = found.groups()
    a, b = int(left), int(right)
    value = a + b if op == "+" else a * b if op == "*" else a - b + 1
    return f"Let me work it out: {a} {op} {b}. The answer is {value}."


def problems(count: int) -> list[Problem]:
    ops = "+*-"
    rows = []
    for n in range(count):
        a, b, op = 10 + n, 3 + n % 5, ops[n % 3]
        truth = a + b if op == "+" else a * b if op == "*" else a - b
        rows.append(Problem(idx=n, id=f"p-{n}", prompt=f"What is {a} {op} {b}?", answer=str(truth),
                            system_prompt="Answer with a number.", environment="arithmetic"))
    return rows


def expected(rows: list[Problem]) -> list[float]:
    return [0.0 if "-" in str(row.prompt) else 1.0 for row in rows]


@pytest.fixture
def model() -> Iterator[str]:
    with model_server(answer) as server:
        yield server.base_url


def tasks_of(rows: list[Problem]) -> list[vf.Task]:
    config = plugged()
    return [vf.Task(row, config=config) for row in rows]


@pytest.mark.timeout(120)
def test_real_traces_get_their_rewards_in_order(configured: str, model: str) -> None:
    """The model's final reply is what is scored: right answers 1.0, wrong 0.0, each trace its own (finding 1)."""
    rows = problems(12)
    traces = asyncio.run(roll_and_score(tasks_of(rows), model))
    assert [reward_of(trace) for trace in traces] == expected(rows)
    assert all(trace.ok and not trace.errors for trace in traces)
    assert [trace.reward for trace in traces] == expected(rows)  # what verifiers trains on: the weighted sum
    for trace in traces:
        as_json(trace)  # the scored trace still serialises, as verifiers writes it


@pytest.mark.timeout(120)
def test_a_multi_turn_trace_is_scored_on_its_final_reply(in_process: None, model: str) -> None:
    rows = problems(3)
    traces = asyncio.run(roll_and_score(tasks_of(rows), model, turns=2))
    assert [len(trace.assistant_messages) for trace in traces] == [2, 2, 2]
    assert [reward_of(trace) for trace in traces] == expected(rows)


@pytest.mark.timeout(120)
def test_a_failed_item_fails_its_trace_never_a_number(configured: str, model: str) -> None:
    rows = [Problem(idx=0, id="bad-1", prompt="What is 1 + 1?", environment="faulty", mode="raise")]
    (trace,) = asyncio.run(roll_and_score(tasks_of(rows), model))
    assert not trace.ok and trace.is_completed  # the agent's stop ("agent_completed") came first and stays
    assert reward_of(trace) is None  # seeded unscored, never 0.0
    assert trace.reward == 0.0 and trace.has_error  # verifiers' own sum over no rewards: the error says why
    error = trace.errors[-1]
    assert error.type == "TaskError"
    assert "VerificationError" in error.message and "faulty" in error.message and "bad-1" in error.message


@pytest.mark.timeout(180)
def test_one_failing_trace_of_64_gathered_fails_only_itself(configured: str, model: str) -> None:
    """64 traces scored at once on one loop (their calls gathered into engine batches): the one with a
    failing item fails, the 63 others keep their own rewards (finding 6)."""
    rows = problems(64)
    bad = 37
    rows[bad] = Problem(idx=bad, id="bad-37", prompt="What is 1 + 1?", environment="faulty", mode="raise")
    traces = asyncio.run(roll_and_score(tasks_of(rows), model))
    want = expected(rows)
    for n, trace in enumerate(traces):
        if n == bad:
            assert not trace.ok and reward_of(trace) is None
            assert "bad-37" in trace.errors[-1].message
        else:
            assert trace.ok, (n, trace.errors and trace.errors[-1].message)
            assert reward_of(trace) == want[n], n


@pytest.mark.timeout(120)
def test_no_environment_fails_the_trace(in_process: None, model: str) -> None:
    rows = [Problem(idx=0, prompt="What is 1 + 1?", answer="2")]
    (trace,) = asyncio.run(roll_and_score(tasks_of(rows), model))
    assert not trace.ok and reward_of(trace) is None
    assert "ENGINE_ENVIRONMENT" in trace.errors[-1].message


@pytest.mark.timeout(120)
def test_engine_environment_names_the_environment(in_process: None, model: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_ENVIRONMENT", "arithmetic")
    rows = [Problem(idx=0, prompt="What is 2 + 2?", answer="4"), Problem(idx=1, prompt="What is 5 - 1?", answer="4")]
    traces = asyncio.run(roll_and_score(tasks_of(rows), model))
    assert [reward_of(trace) for trace in traces] == [1.0, 0.0]


def test_the_page_plugs_the_reward_by_its_import_path() -> None:
    config = plugged()
    assert config.rewards["engine"].fn == "engine.adapters.verifiers:engine_reward"
    (hook,) = vf.Task(Problem(), config=config).hooks("reward")
    assert hook.__name__ == "engine" and hook.__wrapped__.__module__ == "engine.adapters.verifiers"


@pytest.mark.timeout(120)
def test_the_example_runs(model: str) -> None:
    """examples/trainers/verifiers_eval.py as the page runs it, its model the test's server, its engine
    examples/engine.toml (pinned environments)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ENGINE_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(EXAMPLE), "--base-url", model], capture_output=True, text=True,
                          timeout=100, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    printed = [line.split(" ", 2) for line in done.stdout.splitlines()]
    # the first six arithmetic rows of examples/rollouts.jsonl; the model is one off about differences only
    assert printed == [["arith-0184", "ok", "0.0"], ["arith-0076", "ok", "1.0"], ["arith-0107", "ok", "0.0"],
                       ["arith-0077", "ok", "1.0"], ["arith-0164", "ok", "1.0"], ["arith-0187", "ok", "1.0"]]


class Extra(Problem):
    """Task data whose fields JSON's form would change: a NaN (written null), a Decimal and bytes (as strings)."""

    info: dict[str, Any] | None = None
    weight: Decimal = Decimal("0.1")
    raw: bytes = b"xy"


def test_the_tasks_values_reach_the_item_as_they_are_never_in_their_json_form() -> None:
    from engine.adapters.verifiers import item

    task = Extra(prompt=[{"role": "user", "content": "q"}], answer="4", environment="arith",
                 info={"a": math.nan, "b": [None, 1]})
    trace = type("Trace", (), {"last_reply": "4"})()
    fields = item(task, trace)["task"]
    assert math.isnan(fields["info"]["a"]) and fields["info"]["b"] == [None, 1]  # a NaN stays one (and is refused)
    assert fields["weight"] == Decimal("0.1") and fields["raw"] == b"xy"
    assert fields["prompt"] == [{"role": "user", "content": "q"}] and fields["reference"] == "4"
    with pytest.raises(TypeError):  # over the wire the engine's boundary refuses it, never sends a null
        _json.dumps(fields, default=_json.plain)
