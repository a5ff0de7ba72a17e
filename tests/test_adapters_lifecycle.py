"""The adapters' engines: one per process for the synchronous ones, one per event loop for the async ones,
opened lazily and closed at exit (or when their loop shuts down) without the script doing anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from adapter_support import LoopThread
from cli_support import child_env
from conftest import add_endpoint_env, add_env, process_twin
from polling import wait_until
from servers import Server

from engine.adapters import close_engines
from engine.adapters.trl import AsyncEngineReward, EngineReward

SCRIPT = """
import asyncio, os, sys, threading, warnings
from engine.adapters.trl import AsyncEngineReward, EngineReward

config = sys.argv[1]
sync = EngineReward(config, environment="twin_a")
print(sync(prompts=["p"], completions=["c"]))
loop = asyncio.new_event_loop()  # TRL's: a loop for ever in a daemon thread, never closed
threading.Thread(target=loop.run_forever, daemon=True).start()
asynchronous = AsyncEngineReward(config, environment="twin_b")
print(asyncio.run_coroutine_threadsafe(asynchronous(prompts=["p"], completions=["c"]), loop).result(60))
warnings.simplefilter("ignore", DeprecationWarning)  # fork() in a process with threads: the child uses none of them
child = os.fork()
if child == 0:  # a forked worker opens its own engine: its parent's loop thread is not here
    os._exit(0 if sync(prompts=["p"], completions=["c"]) == [0.25] else 1)
_, status = os.waitpid(child, 0)
print("child", os.waitstatus_to_exitcode(status))
# no close: the adapters close their engines at exit, before the interpreter waits for threads
"""



def test_a_script_exits_by_itself_with_its_engines_closed(engine_toml: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), str(engine_toml)]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0.25]", "[0.75]", "child 0"]
    assert done.stderr == ""


FAREWELL = """
import atexit, os

def _closed() -> None:  # runs when the worker's interpreter ends by itself: its engine closed its pipe
    with open({marker!r}, "a") as out:
        out.write(f"{{os.getpid()}}\\n")

atexit.register(_closed)

def score(task, trajectory):
    with open({scored!r}, "a") as out:
        out.write(f"{{os.getpid()}}\\n")
    return 0.5
"""

CLOSING = """
import asyncio, sys, threading
from engine.adapters.trl import AsyncEngineReward, EngineReward

config = sys.argv[1]
sync = EngineReward(config, environment="farewell_process")  # on the adapters' own loop
print(sync(prompts=["p"], completions=["c"]))
loop = asyncio.new_event_loop()  # TRL's: a loop for ever in a daemon thread, never closed
threading.Thread(target=loop.run_forever, daemon=True).start()
reward = AsyncEngineReward(config, environment="farewell_process")
print(asyncio.run_coroutine_threadsafe(reward(prompts=["p"], completions=["c"]), loop).result(60))
# no close: at exit the adapters close both engines, and each closes its plugin's worker process
"""


def test_at_exit_the_engines_close_their_worker_processes(envs: Path, engine_toml: Path, tmp_path: Path) -> None:
    """Closed, not killed: each worker's own exit hook runs, which a worker killed by the plugin pool's
    exit hook, or by its watchdog once the script is gone, never runs. A loop in a thread the
    interpreter joins before its exit hooks would hang the exit instead."""
    marker, scored = tmp_path / "closed.txt", tmp_path / "scored.txt"
    add_env(envs, "farewell", "plugin", "verify:score")
    (envs / "farewell" / "verify.py").write_text(FAREWELL.format(marker=str(marker), scored=str(scored)))
    process_twin(envs, "farewell")  # farewell_process, which the script uses
    script = tmp_path / "train.py"
    script.write_text(CLOSING)
    command = [sys.executable, str(script), str(engine_toml)]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0.5]", "[0.5]"]
    assert done.stderr == ""
    workers = set(scored.read_text().split())
    assert len(workers) >= 2  # one per engine: the adapters' loop's and the trainer loop's
    assert marker.is_file(), "no worker was closed: they were killed"
    assert set(marker.read_text().split()) == workers


def test_each_event_loop_gets_its_own_engine(engine_toml: Path) -> None:
    reward = AsyncEngineReward(engine_toml, environment="twin_a")
    loops = [LoopThread(), LoopThread()]
    try:
        for _ in range(2):  # an engine used from a loop it is not bound to would fail here
            for looping in loops:
                assert looping.call(reward(prompts=["p", "q"], completions=["c", "d"])) == [0.25, 0.25]
    finally:
        for looping in loops:
            looping.shut()


def test_a_loops_engine_is_closed_when_the_loop_shuts_down_and_the_sync_one_by_close_engines(
    envs: Path, engine_toml: Path
) -> None:
    with Server.json(lambda request: {"reward": 0.5}) as server:
        add_endpoint_env(envs, "remote", server.url + "/score")
        looping = LoopThread()
        reward = AsyncEngineReward(engine_toml, environment="remote")
        assert looping.call(reward(prompts=["p"], completions=["c"])) == [0.5]
        assert server.open_connections == 1  # kept alive by the loop's engine
        looping.shut()  # as asyncio.run ends: its async generators are closed, the engine with them
        wait_until(lambda: server.open_connections == 0)
        sync = EngineReward(engine_toml, environment="remote")
        assert sync(prompts=["p"], completions=["c"]) == [0.5]
        assert sync(prompts=["p"], completions=["c"]) == [0.5]  # one engine, kept
        assert server.opened == 2
        close_engines()
        wait_until(lambda: server.open_connections == 0)
        assert sync(prompts=["p"], completions=["c"]) == [0.5]  # a new engine after close_engines()


def test_close_engines_is_refused_on_a_loop_whose_engines_it_would_close(engine_toml: Path) -> None:
    import asyncio

    async def inside() -> None:
        await AsyncEngineReward(engine_toml, environment="twin_a")(prompts=["p"], completions=["c"])
        with pytest.raises(RuntimeError, match="synchronous code"):
            close_engines()

    asyncio.run(inside())


def test_a_loop_that_has_shut_down_is_not_kept(engine_toml: Path) -> None:
    import asyncio
    import gc
    import weakref

    from engine.adapters.verl import compute_score

    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def step() -> float:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        return await compute_score("twin_a", "x", None, config=str(engine_toml))

    for _ in range(3):  # a trainer that runs asyncio.run per step: an engine per step, each closed and let go
        assert asyncio.run(step()) == 0.25

    def collected() -> bool:  # a worker thread of the closed loop's may still be on its way out: it holds the loop
        gc.collect()
        return [ref() for ref in loops] == [None, None, None]

    wait_until(collected, message="a loop that has shut down is still kept")
