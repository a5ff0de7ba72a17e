"""Plugin faults, in the engine's threads and in worker processes, driven through the public API.

Every fault must end as one ``VerificationError`` naming the plugin, the environment and the item,
with a reason a person can act on; never as a result list, a hung batch or a dead trainer. After
each one the same engine scores the next batch, and once the engine is closed nothing it started
is left: no thread, no child process, no pipe or socket (``no_leaks``).

The plugin is ``envs/faults`` (real files, copied per test); its ``_process`` twin is the same code
with ``"executor": "process"`` in its manifest.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from asserts import check_error
from conftest import item, process_twin
from polling import eventually, wait_until

from engine import (
    BlockingEngine,
    ConfigError,
    Engine,
    EngineConfig,
    Limits,
    ManifestError,
    VerificationError,
    digest_directory,
    load_config,
    load_environment,
)
from engine._verifiers.plugin.verifier import PluginVerifier
from engine._verifiers.plugin.worker_client import PluginError

from .conftest import Snapshot, child_pids, process_gone

pytestmark = pytest.mark.timeout(20)  # most tests start worker processes (~0.5 s each); slow ones say more

FAULT_ENVS = Path(__file__).parent / "envs"
THREAD, PROCESS = "faults", "faults_process"
REF = "faults:by_task"
# seconds per call in these tests: a worker's import counts against it, and takes more than half a second on a
# loaded machine (the calls that hang outlast it many times over)
TIMEOUT = 1.0
EXECUTORS = {"thread": THREAD, "process": PROCESS}


@pytest.fixture
def fault_envs(tmp_path: Path) -> Path:
    target = tmp_path / "envs"
    shutil.copytree(FAULT_ENVS, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    process_twin(target, THREAD, PROCESS, workers=2)
    process_twin(target, "math_verify", workers=1)
    return target


def config(envs: Path, timeout: float = TIMEOUT, **limits: Any) -> EngineConfig:
    return EngineConfig(environments=envs, allow_unpinned=True, defaults=Limits(timeout=timeout, **limits))


def fails(eng: BlockingEngine, items: list[dict[str, Any]]) -> VerificationError:
    """The ``VerificationError`` that scoring ``items`` raises: alone, and instead of any result list."""
    with pytest.raises(VerificationError) as info:
        eng.score(items)
    assert type(info.value) is VerificationError  # not wrapped in an ExceptionGroup
    return info.value


check = partial(check_error, ref=REF, kind="plugin")  # its reasons are regular expressions: match=


def ok(environment: str, count: int = 1) -> list[dict[str, Any]]:
    return [item(environment, mode="ok") for _ in range(count)]


def wait_for_file(path: Path, seconds: float = 10.0) -> str:
    wait_until(path.exists, seconds, message=f"{path} did not appear within {seconds:g} s")
    return path.read_text()


def wait_until_gone(pid: int, seconds: float = 5.0) -> None:
    wait_until(lambda: process_gone(pid), seconds, message=f"process {pid} still exists after {seconds:g} s")


def dead(pid: int) -> bool:
    """Whether ``pid`` has exited: reaped, or a zombie none of whose threads still runs.

    (A killed process's main thread shows "Z" while its other threads are still being torn down;
    only once they are gone can its parent see that it died.)
    """
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return state == "Z" and threads == [str(pid)]


def wait_until_dead(pid: int, seconds: float = 5.0) -> None:
    wait_until(lambda: dead(pid), seconds, message=f"process {pid} still runs after {seconds:g} s")


def plugin(eng: BlockingEngine | Engine, environment: str) -> PluginVerifier:
    inner = eng._engine if isinstance(eng, BlockingEngine) else eng
    verifier = inner._verifier(environment)
    assert isinstance(verifier, PluginVerifier)
    return verifier


# --- a call that fails: the same outcome in a thread and in a worker process ---

AT = r" \(at faults\.py:\d+, in by_task\)"  # where in the plugin's file it raised: its own frame, not the engine's
BAD_CALLS = [
    ("raise", re.escape("raised Boom: the plugin blew up") + AT),
    ("none", re.escape("returned None (NoneType), which is not a real number")),
    ("text", re.escape("returned 'high' (str), which is not a real number")),
    ("nan", re.escape("returned nan, which is not a finite number")),
    ("inf", re.escape("returned inf, which is not a finite number")),
    ("exit", re.escape("raised SystemExit: 3") + AT),
    ("base_exception", re.escape("raised FunctionTimedOut: too slow") + AT),  # escaped raw, and killed a BlockingEngine
    ("cancelled", re.escape("raised CancelledError: the plugin's own") + AT),
    ("float_exit", re.escape("returned 0.5 (ExitingFloat), whose float() raised SystemExit(3)")),  # ended the trainer
]


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize(("mode", "reason"), BAD_CALLS, ids=[mode for mode, _ in BAD_CALLS])
def test_a_bad_call_fails_its_item_and_the_engine_goes_on(
    fault_envs: Path, no_leaks: Snapshot, executor: str, mode: str, reason: str
) -> None:
    env = EXECUTORS[executor]
    with BlockingEngine(config(fault_envs)) as eng:
        err = fails(eng, [*ok(env, 2), item(env, item_id=f"bad-{mode}", mode=mode), *ok(env)])
        check(err, environment=env, index=2, item_id=f"bad-{mode}", match=reason)
        assert eng.score(ok(env, 3)) == [0.5] * 3


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_the_plugins_exception_is_the_cause(fault_envs: Path, no_leaks: Snapshot, executor: str) -> None:
    """In a thread the exception itself; from a worker, its type, message and traceback as text
    (the class ``Boom`` exists only in the worker: nothing needs to be picklable)."""
    env = EXECUTORS[executor]
    with BlockingEngine(config(fault_envs)) as eng:
        err = fails(eng, [item(env, mode="raise")])
    cause = err.__cause__
    if executor == "thread":
        assert type(cause).__name__ == "Boom"
        assert str(cause) == "the plugin blew up"
    else:
        assert isinstance(cause, PluginError)
        assert cause.type_name == "Boom"
        assert 'raise Boom("the plugin blew up")' in str(cause)  # the traceback shows the line
        assert str(cause).rstrip().endswith("Boom: the plugin blew up")


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_hanging_call_times_out(fault_envs: Path, tmp_path: Path, no_leaks: Snapshot, executor: str) -> None:
    env = EXECUTORS[executor]
    release, pidfile = tmp_path / "release", tmp_path / "pid"
    with BlockingEngine(config(fault_envs)) as eng:
        assert eng.score(ok(env, 2)) == [0.5] * 2  # both workers are up: the time below is the call's alone
        err = fails(eng, [*ok(env), item(env, item_id="h", mode="block", release=str(release), pidfile=str(pidfile))])
        check(err, environment=env, index=1, item_id="h", match=re.escape(f"timed out after {TIMEOUT:g} s"))
        pid = int(pidfile.read_text())
        if executor == "process":  # killed, and replaced for the next batch
            wait_until_gone(pid)
            assert pid not in eng.score([item(env, mode="pid") for _ in range(4)])
        else:  # a thread cannot be killed: it is abandoned, and ends when the test lets it
            assert pid == os.getpid()
            release.touch()
        assert eng.score(ok(env, 3)) == [0.5] * 3


# --- whatever a plugin's code raises is its item's failure: in a chunk, on the event loop, at import ---

CHUNK_FAULTS = [(mode, reason) for mode, reason in BAD_CALLS if mode in ("exit", "base_exception", "float_exit")]


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize(("mode", "reason"), CHUNK_FAULTS, ids=[mode for mode, _ in CHUNK_FAULTS])
def test_a_bad_call_inside_a_chunk_names_its_item(
    fault_envs: Path, no_leaks: Snapshot, executor: str, mode: str, reason: str
) -> None:
    """A reward whose ``__float__`` exits escaped a thread's chunk as an IndexError (one past the chunk),
    and killed a worker, which blamed the chunk's last item."""
    env = EXECUTORS[executor]
    with BlockingEngine(config(fault_envs)) as eng:
        assert eng.score(ok(env, 200)) == [0.5] * 200  # measures the plugin's cost: chunks form
        assert plugin(eng, env).chunk_size(300) > 1
        batch = ok(env, 300)
        batch[177] = item(env, item_id="bad", mode=mode)
        check(fails(eng, batch), environment=env, index=177, item_id="bad", match=reason)
        assert eng.score(ok(env, 300)) == [0.5] * 300


