"""Where a plugin failed, in its own code: the same file, line and frames under the thread, loop and process executors.

Each environment's entry function calls a helper module of its own, which raises: the innermost frame of the
plugin is not its entry function. ``engine score`` runs as a user runs it, in a subprocess; ``engine check``
and ``engine bench`` in-process (``cli_support.Workspace.run``).
"""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
from cli_support import RUN_TIMEOUT, Workspace, make_workspace, reaped, write_rows
from conftest import add_env, item

import engine
from engine import EngineConfig, VerificationError
from engine._verifiers.plugin.frames import MAX_FRAMES
from engine.cli import EXIT_VERIFICATION

ENTRY = """from . import parse


def score(task, trajectory):
    return parse.reward(trajectory)
"""
ASYNC_ENTRY = """from . import parse


async def score(task, trajectory):
    return parse.reward(trajectory)
"""
PARSE = """import json


def reward(text):
    return _number(json.loads(text)["answer"])


def _number(value):
    if not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def deep(depth):
    if depth:
        return deep(depth - 1)
    raise RecursionError("as deep as it goes")
"""
BROKEN = """VALUE = 1
raise RuntimeError("the helper cannot be imported")
"""
EXECUTORS = ("thread", "async", "process")
# the engine's own frame that called the plugin, which only the whole traceback shows
RUNNER = {"thread": 'thread_calls.py", line', "async": 'on_loop.py", line', "process": 'worker.py", line'}
GOOD = '{"answer": 1}'
BAD = '{"answer": "x"}'  # parse._number raises; a trajectory that is not JSON makes json.loads raise


