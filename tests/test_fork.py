"""A process forked while an engine is open: the child leaves the parent's engine and workers alone.

``os.fork()`` copies the whole process but only the thread that called it. The child has the parent's
engine objects without their threads (a blocking engine's event loop), and the parent's worker
processes, which are not its children. What a child must not do: kill those workers as it exits (the
parent's batch in flight would fail on an innocent item), or wait for ever on a loop that is not there.
Using a parent's engine in a child raises at once, naming both processes.

Every child here ends by ``os._exit`` and never returns into pytest: a child forked inside pytest
that raised ``SystemExit`` would go on running the rest of the session. Every wait is bounded, and a
child that has not answered in time is killed (and the test fails).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from cli_support import child_env
from conftest import item
from polling import wait_until
from servers import Request, Response, Server
from test_remote_trust import answer as well_formed

from engine import BlockingEngine, Engine, EngineConfig
from engine._verifiers.plugin import launcher

CHILD_TIMEOUT = 20.0  # seconds a forked child has to answer and end; then it is killed and the test fails

# A plugin that holds its call until the file "go" appears in the task's directory (20 s at most, then a
# wrong reward): a batch stays in flight for as long as a test needs. It says it started with a file.
GATE = """\
import os
import time


def score(task, trajectory):
    here = task["dir"]
    open(os.path.join(here, f"started-{task['n']}"), "w").close()
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(here, "go")):
        if time.monotonic() > deadline:
            return -1.0
        time.sleep(0.01)
    return task["n"] / 10
"""


def gate_env(envs: Path, name: str = "gate", workers: int = 1) -> str:
    """Environment ``name``: the ``GATE`` plugin, in ``workers`` worker processes."""
    directory = envs / name
    directory.mkdir()
    (directory / "gate.py").write_text(GATE)
    verifier = {"kind": "plugin", "ref": "gate:score", "executor": "process", "workers": workers}
    (directory / "manifest.json").write_bytes(orjson.dumps({"kind": "environment", "verifier": verifier}))
    return name


def alive(pid: int) -> bool:
    """Whether process ``pid`` (a worker: a child of this process) is running: not gone, nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped
        return False


def fork(child: Callable[[], None]) -> int:
    """Fork; the child runs ``child`` and ends (code 0 if it returned, 1 if it raised), never returning here."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            child()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def reap(pid: int, timeout: float = CHILD_TIMEOUT) -> int:
    """The exit code of the forked child ``pid``, once it has ended; killed and failed if it takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child (pid {pid}) did not end within {timeout:g} s: killed")


@contextlib.contextmanager
def answer_pipe() -> Iterator[tuple[int, Callable[[int], str]]]:
    """A pipe: the child writes its answer to the first (a descriptor), the parent reads it with the second."""
    read_end, write_end = os.pipe()
    open_ends = [read_end, write_end]

    def read(pid: int) -> str:
        os.close(write_end)  # the parent's copy: the child's end alone is left, closed as it ends
        open_ends.remove(write_end)
        chunks: list[bytes] = []
        deadline = time.monotonic() + CHILD_TIMEOUT
        while (remaining := deadline - time.monotonic()) > 0:
            if select.select([read_end], [], [], remaining)[0]:
                chunk = os.read(read_end, 65536)
                if not chunk:  # the child closed it: its answer is complete
                    reap(pid)
                    return b"".join(chunks).decode()
                chunks.append(chunk)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"the forked child (pid {pid}) did not answer within {CHILD_TIMEOUT:g} s: killed")

    try:
        yield write_end, read
    finally:
        for fd in open_ends:
            os.close(fd)


def said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- a child that exits leaves the parent's workers alone ---