def test_a_worker_that_dies_reading_a_reward_names_its_item(fault_envs: Path, no_leaks: Snapshot) -> None:
    """A value's ``__float__`` runs after every call of the chunk: the worker says which value it was at
    (it blamed the chunk's last item). One call at a time: the 300 items go in one or two chunks."""
    with BlockingEngine(config(fault_envs, max_concurrency=1)) as eng:
        assert eng.score(ok(PROCESS, 200)) == [0.5] * 200
        assert plugin(eng, PROCESS).chunk_size(300) > 1
        batch = ok(PROCESS, 300)
        batch[177] = item(PROCESS, item_id="dies", mode="float_os_exit")
        err = fails(eng, batch)
        check(
            err,
            environment=PROCESS,
            index=177,
            item_id="dies",
            match=r"its worker process \(pid \d+\) died: it exited with code 7",
        )
        assert eng.score(ok(PROCESS, 300)) == [0.5] * 300


ASYNC_FAULTS = [(mode, reason) for mode, reason in BAD_CALLS if mode in ("exit", "base_exception", "cancelled")]
ASYNC_FAULTS.append(("float_exit", re.escape("returned 0.5 (ExitingFloat), whose float() raised SystemExit(3)")))


@pytest.mark.parametrize(("mode", "reason"), ASYNC_FAULTS, ids=[mode for mode, _ in ASYNC_FAULTS])
def test_an_async_plugins_fault_fails_its_item_on_the_event_loop(
    fault_envs: Path, no_leaks: Snapshot, mode: str, reason: str
) -> None:
    env = process_twin(fault_envs, THREAD, "async_thread", ref="faults:async_by_task", executor="thread")
    with BlockingEngine(config(fault_envs)) as eng:
        err = fails(eng, [*ok(env, 2), item(env, item_id="a", mode=mode)])
        check(err, environment=env, index=2, item_id="a", match=reason, ref="faults:async_by_task")
        assert eng.score(ok(env, 3)) == [0.5] * 3


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_an_import_that_raises_a_base_exception_fails_the_item(
    fault_envs: Path, no_leaks: Snapshot, executor: str
) -> None:
    """As pytest's ``Skipped`` does (``importorskip``): it escaped raw, and the ``BlockingEngine`` was dead."""
    env = process_twin(fault_envs, THREAD, "skips", executor=executor)
    (fault_envs / env / "faults.py").write_text(
        "class Skipped(BaseException):\n    pass\n\n\nraise Skipped('could not import sympy')\n"
    )
    with BlockingEngine(config(fault_envs)) as eng:
        for _ in range(2):  # and again: a failed import is tried again
            err = fails(eng, [*ok(THREAD), item(env, item_id="s")])
            said = "cannot load 'faults:by_task': Skipped: could not import sympy (at faults.py:5, in <module>)"
            reason = re.escape(said)
            check(err, environment=env, index=1, item_id="s", match=reason)
        assert eng.score(ok(THREAD, 2)) == [0.5] * 2