def line_of(source: str, text: str) -> int:
    """The number of the line of ``source`` that holds ``text`` (there is one)."""
    lines = [n for n, line in enumerate(source.splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def helper_env(envs: Path, executor: str, *, broken: bool = False, **extra: Any) -> str:
    """Environment ``helpers_<executor>``: ``entry:score`` calls ``parse.reward``; with ``broken``, entry imports a
    module that raises on import. Its verifier runs in threads, on the loop (``async def``) or in a worker process."""
    name = add_env(envs, f"helpers_{executor}", "plugin", "entry:score", **extra)
    directory = envs / name
    entry = ASYNC_ENTRY if executor == "async" else ENTRY
    (directory / "entry.py").write_text(("from . import broken\n" if broken else "") + entry)
    (directory / "parse.py").write_text(PARSE)
    (directory / "broken.py").write_text(BROKEN)
    if executor == "process":
        manifest = orjson.loads((directory / "manifest.json").read_bytes())
        manifest["verifier"].update(executor="process", workers=1)
        (directory / "manifest.json").write_bytes(orjson.dumps(manifest))
    return name


def expected_frames(directory: Path, executor: str) -> list[tuple[str, int, str, str]]:
    """(file, line, function, source line) of the plugin's frames when ``parse._number`` raises, innermost last."""
    entry = ASYNC_ENTRY if executor == "async" else ENTRY
    call = "return parse.reward(trajectory)"
    reward, raised = "return _number(json.loads(text)[\"answer\"])", 'raise ValueError(f"not a number: {value!r}")'
    return [
        (str(directory / "entry.py"), line_of(entry, call), "score", call),
        (str(directory / "parse.py"), line_of(PARSE, reward), "reward", reward),
        (str(directory / "parse.py"), line_of(PARSE, raised), "_number", raised),
    ]


def frames_of(error: VerificationError) -> list[tuple[str, int | None, str, str | None]]:
    return [(frame.filename, frame.lineno, frame.name, frame.line) for frame in error.plugin_frames]


async def failed(config: EngineConfig, items: list[dict[str, Any]]) -> VerificationError:
    async with engine.Engine(config) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.score(items)
    return info.value


# --- the Python API: a field of frames, and the reason ends with the innermost --------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_the_error_names_the_plugins_own_file_and_line(envs: Path, config: EngineConfig, executor: str) -> None:
    name = helper_env(envs, executor)
    err = await failed(config, [item(name, GOOD, item_id="good"), item(name, BAD, item_id="bad")])
    frames = expected_frames(envs / name, executor)
    assert frames_of(err) == frames
    raised_at = frames[-1][1]
    assert err.reason == f"raised ValueError: not a number: 'x' (at parse.py:{raised_at}, in _number)"
    assert str(err).endswith(err.reason) and (err.index, err.item_id) == (1, "bad")
    again = pickle.loads(pickle.dumps(err))  # what a Ray actor's error brings to the driver
    assert frames_of(again) == frames and str(again) == str(err)


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_a_librarys_frames_are_not_the_plugins(envs: Path, config: EngineConfig, executor: str) -> None:
    """json.loads raises inside json's own modules: the innermost frame named is the plugin's line that called it."""
    name = helper_env(envs, executor)
    err = await failed(config, [item(name, "not JSON")])
    frames = expected_frames(envs / name, executor)[:2]
    assert frames_of(err) == frames
    assert err.reason.startswith("raised JSONDecodeError: Expecting value")
    assert err.reason.endswith(f" (at parse.py:{frames[-1][1]}, in reward)")


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_deep_recursion_keeps_only_the_innermost_frames(envs: Path, executor: str) -> None:
    name = helper_env(envs, executor)
    (envs / name / "entry.py").write_text("from . import parse\n\n\ndef score(task, trajectory):\n"
                                          "    return parse.deep(200)\n")
    config = EngineConfig(environments=envs, allow_unpinned=True)
    err = await failed(config, [item(name, "x")])
    raised = line_of(PARSE, 'raise RecursionError("as deep as it goes")')
    recursed = line_of(PARSE, "return deep(depth - 1)")
    assert [(f.name, f.lineno) for f in err.plugin_frames] == [("deep", recursed)] * (MAX_FRAMES - 1) + [
        ("deep", raised)
    ]


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_helper_that_fails_to_import_is_named(envs: Path, executor: str) -> None:
    name = helper_env(envs, executor, broken=True)
    config = EngineConfig(environments=envs, allow_unpinned=True)
    err = await failed(config, [item(name, BAD)])
    raised = line_of(BROKEN, "raise RuntimeError")
    assert err.cannot_load
    assert err.reason.endswith(f"RuntimeError: the helper cannot be imported (at broken.py:{raised}, in <module>)")
    assert frames_of(err)[-1] == (str(envs / name / "broken.py"), raised, "<module>", 'raise RuntimeError('
                                  '"the helper cannot be imported")')
    assert frames_of(err)[0][:3] == (str(envs / name / "entry.py"), 1, "<module>")


async def test_a_failure_that_raised_nothing_names_no_frame(envs: Path, config: EngineConfig) -> None:
    """A value that is not a reward: nothing the plugin raised, so no frame (and no guess at one)."""
    name = helper_env(envs, "thread")
    (envs / name / "entry.py").write_text("def score(task, trajectory):\n    return 'high'\n")
    err = await failed(config, [item(name, "x")])
    assert (err.plugin_frames, err.reason) == ((), "returned 'high' (str), which is not a real number")


# --- engine score, as a user runs it ------------------------------------------------------------------------------


def scored(space: Workspace, output: str, *extra: str) -> tuple[int, str]:
    """``engine score`` of the workspace's ``in.jsonl`` to ``output`` in a subprocess: its exit status and stderr."""
    with reaped(space.start("score", space.root / "in.jsonl", "-o", space.root / output,
                            "--config", space.config, *extra)) as process:
        try:
            _, err = process.communicate(timeout=RUN_TIMEOUT * 2)
        except subprocess.TimeoutExpired:
            pytest.fail("engine score did not end")
    return process.returncode, err


@pytest.mark.timeout(150)  # two interpreters started, and a worker process
@pytest.mark.parametrize("executor", EXECUTORS)
def test_score_shows_the_plugins_frames_and_traceback_shows_the_whole(tmp_path: Path, executor: str) -> None:
    space = make_workspace(tmp_path)
    name = helper_env(space.envs, executor)
    good = {"id": "good", "environment": name, "task": {}, "trajectory": GOOD}
    write_rows(space.root / "in.jsonl", [good, {**good, "id": "bad", "trajectory": BAD}])
    frames = expected_frames(space.envs / name, executor)
    code, err = scored(space, "out.jsonl")
    assert code == EXIT_VERIFICATION, err
    reason = f"raised ValueError: not a number: 'x' (at parse.py:{frames[-1][1]}, in _number)"
    said = f"error: plugin verifier 'entry:score' (environment '{name}') failed on item 1 (id 'bad'): {reason}"
    block = ["  in the plugin's own code, innermost last (--traceback prints the whole traceback):"]
    for path, line, function, source in frames:
        block += [f'    File "{path}", line {line}, in {function}', f"      {source}"]
    lines = err.splitlines()
    assert said in lines and "  cause: ValueError: not a number: 'x'" in lines, err
    start = lines.index(block[0])
    assert lines[start : start + len(block)] == block, err
    assert "Traceback" not in err and "PluginError" not in err, err  # neither the whole one, nor the engine's
    assert not (space.root / "out.jsonl").exists()

    code, err = scored(space, "whole.jsonl", "--traceback")
    assert code == EXIT_VERIFICATION, err
    lines = err.splitlines()
    assert said in lines, err
    whole = lines[lines.index("  the whole traceback of what it raised:") + 1 :]
    assert whole[0] == "    Traceback (most recent call last):", err
    assert any(RUNNER[executor] in line for line in whole), err  # the engine's frames too
    for path, line, function, source in frames:
        assert f'      File "{path}", line {line}, in {function}' in whole and f"        {source}" in whole, err
    assert "    ValueError: not a number: 'x'" in whole, err
    assert "in the plugin's own code" not in err and "PluginError" not in err, err


# --- engine check and engine bench ----------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_check_shows_where_an_example_failed(tmp_path: Path, executor: str) -> None:
    space = make_workspace(tmp_path)
    name = helper_env(space.envs, executor, example={"task": {}, "trajectory": BAD})
    frames = expected_frames(space.envs / name, executor)
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = f"{name}: in the plugin's own code, innermost last (--traceback prints the whole traceback):"
    assert header in lines, result.stdout
    start = lines.index(header) + 1
    path, line, function, source = frames[-1]
    assert lines[start + 4 : start + 6] == [f'    File "{path}", line {line}, in {function}', f"      {source}"]
    assert "Traceback" not in result.stdout + result.stderr

    result = space.run("check", "--config", space.config, "--traceback")
    assert result.returncode == EXIT_VERIFICATION
    assert f"{name}: the whole traceback of what it raised:\n    Traceback (most recent call last):" in result.stdout
    assert RUNNER[executor] in result.stdout and f'File "{path}", line {line}, in {function}' in result.stdout


def test_check_shows_where_an_import_failed(tmp_path: Path) -> None:
    space = make_workspace(tmp_path)
    name = helper_env(space.envs, "thread", broken=True)
    result = space.run("check", "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION
    raised = line_of(BROKEN, "raise RuntimeError")
    assert f'    File "{space.envs / name / "broken.py"}", line {raised}, in <module>' in result.stdout.splitlines()


def test_bench_shows_the_plugins_frames_and_traceback_the_whole(tmp_path: Path) -> None:
    space = make_workspace(tmp_path)
    name = helper_env(space.envs, "thread")
    rows_in = write_rows(space.root / "in.jsonl", [{"id": "bad", "environment": name, "task": {}, "trajectory": BAD}])
    path, line, function, source = expected_frames(space.envs / name, "thread")[-1]
    result = space.run("bench", rows_in, "--config", space.config)
    assert result.returncode == EXIT_VERIFICATION
    assert f'    File "{path}", line {line}, in {function}\n      {source}' in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    result = space.run("bench", rows_in, "--config", space.config, "--traceback")
    assert result.returncode == EXIT_VERIFICATION
    assert "the whole traceback of what it raised:\n    Traceback (most recent call last):" in result.stderr
