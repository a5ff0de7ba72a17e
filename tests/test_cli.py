"""The command line: ``engine score`` round trips, progress and summary, exit codes, ``check``, ``digest``, ``rubrics``.

Commands run in-process with click's ``CliRunner`` (``cli_support.invoke``), against real
environments (copies of ``tests/envs/``), a real endpoint and a real judge on 127.0.0.1: the CLI
is a thin layer over the engine, and the process adds nothing these tests look at. The exit
status of the ``engine`` command itself is tested in a subprocess (``test_digest_as_a_command``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from cli_support import (
    PLUGIN_ENV,
    ROOT,
    RUBRICS,
    Ran,
    Workspace,
    child_env,
    copy_env,
    fraction_sum_reward,
    load_plugin,
    make_workspace,
    plugin_score,
    records,
    row,
    write_rows,
)
from click.testing import CliRunner, Result
from conftest import SPIN, add_endpoint_env, add_env, add_rubric_env
from polling import wait_until
from servers import Request, Response, Server, score

import engine
from engine import digest_directory
from engine._backfill.checkpoint import state_path
from engine._backfill.run import open_run
from engine._backfill.writer import partial_path
from engine._cli.lifecycle import Commands, outcome
from engine._errors import UnreadyError
from engine._verifiers.plugin.launcher import default_workers
from engine._verifiers.rubric.prompt import PROMPT_VERSION
from engine.cli import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_IO, EXIT_OK, EXIT_VERIFICATION, cli

JUDGE_SCORE = 4  # what the test judge answers for every item
HELPFUL = "bob/helpfulness"  # the rubric of the rubric environment, from tests/rubrics


def endpoint_reward(task: dict[str, Any], trajectory: Any) -> float:
    """What the test endpoint verifier answers."""
    return float(task["n"] % 17 / 17 + len(trajectory) / 1000)


async def endpoint(request: Request) -> Response:
    body = request.json()
    return Response.json({"reward": endpoint_reward(body["task"], body["trajectory"])})


def front_matter(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if not text.startswith("+++"):
        return {}
    return tomllib.loads(text.split("+++")[1])


def rubric_versions(registry: Path, ref: str) -> list[int]:
    return sorted(int(p.stem) for p in (registry / ref).glob("*.md") if p.stem.isdigit())


def table_rows(text: str) -> list[list[str]]:
    """The cells of each line of a rich table that holds cells (box drawing or ASCII)."""
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped[:1] in ("│", "|", "┃"):
            out.append([cell.strip() for cell in re.split(r"[│|┃]", stripped)[1:-1]])
    return out


def row_of(text: str, first: str) -> list[str]:
    """The first line of the table row whose first cell is ``first``."""
    found = [cells for cells in table_rows(text) if cells and cells[0] == first]
    assert found, f"no table row for {first!r} in:\n{text}"
    return found[0]


def done(result: Ran) -> Ran:
    assert result.returncode == EXIT_OK, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


# --- round trips ------------------------------------------------------------------------------


@dataclass
class Mixed:
    """A workspace with one environment of each kind: plugin, endpoint, rubric (with a judge)."""

    space: Workspace
    url: str
    judge: engine.JudgeConfig

    def items(self, count: int) -> list[dict[str, Any]]:
        kinds = [PLUGIN_ENV, "remote", "helpful"]
        return [row(n, kinds[n % 3], prompt=f"question {n}") for n in range(count)]


@pytest.fixture
def mixed(tmp_path: Path) -> Iterator[Mixed]:
    with Server(endpoint) as server, Server.judge(default=score(JUDGE_SCORE)) as judge:
        config = f'rubrics = "rubrics"\n\n[judge]\nbase_url = "{judge.base_url}"\nmodel = "judge-test"\n'
        space = make_workspace(tmp_path, PLUGIN_ENV, config=config)
        shutil.copytree(RUBRICS, space.root / "rubrics")
        url = f"{server.url}/score"
        add_endpoint_env(space.envs, "remote", url)
        add_rubric_env(space.envs, "helpful", HELPFUL)
        yield Mixed(space, url, engine.JudgeConfig(base_url=judge.base_url, model="judge-test"))


def expected_record(mixed: Mixed, item: dict[str, Any]) -> tuple[Any, float, dict[str, Any]]:
    """The id, reward and provenance a run must write for ``item``, from the verifiers themselves."""
    environment, task, trajectory = item["environment"], item["task"], item["trajectory"]
    verifier: dict[str, Any]
    if environment == PLUGIN_ENV:
        reward = plugin_score()(task, trajectory)
        digest = digest_directory(mixed.space.envs / PLUGIN_ENV)
        verifier = {"kind": "plugin", "ref": "verify:score", "environment": PLUGIN_ENV, "digest": digest}
    elif environment == "remote":
        reward = endpoint_reward(task, trajectory)
        verifier = {"kind": "endpoint", "ref": mixed.url, "environment": "remote"}
    else:
        version = rubric_versions(RUBRICS, HELPFUL)[-1]
        path = RUBRICS / HELPFUL / f"{version}.md"
        lo, hi = front_matter(path).get("scale", [0, 1])
        reward = (JUDGE_SCORE - lo) / (hi - lo)
        digest = f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
        verifier = {"kind": "rubric", "ref": f"{HELPFUL}@{version}", "version": version, "digest": digest}
        judge = mixed.judge  # what graded it: the judge prompt's version and the judge's call parameters
        verifier |= {"prompt": PROMPT_VERSION, "model": judge.model,
                     "judge": {"model": judge.model, "base_url": judge.base_url, "temperature": judge.temperature,
                               "max_tokens": judge.max_tokens, "response_format": judge.response_format}}
        verifier["environment"] = "helpful"  # what the backfill adds to every verifier's provenance
    return item["id"], reward, verifier


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("source", "target"), [("jsonl", "jsonl"), ("parquet", "parquet"), ("jsonl", "parquet"),
                                                ("parquet", "jsonl")])
def test_round_trip(mixed: Mixed, source: str, target: str) -> None:
    space = mixed.space
    items = mixed.items(60)
    inp = write_rows(space.root / f"rollouts.{source}", items)
    out = space.root / "out" / f"rewards.{target}"

    result = done(space.score(inp, out, "--chunk-size", "16"))

    got = records(out)
    assert [(r.id, r.reward, dict(r.verifier)) for r in got] == [expected_record(mixed, item) for item in items]
    if target == "parquet":  # each kind's real provenance in the struct's own fields, the others null
        verifier = pq.read_table(out).column("verifier").combine_chunks()
        expected = [expected_record(mixed, item)[2] for item in items]
        for name in ("kind", "ref", "environment", "digest", "version", "prompt", "model"):
            assert verifier.field(name).to_pylist() == [v.get(name) for v in expected], name
    assert f"60 rewards written to {out}" in result.stdout
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no partial, state or temporary file left


# --- progress and summary ---------------------------------------------------------------------


class FlakyOnce:
    """An endpoint that answers 503 (retry at once) to the first request for each task in ``flaky``."""

    def __init__(self, flaky: set[int]) -> None:
        self.flaky = flaky
        self.refused: set[int] = set()

    async def __call__(self, request: Request) -> Response:
        body = request.json()
        n = body["task"]["n"]
        if n in self.flaky and n not in self.refused:
            self.refused.add(n)  # the server's handlers all run on its one event loop thread
            return Response.json({"error": "busy"}, 503, {"retry-after": "0"})
        return Response.json({"reward": endpoint_reward(body["task"], body["trajectory"])})


@pytest.mark.timeout(30)
def test_progress_lines_and_summary_when_not_on_a_terminal(tmp_path: Path) -> None:
    flaky = {3, 90, 201}  # endpoint rows (n % 3 == 0) in three different chunks
    handler = FlakyOnce(flaky)
    with Server(handler) as server:
        space = make_workspace(tmp_path, PLUGIN_ENV)
        url = f"{server.url}/score"
        add_endpoint_env(space.envs, "remote", url)
        items = [row(n, PLUGIN_ENV if n % 3 else "remote") for n in range(300)]
        inp = write_rows(space.root / "in.jsonl", items)
        result = done(space.score(inp, Path("rewards.jsonl"), "--chunk-size", "64"))
    assert handler.refused == flaky

    progress = [re.match(r"scored (\d+)/(\d+) rows", line) for line in result.stderr.splitlines()]
    counts = [(int(m[1]), int(m[2])) for m in progress if m]
    assert counts[-1] == (300, 300) and all(c > 0 for c, _ in counts)  # never "scored 0/300 rows"
    assert [c for c, _ in counts] == sorted(c for c, _ in counts)
    assert result.stderr.splitlines()[0] == "scoring 300 rows"  # nothing scored yet: what is about to be
    lines = [line for line in result.stderr.splitlines() if line.startswith("scored ")]
    assert re.fullmatch(r"scored 300/300 rows, [\d,]+ rows/s", lines[-1]), lines
    assert "\x1b[" not in result.stderr  # plain lines: no bar, no cursor movement, no colour

    score_fn = plugin_score()
    expected = {
        "plugin": [score_fn(i["task"], i["trajectory"]) for i in items if i["environment"] == PLUGIN_ENV],
        "endpoint": [endpoint_reward(i["task"], i["trajectory"]) for i in items if i["environment"] == "remote"],
    }
    header = next(cells for cells in table_rows(result.stdout) if cells and cells[0] == "kind")
    assert header == ["kind", "verifier", "items", "mean reward", "p50 ms", "p99 ms", "retries"]
    for kind, rewards in expected.items():
        cells = row_of(result.stdout, kind)
        assert int(cells[2].replace(",", "")) == len(rewards)
        assert float(cells[3]) == pytest.approx(math.fsum(rewards) / len(rewards), abs=1e-4)
        p50, p99 = float(cells[4]), float(cells[5])
        assert 0 < p50 <= p99
        assert int(cells[6]) == (len(flaky) if kind == "endpoint" else 0)
    # a plugin is named with its environment (two environments may both ship verify:score)
    assert row_of(result.stdout, "plugin")[1] == f"{PLUGIN_ENV}/verify:score"
    assert row_of(result.stdout, "endpoint")[1] == url
    assert result.stdout.rstrip().endswith("300 rewards written to rewards.jsonl")
    assert len(records(space.root / "rewards.jsonl")) == 300


# --- exit codes -------------------------------------------------------------------------------


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], prog_name="engine")


@pytest.fixture
def space(tmp_path: Path) -> Workspace:
    return make_workspace(tmp_path, PLUGIN_ENV)


def test_help_documents_the_exit_codes() -> None:
    result = invoke("--help")
    assert result.exit_code == EXIT_OK
    text = " ".join(result.stdout.split())
    assert "Exit codes: 0 done, 1 a verification error aborted the run, 2 bad usage, config or input" in text
    assert "3 the output or its state could not be written (disk full), 4 engine audit or diff: rewards disagree, " \
           "70 an internal error (a bug" in text
    assert "130 interrupted, 143 terminated (SIGTERM)" in text


ENGINE_ERRORS = {  # one of each of the engine's own errors, and the exit code it ends a command with
    "input": (engine.InputError(Path("in.jsonl"), "bad", unit="line", number=3), EXIT_BAD_INPUT),
    "config": (engine.ConfigError("engine.toml: x: unknown key"), EXIT_BAD_INPUT),
    "manifest": (engine.ManifestError("manifest.json: bad"), EXIT_BAD_INPUT),
    "digest": (engine.DigestError("a FIFO", path=Path("q")), EXIT_BAD_INPUT),
    "output": (engine.OutputError("out.csv: unsupported"), EXIT_BAD_INPUT),
    "resume": (engine.ResumeError("no interrupted run"), EXIT_BAD_INPUT),
    "verification": (engine.VerificationError("plugin", "verify:score", "boom"), EXIT_VERIFICATION),
    "rubric": (engine.RubricError("a/b", "no rubric a/b"), EXIT_VERIFICATION),
    "unready": (UnreadyError([("a", "plugin 'v:s'; verifier: boom")], checked=2, which="named", then=""),
                EXIT_VERIFICATION),
    "write": (engine.WriteError(Path("out.partial"), OSError(28, "No space left on device"), 5), EXIT_IO),
}
NOT_ENGINE_ERRORS = [ValueError("x"), TypeError("x"), KeyError("x"), OSError(5, "x"), RuntimeError("x"), Exception()]


@pytest.mark.parametrize("case", ENGINE_ERRORS, ids=list(ENGINE_ERRORS))
def test_each_of_the_engines_own_errors_has_its_exit_code(case: str) -> None:
    """What a run kept, and how to go on, follows a write error on its line and a verification error on a line of
    its own (as it follows an interrupt)."""
    exc, code = ENGINE_ERRORS[case]
    kept = {EXIT_IO: f"{exc}; kept", EXIT_VERIFICATION: f"{exc}\n  kept"}.get(code, str(exc))
    assert outcome(exc, lambda: "; kept") == (code, kept)


@pytest.mark.parametrize("exc", NOT_ENGINE_ERRORS, ids=lambda exc: type(exc).__name__)
def test_any_other_exception_is_no_bad_input_but_a_bug(exc: Exception) -> None:
    """A ValueError or TypeError the engine did not mean (a bug) must not read as the user's mistake (exit 2):
    :func:`~engine._cli.lifecycle.outcome` has no code for it, so the command group reports it as an internal
    error (exit 70).

    No real input makes the engine raise one (that would be a bug to fix, and a row the engine
    refuses becomes an ``InputError`` naming its line): the mapping is tested as the function it is.
    """
    assert outcome(exc) is None


@pytest.mark.parametrize("exc", [ValueError("a bug"), TypeError("a bug"), engine.InputError(Path("in.jsonl"), "bad")],
                         ids=["ValueError", "TypeError", "InputError"])
def test_the_command_group_reports_a_bug_as_one_and_an_engine_error_as_its_code(exc: Exception) -> None:
    """The group's handler, with a command of this test's own that raises (the engine offers no real way to)."""
    group = Commands()

    @group.command()
    def fail() -> None:
        raise exc

    result = CliRunner().invoke(group, ["fail"], prog_name="engine")
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if isinstance(exc, engine.InputError):
        assert (result.exit_code, said) == (EXIT_BAD_INPUT, [f"error: {exc}"])
        assert "Traceback" not in result.stderr
        return
    assert result.exit_code == EXIT_INTERNAL
    assert "Traceback (most recent call last)" in result.stderr and "raise exc" in result.stderr
    assert said == [f"error: internal error (a bug in engine, not in your input): {type(exc).__name__}: a bug"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["frobnicate"], "No such command 'frobnicate'"),
        (["score", "--frobnicate"], "--frobnicate"),
        (["score", "in.jsonl"], "Missing option '-o'"),
        (["score", "in.jsonl", "-o", "out.jsonl", "--chunk-size", "0"], "Invalid value for '--chunk-size'"),
        (["check", "--resume"], "--resume"),
        (["digest"], "Missing argument 'DIRECTORY'"),
    ],
    ids=["unknown command", "unknown option", "missing output", "bad chunk size", "option of another command",
         "missing argument"],
)
def test_bad_usage_exits_2(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == EXIT_BAD_INPUT
    assert message in result.stderr
    if args[-1].startswith("--") and len(args) == 2:
        assert "No such option" in result.stderr


CONFIG_ERRORS = {
    "unknown key": ('enviroments = "envs"\n', "enviroments: unknown key"),
    "bad value": ('environments = "envs"\n[defaults]\ntimeout = -1\n', "defaults.timeout: must be a number > 0"),
    "unknown limit": ('environments = "envs"\n[refs."x/verify:score"]\ntimeot = 1\n', "timeot: unknown key"),
    "not TOML": ("environments = \n", "not valid TOML"),
    "bad pin": ('environments = "envs"\n[pins]\nbackfill = "md5:00"\n', "pins.backfill: must look like"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS, ids=list(CONFIG_ERRORS))
@pytest.mark.parametrize("command", ["score", "check", "rubrics"])
def test_a_bad_config_exits_2_naming_file_and_key(space: Workspace, command: str, case: str) -> None:
    text, message = CONFIG_ERRORS[case]
    space.config.write_text(text)
    inp = write_rows(space.root / "in.jsonl", [row(0)])
    args: dict[str, list[str | Path]] = {
        "score": ["score", inp, "-o", space.root / "out.jsonl"],
        "check": ["check"],
        "rubrics": ["rubrics"],
    }
    result = invoke(*args[command], "--config", space.config)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert f"error: {space.config}: " in result.stderr and message in result.stderr
    assert not (space.root / "out.jsonl").exists() and not partial_path(space.root / "out.jsonl").exists()


def test_a_missing_config_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "in.jsonl", [row(0)])
    for args in (["score", "in.jsonl", "-o", "out.jsonl"], ["check"], ["check", "--config", "elsewhere.toml"]):
        result = invoke(*args)
        assert result.exit_code == EXIT_BAD_INPUT
        expected = "elsewhere.toml" if "--config" in args else "engine.toml"
        assert f"{expected}: config file not found" in result.stderr


def test_a_missing_input_exits_2(space: Workspace) -> None:
    result = invoke("score", space.root / "nothing.jsonl", "-o", space.root / "out.jsonl", "--config", space.config)
    assert result.exit_code == EXIT_BAD_INPUT
    assert f"{space.root / 'nothing.jsonl'}: no such input file" in result.stderr


@pytest.mark.parametrize(
    ("input_name", "output_name", "message"),
    [
        ("in.jsonl", "out.csv", "unsupported extension '.csv'"),
        ("in.csv", "out.jsonl", "unsupported extension '.csv'"),
        ("in.jsonl", "in.jsonl", "the output would replace the input"),
    ],
    ids=["output format", "input format", "output is the input"],
)
def test_unusable_files_exit_2(space: Workspace, input_name: str, output_name: str, message: str) -> None:
    inp = write_rows(space.root / input_name, [row(0)])
    before = inp.read_bytes()
    result = space.score(inp, space.root / output_name)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert message in result.stderr
    assert inp.read_bytes() == before
    assert not state_path(space.root / output_name).exists()


def test_a_second_run_for_the_same_output_exits_2_naming_the_first(space: Workspace) -> None:
    inp, out = write_rows(space.root / "in.jsonl", [row(0), row(1)]), space.root / "out.jsonl"
    with open_run(inp, out):  # the first run, still writing
        second = space.score(inp, out)
        resumed = space.score(inp, out, "--resume")
    for result in (second, resumed):
        assert result.returncode == EXIT_BAD_INPUT, result.stderr
        assert f"{out} is being written by another run (pid {os.getpid()}" in result.stderr
    assert space.score(inp, space.root / "other.jsonl").returncode == EXIT_OK


def test_exit_codes_of_a_run(space: Workspace) -> None:
    """0 when every row is scored, 1 when a verifier fails, 2 when a row is bad."""
    good = space.score(write_rows(space.root / "good.jsonl", [row(0), row(1)]), space.root / "good-out.jsonl")
    failing = space.score(write_rows(space.root / "bad.jsonl", [row(0), row(1, poison=True)]), space.root / "f.jsonl")
    bad = space.score(write_rows(space.root / "ugly.jsonl", [row(0), row(1, "nowhere")]), space.root / "u.jsonl")
    assert (good.returncode, failing.returncode, bad.returncode) == (EXIT_OK, EXIT_VERIFICATION, EXIT_BAD_INPUT)
    assert "error: plugin verifier 'verify:score'" in failing.stderr and "line 2" in failing.stderr
    assert "ugly.jsonl: line 2: unknown environment 'nowhere'" in bad.stderr


def test_a_call_that_fails_after_retries_names_its_real_cause(tmp_path: Path, refused_port: int) -> None:
    """The cause printed is the last try's own error, not tenacity's ``RetryError[<Future ...>]`` wrapper."""
    url = f"http://127.0.0.1:{refused_port}/score"
    space = make_workspace(tmp_path, config=f'[refs."{url}"]\nmax_attempts = 2\n')
    add_endpoint_env(space.envs, "dead", url)
    result = space.score(write_rows(space.root / "in.jsonl", [row(0, "dead")]), space.root / "out.jsonl")
    assert result.returncode == EXIT_VERIFICATION, result.stderr
    assert "gave up after 2 attempts; last: could not connect" in result.stderr, result.stderr
    assert "cause: ConnectError: " in result.stderr, result.stderr
    assert "RetryError" not in result.stderr and "Future" not in result.stderr, result.stderr


# --- engine check -----------------------------------------------------------------------------


def check_row(stdout: str, environment: str) -> list[str]:
    """The cells of ``environment``'s row of the check table, each with the lines it wraps onto joined."""
    rows_ = table_rows(stdout)
    starts = [i for i, cells in enumerate(rows_) if cells and cells[0] == environment]
    assert len(starts) == 1, f"no single row for {environment!r} in:\n{stdout}"
    cells = list(rows_[starts[0]])
    assert len(cells) == 7, cells  # environment, kind, ref, manifest, digest, verifier, ok
    for more in rows_[starts[0] + 1 :]:
        if len(more) != len(cells) or more[0]:
            break  # the next environment's row, or the table's end
        cells = [f"{cell}\n{piece}" if piece else cell for cell, piece in zip(cells, more, strict=True)]
    return cells