class TrainerOnly:
    """A class of the trainer's own script (``__main__``): a fresh worker process cannot unpickle it."""

    def __init__(self, level: int) -> None:
        self.level = level


@pytest.fixture
def trainer_only(monkeypatch: pytest.MonkeyPatch) -> type[TrainerOnly]:
    """:class:`TrainerOnly` as if defined in the trainer's ``__main__`` (it pickles here, by that name)."""
    monkeypatch.setattr(TrainerOnly, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "TrainerOnly", TrainerOnly, raising=False)
    return TrainerOnly


def test_an_item_a_worker_cannot_unpickle_is_named(
    fault_envs: Path, no_leaks: Snapshot, trainer_only: type[TrainerOnly]
) -> None:
    """The chunk does not unpickle in the worker; each item alone, unpickled one by one, says which it was
    (it was item 0 of the chunk). One call at a time: the 300 items go in one or two chunks."""
    reason = re.escape("the worker process cannot unpickle the item: AttributeError: ") + ".*'TrainerOnly'.*"
    with BlockingEngine(config(fault_envs, max_concurrency=1)) as eng:
        assert eng.score(ok(PROCESS, 200)) == [0.5] * 200
        assert plugin(eng, PROCESS).chunk_size(300) > 1
        batch = ok(PROCESS, 300)
        batch[177] = item(PROCESS, item_id="meta", mode="ok", meta=trainer_only(3))
        check(fails(eng, batch), environment=PROCESS, index=177, item_id="meta", match=reason)
        assert eng.score(ok(PROCESS, 300)) == [0.5] * 300


# --- faults only a worker process survives ---

CRASHES = [
    ("os_exit", "it exited with code 7"),
    ("segfault", "killed by signal SIGSEGV"),
]