def test_a_child_that_exits_leaves_the_parents_workers_alone(envs: Path, tmp_path: Path) -> None:
    name = gate_env(envs)
    gate = tmp_path / "gate"
    gate.mkdir()
    config = EngineConfig(environments=envs, allow_unpinned=True)
    forked: dict[str, Any] = {}

    def fork_mid_batch() -> None:
        """A thread of the parent: once the batch is in flight, fork a child that exits; then let the batch end."""
        try:
            wait_until(lambda: any(gate.glob("started-*")), message="the batch never started")
            forked["pids"] = eng._engine._verifier(name).worker_pids

            def exit_normally() -> None:
                # What the interpreter runs as a child's normal exit (``sys.exit`` in a child forked from
                # the main thread): its exit hooks. A child forked from another thread runs none of them
                # when that thread ends (its interpreter ends with it), so this one runs them itself.
                atexit._run_exitfuncs()

            forked["code"] = reap(fork(exit_normally))
            forked["after"] = [alive(pid) for pid in forked["pids"]]
        finally:
            (gate / "go").touch()

    with BlockingEngine(config) as eng:
        forker = threading.Thread(target=fork_mid_batch, name="test-forker")
        forker.start()
        try:
            rewards = eng.score([item(name, dir=str(gate), n=n) for n in (3, 0, 7)])
        finally:
            (gate / "go").touch()
            forker.join(CHILD_TIMEOUT)
        assert forked["code"] == 0
        assert len(forked["pids"]) == 1
        assert forked["after"] == [True]  # right after the child's exit
        assert rewards == [0.3, 0.0, 0.7]
        assert eng._engine._verifier(name).worker_pids == forked["pids"]  # the same worker, never replaced
        assert all(alive(pid) for pid in forked["pids"])


# A script of its own, for a child that exits the way a program does: ``sys.exit`` from the main thread,
# out of the ``with`` block, through the exit hooks and the interpreter's end.
SCRIPT = """\
import json, os, sys, threading, time
from engine import BlockingEngine, EngineConfig

envs, gate, name = sys.argv[1:4]
out = {}
with BlockingEngine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
    items = [{"environment": name, "task": {"dir": gate, "n": n}, "trajectory": ""} for n in (3, 0, 7)]
    batch = threading.Thread(target=lambda: out.update(rewards=eng.score(items)))
    batch.start()
    deadline = time.monotonic() + 10
    while not any(f.startswith("started-") for f in os.listdir(gate)) and time.monotonic() < deadline:
        time.sleep(0.01)
    pids = eng._engine._verifier(name).worker_pids
    child = os.fork()
    if child == 0:
        sys.exit(0)  # the child: out of the with block, its exit hooks, the interpreter's end
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            out["child"] = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.01)
    else:
        os.kill(child, 9)
        out["child"] = "did not end within 10 s"
    open(os.path.join(gate, "go"), "w").close()
    batch.join(20)
    out["pids"] = pids
    out["same"] = eng._engine._verifier(name).worker_pids == pids
print(json.dumps(out))
"""


def test_a_child_that_exits_as_a_program_does_leaves_the_parents_workers_alone(envs: Path, tmp_path: Path) -> None:
    name = gate_env(envs)
    gate = tmp_path / "gate"
    gate.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(envs), str(gate), name],
        capture_output=True,
        text=True,
        timeout=25,
        env=child_env(None),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = orjson.loads(done.stdout.splitlines()[-1])
    assert out["child"] == 0, done.stderr
    assert out["rewards"] == [0.3, 0.0, 0.7], done.stderr
    assert len(out["pids"]) == 1 and out["same"], done.stderr


def test_a_child_does_not_keep_the_parents_workers_watching_it(envs: Path) -> None:
    """The pipe whose end-of-file tells a worker that its engine's process died: a child holds no copy of its
    write end (a parent killed while its child lives would otherwise leave its workers running), and the
    workers the child starts watch a pipe of the child's own."""
    name = gate_env(envs)
    config = EngineConfig(environments=envs, allow_unpinned=True)
    with BlockingEngine(config) as eng:
        eng.load(name)
        read_end = launcher.alive_fd()
        assert launcher._alive_pipe is not None
        write_end = launcher._alive_pipe[1]
        pipe = os.fstat(read_end).st_ino

        def check() -> None:
            assert launcher._alive_pipe is None
            for fd in (read_end, write_end):
                with pytest.raises(OSError):
                    os.fstat(fd)
            assert os.fstat(launcher.alive_fd()).st_ino != pipe  # a pipe of its own

        assert reap(fork(check)) == 0
        os.fstat(write_end)  # the parent's own copies are untouched
        os.fstat(read_end)