def squeezed(text: str) -> str:
    """``text`` without whitespace: how to compare a cell that rich wrapped or folded across lines."""
    return "".join(text.split())


def probed(server: Server) -> None:
    """Wait until ``server`` has seen ``engine check``'s probe connect and hang up.

    The probe only connects; the server would otherwise be stopped while it still accepts it, and
    the accepted socket would never be closed (its handler never starts).
    """
    wait_until(lambda: server.closed >= 1, message="engine check never connected to the endpoint")


def test_check_passes_when_every_environment_can_score(tmp_path: Path) -> None:
    with Server(endpoint) as server:
        envs = tmp_path / "envs"
        envs.mkdir()
        pin = digest_directory(copy_env(PLUGIN_ENV, envs))
        config = (
            f'rubrics = "rubrics"\n[pins]\n{PLUGIN_ENV} = "{pin}"\n'
            '[judge]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "judge-test"\n'  # never called by check
        )
        space = Workspace(tmp_path)
        space.config.write_text('environments = "envs"\nallow_unpinned = false\n' + config)
        shutil.copytree(RUBRICS, tmp_path / "rubrics")
        url = f"{server.url}/score"
        add_endpoint_env(envs, "remote", url)
        add_rubric_env(envs, "helpful", HELPFUL)
        result = done(space.run("check", "--config", space.config))
        probed(server)

    assert check_row(result.stdout, PLUGIN_ENV) == [PLUGIN_ENV, "plugin", "verify:score", "ok", "ok", "ok", "yes"]
    assert squeezed(" ".join(check_row(result.stdout, "remote"))) == squeezed(f"remote endpoint {url} ok - ok yes")
    assert check_row(result.stdout, "helpful") == ["helpful", "rubric", HELPFUL, "ok", "-", "ok", "yes"]
    assert result.stdout.rstrip().endswith("all 3 environments can score")
    assert not result.stderr


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 that is bound, so nobody else takes it, but not listening: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_check_fails_with_a_table_of_what_cannot_score(tmp_path: Path, refused_port: int) -> None:
    with Server.judge() as judge:
        config = f'rubrics = "rubrics"\n[pins]\nstale = "sha256:{"0" * 64}"\n'
        config += f'[judge]\nbase_url = "{judge.base_url}"\nmodel = "judge-test"\n'
        space = make_workspace(tmp_path, PLUGIN_ENV, "broken_import", "no_attr", config=config)
        shutil.copytree(RUBRICS, tmp_path / "rubrics")
        stale = digest_directory(copy_env("arith", space.envs).rename(space.envs / "stale"))
        add_endpoint_env(space.envs, "dead", f"http://127.0.0.1:{refused_port}/score")
        add_rubric_env(space.envs, "helpful", HELPFUL)
        add_rubric_env(space.envs, "unwritten", "carol/nothing")
        (space.envs / "garbled").mkdir()
        (space.envs / "garbled" / "manifest.json").write_text("{not json")
        result = space.run("check", "--config", space.config)
        assert not judge.requests  # check never asks the judge anything

    assert result.returncode == EXIT_VERIFICATION, result.stderr
    for name in (PLUGIN_ENV, "helpful"):
        assert check_row(result.stdout, name)[-1] == "yes"
    failing = {  # environment: (column, what it says)
        "broken_import": (5, "cannot import module 'verify': ModuleNotFoundError"),
        "no_attr": (5, "module 'verify' has no attribute 'missing'"),
        "stale": (4, f"changed since pinned (now {stale})"),
        "dead": (5, f"cannot connect to 127.0.0.1:{refused_port}"),
        "unwritten": (5, "no rubric carol/nothing"),
        "garbled": (3, f"{space.envs / 'garbled' / 'manifest.json'}: invalid JSON"),
    }
    for name, (column, reason) in failing.items():
        cells = check_row(result.stdout, name)
        assert cells[-1] == "NO"
        assert squeezed(reason) in squeezed(cells[column]), cells
    assert check_row(result.stdout, "stale")[5] == "not imported (digest)"
    assert f"error: {len(failing)} of {len(failing) + 2} environments cannot score: " in result.stderr
    assert set(result.stderr.split("cannot score: ")[-1].replace(",", " ").split()) == set(failing)