@pytest.mark.parametrize(("mode", "how"), CRASHES, ids=[mode for mode, _ in CRASHES])
def test_a_worker_that_dies_fails_its_item_and_is_replaced(
    fault_envs: Path, tmp_path: Path, no_leaks: Snapshot, mode: str, how: str
) -> None:
    pidfile = tmp_path / "pid"
    with BlockingEngine(config(fault_envs)) as eng:
        err = fails(eng, [*ok(PROCESS, 3), item(PROCESS, item_id="crash", mode=mode, pidfile=str(pidfile))])
        pid = int(pidfile.read_text())
        check(
            err,
            environment=PROCESS,
            index=3,
            item_id="crash",
            match=re.escape(f"its worker process (pid {pid}) died: {how}"),
        )
        assert process_gone(pid)  # reaped, not a zombie
        assert eng.score(ok(PROCESS, 3)) == [0.5] * 3


def test_a_worker_killed_from_outside(fault_envs: Path, tmp_path: Path, no_leaks: Snapshot) -> None:
    """What the kernel's OOM killer does: SIGKILL, while the worker is busy with an item."""
    pidfile = tmp_path / "pid"
    killed: list[int] = []

    def kill_it() -> None:
        killed.append(int(wait_for_file(pidfile)))
        os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_it)
    killer.start()
    try:
        with BlockingEngine(config(fault_envs, timeout=10)) as eng:
            block = item(PROCESS, item_id="k", mode="block", release=str(tmp_path / "never"), pidfile=str(pidfile))
            err = fails(eng, [*ok(PROCESS), block, *ok(PROCESS)])
            killer.join()
            reason = f"its worker process (pid {killed[0]}) died: killed by signal SIGKILL (kill -9, or the kernel's "
            check(err, environment=PROCESS, index=1, item_id="k", match=re.escape(reason + "out-of-memory killer)"))
            assert eng.score(ok(PROCESS, 3)) == [0.5] * 3
    finally:
        killer.join()


def test_a_worker_killed_while_idle_is_replaced_without_failing_an_item(
    fault_envs: Path, no_leaks: Snapshot, caplog: pytest.LogCaptureFixture
) -> None:
    with BlockingEngine(config(fault_envs)) as eng:
        pids = {int(pid) for pid in eng.score([item(PROCESS, mode="pid") for _ in range(8)])}
        assert len(pids) == 2
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        wait_until_dead(victim)
        after = {int(pid) for pid in eng.score([item(PROCESS, mode="pid") for _ in range(8)])}
    assert victim not in after and len(after) == 2
    assert process_gone(victim)  # reaped
    assert f"worker process (pid {victim}) died while idle: killed by signal SIGKILL" in caplog.text


def test_an_abort_kills_the_worker_calls_in_flight(fault_envs: Path, tmp_path: Path, no_leaks: Snapshot) -> None:
    """A thread plugin fails while a worker is busy: the batch aborts, and the worker's call is killed."""
    pidfile = tmp_path / "pid"
    busy = item(PROCESS, mode="block", release=str(tmp_path / "never"), pidfile=str(pidfile))
    cue = item(THREAD, item_id="cue", mode="raise_when", when=str(pidfile))
    with BlockingEngine(config(fault_envs, timeout=10)) as eng:
        err = fails(eng, [busy, cue])
        check(err, environment=THREAD, index=1, item_id="cue", match=re.escape("raised Boom: cue pid seen") + AT)
        wait_until_gone(int(pidfile.read_text()))  # not left running for its 10 s
        assert eng.score(ok(PROCESS, 2)) == [0.5] * 2


async def test_closing_the_engine_mid_call_leaves_no_worker(fault_envs: Path, tmp_path: Path) -> None:
    snapshot = Snapshot.take()
    pidfile = tmp_path / "pid"
    busy = item(PROCESS, mode="block", release=str(tmp_path / "never"), pidfile=str(pidfile))
    async with Engine(config(fault_envs, timeout=10)) as eng, anyio.create_task_group() as tg:
        tg.start_soon(eng.score, [busy, *ok(PROCESS)])
        await eventually(pidfile.exists, message="the worker never wrote its pid")
        pids = plugin(eng, PROCESS).worker_pids
        assert int(pidfile.read_text()) in pids
        tg.cancel_scope.cancel()  # the caller gives up on the batch, then closes the engine
    assert all(process_gone(pid) for pid in pids)  # closing waited for them: none is left, not even a zombie
    snapshot.settled()


# --- what a plugin starts dies with its worker ---