# --- a child that uses its parent's engine is told, at once ---


async def reward_of_every_item(request: Request) -> Response:
    return Response.json(well_formed([0.5] * len(request.json()["items"])))


@pytest.mark.parametrize("face", ["in_process", "client"])
def test_a_blocking_engine_used_in_a_forked_child_raises(config: EngineConfig, face: str) -> None:
    items = [item("twin_a")]
    service = contextlib.ExitStack()
    if face == "in_process":
        eng: Any = BlockingEngine(config)
        expected = [0.25]
    else:  # BlockingEngine.connect: the client of a service (a real server here), which shares the blocking face
        server = service.enter_context(Server(reward_of_every_item))
        eng = BlockingEngine.connect(server.url)
        expected = [0.5]
    with service, eng:
        assert eng.score(items) == expected
        with answer_pipe() as (write_end, read):

            def use_it() -> None:
                try:
                    eng.score(items)
                except BaseException as exc:
                    os.write(write_end, said(exc).encode())
                else:
                    os.write(write_end, b"no error")
                os.close(write_end)

            answer = read(fork(use_it))
        assert answer.startswith("RuntimeError: this engine belongs to another process"), answer
        assert f"opened in pid {os.getpid()}" in answer, answer
        assert "open one in this process" in answer, answer
        assert eng.score(items) == expected  # the parent's is as it was


def test_a_blocking_engine_left_open_by_a_child_leaves_the_parents_alone(config: EngineConfig) -> None:
    """A child that leaves the ``with`` block of its parent's engine (as an exception, or its end, takes it out)
    ends at once, and the parent's engine is as it was."""
    with BlockingEngine(config) as eng:
        assert eng.score([item("twin_a")]) == [0.25]

        def leave() -> None:
            eng.__exit__(None, None, None)
            eng.__exit__(None, None, None)  # closed in the child: nothing more to do

        assert reap(fork(leave)) == 0
        assert eng.score([item("twin_a")]) == [0.25]


async def test_an_engine_used_in_a_forked_child_raises(envs: Path, tmp_path: Path) -> None:
    """The async engine: a child that runs the parent's open engine on a loop of its own is refused at once,
    and closing it there closes nothing of the parent's (its worker processes, their pipes)."""
    name = gate_env(envs)
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "go").touch()
    items = [item(name, dir=str(gate), n=4)]
    config = EngineConfig(environments=envs, allow_unpinned=True)
    async with Engine(config) as eng:
        assert await eng.score(items) == [0.4]
        pids = eng._verifier(name).worker_pids
        assert len(pids) == 1

        def fork_and_ask() -> str:
            with answer_pipe() as (write_end, read):

                def use_it() -> None:
                    answers = []
                    for call in (lambda: eng.run(items), lambda: eng.load(name)):
                        try:
                            anyio.run(call)
                        except BaseException as exc:
                            answers.append(said(exc))
                        else:
                            answers.append("no error")
                    anyio.run(eng.__aexit__, None, None, None)
                    answers.append("closed")
                    os.write(write_end, orjson.dumps(answers))
                    os.close(write_end)

                return read(fork(use_it))

        answers = orjson.loads(await anyio.to_thread.run_sync(fork_and_ask))
        for answer in answers[:2]:
            assert answer.startswith("RuntimeError: this engine belongs to another process"), answers
            assert f"opened in pid {os.getpid()}" in answer, answers
        assert answers[2] == "closed"
        assert all(alive(pid) for pid in pids)
        assert await eng.score(items) == [0.4]
        assert eng._verifier(name).worker_pids == pids
