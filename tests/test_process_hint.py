"""The process hint: ``engine check`` and ``engine bench`` advise ``"executor": "process"`` by one rule, on warm calls.

A hint must survive being followed: a microsecond JSON parse, whose first calls may be slow, never gets one
(following it made such a plugin slower), and a plugin that keeps a CPU busy for milliseconds a call gets it
from both commands. The rule is tested on figures; the commands on real plugins, in real environments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from cli_support import Workspace, make_workspace, write_rows
from conftest import add_env, spinner
from test_cli import check_row, squeezed

from engine._verifiers.plugin.in_threads import PROCESS_ITEM_COST, hint_from, process_gain
from engine._verifiers.plugin.launcher import default_workers
from engine.cli import EXIT_OK, EXIT_VERIFICATION

# microseconds a call: a JSON parse of a trajectory (the was ~7 us), all of it on a CPU
PARSE = """\
import json


def score(task, trajectory):
    return 1.0 if json.loads(trajectory)["answer"] == task["expected"] else 0.0
"""
# the same parse, whose first three calls fill a cache: ~20 ms of pure Python each (a lazy import, a compiled table)
PARSE_COLD = """\
import json

_calls = 0


def score(task, trajectory):
    global _calls
    _calls += 1
    if _calls <= 3:
        total = 0
        for i in range(400_000):
            total += i * i % 7
    return 1.0 if json.loads(trajectory)["answer"] == task["expected"] else 0.0
"""
SPIN5 = spinner(100_000)  # ~5 ms of pure Python a call
# ~1 ms of pure Python a call, and from its fourth call on it raises: it scores an item once, not again
FLAKY = """\
_calls = 0


def score(task, trajectory):
    global _calls
    _calls += 1
    total = 0
    for i in range(20_000):
        total += i * i % 7
    if _calls > 3:
        raise RuntimeError(f"call {_calls}: the cache is full")
    return 1.0
"""
DOC = orjson.dumps({"answer": 42, "steps": [{"i": i, "text": f"step {i} of the working"} for i in range(8)]}).decode()
EXAMPLE = {"example": {"task": {"expected": 42}, "trajectory": DOC}}
TRIES = 3  # a machine loaded past its cores lowers a call's share on a CPU, and then no hint is the right answer


def add_plugin(space: Workspace, name: str, code: str) -> str:
    add_env(space.envs, name, "plugin", "verify:score", **EXAMPLE)
    (space.envs / name / "verify.py").write_text(code)
    return name


def items(environment: str, count: int) -> list[dict[str, Any]]:
    return [{"id": f"{environment}-{n}", "environment": environment, "task": {"expected": 42}, "trajectory": DOC}
            for n in range(count)]


def check_hints(space: Workspace) -> dict[str, str]:
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    return {line.split(":")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("hint: ")}


def bench_hints(space: Workspace, inp: Path) -> dict[str, Any]:
    result = space.run("bench", inp, "--config", space.config, "--json")
    assert result.returncode == EXIT_OK, result.stderr
    return {v["verifier"].split("/")[0]: v["process_hint"] for v in orjson.loads(result.stdout)["verifiers"]}


def test_the_rule_advises_processes_only_where_their_cost_per_item_is_a_small_share() -> None:
    """From figures (no machine's load in them): what the process executor adds to an item bounds the gain."""
    for cores in (1, 2, 4, 8, 64, 1024):
        # a 7 us call, all on a CPU, however many calls measured it: processes would be slower or barely faster
        assert hint_from(wall=0.25, cpu=0.25, calls=35_714, cores=cores) is None
        # a call costing what processes add to an item is at best even
        assert process_gain(PROCESS_ITEM_COST, cores) <= 1.0
    assert hint_from(wall=0.25, cpu=0.25, calls=50, cores=1) is None  # one core: nothing to gain
    assert hint_from(wall=0.25, cpu=0.1, calls=50, cores=2) is None  # 5 ms calls that mostly wait: threads overlap
    assert hint_from(wall=0.0, cpu=0.0, calls=0, cores=2) is None  # nothing measured
    hint = hint_from(wall=0.25, cpu=0.24, calls=50, cores=2)  # 5 ms calls on a CPU
    assert hint is not None
    assert (hint.calls, hint.cores) == (50, 2) and hint.call_seconds == pytest.approx(0.005)
    assert hint.cpu_share == pytest.approx(0.96) and 1.5 <= hint.gain < 2
    assert "over 50 warm calls" in hint.says() and hint.says().endswith("would use 2 cores")
    assert hint.as_dict()["calls"] == 50 and hint.as_dict()["gain"] == hint.gain


@pytest.mark.skipif(default_workers() < 2, reason="worker processes gain nothing on one core: no hint")
@pytest.mark.timeout(90)
def test_check_and_bench_agree_from_warm_calls(tmp_path: Path) -> None:
    """Neither command hints at a JSON parse, slow first calls or not; both hint at a 5 ms CPU-bound plugin."""
    space = make_workspace(tmp_path)
    for name, code in (("parse", PARSE), ("parse_cold", PARSE_COLD), ("spin", SPIN5)):
        add_plugin(space, name, code)
    inp = write_rows(space.root / "in.jsonl", items("parse", 3000) + items("parse_cold", 3000) + items("spin", 30))

    for _ in range(TRIES):
        said = check_hints(space)
        assert said.keys() <= {"spin"}, said  # the parses never, on any try
        if "spin" in said:
            break
    assert "spin" in said, said
    assert said["spin"].startswith("hint: spin: CPU-bound (")
    cores = default_workers()
    assert said["spin"].endswith(f'"executor": "process" in its manifest\'s verifier would use {cores} cores')

    for _ in range(TRIES):
        hints = bench_hints(space, inp)
        assert hints["parse"] is None and hints["parse_cold"] is None, hints
        if hints["spin"] is not None:
            break
    hint = hints["spin"]
    assert hint is not None, hints
    assert hint["cores"] == default_workers() and hint["cpu_share"] > 0.5 and hint["gain"] >= 1.5
    assert hint["calls"] >= 1 and hint["call_ms"] * hint["calls"] >= 250  # warm calls summing to a quarter second


@pytest.mark.skipif(default_workers() < 2, reason="no calls are timed on one core")
def test_a_plugin_that_fails_when_called_again_is_an_error_not_a_missing_hint(tmp_path: Path) -> None:
    """The calls timed for the hint are calls: one that fails fails check's example, and the benchmark."""
    space = make_workspace(tmp_path)
    add_plugin(space, "flaky", FLAKY)
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION, result.stdout
    verdict = squeezed(check_row(result.stdout, "flaky")[5])
    assert verdict.startswith(squeezed("its example fails: ")), verdict
    assert squeezed("failed when called again") in verdict and squeezed("the cache is full") in verdict
    assert "hint: " not in result.stdout

    inp = write_rows(space.root / "in.jsonl", items("flaky", 2))  # a new engine: calls 1 and 2 score the rows
    bench = space.run("bench", inp, "--config", space.config, "--json")
    assert bench.returncode == EXIT_VERIFICATION, bench.stdout
    assert bench.stdout == ""  # no figures: a verifier that fails is not a result
    assert "plugin verifier 'verify:score' (environment 'flaky') failed" in bench.stderr
    assert "failed when called again" in bench.stderr and "the cache is full" in bench.stderr
    assert "'flaky-" in bench.stderr  # the item, by its id