@pytest.mark.parametrize("how", ["timeout", "abort", "close"])
def test_a_plugins_subprocess_does_not_outlive_its_worker(
    fault_envs: Path, tmp_path: Path, no_leaks: Snapshot, how: str
) -> None:
    """Each worker leads a process group, and the group goes when the worker goes: killed at a
    timeout or an abort, or exiting when the engine closes."""
    childfile, pidfile = tmp_path / "child", tmp_path / "pid"
    spawn = {"childfile": str(childfile), "pidfile": str(pidfile)}
    with BlockingEngine(config(fault_envs)) as eng:
        if how == "close":
            assert eng.score([item(PROCESS, mode="ok", **spawn)]) == [0.5]
        else:
            busy = item(PROCESS, item_id="busy", mode="block", release=str(tmp_path / "never"), **spawn)
            batch = [busy] if how == "timeout" else [busy, item(THREAD, mode="raise_when", when=str(pidfile))]
            err = fails(eng, batch)
            if how == "timeout":
                timed_out = re.escape(f"timed out after {TIMEOUT:g} s")
                check(err, environment=PROCESS, index=0, item_id="busy", match=timed_out)
            child = int(childfile.read_text())
            wait_until_dead(child)  # with its worker, not when the engine closes
            assert eng.score(ok(PROCESS, 2)) == [0.5] * 2
        child = int(childfile.read_text())
        assert child not in (os.getpid(), int(pidfile.read_text()))
    wait_until_dead(child)
    assert process_gone(int(pidfile.read_text()))


# --- many aborts: every killed worker is reaped and released at once ---

ABORTS = 100  # each of the ten landings below ten times over: a leak of one shows at once (the check is exact)


def resources() -> tuple[int, int, int]:
    """Open descriptors, threads (the thread executor's idle pool threads aside: it bounds and reuses them), and
    child processes, zombies included."""
    threads = [t for t in threading.enumerate() if not t.name.startswith("engine-plugin-")]
    return len(os.listdir("/proc/self/fd")), len(threads), len(child_pids())


