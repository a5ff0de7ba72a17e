"""``engine score`` as a backfill that never loses work: kill -9, Ctrl-C, a failing verifier, bad rows, a changed input.

Every test runs the real command over files in ``tmp_path``, scoring with the real plugin
environment ``tests/envs/backfill`` or with an endpoint on a real HTTP server on 127.0.0.1: in a
subprocess (``python -m engine score``) where the process is the point (kill -9, signals, a file
size limit, a tracer that kills at a step of finishing), in-process through click's ``CliRunner``
otherwise (the runs those tests resume, and every run that ends by itself). The plugin logs
every call to ``$ENGINE_TEST_CALL_LOG``, so a test knows exactly which rows a run scored, and
fails its poisoned rows until ``$ENGINE_TEST_FIXED`` exists, so a test can "fix the verifier"
between two runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from cli_support import (
    ENGINE_UNDER_TRACE,
    ENVS,
    PLUGIN_ENV,
    RUN_TIMEOUT,
    Ran,
    Workspace,
    child_env,
    copy_env,
    engine_command,
    finish_steps,
    kill_at_step,
    make_workspace,
    partial_records,
    read_log,
    reaped,
    records,
    row,
    rows,
    start_under_trace,
    state_of,
    write_rows,
)
from conftest import add_endpoint_env
from polling import wait_until
from servers import Request, Response, Server

from engine._backfill.checkpoint import lock_path, state_path
from engine._backfill.writer import partial_path
from engine.cli import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_IO, EXIT_TERMINATED

ROWS = 1000
CHUNK = 50
FAIL_LINE = 700  # the 1-based line (row) whose verifier fails
SMALL = 200  # rows of the bad-row and changed-input tests
BAD_LINE = 130
WAIT_SECONDS = 30.0  # the longest a test waits for a run to reach a checkpoint


def chunk_args(size: int = CHUNK) -> tuple[str, str]:
    return ("--chunk-size", str(size))


def knobs(log: Path, fixed: Path | None = None, sleep: float | None = None) -> dict[str, str]:
    """The ``backfill`` plugin's environment variables for one run."""
    env = {"ENGINE_TEST_CALL_LOG": str(log)}
    if fixed is not None:
        env["ENGINE_TEST_FIXED"] = str(fixed)
    if sleep is not None:
        env["ENGINE_TEST_SLEEP"] = str(sleep)
    return env


def ok(result: Ran) -> Ran:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def last_checkpoint(output: Path) -> int:
    """rows_done of the state a failed run left, checking the partial file holds exactly those records."""
    state = state_of(output)
    done: int = state["rows_done"]
    assert partial_path(output).stat().st_size == state["output_bytes"], "records beyond the checkpoint were kept"
    assert len(partial_records(output)) == done
    return done


@pytest.fixture
def space(tmp_path: Path) -> Workspace:
    return make_workspace(tmp_path, PLUGIN_ENV)


# --- kill -9 ----------------------------------------------------------------------------------


def wait_for_rows_done(output: Path, rows_done: int, process: subprocess.Popen[str]) -> int:
    """Poll the run's state file until it records ``rows_done`` rows; the output must not appear meanwhile."""

    def done() -> int:
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before its checkpoint"
        assert not output.exists(), "the output appeared before the run finished"
        try:
            count = int(state_of(output)["rows_done"])
        except FileNotFoundError:
            return 0  # the run has not started its state yet
        return count if count >= rows_done else 0

    return wait_until(done, WAIT_SECONDS, message=f"no checkpoint of {rows_done} rows within {WAIT_SECONDS:g} s")


STOPS = {  # how a run is stopped part-way: the signal, and the exit status it leaves
    "kill -9": (signal.SIGKILL, -signal.SIGKILL),
    "Ctrl-C": (signal.SIGINT, EXIT_INTERRUPTED),
    "SIGTERM": (signal.SIGTERM, EXIT_TERMINATED),
}