def test_check_tries_the_proxy_the_environment_names_for_an_endpoint(tmp_path: Path, refused_port: int) -> None:
    with Server(endpoint) as server:  # reachable directly, but the environment says: through the proxy
        space = make_workspace(tmp_path)
        add_endpoint_env(space.envs, "remote", f"{server.url}/score")
        # either case, so that none inherited from the test's own environment wins (lowercase does, in urllib)
        url = f"http://127.0.0.1:{refused_port}"
        proxy = {"HTTP_PROXY": url, "http_proxy": url, "NO_PROXY": "", "no_proxy": ""}
        proxied = space.run("check", "--config", space.config, env=proxy)
        direct = space.run("check", "--config", space.config, env={**proxy, "no_proxy": "127.0.0.1"})
        probed(server)
    assert proxied.returncode == EXIT_VERIFICATION, proxied.stderr
    cells = check_row(proxied.stdout, "remote")
    assert squeezed(f"cannot connect to the proxy 127.0.0.1:{refused_port}") in squeezed(cells[5]), cells
    assert direct.returncode == EXIT_OK, direct.stdout + direct.stderr


def test_check_without_pins_or_judge_says_what_to_add(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    space.config.write_text('environments = "envs"\n')  # allow_unpinned defaults to false; no [judge]
    add_rubric_env(space.envs, "helpful", HELPFUL)
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION
    plugin = check_row(result.stdout, PLUGIN_ENV)
    pin = digest_directory(space.envs / PLUGIN_ENV)
    assert squeezed(f'no pin; after vetting, pin it: {PLUGIN_ENV} = "{pin}"') == squeezed(plugin[4])
    assert plugin[5:] == ["not imported (digest)", "NO"]
    rubric = check_row(result.stdout, "helpful")
    assert squeezed("no [judge] is configured") in squeezed(rubric[5]) and rubric[-1] == "NO"


MATH_ENV = ROOT / "tests" / "faults" / "envs"  # math_verify: math-verify with its default (signal.alarm) timeouts


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_check_scores_a_manifests_example_and_says_when_it_fails_only_in_a_thread(tmp_path: Path) -> None:
    """math-verify imports fine in a thread and fails every call there: check calls it on the manifest's example."""
    space = make_workspace(tmp_path)
    space.config.write_text('environments = "envs"\nallow_unpinned = true\n')
    example = {"task": {"answer": "0.5"}, "trajectory": "\\boxed{1/2}"}
    for name, extra in {"in_thread": {}, "in_process": {"executor": "process", "workers": 1}}.items():
        manifest = copy_env("math_verify", space.envs, source=MATH_ENV).rename(space.envs / name) / "manifest.json"
        data = orjson.loads(manifest.read_bytes())
        data["verifier"].update(extra)
        manifest.write_bytes(orjson.dumps({**data, "example": example}))
    wrong = copy_env("math_verify", space.envs, source=MATH_ENV).rename(space.envs / "bad_example") / "manifest.json"
    manifest_data = orjson.loads(wrong.read_bytes())
    wrong.write_bytes(orjson.dumps({**manifest_data, "example": {"task": {"answer": "0.5"}}}))
    result = space.run("check", "--config", space.config)

    assert result.returncode == EXIT_VERIFICATION, result.stdout + result.stderr
    assert check_row(result.stdout, "in_process")[-1] == "yes"
    thread = check_row(result.stdout, "in_thread")
    assert thread[-1] == "NO"
    expected = 'its example fails in the engine\'s threads only: it sets a signal handler'
    assert squeezed(expected) in squeezed(thread[5]), thread
    assert squeezed('set "executor": "process"') in squeezed(thread[5]), thread
    bad = check_row(result.stdout, "bad_example")
    assert squeezed("manifest field 'example' must be an object with 'task' and 'trajectory'") in squeezed(bad[5])
    assert "error: 2 of 3 environments cannot score: bad_example, in_thread" in result.stderr


def test_check_reports_a_missing_rubric_even_without_a_judge(tmp_path: Path) -> None:
    space = make_workspace(tmp_path)
    add_rubric_env(space.envs, "unwritten", "carol/nothing")
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION
    assert squeezed("no rubric carol/nothing") in squeezed(check_row(result.stdout, "unwritten")[5])


@pytest.mark.timeout(60)
def test_check_names_a_special_file_instead_of_hanging(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV, "arith")
    fifo = space.envs / "arith" / "queue"
    os.mkfifo(fifo)  # the digest would wait forever for a writer
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION, result.stderr
    cells = check_row(result.stdout, "arith")
    assert squeezed(f"{fifo} is a named pipe (FIFO), not a regular file or directory") in squeezed(cells[4])
    assert cells[5:] == ["not imported (digest)", "NO"]
    assert check_row(result.stdout, PLUGIN_ENV)[-1] == "yes"  # the others are still checked


@pytest.mark.timeout(60)
def test_check_names_a_fifo_manifest_instead_of_hanging(tmp_path: Path) -> None:
    """The manifest is read before the digest, on the event loop: a FIFO there blocked ``engine check`` for good."""
    space = make_workspace(tmp_path, PLUGIN_ENV, "arith")
    manifest = space.envs / "arith" / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION, result.stderr
    cells = check_row(result.stdout, "arith")
    assert squeezed(f"{manifest} is a named pipe (FIFO)") in squeezed(cells[3]), cells
    assert cells[-1] == "NO"
    assert check_row(result.stdout, PLUGIN_ENV)[-1] == "yes"  # the others are still checked


HANGS = """import threading


def score(task, trajectory):
    threading.Event().wait()  # never returns: the engine abandons the call at its timeout
"""
EXIT_WAIT = 90.0  # seconds to wait for an engine process whose work is done to end (it took ~1 s) before failing


def hanging_workspace(root: Path, *, example: bool = True) -> Workspace:
    """A workspace whose environment ``hang`` never returns from a call, in the engine's threads, timeout 1 s;
    ``example``: its manifest has one (which ``engine check``, and ``engine score`` before its rows, calls)."""
    space = make_workspace(root, config="[defaults]\ntimeout = 1.0\n")
    extra = {"example": {"task": {}, "trajectory": "x"}} if example else {}
    add_env(space.envs, "hang", "plugin", "hang:score", **extra)
    (space.envs / "hang" / "hang.py").write_text(HANGS)
    return space


def exited(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    """The exit status, stdout and stderr of ``process``; the test fails if it does not end."""
    try:
        out, err = process.communicate(timeout=EXIT_WAIT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the engine did not exit after its work was done:\n{out}\n{err}")
    return process.returncode, out, err


@pytest.mark.timeout(150)  # a new interpreter: its exit is the point
def test_check_exits_when_a_plugin_call_hangs_in_a_thread(tmp_path: Path) -> None:
    """The abandoned call's thread is one of the engine's daemons: the interpreter exits without waiting for it
    (anyio's worker threads, which are not, kept it from exiting for ever)."""
    space = hanging_workspace(tmp_path)
    code, out, err = exited(space.start("check", "--config", space.config))
    assert code == EXIT_VERIFICATION, out + err
    assert squeezed("its example fails: timed out after 1 s") in squeezed(check_row(out, "hang")[5]), out
    assert err == "error: 1 of 1 environment cannot score: hang\n"  # nothing from the interpreter's shutdown


@pytest.mark.timeout(150)  # a new interpreter: its exit is the point
def test_score_exits_when_a_plugin_call_hangs_in_a_thread(tmp_path: Path) -> None:
    space = hanging_workspace(tmp_path, example=False)  # the row's call hangs, not the check's before it
    stuck = {"id": "stuck", "environment": "hang", "task": {}, "trajectory": "x"}
    rows_in = write_rows(space.root / "in.jsonl", [stuck])
    output = space.root / "out.jsonl"
    code, out, err = exited(space.start("score", rows_in, "-o", output, "--config", space.config))
    assert code == EXIT_VERIFICATION, out + err
    said = "error: plugin verifier 'hang:score' (environment 'hang') failed on item 0 (id 'stuck'): timed out after 1 s"
    assert said in err, err
    assert "Exception ignored" not in err, err
    assert not output.exists()


# --- engine digest ----------------------------------------------------------------------------


def test_digest_prints_the_digest_of_a_directory(tmp_path: Path) -> None:
    env = copy_env(PLUGIN_ENV, tmp_path)
    first = invoke("digest", env)
    assert first.exit_code == EXIT_OK
    assert first.stdout == f"{digest_directory(env)}\n"
    (env / "verify.py").write_text((env / "verify.py").read_text() + "\n# vetted\n")
    second = invoke("digest", env)
    assert second.stdout == f"{digest_directory(env)}\n" and second.stdout != first.stdout
    assert invoke("digest", tmp_path / "nowhere").exit_code == EXIT_BAD_INPUT


@pytest.mark.timeout(60)  # a new interpreter: the exit status of the command itself is the point
def test_digest_as_a_command(tmp_path: Path) -> None:
    env = copy_env(PLUGIN_ENV, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "engine", "digest", str(env)],
        capture_output=True, text=True, env=child_env(None), timeout=30, check=False,
    )
    assert (result.returncode, result.stdout) == (EXIT_OK, f"{digest_directory(env)}\n")


# --- engine rubrics ---------------------------------------------------------------------------


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    """A config whose rubric registry is a copy of tests/rubrics; returns the config file."""
    shutil.copytree(RUBRICS, tmp_path / "rubrics")
    config = tmp_path / "engine.toml"
    config.write_text('environments = "envs"\nrubrics = "rubrics"\n')
    return config


def test_rubrics_lists_every_rubric_and_its_versions(registry: Path) -> None:
    result = invoke("rubrics", "--config", registry)
    assert result.exit_code == EXIT_OK
    refs = sorted(f"{p.parent.name}/{p.name}" for p in (registry.parent / "rubrics").glob("*/*") if p.is_dir())
    assert len(refs) >= 2
    lines = result.stdout.splitlines()
    assert len(lines) == len(refs)
    for ref, line in zip(refs, lines, strict=True):
        versions = rubric_versions(registry.parent / "rubrics", ref)
        assert line.split() == [ref, "versions", *[f"{v}," for v in versions[:-1]], str(versions[-1]),
                                "(latest", f"{versions[-1]})"]


def test_rubrics_with_an_empty_registry(tmp_path: Path) -> None:
    config = tmp_path / "engine.toml"
    config.write_text('rubrics = "none-yet"\n')
    result = invoke("rubrics", "--config", config)
    assert result.exit_code == EXIT_OK
    assert f"no rubrics under {tmp_path / 'none-yet'}" in result.stdout


@pytest.mark.parametrize("pinned", [True, False], ids=["owner/name@N", "owner/name is the latest"])
def test_rubrics_show_prints_the_text(registry: Path, pinned: bool) -> None:
    ref = "alice/arithmetic-correctness"
    versions = rubric_versions(registry.parent / "rubrics", ref)
    version = versions[0] if pinned else versions[-1]
    result = invoke("rubrics", "--config", registry, "show", f"{ref}@{version}" if pinned else ref)
    assert result.exit_code == EXIT_OK, result.output
    path = registry.parent / "rubrics" / ref / f"{version}.md"
    header, *text = result.stdout.splitlines()
    digest = f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    lo, hi = front_matter(path).get("scale", [0, 1])
    assert header.split() == ["#", f"{ref}@{version}", "scale", f"[{lo:g},", f"{hi:g}]", digest]
    body = path.read_text().split("+++")[-1]
    expected = [line.rstrip() for line in body.splitlines() if line.strip()]
    assert [line.rstrip() for line in text if line.strip()] == expected


@pytest.mark.parametrize(
    "where", ["after show", "before show"], ids=["show REF --config", "show --config REF"]
)
def test_rubrics_show_takes_config_where_users_type_it(registry: Path, tmp_path: Path, where: str) -> None:
    """``engine rubrics show owner/name --config engine.toml``, from a directory with no engine.toml."""
    ref = "alice/arithmetic-correctness"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["show", ref, "--config", registry] if where == "after show" else ["show", "--config", registry, ref]
    with contextlib.chdir(elsewhere):
        result = invoke("rubrics", *args)
    assert result.exit_code == EXIT_OK, result.output
    assert result.stdout.split()[:2] == ["#", f"{ref}@{rubric_versions(registry.parent / 'rubrics', ref)[-1]}"]


def test_rubrics_show_config_wins_over_the_groups(registry: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text('rubrics = "none-yet"\n')
    result = invoke("rubrics", "--config", empty, "show", "alice/arithmetic-correctness", "--config", registry)
    assert result.exit_code == EXIT_OK, result.output
    wrong = invoke("rubrics", "--config", registry, "show", "alice/arithmetic-correctness", "--config", empty)
    assert wrong.exit_code == EXIT_BAD_INPUT and "no rubric alice/arithmetic-correctness" in wrong.stderr


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("carol/nothing", "no rubric carol/nothing"),
        ("alice/arithmetic-correctness@99", "has no version 99"),
        ("not a ref", "must be 'owner/name' or 'owner/name@N'"),
    ],
    ids=["unknown rubric", "unknown version", "malformed ref"],
)
def test_rubrics_show_an_unknown_rubric_exits_2(registry: Path, ref: str, message: str) -> None:
    result = invoke("rubrics", "--config", registry, "show", ref)
    assert result.exit_code == EXIT_BAD_INPUT
    assert message in result.stderr


# --- the README's main job --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def start_service(examples: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start the example verifier service on a free port (retrying if the port is taken meanwhile)."""
    for _ in range(3):
        port = free_port()
        service = subprocess.Popen(
            [sys.executable, str(examples / "service.py"), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # until it listens, or exits (its port was taken meanwhile)
        with contextlib.suppress(AssertionError):
            wait_until(functools.partial(lambda s, p: s.poll() is not None or listening(p), service, port))
        if service.poll() is None and listening(port):
            return service, port
        service.kill()
        service.wait(10)
    raise AssertionError("the example service did not start")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_example_job_on_a_copy_of_examples(tmp_path: Path) -> None:
    """What ``make run`` does, on a copy of examples/ with the service on a free port instead of 8765."""
    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", examples, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    service, port = start_service(examples)
    try:
        for path in (examples / "engine.toml", examples / "envs" / "keywords" / "manifest.json"):
            path.write_text(path.read_text().replace("127.0.0.1:8765", f"127.0.0.1:{port}"))
        space = Workspace(examples)
        out = tmp_path / "out" / "rewards.jsonl"
        result = done(space.run("score", examples / "rollouts.jsonl", "-o", out, "--config", examples / "engine.toml"))
        check = space.run("check", "--config", examples / "engine.toml")
    finally:
        service.terminate()
        service.wait(10)

    items = [orjson.loads(line) for line in (examples / "rollouts.jsonl").read_bytes().splitlines() if line.strip()]
    assert f"{len(items)} rewards written to {out}" in result.stdout
    arithmetic = load_plugin(examples / "envs" / "arithmetic", "verify", "score")
    coverage = load_plugin(examples, "service", "coverage")
    pin = tomllib.loads((examples / "engine.toml").read_text())["pins"]["arithmetic"]
    assert pin == digest_directory(examples / "envs" / "arithmetic")
    got = records(out)
    assert [r.id for r in got] == [i["id"] for i in items]
    for item, record in zip(items, got, strict=True):
        if item["environment"] == "arithmetic":
            assert record.reward == arithmetic(item["task"], item["trajectory"])
            plugin = {"kind": "plugin", "ref": "verify:score", "environment": "arithmetic", "digest": pin}
            assert record.verifier == plugin
        elif item["environment"] == "math":  # math-verify, in worker processes: against fractions computed here
            assert record.reward == fraction_sum_reward(item), item
            assert record.verifier == {"kind": "plugin", "ref": "verify:score", "environment": "math",
                                       "digest": digest_directory(examples / "envs" / "math")}
        else:
            assert record.reward == coverage(item["task"], item["trajectory"])
            assert record.verifier == {"kind": "endpoint", "ref": f"http://127.0.0.1:{port}/score",
                                       "environment": "keywords"}
    math_rewards = [r.reward for i, r in zip(items, got, strict=True) if i["environment"] == "math"]
    assert len(math_rewards) == 60 and 0 < sum(math_rewards) < 60  # right and wrong answers both

    # check: the plugin and the endpoint can score; the rubric environment waits for a [judge] (see the README)
    assert check.returncode == EXIT_VERIFICATION
    assert check_row(check.stdout, "arithmetic")[-1] == "yes" and check_row(check.stdout, "keywords")[-1] == "yes"
    assert check_row(check.stdout, "math") == ["math", "plugin", "verify:score", "ok", "ok", "ok", "yes"]  # its example
    helpfulness = check_row(check.stdout, "helpfulness")
    assert helpfulness[-1] == "NO" and squeezed("no [judge]") in squeezed(helpfulness[5])


SLEEPY = "import time\n\n\ndef score(task, trajectory):\n    time.sleep(0.005)\n    return 1.0\n"


@pytest.mark.skipif(default_workers() < 2, reason="no hint on one core")
def test_check_says_when_a_cpu_bound_thread_plugin_would_use_every_core(tmp_path: Path) -> None:
    """A thread plugin whose example's warm calls measured CPU-bound gets one line: processes would use every core."""
    space = make_workspace(tmp_path, PLUGIN_ENV)  # a cheap plugin
    example = {"example": {"task": {"n": 1}, "trajectory": "answer 1"}}
    manifest = space.envs / PLUGIN_ENV / "manifest.json"
    manifest.write_bytes(orjson.dumps({**orjson.loads(manifest.read_bytes()), **example}))
    for name, code, executor in [("spin", SPIN, "thread"), ("spin_process", SPIN, "process"),
                                 ("sleepy", SLEEPY, "thread")]:
        add_env(space.envs, name, "plugin", "verify:score", **example)
        (space.envs / name / "verify.py").write_text(code)
        if executor == "process":
            data = orjson.loads((space.envs / name / "manifest.json").read_bytes())
            data["verifier"].update({"executor": "process", "workers": 1})
            (space.envs / name / "manifest.json").write_bytes(orjson.dumps(data))
    # the spinner is CPU-bound by the share of its calls' time on a CPU, which a machine loaded past its cores
    # lowers: up to three runs, until one measures it so (the cheap plugin, the process plugin and the sleepy
    # one never get one: the hint comes from warm calls, not the example's one cold call)
    for _ in range(3):
        result = done(space.run("check", "--config", space.config))
        for name in ("spin", "spin_process", "sleepy", PLUGIN_ENV):
            assert check_row(result.stdout, name)[-1] == "yes"
        said = {line.split(":")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("hint: ")}
        assert said.keys() <= {"spin"}, result.stdout
        if "spin" in said:
            break
    cores = default_workers()
    assert "spin" in said, result.stdout
    assert said["spin"].startswith("hint: spin: CPU-bound ("), result.stdout
    assert said["spin"].endswith(f'"executor": "process" in its manifest\'s verifier would use {cores} cores')