def aborting_batch(env: str, asynchronous: str, n: int, cue: str) -> list[dict[str, Any]]:
    """A batch that aborts while ``env``'s one worker is busy, or just after it answered."""
    if n % 10 == 0:  # the worker has answered, but the engine has not taken the answer: no call sees it die
        go = f"{cue}.go"
        return [
            item(env, mode="block", pidfile=cue, release=go),
            item(asynchronous, mode="hold_loop_then_raise", when=cue, release=go),
        ]
    if n % 10 == 5:  # in the middle of a call
        return [item(env, mode="block", pidfile=cue, release=f"{cue}.never"), item(THREAD, mode="raise_when", when=cue)]
    # wherever the abort falls: mostly between calls, now and then during or just after one
    return [item(env, mode="ok", pidfile=cue), *ok(env, n % 4), item(THREAD, mode="raise_when", when=cue)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hundreds_of_aborted_batches_leave_nothing_behind(fault_envs: Path, tmp_path: Path, no_leaks: Snapshot) -> None:
    """Each worker killed by an abort is reaped, and its thread, pipe and pidfd released, when it dies,
    not when the engine closes: a trainer aborts batches for hours."""
    env = process_twin(fault_envs, THREAD, "one_worker", workers=1)
    asynchronous = "faults_async"
    shutil.copytree(fault_envs / THREAD, fault_envs / asynchronous)
    manifest = {"kind": "environment", "verifier": {"kind": "plugin", "ref": "faults:async_by_task"}}
    (fault_envs / asynchronous / "manifest.json").write_bytes(orjson.dumps(manifest))
    good = [*ok(env, 4), *ok(THREAD), *ok(asynchronous)]
    with BlockingEngine(config(fault_envs, timeout=10)) as eng:
        assert eng.score(good) == [0.5] * 6  # the thread plugin's first call measures it: cheap
        assert eng.score(good) == [0.5] * 6  # so its chunks run on a thread of its own, kept from now on
        baseline = resources()  # the one live worker, the threads and the descriptors included
        for n in range(ABORTS):
            fails(eng, aborting_batch(env, asynchronous, n, str(tmp_path / f"cue-{n}")))
        assert eng.score(good) == [0.5] * 6  # one live worker again
        wait_until(lambda: resources() == baseline, message=f"{resources()} is not back to {baseline}")
        assert len(plugin(eng, env).worker_pids) == 1


# --- what a worker does, and what it refuses ---


def test_workers_call_the_plugin_in_their_main_thread_on_every_core(fault_envs: Path, no_leaks: Snapshot) -> None:
    with BlockingEngine(config(fault_envs)) as eng:
        assert eng.score([item(PROCESS, mode="main_thread") for _ in range(8)]) == [1.0] * 8
        assert eng.score([item(THREAD, mode="main_thread")]) == [0.0]
        pids = {int(reward) for reward in eng.score([item(PROCESS, mode="pid") for _ in range(64)])}
        assert len(pids) == 2  # "workers": 2, both busy
        assert pids == set(plugin(eng, PROCESS).worker_pids)
        assert os.getpid() not in pids


def test_an_async_plugin_runs_in_a_worker_too(fault_envs: Path, no_leaks: Snapshot) -> None:
    env = process_twin(fault_envs, THREAD, "async_process", ref="faults:async_by_task")
    with BlockingEngine(config(fault_envs)) as eng:
        assert eng.score([item(env, mode="ok"), item(env, mode="main_thread")]) == [0.5, 1.0]
        err = fails(eng, [item(env, item_id="a", mode="raise")])
        reason = re.escape("raised Boom: the plugin blew up") + AT
        check(err, environment=env, index=0, item_id="a", match=reason, ref="faults:async_by_task")


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_chunks_go_to_workers_and_a_failure_inside_names_its_item(fault_envs: Path, no_leaks: Snapshot) -> None:
    with BlockingEngine(config(fault_envs)) as eng:
        assert eng.score(ok(PROCESS, 200)) == [0.5] * 200  # measures the plugin's cost
        result = eng.run(ok(PROCESS, 3000))
        assert result.rewards == [0.5] * 3000
        assert len(result.verifiers[0].latencies) < 3000 / 4  # one round trip per chunk, not per item

        batch = ok(PROCESS, 3000)
        batch[1777] = item(PROCESS, item_id="nan", mode="nan")
        check(
            fails(eng, batch),
            environment=PROCESS,
            index=1777,
            item_id="nan",
            match=re.escape("returned nan, which is not a finite number"),
        )
        batch[1777] = item(PROCESS, item_id="h", mode="block", release="/nonexistent")
        check(
            fails(eng, batch),
            environment=PROCESS,
            index=1777,
            item_id="h",
            match=re.escape(f"timed out after {TIMEOUT:g} s"),
        )
        batch[1777] = item(PROCESS, threading.Lock(), item_id="lock")
        err = fails(eng, batch)
        unpicklable = re.escape("cannot pass the item to a worker process: TypeError: ") + ".*lock.*"
        check(err, environment=PROCESS, index=1777, item_id="lock", match=unpicklable)
        assert eng.score(ok(PROCESS, 500)) == [0.5] * 500


def test_a_worker_started_after_a_file_changed_runs_the_vetted_code(fault_envs: Path, no_leaks: Snapshot) -> None:
    """The engine vets the digest once and hands every worker it starts, later ones too, the sources it
    hashed: a file changed on disk since is never read."""
    pin = digest_directory(fault_envs / PROCESS)
    pinned = EngineConfig(environments=fault_envs, pins={PROCESS: pin}, defaults=Limits(timeout=TIMEOUT))
    with BlockingEngine(pinned) as eng:
        assert eng.score(ok(PROCESS)) == [0.5]  # one worker, running the vetted code
        with (fault_envs / PROCESS / "faults.py").open("a") as f:
            f.write("\nraise SystemExit('code nobody vetted ran')\n")
        first = plugin(eng, PROCESS).worker_pids
        fails(eng, [item(PROCESS, mode="os_exit")])  # that worker is gone; its replacement imports anew
        result = eng.run(ok(PROCESS, 2))
        assert result.rewards == [0.5] * 2
        assert result.provenance(0)["digest"] == pin
        assert plugin(eng, PROCESS).worker_pids not in ([], first)  # a new worker scored them
    assert digest_directory(fault_envs / PROCESS) != pin


IMPORT_FAULTS = [
    (
        "import a_module_that_does_not_exist_anywhere\n",
        re.escape("cannot import module 'faults': ModuleNotFoundError: No module named ")
        + re.escape("'a_module_that_does_not_exist_anywhere' (at faults.py:1, in <module>)"),
    ),
    (
        "import ctypes\nctypes.string_at(0)\n",
        r"its worker process \(pid \d+\) died importing the module: killed by signal SIGSEGV",
    ),
    ("import time\ntime.sleep(10)\n", re.escape(f"timed out after {TIMEOUT:g} s importing the module")),
]


@pytest.mark.parametrize(("source", "reason"), IMPORT_FAULTS, ids=["raises", "segfault", "hangs"])
def test_a_worker_that_cannot_import_the_plugin(fault_envs: Path, no_leaks: Snapshot, source: str, reason: str) -> None:
    env = process_twin(fault_envs, THREAD, "broken_process")
    (fault_envs / env / "faults.py").write_text(source)
    with BlockingEngine(config(fault_envs)) as eng:
        err = fails(eng, [*ok(PROCESS), item(env, item_id="b")])
        check(err, environment=env, index=1, item_id="b", match=reason)
        if "ModuleNotFoundError" in reason:
            assert isinstance(err.__cause__, PluginError)
            assert err.__cause__.type_name == "ModuleNotFoundError"
        assert plugin(eng, env).worker_pids == []  # the worker that could not import is gone
        assert eng.score(ok(PROCESS, 2)) == [0.5] * 2


@pytest.mark.slow
@pytest.mark.timeout(40)
def test_workers_exit_when_the_trainer_is_killed(fault_envs: Path, tmp_path: Path) -> None:
    """kill -9 of the engine's process leaves no orphan: a worker busy with a call exits too, and so
    does the subprocess its plugin started."""
    pidfile, childfile = tmp_path / "pid", tmp_path / "child"
    busy = item(PROCESS, mode="block", release=str(tmp_path / "never"), pidfile=str(pidfile), childfile=str(childfile))
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "import orjson\n"
        "from engine import BlockingEngine, EngineConfig, Limits\n"
        "if __name__ == '__main__':\n"
        f"    config = EngineConfig(environments={str(fault_envs)!r}, allow_unpinned=True,\n"
        "                          defaults=Limits(timeout=60))\n"
        "    with BlockingEngine(config) as eng:\n"
        f"        eng.score([orjson.loads({orjson.dumps(busy)!r})])\n"
    )
    process = subprocess.Popen([sys.executable, str(trainer)])
    try:
        worker = int(wait_for_file(pidfile, seconds=30))
    finally:
        process.kill()
        process.wait()
    wait_until_dead(worker, seconds=3)  # the plugin itself would wait 10 s
    wait_until_dead(int(childfile.read_text()), seconds=3)  # its sleep, 60 s