def one_error_line(stderr: str) -> str:
    """The run's one ``error:`` line; no traceback, nothing else but progress lines."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    progress = ("scored ", "scoring ", "resuming at row ")  # the progress lines, the first before anything is scored
    others = [line for line in stderr.splitlines() if line and not line.startswith(("error: ", *progress))]
    assert others == [], stderr
    return errors[0]


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("stop", "fmt"),
    [("kill -9", "jsonl"), ("kill -9", "parquet"), ("Ctrl-C", "jsonl"), ("SIGTERM", "jsonl")],
    ids=lambda v: str(v),
)
def test_a_stopped_run_resumes_to_the_uninterrupted_output(space: Workspace, stop: str, fmt: str) -> None:
    inp = write_rows(space.root / f"in.{fmt}", rows(ROWS))
    reference = space.root / "reference" / f"rewards.{fmt}"
    ok(space.score(inp, reference, *chunk_args()))

    out = space.root / "out" / f"rewards.{fmt}"
    killed_log, resumed_log = space.root / "killed.log", space.root / "resumed.log"
    # Each call sleeps, one at a time, so the run is still going when it is stopped: calls that
    # wait would otherwise run in parallel chunks and finish 1,000 rows in under a second.
    space.write_config(f'[refs."{PLUGIN_ENV}/verify:score"]\nmax_concurrency = 1\n')
    process = space.start(
        "score", inp, "-o", out, "--config", space.config, *chunk_args(), env=knobs(killed_log, sleep=0.02)
    )
    signum, status = STOPS[stop]
    with reaped(process):
        wait_for_rows_done(out, 2 * CHUNK, process)
        os.kill(process.pid, signum)
        _, stderr = process.communicate(timeout=RUN_TIMEOUT)
    assert process.returncode == status, stderr
    if signum == signal.SIGINT:
        assert one_error_line(stderr).startswith("error: interrupted (Ctrl-C); ")
    if signum == signal.SIGTERM:
        assert one_error_line(stderr).startswith("error: terminated (SIGTERM); ")
    if signum != signal.SIGKILL:
        assert "rows are checkpointed: run the same command with --resume to continue" in stderr
        assert not lock_path(out).exists()  # released on the way out

    assert not out.exists()
    done = int(state_of(out)["rows_done"])
    assert 2 * CHUNK <= done < ROWS and done % CHUNK == 0
    killed_calls = read_log(killed_log)
    assert set(range(done)) <= set(killed_calls)
    assert len(killed_calls) <= done + CHUNK  # the chunk in flight at the kill, at most

    resumed = ok(space.score(inp, out, *chunk_args(), "--resume", env=knobs(resumed_log)))
    assert out.read_bytes() == reference.read_bytes()
    resumed_calls = read_log(resumed_log)
    assert sorted(resumed_calls) == list(range(done, ROWS))  # nothing checkpointed is scored again
    assert len(killed_calls) + len(resumed_calls) - ROWS <= CHUNK  # re-scored: at most one chunk
    assert f"{ROWS:,} rewards written to {out} (resumed at row {done:,})" in resumed.stdout
    summary = [line.split("│") for line in resumed.stdout.splitlines() if line.startswith("│ plugin ")]
    assert [cells[3].strip() for cells in summary] == [f"{ROWS:,}"]  # the summary covers the whole file
    assert not partial_path(out).exists() and not state_path(out).exists()


# --- a verifier that fails at row 700 of 1,000 --------------------------------------------------


class Broken:
    """An endpoint verifier that answers 500 for one task until it is fixed."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.fixed = threading.Event()

    @staticmethod
    def reward(body: Any) -> float:
        return float(body["task"]["n"] % 13 / 13 + len(body["trajectory"]) / 100)

    async def __call__(self, request: Request) -> Response:
        body = request.json()
        if body["task"]["n"] == self.bad and not self.fixed.is_set():
            return Response.json({"error": "the verifier crashed on this task"}, 500)
        return Response.json({"reward": self.reward(body)})


@pytest.fixture
def broken_endpoint() -> Iterator[tuple[Server, Broken]]:
    handler = Broken(FAIL_LINE - 1)
    with Server(handler) as server:
        yield server, handler


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["plugin", "endpoint"])
def test_a_verifier_failing_at_row_700_keeps_the_rows_before_it_and_resumes(
    space: Workspace, broken_endpoint: tuple[Server, Broken], kind: str
) -> None:
    server, handler = broken_endpoint
    fixed = space.root / "fixed"
    if kind == "plugin":
        inp = write_rows(space.root / "in.jsonl", rows(ROWS, poison=[FAIL_LINE - 1]))
        expected = ["plugin", "'verify:score'", f"(environment '{PLUGIN_ENV}')", "Poisoned", "task 699 is poisoned"]

        def fix() -> None:
            fixed.touch()
    else:
        url = f"{server.url}/score"
        add_endpoint_env(space.envs, "remote", url)
        inp = write_rows(space.root / "in.jsonl", rows(ROWS, environment="remote"))
        expected = ["endpoint", f"'{url}'", "(environment 'remote')", "HTTP 500", "the verifier crashed on this task"]

        def fix() -> None:
            handler.fixed.set()

    out = space.root / "rewards.jsonl"
    first_log, resumed_log = space.root / "first.log", space.root / "resumed.log"
    failed = space.score(inp, out, *chunk_args(), env=knobs(first_log, fixed))
    assert failed.returncode == 1, failed.stderr
    message = failed.stderr
    for words in [*expected, "'row-0699'", f"{inp.name}, line {FAIL_LINE}"]:
        assert words in message
    assert not out.exists()

    done = last_checkpoint(out)
    assert done % CHUNK == 0 and FAIL_LINE - 1 - CHUNK < done <= FAIL_LINE - 1  # every chunk before it, kept
    assert f"  {done:,} rows are checkpointed: run the same command with --resume to continue" in message.splitlines()
    kept = partial_records(out)
    assert [record["id"] for record in kept] == [f"row-{n:04d}" for n in range(done)]  # none for row-0699

    fix()
    ok(space.score(inp, out, *chunk_args(), "--resume", env=knobs(resumed_log, fixed)))
    reference = space.root / "reference.jsonl"
    ok(space.score(inp, reference, *chunk_args(), env=knobs(space.root / "reference.log", fixed)))
    assert out.read_bytes() == reference.read_bytes()
    if kind == "plugin":
        assert sorted(read_log(resumed_log)) == list(range(done, ROWS))


def test_the_error_does_not_misplace_the_failed_row(space: Workspace) -> None:
    inp = write_rows(space.root / "in.jsonl", rows(10, poison=[6]))
    failed = space.score(inp, space.root / "rewards.jsonl", *chunk_args(4))
    assert failed.returncode == 1
    assert f"{inp.name}, line 7" in failed.stderr
    positions = {int(found) for found in re.findall(r"on item (\d+)", failed.stderr)}
    assert positions <= {6}  # if the message gives a position, it is the row's position in the input


# --- bad rows -----------------------------------------------------------------------------------


