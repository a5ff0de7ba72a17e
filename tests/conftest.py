"""Shared fixtures: a private copy of the test environments, endpoint environments, a config, a sleep recorder.

Every test gets its own copy of ``tests/envs`` under ``tmp_path``, so a test may edit files (the pin
tests do) and every engine imports its plugins from a directory no other test touches. Plugins keep
state in module globals (``spy``); :func:`plugin_module` finds the module an engine imported from
that private copy.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio.lowlevel
import orjson
import pytest

import engine

ENVS = Path(__file__).parent / "envs"
# tests/trainers/ runs each trainer's released code, each in a venv of its own (`make trainers`, which sets
# ENGINE_TRAINER): the main venv has none of them
collect_ignore = [] if os.environ.get("ENGINE_TRAINER") else ["trainers"]
# Ray started by a test (here, or in a subprocess, which inherits this) listens on 127.0.0.1 only: it takes a
# 127.0.0.1 given as its node's address for the machine's own interface, unless told it is a one-machine cluster
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# A suite started in the background (nohup, a script's `&`) inherits SIGINT ignored, and so would every engine
# it starts: its Ctrl-C tests are a foreground user's, so the children start with the default (an ignored SIGINT
# stays ignored across exec; a handled one is reset). Two fresh clones run that way failed only those tests.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# seconds, per test, unless a test says otherwise: it catches a hang, and is sized so that a test of a few
# seconds' work still passes on a loaded 2-core machine (CI may run while the machine is busy)
TEST_TIMEOUT = 30.0


def spinner(iterations: int) -> str:
    """A plugin of pure Python, the GIL held throughout (CPU-bound, for the process-executor hint): ~50 ns an
    iteration."""
    return f"""\
def score(task, trajectory):
    total = 0
    for i in range({iterations:_}):
        total += i * i % 7
    return 1.0
"""


SPIN = spinner(20_000)  # ~1 ms a call


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test the per-test timeout; a test may set its own with ``@pytest.mark.timeout``."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


PROXY_VARIABLES = [f"{name}_proxy" for name in ("http", "https", "all", "no")]


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No proxy variable set, in either case, whatever the machine's environment says: every test server is
    on 127.0.0.1, which the engine would send through a proxy as httpx does. A test sets the ones it wants
    with the returned monkeypatch (subprocesses inherit the result)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.delenv("REQUEST_METHOD", raising=False)  # urllib ignores HTTP_PROXY under CGI
    return monkeypatch


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # the test plugins use asyncio directly (faulty_async, arith_async)
    return "asyncio"


@pytest.fixture
def envs(tmp_path: Path) -> Path:
    """A fresh copy of ``tests/envs``: the environments directory of this test's engines."""
    target = tmp_path / "envs"
    shutil.copytree(ENVS, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


@pytest.fixture
def config(envs: Path) -> engine.EngineConfig:
    return engine.EngineConfig(environments=envs, allow_unpinned=True)


def add_env(envs: Path, name: str, kind: str, ref: str, **extra: Any) -> str:
    """Create environment ``name`` whose verifier is ``kind`` ``ref``; returns ``name``.

    ``extra``: more top-level manifest keys.
    """
    directory = envs / name
    directory.mkdir(parents=True)
    manifest = {"kind": "environment", **extra, "verifier": {"kind": kind, "ref": ref}}
    (directory / "manifest.json").write_bytes(orjson.dumps(manifest))
    return name


def add_endpoint_env(envs: Path, name: str, url: str, **extra: Any) -> str:
    """Create environment ``name`` whose verifier is the endpoint at ``url``; returns ``name``."""
    return add_env(envs, name, "endpoint", url, **extra)


def add_rubric_env(envs: Path, name: str, ref: str) -> str:
    """Create environment ``name`` whose verifier is the rubric ``ref``; returns ``name``."""
    return add_env(envs, name, "rubric", ref)


def process_twin(envs: Path, name: str, twin: str | None = None, **verifier: Any) -> str:
    """Copy environment ``name`` to ``twin`` (``<name>_process``), its verifier run in worker processes.

    ``verifier`` is merged into the copy's manifest's verifier (``workers``, say).
    """
    twin = twin or f"{name}_process"
    shutil.copytree(envs / name, envs / twin)
    path = envs / twin / "manifest.json"
    manifest = orjson.loads(path.read_bytes())
    manifest["verifier"].update({"executor": "process", **verifier})
    path.write_bytes(orjson.dumps(manifest))
    return twin


def loaded_module(envs: Path, environment: str, filename: str) -> ModuleType | None:
    """The module an engine imported from ``envs/<environment>/<filename>``, if one did yet."""
    wanted = str(envs / environment / filename)
    found = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == wanted]
    assert len(found) <= 1, f"{wanted} was imported {len(found)} times"
    return found[0] if found else None


def plugin_module(envs: Path, environment: str, filename: str) -> ModuleType:
    """The module an engine imported from ``envs/<environment>/<filename>`` (it must have)."""
    module = loaded_module(envs, environment, filename)
    assert module is not None, f"nothing was imported from {envs / environment / filename}"
    return module


def item(environment: str, trajectory: Any = "", item_id: Any = None, **task: Any) -> dict[str, Any]:
    """A batch item; the keyword arguments are its task."""
    out: dict[str, Any] = {"environment": environment, "task": task, "trajectory": trajectory}
    if item_id is not None:
        out["id"] = item_id
    return out


class SleepRecorder:
    """An ``Engine(sleep=...)`` that records each wait and takes no time (it still yields once)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        await anyio.lowlevel.checkpoint()


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
def import_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The file the ``import_log`` environment appends a line to each time it is imported."""
    log = tmp_path / "imports.log"
    monkeypatch.setenv("ENGINE_TEST_IMPORT_LOG", str(log))
    yield log


def import_count(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def engine_toml(envs: Path) -> Iterator[Path]:
    """A config file over this test's environments, for the trainer adapters; the engines they opened (one
    per process or loop, kept across calls) are closed when the test ends."""
    from adapter_support import write_config

    from engine.adapters import close_engines

    yield write_config(envs)
    close_engines()


@pytest.fixture
def trainer_loop() -> Iterator[Any]:
    """An event loop running in a daemon thread, as TRL's is (``adapter_support.LoopThread``), shut at the end."""
    from adapter_support import LoopThread

    looping = LoopThread()
    yield looping
    looping.shut()