def test_workers_do_not_run_the_trainer_script_again(fault_envs: Path, tmp_path: Path) -> None:
    """A worker imports the engine and the plugin only: not the script (no main guard needed)."""
    ran = tmp_path / "ran"
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "import os\n"
        "import orjson\n"
        "from engine import BlockingEngine, EngineConfig\n"
        f"with open({str(ran)!r}, 'a') as f:  # the script's own module level, e.g. loading a model\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        f"with BlockingEngine(EngineConfig(environments={str(fault_envs)!r}, allow_unpinned=True)) as eng:\n"
        f"    print(eng.score([orjson.loads({orjson.dumps(item(PROCESS))!r})] * 3))\n"
    )
    done = subprocess.run([sys.executable, str(trainer)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0.5, 0.5, 0.5]"
    assert len(ran.read_text().split()) == 1  # the trainer's process, not one per worker


# --- threads that cannot be killed are counted ---


def test_too_many_abandoned_threads_refuse_new_calls(fault_envs: Path, tmp_path: Path, no_leaks: Snapshot) -> None:
    release = tmp_path / "release"
    block = {"mode": "block", "release": str(release)}
    with BlockingEngine(config(fault_envs, max_abandoned=1)) as eng:
        for n in range(2):  # the first leaves one abandoned thread (not more than 1): the second still runs
            check(
                fails(eng, [item(THREAD, item_id=n, **block)]),
                environment=THREAD,
                index=0,
                item_id=n,
                match=re.escape(f"timed out after {TIMEOUT:g} s"),
            )
        err = fails(eng, [item(THREAD, item_id="next", mode="ok")])  # refused at once (the reason), not timed out
        reason = (
            "2 of its calls that timed out or were cut short by an abort are still running in threads; "
            "refusing to start more until they finish (max_abandoned=1)"
        )
        check(err, environment=THREAD, index=0, item_id="next", match=re.escape(reason))
        assert eng.score(ok(PROCESS)) == [0.5]  # other verifiers are not concerned

        release.touch()  # the abandoned calls return; then they stop counting

        def scores() -> bool:
            try:
                assert eng.score(ok(THREAD, 3)) == [0.5] * 3
            except VerificationError as exc:
                assert "refusing to start more" in exc.reason
                return False
            return True

        wait_until(scores, message="the abandoned calls still count after they returned")


def test_max_abandoned_is_validated() -> None:
    assert Limits(max_abandoned=0).max_abandoned == 0
    with pytest.raises(ConfigError, match=r"max_abandoned: must be a whole number >= 0, got -1"):
        Limits(max_abandoned=-1)


def test_max_abandoned_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[defaults]\nmax_abandoned = 3\n[refs."faults/faults:by_task"]\nmax_abandoned = 0\n')
    loaded = load_config(path)
    assert loaded.defaults.max_abandoned == 3
    assert loaded.limits_for("faults/faults:by_task").max_abandoned == 0


# --- a real third-party verifier whose timeouts use signals ---

HALF = "0.5"


def answer(environment: str, gold: str, trajectory: str, item_id: Any = None) -> dict[str, Any]:
    return item(environment, trajectory, item_id=item_id, answer=gold)


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_math_verify_in_a_thread_is_an_error_never_a_zero(fault_envs: Path, no_leaks: Snapshot) -> None:
    """math-verify's signal.alarm fails in a thread; math-verify raises, and the engine says so."""
    with BlockingEngine(config(fault_envs, timeout=20)) as eng:
        err = fails(eng, [answer("math_verify", HALF, "\\boxed{1/2}", item_id="m")])
    check(
        err,
        environment="math_verify",
        index=0,
        item_id="m",
        match=re.escape("raised ValueError: Math-Verify 'parse' function doesn't support threaded environment") + ".*",
        ref="verify:score",
    )
    assert isinstance(err.__cause__, ValueError)
    assert str(err.__cause__.__cause__) == "signal only works in main thread of the main interpreter"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_math_verify_in_a_worker_process_scores(fault_envs: Path, no_leaks: Snapshot) -> None:
    env = "math_verify_process"
    cases = [
        (HALF, "\\boxed{1/2}", 1.0),
        (HALF, "\\boxed{1/3}", 0.0),
        (HALF, "So the answer is $\\frac{1}{2}$.", 1.0),
        ("$\\frac{\\sqrt{8}}{2}$", "\\boxed{\\sqrt{2}}", 1.0),
        ("2", "\\boxed{3}", 0.0),
    ]
    with BlockingEngine(config(fault_envs, timeout=30)) as eng:
        assert eng.score([answer(env, gold, said) for gold, said, _ in cases]) == [r for _, _, r in cases]


# --- manifests that ask for an executor wrongly ---


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        ({"executor": "fork"}, "field 'verifier.executor' is 'fork'; it must be 'thread' (the engine's thread pool"),
        ({"workers": 2}, "field 'verifier.workers' needs \"executor\": \"process\""),
        ({"executor": "thread", "workers": 2}, "field 'verifier.workers' needs \"executor\": \"process\""),
        ({"executor": "process", "workers": 0}, "field 'verifier.workers' must be a whole number >= 1, got 0"),
        ({"executor": "process", "workers": True}, "field 'verifier.workers' must be a whole number >= 1, got True"),
        ({"executor": "process", "workers": 1.5}, "field 'verifier.workers' must be a whole number >= 1, got 1.5"),
        ({"executor": "process", "threads": 2}, "verifier.threads: unknown key (known: executor, kind, ref, workers)"),
    ],
)
def test_a_bad_executor_in_a_manifest_is_refused(tmp_path: Path, verifier: dict[str, Any], message: str) -> None:
    (tmp_path / "manifest.json").write_bytes(
        orjson.dumps({"kind": "environment", "verifier": {"kind": "plugin", "ref": "v:score", **verifier}})
    )
    with pytest.raises(ManifestError) as info:
        load_environment(tmp_path)
    assert message in str(info.value)


def test_executor_is_for_plugins_only(tmp_path: Path) -> None:
    verifier = {"kind": "endpoint", "ref": "http://127.0.0.1:9/score", "executor": "process"}
    (tmp_path / "manifest.json").write_bytes(orjson.dumps({"kind": "environment", "verifier": verifier}))
    said = r"verifier\.executor: unknown key \(known: kind, ref\); 'executor' is for plugins only"
    with pytest.raises(ManifestError, match=said):
        load_environment(tmp_path)


def test_executor_defaults(fault_envs: Path) -> None:
    spec = load_environment(fault_envs / THREAD).verifier
    assert (spec.executor, spec.workers) == ("thread", None)
    spec = load_environment(fault_envs / PROCESS).verifier
    assert (spec.executor, spec.workers) == ("process", 2)
    twin = process_twin(fault_envs, THREAD, "cores")
    assert load_environment(fault_envs / twin).verifier.workers is None  # one worker per CPU, decided by the engine