BAD_ROWS: dict[str, tuple[bytes, str]] = {
    # case: (the line written in place of line BAD_LINE, what the error says about it)
    "invalid JSON": (b'{"id": "row-0129", "environment": ', "invalid JSON"),
    "not an object": (b'["row-0129", "backfill"]', "must be a JSON object, got list"),
    "missing field": (
        b'{"id": "row-0129", "environment": "backfill", "task": {"n": 129}}',
        "missing field(s) 'trajectory'",
    ),
    "task not an object": (
        b'{"id": "row-0129", "environment": "backfill", "task": [129], "trajectory": "x"}',
        "'task' must be an object, got list",
    ),
    "id nested too deep": (  # read as JSON, but deeper than the output can write it
        b'{"id": ' + b"[" * 300 + b'"row-0129"' + b"]" * 300 + b', "environment": "backfill", "task": {"n": 129}, '
        b'"trajectory": "x"}',
        "'id' cannot be written to the output as JSON",
    ),
    "invalid UTF-8": (
        b'{"id": "row-0129", "environment": "backfill", "task": {"n": 129}, "trajectory": "\xe9t\xe9"}',
        "invalid UTF-8 at byte 82 of line 130 (counted from 1 within the line",
    ),
}


@pytest.fixture(scope="module")
def small_reference(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The output of an uninterrupted run over ``rows(SMALL)``: what every repaired run must produce."""
    space = make_workspace(tmp_path_factory.mktemp("reference"), PLUGIN_ENV)
    out = space.root / "rewards.jsonl"
    ok(space.score(write_rows(space.root / "in.jsonl", rows(SMALL)), out, *chunk_args()))
    return out.read_bytes()


@pytest.mark.parametrize("case", BAD_ROWS, ids=list(BAD_ROWS))
def test_a_bad_row_names_its_line_before_its_chunk_is_scored(
    space: Workspace, small_reference: bytes, case: str
) -> None:
    bad, reason = BAD_ROWS[case]
    good = rows(SMALL)
    lines = [orjson.dumps(item) for item in good]
    lines[BAD_LINE - 1] = bad
    inp = space.root / "in.jsonl"
    inp.write_bytes(b"\n".join(lines) + b"\n")
    out = space.root / "rewards.jsonl"
    log = space.root / "calls.log"

    failed = space.score(inp, out, *chunk_args(), env=knobs(log))
    assert failed.returncode == 2, failed.stderr
    assert f"{inp.name}: line {BAD_LINE}: " in failed.stderr and reason in failed.stderr
    assert not out.exists()
    done = last_checkpoint(out)
    assert done == (BAD_LINE - 1) // CHUNK * CHUNK  # every chunk before the bad row is kept
    assert sorted(read_log(log)) == list(range(done))  # nothing of the bad row's chunk was scored

    lines[BAD_LINE - 1] = orjson.dumps(good[BAD_LINE - 1])  # repair the row: rows after the checkpoint may change
    inp.write_bytes(b"\n".join(lines) + b"\n")
    ok(space.score(inp, out, *chunk_args(), "--resume"))
    assert out.read_bytes() == small_reference


def test_a_bad_parquet_row_names_its_row_number(space: Workspace) -> None:
    items = rows(SMALL)
    inp = write_rows(space.root / "in.parquet", items)
    table = pq.read_table(inp)
    tasks = table.column("task").to_pylist()
    tasks[BAD_LINE - 1] = "{not json"
    pq.write_table(table.set_column(table.schema.get_field_index("task"), "task", [tasks]), inp)
    out = space.root / "rewards.parquet"

    failed = space.score(inp, out, *chunk_args(), env=knobs(space.root / "calls.log"))
    assert failed.returncode == 2, failed.stderr
    assert f"{inp.name}: row {BAD_LINE}: 'task' is text but not valid JSON" in failed.stderr
    assert last_checkpoint(out) == (BAD_LINE - 1) // CHUNK * CHUNK
    assert sorted(read_log(space.root / "calls.log")) == list(range((BAD_LINE - 1) // CHUNK * CHUNK))


def test_a_bad_manifest_stops_the_run_as_a_config_error_before_any_row_is_scored(space: Workspace) -> None:
    (space.envs / "broken").mkdir()
    (space.envs / "broken" / "manifest.json").write_text('{"kind": "environment", "verifier": {"kind": "builtin"}}')
    items = rows(SMALL)
    items[BAD_LINE - 1] = {**items[BAD_LINE - 1], "environment": "broken"}
    out = space.root / "rewards.jsonl"
    log = space.root / "calls.log"
    failed = space.score(write_rows(space.root / "in.jsonl", items), out, *chunk_args(), env=knobs(log))
    assert failed.returncode == 2, failed.stderr
    assert "manifest.json" in failed.stderr and "verifier.kind" in failed.stderr
    assert read_log(log) == [] and not state_path(out).exists()


# --- every environment the input names, checked before its first row ----------------------------------

GOOD_FIRST = 5000  # good rows before the first of a broken environment's (the file: 4,096 were scored)


def broken_environments(space: Workspace) -> None:
    """Three environments that cannot score (an import that fails, a missing callable, an example that fails),
    and one that cannot either but no row names."""
    for name in ("broken_import", "no_attr", "not_callable"):
        copy_env(name, space.envs)
    example = copy_env(PLUGIN_ENV, space.envs).rename(space.envs / "bad_example") / "manifest.json"
    copy_env(PLUGIN_ENV, space.envs)
    manifest = orjson.loads(example.read_bytes())
    example.write_bytes(orjson.dumps({**manifest, "example": {"task": {"n": -1, "poison": True}, "trajectory": ""}}))


def test_an_example_whose_task_is_not_an_object_is_a_broken_environment_not_an_internal_error(tmp_path: Path) -> None:
    space = make_workspace(tmp_path)
    manifest = copy_env(PLUGIN_ENV, space.envs) / "manifest.json"
    manifest.write_bytes(orjson.dumps({**orjson.loads(manifest.read_bytes()),
                                       "example": {"task": "what is 2 + 2", "trajectory": "4"}}))
    failed = space.score(write_rows(space.root / "in.jsonl", rows(3)), space.root / "rewards.jsonl")
    assert failed.returncode == 1 and "internal error" not in failed.stderr, failed.stderr
    assert f"  {PLUGIN_ENV}: plugin 'verify:score'; verifier: manifest field 'example': its 'task' must be an object" \
        in failed.stderr.splitlines(), failed.stderr
    assert "error: 1 of 1 environment the input names cannot score" in failed.stderr, failed.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_broken_environments_after_thousands_of_good_rows_stop_the_run_before_any_row(
    tmp_path: Path, fmt: str
) -> None:
    space = make_workspace(tmp_path)
    broken_environments(space)
    named = ["no_attr", PLUGIN_ENV, "broken_import", "bad_example"]
    items = rows(GOOD_FIRST) + [row(GOOD_FIRST + k, name) for k, name in enumerate(named)]
    inp = write_rows(space.root / f"in.{fmt}", items)
    out = space.root / f"rewards.{fmt}"
    log = space.root / "calls.log"

    failed = space.score(inp, out, env=knobs(log))  # the default chunk: 4 of them are good rows only
    assert failed.returncode == 1, failed.stderr
    assert "Traceback" not in failed.stderr
    lines = failed.stderr.splitlines()
    first = lines.index("error: 3 of 4 environments the input names cannot score, checked before scoring any row:")
    assert [line.split(": ", 1)[0] for line in lines[first + 1:first + 4]] == [
        "  bad_example", "  broken_import", "  no_attr"]
    assert lines[first + 1].startswith("  bad_example: plugin 'verify:score'; verifier: its example fails: ")
    assert "task -1 is poisoned" in lines[first + 1]
    assert lines[first + 2].startswith("  broken_import: plugin 'verify:score'; verifier: cannot import module")
    assert lines[first + 3] == ("  no_attr: plugin 'verify:missing'; verifier: module 'verify' has no attribute "
                                "'missing'")
    assert lines[first + 4:] == ["  nothing was checkpointed yet: run the same command again"], failed.stderr
    assert read_log(log) == [-1]  # the example's call, and no row's
    assert not out.exists() and not state_path(out).exists() and not partial_path(out).exists()

    (space.envs / "broken_import" / "verify.py").write_text("def score(task, trajectory):\n    return 0.5\n")
    (space.envs / "no_attr" / "verify.py").write_text("def missing(task, trajectory):\n    return 0.25\n")
    (space.envs / "bad_example" / "manifest.json").write_bytes((space.envs / PLUGIN_ENV / "manifest.json").read_bytes())
    ok(space.score(inp, out, env=knobs(log)))  # the same command again, once they are fixed
    assert len(records(out)) == len(items)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_row_naming_no_environment_is_refused_by_its_place_before_any_row(space: Workspace, fmt: str) -> None:
    items = [*rows(GOOD_FIRST), row(GOOD_FIRST, "nowhere"), row(GOOD_FIRST + 1, "nowhere")]
    inp = write_rows(space.root / f"in.{fmt}", items)
    out = space.root / f"rewards.{fmt}"
    log = space.root / "calls.log"
    failed = space.score(inp, out, env=knobs(log))
    assert failed.returncode == EXIT_BAD_INPUT, failed.stderr
    unit = "line" if fmt == "jsonl" else "row"
    assert f"{inp.name}: {unit} {GOOD_FIRST + 1}: unknown environment 'nowhere'" in failed.stderr
    assert read_log(log) == [] and not state_path(out).exists()


def test_a_resume_checks_the_environments_of_the_rows_still_to_score_only(space: Workspace) -> None:
    """The rows before the checkpoint are not read again: an environment only they name may be gone since."""
    shutil.copytree(space.envs / PLUGIN_ENV, space.envs / "early")
    items = rows(SMALL, environment="early") + [row(SMALL + n, poison=n == 100) for n in range(SMALL)]
    inp = write_rows(space.root / "in.jsonl", items)
    out = space.root / "rewards.jsonl"
    fixed = space.root / "fixed"
    assert space.score(inp, out, *chunk_args(), env=knobs(space.root / "first.log", fixed)).returncode == 1
    assert last_checkpoint(out) == SMALL + 100
    shutil.rmtree(space.envs / "early")
    shutil.copytree(ENVS / "broken_import", space.envs / PLUGIN_ENV, dirs_exist_ok=True)  # what is left breaks
    failed = space.score(inp, out, *chunk_args(), "--resume", env=knobs(space.root / "second.log", fixed))
    assert failed.returncode == 1, failed.stderr
    assert ("error: 1 of 1 environment the rows still to score name cannot score, checked before scoring any row:"
            in failed.stderr.splitlines()), failed.stderr
    assert f"  {SMALL + 100:,} rows are checkpointed: run the same command with --resume to continue" \
        in failed.stderr.splitlines()
    shutil.rmtree(space.envs / PLUGIN_ENV)
    copy_env(PLUGIN_ENV, space.envs)
    fixed.touch()
    log = space.root / "resumed.log"
    ok(space.score(inp, out, *chunk_args(), "--resume", env=knobs(log, fixed)))
    assert sorted(read_log(log)) == list(range(SMALL + 100, 2 * SMALL))
    assert len(records(out)) == 2 * SMALL


def test_the_check_before_the_run_is_the_runs_own_import(space: Workspace) -> None:
    """Checked and then scored on one engine: a plugin is imported once (a slow import is paid once)."""
    copy_env("import_log", space.envs)
    imports = space.root / "imports.log"
    inp = write_rows(space.root / "in.jsonl", rows(20, environment="import_log"))
    ok(space.score(inp, space.root / "rewards.jsonl", env={"ENGINE_TEST_IMPORT_LOG": str(imports)}))
    assert imports.read_text() == "imported\n"


# --- resume refusals --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_resume_against_a_changed_input_is_refused(space: Workspace, small_reference: bytes, fmt: str) -> None:
    fixed = space.root / "fixed"
    original = rows(SMALL, poison=[BAD_LINE - 1])
    inp = write_rows(space.root / f"in.{fmt}", original)
    out = space.root / "rewards.jsonl"
    failed = space.score(inp, out, *chunk_args(), env=knobs(space.root / "calls.log", fixed))
    assert failed.returncode == 1, failed.stderr
    done = last_checkpoint(out)
    assert done == (BAD_LINE - 1) // CHUNK * CHUNK
    kept = (state_path(out).read_bytes(), partial_path(out).read_bytes())
    fixed.touch()

    edited = [dict(item) for item in original]
    edited[10]["trajectory"] = "a different answer"  # a row the interrupted run already scored
    write_rows(inp, edited)
    refused = space.score(inp, out, *chunk_args(), "--resume", env=knobs(space.root / "calls.log", fixed))
    assert refused.returncode == 2, refused.stderr
    assert "the input changed since the run started" in refused.stderr and f"first {done} rows" in refused.stderr
    assert (state_path(out).read_bytes(), partial_path(out).read_bytes()) == kept  # nothing lost to the refusal

    write_rows(inp, original[: done // 2])
    shorter = space.score(inp, out, *chunk_args(), "--resume", env=knobs(space.root / "calls.log", fixed))
    assert shorter.returncode == 2, shorter.stderr
    assert f"now has {done // 2} rows, but {done} were already scored" in shorter.stderr
    assert (state_path(out).read_bytes(), partial_path(out).read_bytes()) == kept

    write_rows(inp, original)
    ok(space.score(inp, out, *chunk_args(), "--resume", env=knobs(space.root / "calls.log", fixed)))
    assert out.read_bytes() == small_reference


EDITED_META: dict[str, Any] = {  # meta.verifiers of a hand-edited state, or another field of it
    "verifiers a list": {"verifiers": []},
    "verifiers not objects": {"verifiers": {"plugin:x": 3}},
    "totals missing a key": {"verifiers": {"plugin:x": {"kind": "plugin"}}},
    "a count as text": None,  # the run's own totals with items as text: set below
    "latency with a bad bucket": None,
}


@pytest.mark.parametrize("case", [*EDITED_META, "output_bytes -5"])
def test_a_hand_edited_state_is_refused_as_unusable(space: Workspace, case: str) -> None:
    inp = write_rows(space.root / "in.jsonl", rows(SMALL, poison=[BAD_LINE - 1]))
    out = space.root / "rewards.jsonl"
    assert space.score(inp, out, *chunk_args()).returncode == 1
    state = state_of(out)
    (key, totals), = state["meta"]["verifiers"].items()
    if case == "output_bytes -5":
        state["output_bytes"] = -5
    elif case == "a count as text":
        state["meta"]["verifiers"][key] = {**totals, "items": str(totals["items"])}
    elif case == "latency with a bad bucket":
        state["meta"]["verifiers"][key] = {**totals, "latency": {"fast": 1}}
    else:
        state["meta"] = EDITED_META[case]
    state_path(out).write_bytes(orjson.dumps(state))
    refused = space.score(inp, out, *chunk_args(), "--resume")
    assert refused.returncode == EXIT_BAD_INPUT, refused.stderr
    line = one_error_line(refused.stderr)
    assert f"{state_path(out)}: unusable state file: " in line and line.endswith("; delete it to start over"), line
    assert not lock_path(out).exists()


def test_a_fresh_run_over_an_interrupted_one_is_refused(space: Workspace) -> None:
    inp = write_rows(space.root / "in.jsonl", rows(SMALL, poison=[BAD_LINE - 1]))
    out = space.root / "rewards.jsonl"
    assert space.score(inp, out, *chunk_args()).returncode == 1
    kept = (state_path(out).read_bytes(), partial_path(out).read_bytes())

    again = space.score(inp, out, *chunk_args())
    assert again.returncode == 2
    assert "use --resume to continue it" in again.stderr
    other = write_rows(space.root / "other.jsonl", rows(SMALL))
    elsewhere = space.score(other, out, *chunk_args(), "--resume")
    assert elsewhere.returncode == 2
    assert f"read {inp.resolve()}, not {other.resolve()}" in elsewhere.stderr
    assert (state_path(out).read_bytes(), partial_path(out).read_bytes()) == kept


def test_resume_without_an_interrupted_run_is_refused(space: Workspace) -> None:
    inp = write_rows(space.root / "in.jsonl", rows(10))
    out = space.root / "rewards.jsonl"
    refused = space.score(inp, out, "--resume")
    assert refused.returncode == 2
    assert "no interrupted run to resume" in refused.stderr
    assert not out.exists() and not partial_path(out).exists()


# --- stopped while finishing ---------------------------------------------------------------------


def start_traced(space: Workspace, inp: Path, out: Path, stop: int) -> subprocess.Popen[str]:
    """``engine score`` under the finishing tracer (cli_support.FINISH_TRACE), pausing before step ``stop``."""
    args = ["score", str(inp), "-o", str(out), "--config", str(space.config), *chunk_args()]
    return start_under_trace(space.root / "engine_traced.py", ENGINE_UNDER_TRACE, args, stop, cwd=space.root)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_run_killed_after_its_output_is_complete_resumes_with_exit_0(space: Workspace, fmt: str) -> None:
    inp = write_rows(space.root / "in.jsonl", rows(SMALL))
    reference = space.root / "reference" / f"rewards.{fmt}"
    traced = start_traced(space, inp, reference, 0)
    _, stderr = traced.communicate(timeout=RUN_TIMEOUT)
    assert traced.returncode == 0, stderr
    steps = finish_steps(stderr)
    renamed = next(i for i, step in enumerate(steps, 1) if re.fullmatch(rf"replace \S+ -> {reference.name}", step))

    out = space.root / "out" / f"rewards.{fmt}"
    # kill -9 right after the output was renamed into place, before the state file is removed
    assert kill_at_step(start_traced(space, inp, out, renamed + 1), renamed + 1) == "fsync <directory>"
    assert out.read_bytes() == reference.read_bytes() and state_path(out).exists()

    fresh = space.score(inp, out, *chunk_args())
    assert fresh.returncode == EXIT_BAD_INPUT, fresh.stderr
    assert "finished but was stopped while cleaning up" in fresh.stderr and "use --resume" in fresh.stderr

    log = space.root / "resumed.log"
    resumed = ok(space.score(inp, out, *chunk_args(), "--resume", env=knobs(log)))
    assert f"the run had already finished: {out} was complete" in resumed.stdout
    assert read_log(log) == []  # nothing scored again
    summary = [line.split("│") for line in resumed.stdout.splitlines() if line.startswith("│ plugin ")]
    assert [cells[3].strip() for cells in summary] == [f"{SMALL:,}"]  # the whole run's summary
    assert "repeated ids: none" in resumed.stdout
    assert out.read_bytes() == reference.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]

    ok(space.score(inp, out, *chunk_args()))  # a fresh run then starts over, as any run does
    assert out.read_bytes() == reference.read_bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tail", [b"\n", b"\n  \n\t", b"no final newline", b"parquet"], ids=repr)
def test_a_run_killed_while_finishing_an_input_with_a_tail_resumes(space: Workspace, tail: bytes) -> None:
    """The last, short chunk reads to the end of the input: its checkpoint must be one a resume agrees with."""
    count = SMALL + 7  # not a multiple of the chunk size
    fmt = "parquet" if tail == b"parquet" else "jsonl"
    inp = write_rows(space.root / f"in.{fmt}", rows(count))
    if tail == b"no final newline":
        inp.write_bytes(inp.read_bytes()[:-1])
    elif fmt == "jsonl":
        inp.write_bytes(inp.read_bytes() + tail)
    reference = space.root / "reference.jsonl"
    ok(space.score(inp, reference, *chunk_args()))

    out = space.root / "out" / "rewards.jsonl"
    kill_at_step(start_traced(space, inp, out, 1), 1)  # before anything of finishing: the last checkpoint is all
    assert state_of(out)["rows_done"] == count and "finished" not in state_of(out)
    resumed = ok(space.score(inp, out, *chunk_args(), "--resume"))
    assert f"{count:,} rewards written" in resumed.stdout
    assert out.read_bytes() == reference.read_bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["edited", "moved", "a FIFO now"])
def test_a_run_killed_after_its_rename_completes_without_its_input(space: Workspace, change: str) -> None:
    """Only the cleanup is left: the input, since edited, moved away or replaced, is not needed nor read
    (not even counted for the progress bar: a FIFO in its place would block that count for ever)."""
    inp = write_rows(space.root / "in.jsonl", rows(SMALL))
    reference = space.root / "reference" / "rewards.jsonl"
    traced = start_traced(space, inp, reference, 0)
    _, stderr = traced.communicate(timeout=RUN_TIMEOUT)
    assert traced.returncode == 0, stderr
    steps = finish_steps(stderr)
    renamed = next(i for i, step in enumerate(steps, 1) if step == f"replace rewards.jsonl.partial -> {reference.name}")

    out = space.root / "out" / "rewards.jsonl"
    kill_at_step(start_traced(space, inp, out, renamed + 1), renamed + 1)
    assert out.read_bytes() == reference.read_bytes() and state_path(out).exists()
    if change == "edited":
        write_rows(inp, rows(SMALL + 5)[5:])
    elif change == "moved":
        inp.rename(space.root / "elsewhere.jsonl")
    else:
        inp.unlink()
        os.mkfifo(inp)

    resumed = ok(space.score(inp, out, *chunk_args(), "--resume"))
    assert f"the run had already finished: {out} was complete" in resumed.stdout
    assert out.read_bytes() == reference.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


# --- a full disk, SIGTERM and an early Ctrl-C ---------------------------------------------------

FILE_SIZE_LIMIT = 60_000  # bytes: RLIMIT_FSIZE, so the partial file (~180 bytes a row) fails around row 330
LIMITED = (
    "import resource, runpy, sys; "
    "resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
    "sys.argv[0] = 'engine'; runpy.run_module('engine', run_name='__main__')"
)


@pytest.mark.timeout(60)  # the run under a file size limit is a subprocess
def test_a_full_disk_stops_with_exit_3_and_one_line_and_resume_continues(space: Workspace) -> None:
    """A real write error from the kernel: EFBIG past RLIMIT_FSIZE (Python ignores SIGXFSZ), as ENOSPC would be."""
    inp = write_rows(space.root / "in.jsonl", rows(ROWS))
    reference = space.root / "reference.jsonl"
    ok(space.score(inp, reference, *chunk_args()))

    out = space.root / "out" / "rewards.jsonl"
    full = subprocess.run(
        [sys.executable, "-c", LIMITED.format(limit=FILE_SIZE_LIMIT), "score", str(inp), "-o", str(out),
         "--config", str(space.config), *chunk_args()],
        cwd=space.root, env=child_env(None), capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    assert full.returncode == EXIT_IO, full.stderr
    line = one_error_line(full.stderr)
    assert line.startswith(f"error: cannot write {partial_path(out)}: File too large; ")
    done = int(state_of(out)["rows_done"])  # the partial file may hold part of what followed: a resume drops it
    assert 0 < done < ROWS and f"{done:,} rows are checkpointed: run the same command with --resume" in line
    assert not out.exists() and not lock_path(out).exists()

    ok(space.score(inp, out, *chunk_args(), "--resume"))  # the space is free again
    assert out.read_bytes() == reference.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


@pytest.mark.timeout(60)  # the run under a file size limit is a subprocess
@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_disk_full_when_the_run_starts_stops_with_exit_3_and_one_line(space: Workspace, resume: bool) -> None:
    """Not even the lock file's pid can be written (RLIMIT_FSIZE 0: EFBIG, as ENOSPC would be)."""
    inp = write_rows(space.root / "in.jsonl", rows(SMALL, poison=[BAD_LINE - 1]))
    out = space.root / "rewards.jsonl"
    if resume:
        assert space.score(inp, out, *chunk_args()).returncode == 1  # leaves a checkpoint to resume
    kept = state_path(out).read_bytes() if resume else None
    full = subprocess.run(
        [sys.executable, "-c", LIMITED.format(limit=0), "score", str(inp), "-o", str(out),
         "--config", str(space.config), *chunk_args(), *(["--resume"] if resume else [])],
        cwd=space.root, env=child_env(None), capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    assert full.returncode == EXIT_IO, full.stderr
    assert one_error_line(full.stderr).startswith(f"error: cannot write {lock_path(out)}: File too large; ")
    assert not lock_path(out).exists() and not out.exists()
    assert (state_path(out).read_bytes() if resume else None) == kept
    if not resume:
        assert not state_path(out).exists() and not partial_path(out).exists()


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` refuses new files: mode 0o555, and for root (whom modes do not stop, as in CI) the immutable
    attribute, which stops root too (``chattr +i``; skipped where the file system or the machine has none)."""
    folder.chmod(0o555)
    immutable = os.geteuid() == 0
    try:
        if immutable:
            done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                immutable = False
                pytest.skip(f"root writes into a 0o555 directory, and chattr +i failed: {done.stderr.strip()}")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_a_read_only_output_directory_is_a_write_error(space: Workspace) -> None:
    inp = write_rows(space.root / "in.jsonl", rows(10))
    folder = space.root / "read-only"
    folder.mkdir()
    with read_only(folder):
        refused = space.score(inp, folder / "rewards.jsonl")
    assert refused.returncode == EXIT_IO, refused.stderr
    assert one_error_line(refused.stderr).startswith(f"error: cannot write {lock_path(folder / 'rewards.jsonl')}: ")


SIGNALLED = {  # how a run is stopped: the signal, how many times at once, whether SIGINT is ignored, the exit status
    "SIGTERM, SIGINT ignored": (signal.SIGTERM, 1, True, EXIT_TERMINATED),  # a background job of a script, nohup
    "SIGTERM twice": (signal.SIGTERM, 2, False, EXIT_TERMINATED),
    "SIGTERM twice, SIGINT ignored": (signal.SIGTERM, 2, True, EXIT_TERMINATED),
    "Ctrl-C twice": (signal.SIGINT, 2, False, EXIT_INTERRUPTED),
}
# Rows scored at thousands a second: the main thread busy in the engine's task groups, not waiting, when a signal
# lands just after a checkpoint. The last one's call holds until the run is stopped (it cannot end first; a signal
# the test sends late then lands while the run waits for that call, another place to land).
BUSY_ROWS = 4_000
BUSY_CHUNK = 100
GAPS = (0.0, 0.005, 0.01, 0.02, 0.04)  # seconds between a second signal and the first: not a bound, a spread
CHECKPOINTS = 3  # the first signal is sent after 1, 2 or 3 chunks' checkpoints
# The signal lands wherever the run is: in a task group, a worker thread's hand-over, the loop. A run per gap for
# two signals, per checkpoint for one (a run costs an interpreter's start, seconds on a loaded machine).
ATTEMPTS = {1: CHECKPOINTS, 2: len(GAPS)}


@pytest.fixture(scope="module")
def busy_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """The signal tests' input (:data:`BUSY_ROWS` rows, the last held), and its rewards scored without a stop."""
    space = make_workspace(tmp_path_factory.mktemp("busy"), PLUGIN_ENV)
    inp = write_rows(space.root / "in.jsonl", [*rows(BUSY_ROWS - 1), row(BUSY_ROWS - 1, hold=True)])
    reference = space.root / "reference.jsonl"
    ok(space.score(inp, reference, *chunk_args(BUSY_CHUNK)))  # no ENGINE_TEST_HOLD: the held row returns at once
    return inp, reference.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", SIGNALLED)
def test_a_signal_stops_a_run_with_one_line_however_it_lands(
    space: Workspace, busy_rows: tuple[Path, bytes], how: str
) -> None:
    signum, times, sigint_ignored, status = SIGNALLED[how]
    inp, reference = busy_rows
    held = {"ENGINE_TEST_HOLD": str(2 * RUN_TIMEOUT)}  # longer than the test waits for the run to end

    for attempt in range(ATTEMPTS[times]):
        out = space.root / str(attempt) / "rewards.jsonl"
        command = engine_command("score", inp, "-o", out, "--config", space.config, *chunk_args(BUSY_CHUNK))
        if sigint_ignored:  # as a shell starts a background job: SIGINT ignored, inherited through exec
            command = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *command]
        process = subprocess.Popen(
            command, cwd=space.root, env=child_env(held),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with reaped(process):
            wait_for_rows_done(out, BUSY_CHUNK * (1 + attempt % CHECKPOINTS), process)
            process.send_signal(signum)
            if times == 2:  # the second while the run unwinds from the first: at once, or a little later
                time.sleep(GAPS[attempt])
                process.send_signal(signum)
            _, stderr = process.communicate(timeout=RUN_TIMEOUT)
        assert process.returncode == status, (attempt, stderr)
        line = one_error_line(stderr)
        said = "error: terminated (SIGTERM); " if status == EXIT_TERMINATED else "error: interrupted (Ctrl-C); "
        assert line.startswith(said), line
        assert not lock_path(out).exists()
        again = ["--resume"] if "--resume" in line else []
        ok(space.score(inp, out, *chunk_args(BUSY_CHUNK), *again))
        assert out.read_bytes() == reference, (attempt, line)


def signal_handlers(pid: int) -> int:
    """The mask of signals process ``pid`` catches (``SigCgt`` in /proc/PID/status); 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)


def maps_pyarrow(pid: int) -> bool:
    try:
        return "libarrow" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def reached(process: subprocess.Popen[str], moment: str) -> bool:
    """Whether ``process`` has reached ``moment`` of EARLY (or ended: the test then fails on its status)."""
    if process.poll() is not None:
        return True
    if moment == "importing the engine":
        return maps_pyarrow(process.pid)
    # SIGTERM is caught from the start (engine/__main__.py), so "in main" is reached once the import is
    # well under way (pyarrow loaded); the delays after it reach into main.
    return maps_pyarrow(process.pid) and bool(signal_handlers(process.pid) & 1 << (signal.SIGTERM - 1))


EARLY = [  # when the Ctrl-C is sent: the moment the process reaches, then a delay in seconds
    ("importing the engine", 0.0),  # pyarrow is being loaded: the CLI is still being imported
    ("in main", 0.0),  # the import is well under way: reading the config comes soon
    ("in main", 0.05),
    ("in main", 0.1),
    ("in main", 0.2),
    ("in main", 0.4),
]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", ["Ctrl-C", "SIGTERM"])
def test_an_early_signal_exits_with_one_line_and_the_run_goes_on(space: Workspace, stop: str) -> None:
    signum, status = STOPS[stop]
    said = "error: interrupted (Ctrl-C)" if signum == signal.SIGINT else "error: terminated (SIGTERM)"
    inp = write_rows(space.root / "in.jsonl", rows(SMALL))
    reference = space.root / "reference.jsonl"
    ok(space.score(inp, reference, *chunk_args()))
    space.write_config(f'[refs."{PLUGIN_ENV}/verify:score"]\nmax_concurrency = 1\n')  # a slow run: still going

    for moment, delay in EARLY if signum == signal.SIGINT else EARLY[:3]:
        out = space.root / f"{moment.replace(' ', '-')}-{delay}" / "rewards.jsonl"
        slow = knobs(space.root / "calls.log", sleep=0.02)
        process = space.start("score", inp, "-o", out, "--config", space.config, *chunk_args(), env=slow)
        with reaped(process):
            wait_until(partial(reached, process, moment), message=f"the run never reached {moment!r}")
            time.sleep(delay)
            process.send_signal(signum)
            _, stderr = process.communicate(timeout=RUN_TIMEOUT)
        assert process.returncode == status, (moment, delay, stderr)
        line = one_error_line(stderr)
        assert line.startswith(said), line
        assert not out.exists() and not lock_path(out).exists()
        # The line says how to go on; doing what it says completes the run.
        again = ["--resume"] if "--resume" in line else []
        assert again or not state_path(out).exists(), line
        ok(space.score(inp, out, *chunk_args(), *again))
        assert out.read_bytes() == reference.read_bytes(), (moment, delay)


# --- repeated ids ---------------------------------------------------------------------------------


def test_repeated_ids_are_counted_over_the_whole_run_across_a_resume(space: Workspace) -> None:
    items = rows(SMALL, poison=[BAD_LINE - 1])
    for n in range(150, 160):  # after the failure: ten rows reuse the ids of rows 0-9 (before it)
        items[n] = {**row(n), "id": items[n - 150]["id"]}
    items[170] = {**row(170), "id": items[0]["id"]}  # a third row-0000
    for n in (180, 181):
        items[n] = {**row(n), "id": None}  # rows without an id are no repeat
    items[190] = {**row(190), "id": 7}  # an int is not the string "7", nor row-0007
    items[191] = {**row(191), "id": "7"}
    inp = write_rows(space.root / "in.jsonl", items)
    out = space.root / "rewards.jsonl"
    fixed = space.root / "fixed"
    assert space.score(inp, out, *chunk_args(), env=knobs(space.root / "1.log", fixed)).returncode == 1
    assert last_checkpoint(out) == (BAD_LINE - 1) // CHUNK * CHUNK  # rows 0-99 before, their repeats after
    fixed.touch()
    resumed = ok(space.score(inp, out, *chunk_args(), "--resume", env=knobs(space.root / "2.log", fixed)))
    repeats = "repeated ids: 11 rows have an id an earlier row had (10 distinct ids occur more than once)"
    assert repeats in resumed.stdout
