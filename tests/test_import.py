"""Importing the engine changes nothing in its host process: no descriptor opened, no import hook, no
signal handler, no collector setting (a trainer imports it into a process it owns). And a plugin's
worker process imports only what it needs: every worker started or replaced pays for its imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
from cli_support import child_env
from conftest import add_env, item, process_twin

import engine

PROBE = """
import gc, os, signal, sys, threading
import orjson

def state():
    return {
        "fds": sorted(name for name in os.listdir("/proc/self/fd")),
        "meta_path": [repr(finder) for finder in sys.meta_path],
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)},
        "gc": [gc.isenabled(), *gc.get_threshold()],
        "switch": sys.getswitchinterval(),
        "threads": threading.active_count(),
    }

before = state()
import engine
for name in engine.__all__:  # every public name, and the modules behind them
    getattr(engine, name)
import engine._verifiers.plugin.verifier, engine._verifiers.plugin.importer, engine._verifiers.plugin.worker
import engine._verifiers.plugin.in_processes, engine._verifiers.plugin.in_threads, engine._http.transport, engine.cli
after = state()
sys.stdout.write(orjson.dumps([before, after]).decode())
"""


def test_importing_the_engine_changes_nothing_in_its_process() -> None:
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, after = orjson.loads(done.stdout)
    assert after == before


# What a worker does not use: the engine's third-party dependencies (and what they pull in), and the
# event loop (an async def plugin's worker imports asyncio when it loads the plugin, not before).
NOT_IN_A_WORKER = (
    "anyio",
    "httpx",
    "httpcore",
    "httptools",
    "orjson",
    "tenacity",
    "aiolimiter",
    "pyarrow",
    "rich",
    "click",
    "asyncio",
)
WORKER_PROBE = f"""
import sys
import engine._verifiers.plugin.worker
sys.stdout.write(repr([name for name in {NOT_IN_A_WORKER!r} if name in sys.modules]))
"""


def test_the_worker_module_imports_none_of_the_engines_dependencies() -> None:
    command = [sys.executable, "-c", WORKER_PROBE]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]"


LEAN_PLUGIN = f"""
import sys


def score(task, trajectory):
    loaded = [name for name in {NOT_IN_A_WORKER!r} if name in sys.modules]
    if loaded:
        raise RuntimeError(f"the worker process has imported {{loaded}}")
    return 1.0
"""


async def test_a_worker_process_has_none_of_them_when_it_calls_the_plugin(envs: Path) -> None:
    """The module a worker really runs, with its plugin imported: nothing it does not use."""
    add_env(envs, "lean", "plugin", "verify:score")
    (envs / "lean" / "verify.py").write_text(LEAN_PLUGIN)
    name = process_twin(envs, "lean", workers=1)
    async with engine.Engine(engine.EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        assert await eng.score([item(name), item(name)]) == [1.0, 1.0]
