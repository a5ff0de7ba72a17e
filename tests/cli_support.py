"""Helpers of the command-line tests (test_cli.py, test_backfill.py): workspaces, inputs, and running ``engine``.

The CLI runs in a workspace under ``tmp_path`` holding ``engine.toml``, an ``envs/`` directory
with copies of real environments from ``tests/envs/``, and the input files. It runs in-process
through click's ``CliRunner`` (:meth:`Workspace.run`, :meth:`Workspace.score`): the command is a
thin layer over keyword-only functions, and a test whose subject is not the process gains nothing
from paying for a new interpreter. Where the process is the point (kill -9, signals, a file size
limit, the exit status of the ``engine`` command itself, a tracer that kills at a step), it runs
as a user runs it, ``python -m engine ...`` in a subprocess (:meth:`Workspace.start`,
:func:`engine_command`); a traced run killed at each of many steps runs in a process forked from
this one (:func:`fork_under_trace`), which has imported the engine already. The ``backfill``
environment's plugin is also loaded here, directly from its file, so a test can compare the
rewards the CLI wrote with what the plugin computes.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner
from polling import wait_until

from engine import RewardRecord, read_rewards
from engine._backfill.checkpoint import state_path
from engine._backfill.writer import partial_path
from engine.cli import cli

ROOT = Path(__file__).resolve().parent.parent
ENVS = Path(__file__).resolve().parent / "envs"
RUBRICS = Path(__file__).resolve().parent / "rubrics"
PLUGIN_ENV = "backfill"  # tests/envs/backfill: the deterministic plugin these tests score with
RUN_TIMEOUT = 30.0  # seconds for one engine command
KNOBS = ("ENGINE_TEST_CALL_LOG", "ENGINE_TEST_SLEEP", "ENGINE_TEST_FIXED", "ENGINE_TEST_HOLD", "FINISH_STOP")

_packages = itertools.count()


def copy_env(name: str, envs: Path, *, source: Path = ENVS) -> Path:
    """Copy environment ``name`` from ``source`` into ``envs``; returns the copy."""
    target = envs / name
    shutil.copytree(source / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


@dataclass(frozen=True)
class Ran:
    """How an ``engine`` command run in-process ended: its exit status and what it printed (as a process would)."""

    returncode: int
    stdout: str
    stderr: str


def invoke(*args: str | Path, cwd: Path, env: Mapping[str, str] | None = None) -> Ran:
    """``engine ARGS`` in this process (click's ``CliRunner``), in ``cwd``, with ``env`` set and no stray test knobs.

    An exception that escapes the command fails the test (it is not turned into an exit status).
    """
    unset: dict[str, str | None] = {key: None for key in KNOBS}
    with contextlib.chdir(cwd):
        result = CliRunner().invoke(
            cli, [str(a) for a in args], prog_name="engine", env={**unset, **(env or {})}, catch_exceptions=False
        )
    return Ran(result.exit_code, result.stdout, result.stderr)


@dataclass
class Workspace:
    """A directory to run ``engine`` in: its config, its environments, and the files of one test."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "engine.toml"

    @property
    def envs(self) -> Path:
        return self.root / "envs"

    def write_config(self, text: str = "") -> Path:
        """``engine.toml`` with unpinned plugins allowed, plus ``text`` (more keys and tables)."""
        self.config.write_text('environments = "envs"\nallow_unpinned = true\n' + text)
        return self.config

    def run(self, *args: str | Path, env: Mapping[str, str] | None = None) -> Ran:
        """``engine ARGS`` in-process, with this workspace as the working directory (see :func:`invoke`)."""
        return invoke(*args, cwd=self.root, env=env)

    def start(self, *args: str | Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
        """``engine ARGS`` started in the background, its output captured."""
        return subprocess.Popen(
            engine_command(*args),
            cwd=self.root,
            env=child_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def score(self, input_path: Path, output: Path, *extra: str, env: Mapping[str, str] | None = None) -> Ran:
        """``engine score INPUT -o OUTPUT --config engine.toml EXTRA``."""
        return self.run("score", input_path, "-o", output, "--config", self.config, *extra, env=env)


def make_workspace(root: Path, *plugin_envs: str, config: str = "") -> Workspace:
    """A workspace at ``root`` with copies of ``plugin_envs`` from tests/envs and a config."""
    space = Workspace(root)
    space.envs.mkdir(parents=True)
    for name in plugin_envs:
        copy_env(name, space.envs)
    space.write_config(config)
    return space


def engine_command(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "engine", *map(str, args)]


def child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    """The environment of an ``engine`` process: this one's, without stray test knobs, plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if key not in KNOBS}
    env["PYTHONPATH"] = str(ROOT)  # the engine of this checkout, whatever is installed
    env["PYTHONIOENCODING"] = "utf-8"  # rich draws its tables with box characters
    env.update(extra or {})
    return env


def row(n: int, environment: str = PLUGIN_ENV, **task: Any) -> dict[str, Any]:
    """Input row number ``n`` (from 0): id ``row-NNNN``, the task ``{"n": n, **task}``."""
    return {"id": f"row-{n:04d}", "environment": environment, "task": {"n": n, **task}, "trajectory": f"answer {n}"}


# verl's own Parquet columns (its examples/data_preprocess/gsm8k.py), plus the rollout's ``response``, read by the
# ``verl_gsm8k`` environment through this mapping (its ids: extra_info.index)
VERL_COLUMNS = ("environment=data_source,task.prompt=prompt,task.reference=reward_model.ground_truth,"
                "id=extra_info.index,trajectory=response")


def verl_rows(count: int, first: int = 0) -> list[dict[str, Any]]:
    """``count`` rows shaped as verl writes them; row ``n``'s response is right (reward 1.0) unless ``n % 3 == 0``."""
    made = []
    for n in range(first, first + count):
        answer = str(7 * n)
        question = f"What is 7 times {n}?"
        made.append({
            "data_source": "verl_gsm8k",
            "prompt": [{"role": "user", "content": f'{question} Output the final answer after "####".'}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "test", "index": 1000 + n, "answer": f"7 * {n} = {answer}\n#### {answer}",
                           "question": question},
            "response": f"7 times {n} is {answer}.\n#### {answer if n % 3 else answer + '1'}",
        })
    return made


def verl_reward(n: int) -> float:
    """The reward of :func:`verl_rows`' row ``n``."""
    return 1.0 if n % 3 else 0.0


def rows(count: int, *, environment: str = PLUGIN_ENV, poison: Iterable[int] = ()) -> list[dict[str, Any]]:
    """``count`` rows of ``environment``; for the ``backfill`` plugin, those in ``poison`` fail until it is fixed."""
    bad = set(poison)
    return [row(n, environment, poison=True) if n in bad else row(n, environment) for n in range(count)]


def write_rows(path: Path, items: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``items`` as JSON Lines or, for ``.parquet``, as Parquet with ``task`` stored as JSON text."""
    if path.suffix == ".parquet":
        table = pa.table(
            {
                "id": [item["id"] for item in items],
                "environment": [item["environment"] for item in items],
                "task": [orjson.dumps(item["task"]).decode() for item in items],
                "trajectory": [item["trajectory"] for item in items],
            }
        )
        pq.write_table(table, path)
    else:
        path.write_bytes(b"".join(orjson.dumps(item) + b"\n" for item in items))
    return path


def records(path: Path) -> list[RewardRecord]:
    return list(read_rewards(path))


def partial_records(output: Path) -> list[dict[str, Any]]:
    """The records of an unfinished run (its partial file is JSON Lines whatever the output's format)."""
    return [orjson.loads(line) for line in partial_path(output).read_bytes().splitlines()]


def state_of(output: Path) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(state_path(output).read_bytes())
    return data


def read_log(path: Path) -> list[int]:
    """The task numbers a ``backfill`` plugin call log holds, in call order."""
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def load_plugin(environment: Path, module: str, attr: str) -> Callable[..., Any]:
    """``module:attr`` of an environment directory, imported as a private package (relative imports work)."""
    package = f"_cli_test_{environment.name}_{next(_packages)}"
    pkg = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(package, None, is_package=True))
    pkg.__path__ = [str(environment)]
    sys.modules[package] = pkg
    target: Any = importlib.import_module(f"{package}.{module}")
    for part in attr.split("."):
        target = getattr(target, part)
    fn: Callable[..., Any] = target
    return fn


def plugin_score() -> Callable[..., Any]:
    """The ``backfill`` plugin's callable, to compute the rewards a run must have written."""
    return load_plugin(ENVS / PLUGIN_ENV, "verify", "score")


# --- a crash at each step of finishing ---------------------------------------------------------

FINISH_TRACE = """
# Test harness (never part of the engine): from the moment a run calls RewardWriter.finish(), every
# file-system call that moves, removes or syncs a file is a step. With FINISH_STOP=k the process says
# "paused before <step k>" on stderr and waits there to be killed with SIGKILL; at exit it lists
# the steps it took ("steps: a | b | ..."). The engine's code runs unchanged: the calls are only counted.
import atexit
import os
import sys
import tempfile
import time

import engine._backfill.writer

_STOP = int(os.environ.get("FINISH_STOP", "0"))
_SCRATCH = tempfile.gettempdir()
_steps = []
_finishing = False


def _name(value):
    if isinstance(value, int):
        value = os.readlink(f"/proc/self/fd/{value}")
    if os.path.isdir(value):
        return "<directory>"
    folder, name = os.path.split(os.path.abspath(os.fspath(value)))
    if folder == _SCRATCH or os.path.basename(folder).startswith("engine-ids-"):
        return "<scratch>"  # temporary files, randomly named
    return name


def _traced(name, call):
    def traced(*args, **kwargs):
        if _finishing:
            paths = args[:2] if name in ("replace", "rename") else args[:1]
            _steps.append(f"{name} " + " -> ".join(_name(path) for path in paths))
            if len(_steps) == _STOP:
                print(f"paused before {_steps[-1]}", file=sys.stderr, flush=True)
                time.sleep(600)
        return call(*args, **kwargs)
    return traced


for _call in ("replace", "rename", "unlink", "rmdir", "fsync", "ftruncate"):
    setattr(os, _call, _traced(_call, getattr(os, _call)))

_finish = engine._backfill.writer.RewardWriter.finish


def _finish_traced(self):
    global _finishing
    _finishing = True
    return _finish(self)


engine._backfill.writer.RewardWriter.finish = _finish_traced


def _report_steps():
    print("steps: " + " | ".join(_steps), file=sys.stderr, flush=True)


atexit.register(_report_steps)
"""

ENGINE_UNDER_TRACE = """
sys.argv[0] = "engine"
from engine.cli import main

main()
"""


@contextlib.contextmanager
def reaped(process: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``process``, killed and waited for on leaving if it still runs (a test that failed half-way)."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=RUN_TIMEOUT)


def start_under_trace(
    script: Path, program: str, args: list[str], stop: int, *, cwd: Path | None = None
) -> subprocess.Popen[str]:
    """Run ``program`` (Python source) under the finishing tracer, pausing before finishing step ``stop`` (0: never).

    The source is written to ``script`` after :data:`FINISH_TRACE`; its output is piped as text.
    """
    script.write_text(FINISH_TRACE + program)
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=child_env({"FINISH_STOP": str(stop)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@dataclass
class ForkedRun:
    """A traced run in a process forked from this one (:func:`fork_under_trace`): what a ``Popen`` gives, in files."""

    pid: int
    stdout_path: Path
    stderr_path: Path
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the forked run {self.pid} did not end within {timeout:g} s")
            time.sleep(0.005)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.returncode = -signal.SIGKILL

    def communicate(self, timeout: float = RUN_TIMEOUT) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout_path.read_text(), self.stderr_path.read_text()


def fork_under_trace(folder: Path, program: str, args: list[str], stop: int) -> ForkedRun:
    """Run ``program`` as :func:`start_under_trace` does, in a child forked from this process: no interpreter to start
    and no engine to import (seconds each on a loaded machine, for a test that kills a run at each of many steps).

    The child writes its output to files in ``folder`` (which must exist), runs nothing of this process's own
    (its exit hooks, its test framework's) and leaves by ``os._exit``.
    """
    stdout_path, stderr_path = folder / "stdout", folder / "stderr"
    script = str(folder / "traced.py")
    code = compile(FINISH_TRACE + program, script, "exec")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return ForkedRun(pid, stdout_path, stderr_path)
    status = 1
    try:  # the child: only this, and then os._exit whatever happens
        for fd, path in ((1, stdout_path), (2, stderr_path)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # noqa: SIM115
        for key in KNOBS:
            os.environ.pop(key, None)
        os.environ["FINISH_STOP"] = str(stop)
        sys.argv = [script, *args]
        namespace: dict[str, Any] = {"__name__": "__main__", "__file__": script}
        try:
            exec(code, namespace)
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        namespace["_report_steps"]()  # what the traced script's exit hook says
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def finish_steps(stderr: str) -> list[str]:
    """The steps of finishing a traced run took, from its stderr."""
    lines = [line for line in stderr.splitlines() if line.startswith("steps: ")]
    assert lines, stderr
    return lines[-1].removeprefix("steps: ").split(" | ")


def kill_forked_at_step(run: ForkedRun, step: int) -> str:
    """:func:`kill_at_step` for a run of :func:`fork_under_trace`."""

    def paused() -> str | None:
        lines = run.stderr_path.read_text().splitlines() if run.stderr_path.exists() else []
        line = next((line for line in lines if line.startswith("paused before ")), None)
        if line is None and run.poll() is not None:
            raise AssertionError(f"the run did not pause at step {step}: {lines[-20:]}")
        return line

    try:
        line = wait_until(paused, RUN_TIMEOUT, f"the run did not pause at step {step} within {RUN_TIMEOUT:g} s")
    finally:
        run.kill()
    assert run.returncode == -signal.SIGKILL
    return line.removeprefix("paused before ").strip()


def kill_at_step(process: subprocess.Popen[str], step: int) -> str:
    """Wait until a traced run pauses before finishing step ``step``, then kill -9 it; returns the step."""
    assert process.stderr is not None
    seen: list[str] = []
    for _ in range(10_000):  # progress lines come first; bounded in count, and readline ends at EOF
        line = process.stderr.readline()
        seen.append(line)
        if not line or line.startswith("paused before "):
            break
    try:
        assert seen and seen[-1].startswith("paused before "), f"the run did not pause at step {step}: {seen[-20:]}"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=RUN_TIMEOUT)
        if process.stdout is not None:
            process.stdout.close()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    return seen[-1].removeprefix("paused before ").strip()


def fraction_sum_reward(item: dict[str, Any]) -> float:
    """The math example's reward without math-verify: the sum asked for against the number the answer ends with."""
    a, b, c, d = map(int, re.findall(r"\d+", item["task"]["prompt"]))
    trajectory = item["trajectory"]
    text = trajectory if isinstance(trajectory, str) else trajectory[-1]["content"]
    said = re.findall(r"\d+(?:\.\d+)?", text.rpartition("the sum is ")[2])
    value = Fraction(said[0]) if len(said) == 1 else Fraction(int(said[0]), int(said[1]))
    return 1.0 if value == Fraction(a, b) + Fraction(c, d) else 0.0
