"""Importing the engine changes nothing in its host process: no descriptor opened, no import hook, no
signal handler, no collector setting (a trainer imports it into a process it owns)."""

from __future__ import annotations

import subprocess
import sys

import orjson
from cli_support import child_env

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
import engine._verifiers.plugin.pool, engine._verifiers.plugin.importer, engine._http.transport, engine.cli
after = state()
sys.stdout.write(orjson.dumps([before, after]).decode())
"""


def test_importing_the_engine_changes_nothing_in_its_process() -> None:
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, after = orjson.loads(done.stdout)
    assert after == before
