"""Plugin verifiers: real modules imported from real environment directories, and every way they fail."""

from __future__ import annotations

import importlib.util
import marshal
import math
import pickle
import struct
import subprocess
import sys
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from asserts import check_error
from cli_support import child_env
from conftest import add_env, import_count, item, plugin_module, process_twin
from polling import eventually
from special_files import SPECIAL_KINDS, make_special

import engine
import engine._verifiers.plugin.importer
from engine import EngineConfig, Limits, VerificationError, digest_directory
from engine._core.contract import BadItem
from engine._errors import Failure
from engine._reasons import describe
from engine._verifiers.plugin.executor import CallFailed
from engine._verifiers.plugin.importer import PluginLoadError
from engine._verifiers.plugin.verifier import PluginVerifier


async def fails(config: EngineConfig, items: list[dict[str, Any]], *, load: tuple[str, ...] = ()) -> VerificationError:
    """The ``VerificationError`` scoring ``items`` raises (there must be one, and no result list); the
    environments in ``load`` are loaded first (an import is not bounded by a call's timeout, then)."""
    async with engine.Engine(config) as eng:
        for name in load:
            await eng.load(name)
        with pytest.raises(VerificationError) as info:
            await eng.score(items)
    assert type(info.value) is VerificationError  # raised alone, not in an ExceptionGroup
    return info.value


check = partial(check_error, kind="plugin")


async def test_relative_imports_dotted_module_and_attribute(config: EngineConfig) -> None:
    items = [
        item("arith", "4.", reference="4"),
        item("arith", "5", reference="4"),
        item("length", "x" * 30),
        item("length", "y" * 250),
    ]
    async with engine.Engine(config) as eng:
        assert await eng.score(items) == [1.0, 0.0, 0.3, 1.0]


async def test_twins_with_their_own_verify_py_give_their_own_rewards(config: EngineConfig) -> None:
    items = [item(name) for name in ("twin_a", "twin_b", "twin_b", "twin_a", "twin_a")]
    async with engine.Engine(config) as eng:
        assert await eng.score(items) == [0.25, 0.75, 0.75, 0.25, 0.25]


async def test_import_error(config: EngineConfig) -> None:
    err = await fails(config, [item("twin_a"), item("broken_import", item_id="b-1")])
    reason = "cannot import module 'verify': ModuleNotFoundError"
    check(err, environment="broken_import", ref="verify:score", index=1, item_id="b-1", reason=reason)
    assert isinstance(err.__cause__, ModuleNotFoundError)
    assert "a_module_that_does_not_exist_anywhere" in err.reason



async def test_load_makes_a_plugin_ready_before_the_first_batch(config: EngineConfig, import_log: Path) -> None:
    """``load``: the import happens there, once; a plugin that cannot load is a ``VerificationError``, not
    an internal failure, naming the verifier and the environment (no item asked for it)."""
    async with engine.Engine(config) as eng:
        await eng.load("import_log")
        assert import_count(import_log) == 1
        assert await eng.score([item("import_log")]) == [1.0]
        assert import_count(import_log) == 1  # the batch found it imported
        with pytest.raises(VerificationError) as info:
            await eng.load("broken_import")
        assert type(info.value) is VerificationError
        assert (info.value.kind, info.value.ref, info.value.environment, info.value.index) == (
            "plugin",
            "verify:score",
            "broken_import",
            None,
        )
        assert str(info.value).startswith(
            "plugin verifier 'verify:score' (environment 'broken_import') failed: cannot import module 'verify'"
        )
        assert isinstance(info.value.__cause__, ModuleNotFoundError)
        with pytest.raises(ValueError, match="unknown environment 'nowhere'"):
            await eng.load("nowhere")
    with engine.BlockingEngine(config) as blocking, pytest.raises(VerificationError, match="cannot import module"):
        blocking.load("broken_import")

async def test_missing_attribute(config: EngineConfig) -> None:
    err = await fails(config, [item("no_attr", item_id=7)])
    check(
        err,
        environment="no_attr",
        ref="verify:missing",
        index=0,
        item_id=7,
        reason="module 'verify' has no attribute 'missing'",
    )


async def test_not_callable(config: EngineConfig) -> None:
    err = await fails(config, [item("not_callable", item_id="n")])
    check(
        err,
        environment="not_callable",
        ref="verify:THRESHOLD",
        index=0,
        item_id="n",
        reason="'THRESHOLD' in module 'verify' is a float, not callable",
    )


async def test_plugin_raises_with_cause_chained(config: EngineConfig) -> None:
    err = await fails(config, [item("faulty", mode="ok"), item("faulty", item_id="boom", mode="raise")])
    check(
        err,
        environment="faulty",
        ref="faults:by_task",
        index=1,
        item_id="boom",
        reason="raised Boom: the plugin blew up",
    )
    assert type(err.__cause__).__name__ == "Boom"
    assert str(err.__cause__) == "the plugin blew up"


async def test_async_plugin_raises_with_cause_chained(config: EngineConfig) -> None:
    err = await fails(config, [item("faulty_async", item_id="a", mode="raise")])
    reason = "raised ValueError: async plugin failed"
    check(err, environment="faulty_async", ref="faults:by_task", index=0, item_id="a", reason=reason)
    assert isinstance(err.__cause__, ValueError)


async def test_sys_exit_in_a_plugin_fails_the_item_not_the_process(config: EngineConfig) -> None:
    err = await fails(config, [item("faulty", item_id="x", mode="exit")])
    check(err, environment="faulty", ref="faults:by_task", index=0, item_id="x", reason="raised SystemExit: 3")
    assert isinstance(err.__cause__, SystemExit)


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("none", "returned None (NoneType), which is not a real number"),
        ("text", "returned 'high' (str), which is not a real number"),
        ("numeric_text", "returned '0.75' (str), which is not a real number"),
        ("list", "returned [1.0] (list), which is not a real number"),
        ("nan", "returned nan, which is not a finite number"),
        ("inf", "returned inf, which is not a finite number"),
    ],
)
async def test_bad_return_values(config: EngineConfig, mode: str, reason: str) -> None:
    items = [item("faulty", mode="ok"), item("faulty", mode="ok"), item("faulty", item_id=mode, mode=mode)]
    err = await fails(config, items)
    check(err, environment="faulty", ref="faults:by_task", index=2, item_id=mode, reason=reason)


# --- a reward is a real number: the same in a thread, on the event loop and in a worker process ---

RETURNS = """\
import decimal
import fractions


class Raising(float):  # a real number (a float) whose own __float__ raises
    def __float__(self):
        raise RuntimeError("no float for you")


class Text(str):  # text that float() would read as 1.0
    def __float__(self):
        return 1.0


VALUES = {
    "float": lambda: 0.5, "int": lambda: 1, "bool": lambda: True, "decimal": lambda: decimal.Decimal("0.25"),
    "fraction": lambda: fractions.Fraction(1, 4), "text": lambda: "42", "bytes": lambda: b"1",
    "bytearray": lambda: bytearray(b"1"), "complex": lambda: 1 + 0j, "huge_int": lambda: 10**400,
    "huge_fraction": lambda: fractions.Fraction(10**400, 3), "huge_decimal": lambda: decimal.Decimal("1e400"),
    "raising": Raising, "str_float": lambda: Text("wrong"),
}


def value(mode):
    if mode.startswith("numpy"):
        import numpy

        return {
            "numpy_float": numpy.float32(0.25), "numpy_int": numpy.int64(1), "numpy_bool": numpy.bool_(True),
            "numpy_str": numpy.str_("0.75"), "numpy_bytes": numpy.bytes_(b"1"), "numpy_0d": numpy.array("0.25"),
            "numpy_complex": numpy.complex128(0.3 + 0.9j),
        }[mode]
    return VALUES[mode]()
"""
SYNC_SCORE = "\n\ndef score(task, trajectory):\n    return value(task.get('mode', 'float'))\n"
ASYNC_SCORE = "\n\nasync def score(task, trajectory):\n    return value(task.get('mode', 'float'))\n"


def returns_env(envs: Path, executor: str) -> str:
    """An environment whose plugin returns the value its task's ``mode`` names, run by ``executor``."""
    source = RETURNS + (ASYNC_SCORE if executor == "async" else SYNC_SCORE)
    name = add_env(envs, "returns_async" if executor == "async" else "returns", "plugin", "verify:score")
    (envs / name / "verify.py").write_text(source)
    return process_twin(envs, name, workers=1) if executor == "process" else name


EXECUTORS = ["thread", "async", "process"]
NOT_NUMBERS = [
    ("text", "returned '42' (str), which is not a real number"),
    ("bytes", "returned b'1' (bytes), which is not a real number"),
    ("bytearray", "returned bytearray(b'1') (bytearray), which is not a real number"),
    ("complex", "returned (1+0j) (complex), which is not a real number"),
    ("huge_int", "which is too large for a float"),
    ("huge_fraction", "which is too large for a float"),
    ("huge_decimal", "returned Decimal('1E+400'), which is not a finite number"),
    ("raising", "(Raising), whose float() raised RuntimeError('no float for you')"),
    ("str_float", "returned 'wrong' (Text), which is not a real number"),  # was 1.0
    # numpy's: each was a reward (0.75, 1.0, 0.25, and 0.3, the real part)
    ("numpy_str", "returned np.str_('0.75') (str_), which is not a real number"),
    ("numpy_bytes", "returned np.bytes_(b'1') (bytes_), which is not a real number"),
    ("numpy_0d", "returned array('0.25', dtype='<U4') (ndarray), which is not a real number"),
    ("numpy_complex", "returned np.complex128(0.3+0.9j) (complex128), which is not a real number"),
]



@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(("mode", "reason"), NOT_NUMBERS, ids=[mode for mode, _ in NOT_NUMBERS])
async def test_a_reward_that_is_not_a_real_number_fails_its_item(
    envs: Path, executor: str, mode: str, reason: str
) -> None:
    """A string is an extracted answer, not a score: "42" must fail, not score 42.0 (as an endpoint's does)."""
    name = returns_env(envs, executor)
    config = EngineConfig(environments=envs, allow_unpinned=True)
    items = [item(name, item_id=f"r{n}", mode="float") for n in range(3)]
    items[1] = item(name, item_id="bad", mode=mode)
    err = await fails(config, items)
    check(err, environment=name, ref="verify:score", index=1, item_id="bad", reason=reason)


@pytest.mark.timeout(20)  # a worker process starts, and 10,000 calls
@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize(("mode", "reason"), NOT_NUMBERS, ids=[mode for mode, _ in NOT_NUMBERS])
async def test_a_reward_that_is_not_a_real_number_inside_a_chunk_names_its_item(
    envs: Path, executor: str, mode: str, reason: str
) -> None:
    """In a chunk too (there, a raising ``__float__`` escaped as an IndexError, or killed the worker)."""
    name = returns_env(envs, executor)
    items = [item(name, item_id=f"r{n}", mode="float") for n in range(5_000)]
    items[3_777] = item(name, item_id="bad", mode=mode)
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        assert await eng.score(items[:2_000]) == [0.5] * 2_000  # chunks form after this
        assert eng._verifier(name).chunk_size(5_000) > 1
        with pytest.raises(VerificationError) as info:
            await eng.score(items)
        assert type(info.value) is VerificationError
        check(info.value, environment=name, ref="verify:score", index=3_777, item_id="bad", reason=reason)
        assert await eng.score(items[:3_000]) == [0.5] * 3_000  # the engine (and its worker) still scores


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_real_numbers_of_every_kind_are_rewards(envs: Path, executor: str) -> None:
    name = returns_env(envs, executor)
    modes = ["float", "int", "bool", "decimal", "fraction"]
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        rewards = await eng.score([item(name, mode=mode) for mode in modes])
    assert rewards == [0.5, 1.0, 1.0, 0.25, 0.25]
    assert all(type(r) is float for r in rewards)


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_numpy_scalars_are_rewards(envs: Path, executor: str) -> None:
    name = returns_env(envs, executor)
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        rewards = await eng.score([item(name, mode=mode) for mode in ("numpy_float", "numpy_int", "numpy_bool")])
    assert rewards == [0.25, 1.0, 1.0]
    assert all(type(r) is float for r in rewards)


async def test_sync_plugin_timeout(envs: Path) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={"faulty/faults:by_task": Limits(timeout=0.2)})
    # the abandoned thread sleeps on for 10 s; Python cannot stop it, the engine does not wait for it (if it
    # did, the test's own timeout would fail it). Loaded first: under load its import alone may take 0.2 s.
    items = [item("faulty", mode="ok"), item("faulty", item_id="h", mode="hang", seconds=10)]
    err = await fails(config, items, load=("faulty",))
    check(err, environment="faulty", ref="faults:by_task", index=1, item_id="h", reason="timed out after 0.2 s")


async def test_async_plugin_hang_times_out(envs: Path) -> None:
    config = EngineConfig(
        environments=envs, allow_unpinned=True, refs={"faulty_async/faults:by_task": Limits(timeout=0.2)}
    )
    err = await fails(config, [item("faulty_async", item_id="h", mode="hang", seconds=30)], load=("faulty_async",))
    check(err, environment="faulty_async", ref="faults:by_task", index=0, item_id="h", reason="timed out after 0.2 s")


async def test_timeout_is_per_ref(envs: Path) -> None:
    """A short timeout under one plugin's key does not apply to another plugin with the same ref."""
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={"twin_a/verify:score": Limits(timeout=0.2)})
    async with engine.Engine(config) as eng:
        await eng.load("twin_a")  # its import is not the call: the call then returns at once, within 0.2 s
        assert await eng.score([item("twin_a"), item("twin_b")]) == [0.25, 0.75]
        assert (eng._verifier("twin_a").limits.timeout, eng._verifier("twin_b").limits.timeout) == (0.2, 60.0)


# --- importing: once, and only what was pinned ---


async def test_fifty_concurrent_first_calls_import_once(config: EngineConfig, import_log: Path) -> None:
    results: list[list[float]] = []

    async def score_one(eng: engine.Engine) -> None:
        results.append(await eng.score([item("import_log")]))

    async with engine.Engine(config) as eng:
        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(score_one, eng)
        assert results == [[1.0]] * 50
        assert import_count(import_log) == 1

        second: dict[str, list[float]] = {}

        async def score_batch(name: str) -> None:
            second[name] = await eng.score([item("import_log")] * 10)

        async with anyio.create_task_group() as tg:
            tg.start_soon(score_batch, "first")
            tg.start_soon(score_batch, "second")
        assert second == {"first": [1.0] * 10, "second": [1.0] * 10}
        assert import_count(import_log) == 1


async def test_fifty_items_of_one_batch_import_once(config: EngineConfig, import_log: Path) -> None:
    async with engine.Engine(config) as eng:
        assert await eng.score([item("import_log")] * 50) == [1.0] * 50
    assert import_count(import_log) == 1


async def test_correct_pin_imports(envs: Path, import_log: Path) -> None:
    pin = digest_directory(envs / "import_log")
    config = EngineConfig(environments=envs, pins={"import_log": pin})
    async with engine.Engine(config) as eng:
        assert await eng.score([item("import_log")]) == [1.0]
    assert import_count(import_log) == 1
    # importing wrote __pycache__ into the directory; the pin still holds for the next engine
    async with engine.Engine(config) as eng:
        assert await eng.score([item("import_log")]) == [1.0]
    assert import_count(import_log) == 2


async def test_changed_file_after_pinning_refuses_the_import(envs: Path, import_log: Path) -> None:
    pin = digest_directory(envs / "import_log")
    with (envs / "import_log" / "verify.py").open("a") as f:
        f.write("\n# an edit after vetting\n")
    config = EngineConfig(environments=envs, pins={"import_log": pin})

    err = await fails(config, [item("import_log", item_id="p")])

    check(err, environment="import_log", ref="verify:score", index=0, item_id="p", reason="changed since it was pinned")
    assert "changed since it was pinned" in err.reason
    assert f"the pin is {pin}" in err.reason
    assert digest_directory(envs / "import_log") in err.reason
    assert not import_log.exists()  # the module never ran


async def test_missing_pin_is_refused_with_the_digest_to_pin(envs: Path, import_log: Path) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=False, pins={"twin_a": digest_directory(envs / "twin_a")})
    async with engine.Engine(config) as eng:
        assert await eng.score([item("twin_a")]) == [0.25]  # pinned: fine
        with pytest.raises(VerificationError) as info:
            await eng.score([item("twin_a"), item("import_log")])
    err = info.value
    assert (err.environment, err.index) == ("import_log", 1)
    assert "has no pin and allow_unpinned is false" in err.reason
    assert f'import_log = "{digest_directory(envs / "import_log")}"' in err.reason
    assert not import_log.exists()


async def test_rewards_are_floats(config: EngineConfig) -> None:
    async with engine.Engine(config) as eng:
        rewards = await eng.score([item("arith", "4", reference="4"), item("length", "abc")])
    assert all(type(r) is float and math.isfinite(r) for r in rewards)


# --- the import gate against what slipped past it once ---


async def test_planted_bytecode_does_not_run_under_a_pin(envs: Path) -> None:
    """The digest ignores __pycache__, so the import must never read it: a planted .pyc whose header
    matches the source's mtime and size would otherwise run code nobody pinned."""
    source = envs / "twin_a" / "verify.py"
    pin = digest_directory(envs / "twin_a")
    stat = source.stat()
    planted = compile("def score(task, trajectory):\n    return 99.0\n", str(source), "exec")
    cached = Path(importlib.util.cache_from_source(str(source)))
    cached.parent.mkdir()
    header = importlib.util.MAGIC_NUMBER + struct.pack(
        "<III", 0, int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF
    )
    cached.write_bytes(header + marshal.dumps(planted))
    assert digest_directory(envs / "twin_a") == pin  # the digest does not see it, by design

    async with engine.Engine(EngineConfig(environments=envs, pins={"twin_a": pin})) as eng:
        assert await eng.score([item("twin_a")]) == [0.25]  # what the vetted source says


async def test_an_import_cut_short_by_an_abort_is_not_run_again(config: EngineConfig, import_log: Path) -> None:
    """An aborted batch abandons the import thread, not the import: the next batch waits for it."""
    async with engine.Engine(config) as eng:
        with pytest.raises(VerificationError, match="Boom"):
            # the faulty item fails while import_log's module is still importing (it takes 0.2 s)
            await eng.score([item("import_log"), item("faulty", mode="raise")])
        assert await eng.score([item("import_log")]) == [1.0]
    assert import_count(import_log) == 1


async def test_a_slow_import_is_bounded_by_the_timeout(envs: Path) -> None:
    """A module whose import hangs fails its item like a call that hangs, instead of hanging the batch."""
    config = EngineConfig(
        environments=envs, allow_unpinned=True, refs={"slow_import/verify:score": Limits(timeout=0.2)}
    )
    async with engine.Engine(config) as eng:
        with pytest.raises(VerificationError, match="timed out"):
            await eng.score([item("slow_import")])


SLOW_IMPORT = """\
import time

started = time.perf_counter()
time.sleep(0.3)  # a deterministic import: start-up can be no shorter
IMPORT_SECONDS = time.perf_counter() - started


def score(task, trajectory):
    return 1.0
"""


async def test_start_up_holds_the_whole_import(envs: Path) -> None:
    """The start-up figure begins before the import's thread does: it is at least the import's own time."""
    add_env(envs, "slow_start", "plugin", "verify:score")
    (envs / "slow_start" / "verify.py").write_text(SLOW_IMPORT)
    async with engine.Engine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        result = await eng.run([item("slow_start"), item("slow_start")])
        module = plugin_module(envs, "slow_start", "verify.py")
    report = result.verifiers[0]
    assert result.rewards == [1.0, 1.0]
    assert 1 <= len(report.startup) <= 2  # the first calls waited for the one import
    assert max(report.startup) >= module.IMPORT_SECONDS >= 0.3


HANGING_SCRIPT = """\
import asyncio, sys
import engine

config = engine.EngineConfig(environments=sys.argv[1], allow_unpinned=True,
                             refs={"hang/hang:score": engine.Limits(timeout=1.0)})


async def main():
    async with engine.Engine(config) as eng:
        await eng.load("hang")  # imported here: the call's second is the call's alone
        try:
            await eng.score([{"environment": "hang", "task": {}, "trajectory": "x"}])
        except engine.VerificationError as exc:
            print(exc.reason, flush=True)


asyncio.run(main())
"""
HANGS = """\
import threading


def score(task, trajectory):
    threading.Event().wait()  # never returns: the engine abandons the call at its timeout
"""


@pytest.mark.timeout(150)  # a new interpreter: its exit is the point
def test_a_script_exits_once_its_batch_failed_on_a_call_that_hangs_in_a_thread(envs: Path, tmp_path: Path) -> None:
    """The abandoned call runs on one of the engine's daemon threads: the interpreter's exit does not wait for it
    (on anyio's worker threads, which are not daemons, it waited for ever)."""
    add_env(envs, "hang", "plugin", "hang:score")
    (envs / "hang" / "hang.py").write_text(HANGS)
    script = tmp_path / "hangs.py"
    script.write_text(HANGING_SCRIPT)
    command = [sys.executable, str(script), str(envs)]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=90, check=False)
    assert (done.returncode, done.stdout) == (0, "timed out after 1 s\n"), done.stderr
    assert [line for line in done.stderr.splitlines() if not line.startswith("batch aborted: ")] == []  # the log


# --- what runs is what was hashed: files changed after the check do not run ---

LAZY_VERIFY = '''\
def score(task, trajectory):
    if not task.get("lazy"):
        return 1.0
    from . import lazy  # imported on the first call that needs it, long after the check

    if task.get("boom"):
        lazy.boom()
    return lazy.REWARD
'''
LAZY_VETTED = 'REWARD = 0.25\n\n\ndef boom():\n    raise RuntimeError("the vetted line")\n'
LAZY_CHANGED = 'REWARD = 0.75\n\n\n\n\ndef boom():\n    raise RuntimeError("a line nobody vetted")\n'


def write_env(envs: Path, name: str, files: dict[str, str], executor: str) -> str:
    """Environment ``name`` with ``files`` and the verifier ``verify:score`` run by ``executor``."""
    add_env(envs, name, "plugin", "verify:score")
    for filename, text in files.items():
        (envs / name / filename).write_text(text)
    return name if executor == "thread" else process_twin(envs, name, workers=1)


def pinned(envs: Path, name: str) -> EngineConfig:
    return EngineConfig(environments=envs, pins={name: digest_directory(envs / name)})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_lazily_imported_sibling_changed_after_the_check_runs_as_vetted(envs: Path, executor: str) -> None:
    name = write_env(envs, "lazy_env", {"verify.py": LAZY_VERIFY, "lazy.py": LAZY_VETTED}, executor)
    config = pinned(envs, name)
    pin = config.pins[name]
    async with engine.Engine(config) as eng:
        assert await eng.score([item(name)]) == [1.0]  # checked and imported; lazy.py not yet
        (envs / name / "lazy.py").write_text(LAZY_CHANGED)
        assert digest_directory(envs / name) != pin

        result = await eng.run([item(name, lazy=True)])
        assert result.rewards == [0.25]  # the vetted bytes, not the file on disk
        assert result.provenance(0)["digest"] == pin  # and the provenance tells the truth
        with pytest.raises(VerificationError) as info:
            await eng.score([item(name, item_id="b", lazy=True, boom=True)])
    assert "raised RuntimeError: the vetted line" in info.value.reason
    # the traceback quotes the code that ran, not the file on disk
    cause = info.value.__cause__
    text = str(cause) if executor == "process" else "".join(traceback.format_exception(cause))
    assert 'raise RuntimeError("the vetted line")' in text
    assert "nobody vetted" not in text


HOSTILE_VERIFY = '''\
import pathlib

# a plugin that swaps its own sibling after the check, before importing it
pathlib.Path(__file__).with_name("helper.py").write_text("REWARD = 0.75\\n")

from . import helper


def score(task, trajectory):
    return helper.REWARD
'''


@pytest.mark.timeout(30)
@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_sibling_swapped_while_the_module_imports_runs_as_vetted(envs: Path, executor: str) -> None:
    name = write_env(envs, "hostile", {"verify.py": HOSTILE_VERIFY, "helper.py": "REWARD = 0.25\n"}, executor)
    config = pinned(envs, name)
    async with engine.Engine(config) as eng:
        result = await eng.run([item(name), item(name)])
    assert (envs / name / "helper.py").read_text() == "REWARD = 0.75\n"  # the swap happened
    assert result.rewards == [0.25, 0.25]
    assert result.provenance(0)["digest"] == config.pins[name]


async def test_only_modules_in_the_snapshot_import(envs: Path) -> None:
    """A module that appears after the check is not importable: it was never hashed."""
    source = 'def score(task, trajectory):\n    from . import late\n    return late.REWARD\n'
    name = write_env(envs, "late_env", {"verify.py": source}, "thread")
    async with engine.Engine(pinned(envs, name)) as eng:
        with pytest.raises(VerificationError):
            await eng.score([item(name, item_id="x")])  # checked and imported: late.py does not exist yet
        (envs / name / "late.py").write_text("REWARD = 1.0\n")
        with pytest.raises(VerificationError) as info:
            await eng.score([item(name, item_id="y")])
    assert "raised ImportError: cannot import name 'late'" in info.value.reason


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
async def test_an_environment_holding_a_special_file_fails_its_items_naming_it(
    envs: Path, import_log: Path, kind: str, executor: str
) -> None:
    """A FIFO or a link to /dev/zero would hang the digest (and burn a CPU after the engine closed)."""
    name = "import_log" if executor == "thread" else process_twin(envs, "import_log", workers=1)
    special = envs / name / "fifo"
    what = make_special(special, kind)
    config = EngineConfig(environments=envs, allow_unpinned=True)
    async with engine.Engine(config) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.score([item("twin_a"), item(name, item_id="s")])
        verifier = eng._verifier(name)
        assert isinstance(verifier, PluginVerifier) and verifier.worker_pids == []  # no worker was started
    reason = f"environment {name!r} cannot be vetted: {special}"
    check(info.value, environment=name, ref="verify:score", index=1, item_id="s", reason=reason)
    assert f"is {what}, not a regular file or directory" in info.value.reason
    assert info.value.reason.endswith("; nothing was imported")
    assert not import_log.exists()  # the module never ran


async def test_data_files_are_still_read_from_disk(envs: Path) -> None:
    """Modules come from the snapshot; a package's data files (importlib.resources, pkgutil) from disk."""
    source = (
        "import importlib.resources\nimport pkgutil\n\nfrom . import data\n\n\n"
        "def score(task, trajectory):\n"
        '    text = importlib.resources.files(data).joinpath("weight.txt").read_text()\n'
        '    assert pkgutil.get_data(data.__name__, "weight.txt") == text.encode()\n'
        "    return float(text)\n"
    )
    name = write_env(envs, "with_data", {"verify.py": source}, "thread")
    (envs / name / "data").mkdir()
    (envs / name / "data" / "__init__.py").write_text("")
    (envs / name / "data" / "weight.txt").write_text("0.5")
    async with engine.Engine(pinned(envs, name)) as eng:
        assert await eng.score([item(name)]) == [0.5]


# --- a sync plugin's value becomes a reward in the call's thread, within the call's timeout ---

SLOW_FLOAT = """\
import time
from pathlib import Path

HERE = Path({here!r})


def _wait(path, seconds):
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    return path.exists()


class Slow(float):
    def __float__(self):
        (HERE / "started").touch()
        if _wait(HERE / "pinged", 3):  # a task on the engine's event loop ran while this blocked
            (HERE / "answered").touch()
        _wait(HERE / "done", 3)  # past the call's timeout
        return 0.5


def score(task, trajectory):
    if task.get("wait"):  # a call that waits: calls then go one at a time, not in chunks of cheap calls
        time.sleep(0.002)
    return Slow(0.5) if task.get("slow") else 0.25
"""


@pytest.mark.timeout(20)  # before the fix the event loop stood still for 6 s
@pytest.mark.parametrize("path", ["single", "chunk"])
async def test_a_rewards_slow_float_times_out_and_leaves_the_event_loop_free(
    envs: Path, tmp_path: Path, path: str
) -> None:
    """Its ``__float__`` is the plugin's code: one item's ran on the event loop after the call, with no
    timeout; a chunk's timed out naming the item after the chunk's last (an IndexError)."""
    here = tmp_path / "slow"
    here.mkdir()
    name = add_env(envs, "slow_float", "plugin", "verify:score")
    (envs / name / "verify.py").write_text(SLOW_FLOAT.format(here=str(here)))
    config = EngineConfig(environments=envs, allow_unpinned=True, defaults=Limits(timeout=0.5))

    async def ping() -> None:  # another task on the loop: it runs only if the loop is free
        await eventually(lambda: (here / "started").exists())
        (here / "pinged").touch()

    wait = path == "single"
    async with engine.Engine(config) as eng:
        await eng.load(name)  # imported (not within a call's 0.5 s: a loaded machine's import may take longer)
        assert await eng.score([item(name, wait=wait)]) == [0.25]  # measured: the timeout below is the call's
        assert (eng._verifier(name).chunk_size(1) > 1) == (path == "chunk")
        async with anyio.create_task_group() as tg:
            tg.start_soon(ping)
            with pytest.raises(VerificationError) as info:
                await eng.score([item(name, item_id="s", slow=True, wait=wait)])
        (here / "done").touch()  # the abandoned thread returns
    check(info.value, environment=name, ref="verify:score", index=0, item_id="s", reason="timed out after 0.5 s")
    await eventually(lambda: (here / "answered").exists(), message="the event loop stood still in __float__")


# --- an engine that closes forgets the modules it imported ---


def registered(envs: Path, name: str) -> tuple[int, list[str]]:
    """The import finder's entries for environment ``name``, and its modules in ``sys.modules``."""
    root = envs / name
    snapshots = sum(1 for s in list(engine._verifiers.plugin.importer._finder.snapshots.values()) if s.root == root)
    modules = sorted(m for m in list(sys.modules) if m.partition(".")[0].endswith(f"_{name}"))
    return snapshots, modules


@pytest.mark.parametrize("executor", ["thread", "async"])
async def test_an_engine_that_closes_leaves_no_module_behind(envs: Path, executor: str) -> None:
    """A trainer that opens an engine per run (300 of them: 37 -> 96 MiB) kept every one's modules."""
    name = returns_env(envs, executor)
    config = EngineConfig(environments=envs, allow_unpinned=True)
    before = registered(envs, name)
    for _ in range(20):
        async with engine.Engine(config) as eng:
            assert await eng.score([item(name), item(name)]) == [0.5, 0.5]
            assert len(registered(envs, name)[1]) > len(before[1])  # while it is open, the module is there
        assert registered(envs, name) == before


async def test_an_import_that_failed_is_forgotten_too(config: EngineConfig, envs: Path) -> None:
    before = registered(envs, "broken_import")
    for _ in range(5):
        await fails(config, [item("broken_import")])
    assert registered(envs, "broken_import") == before


SWAP_VERIFY = '''\
import os

with open(os.environ["ENGINE_TEST_SWAP_LOG"], "a") as log:
    log.write("imported\\n")


def score(task, trajectory):
    return 0.25  # the vetted verifier


def always_one(task, trajectory):
    return 1.0  # a helper the vetted manifest never names
'''


def rewrite_ref(envs: Path, name: str, ref: str) -> bytes:
    """Point environment ``name``'s manifest at ``ref`` (other keys kept); returns the old bytes."""
    path = envs / name / "manifest.json"
    old = path.read_bytes()
    manifest = orjson.loads(old)
    manifest["verifier"]["ref"] = ref
    path.write_bytes(orjson.dumps(manifest))
    return old


@pytest.fixture
def swap_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "swap.log"
    monkeypatch.setenv("ENGINE_TEST_SWAP_LOG", str(log))
    return log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_manifest_changed_after_it_was_read_runs_nothing(envs: Path, swap_log: Path, executor: str) -> None:
    """The engine read ``verify:score``; the directory hashed now names another callable: neither runs."""
    name = write_env(envs, "swapped", {"verify.py": SWAP_VERIFY}, executor)
    config = EngineConfig(environments=envs, allow_unpinned=True)
    async with engine.Engine(config) as eng:
        assert eng.environment(name).verifier.ref == "verify:score"
        rewrite_ref(envs, name, "verify:always_one")
        with pytest.raises(VerificationError) as info:
            await eng.score([item(name, item_id="m")])
    reason = f"environment {name!r}: manifest.json changed after it was read; nothing was imported"
    check(info.value, environment=name, ref="verify:score", index=0, item_id="m", reason=reason)
    assert not swap_log.exists()  # the module never ran, in the engine or in a worker


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_manifest_swapped_back_to_the_pinned_one_does_not_pick_the_verifier(
    envs: Path, swap_log: Path, executor: str
) -> None:
    """Read as ``verify:always_one``, swapped back to the vetted bytes before the digest: the digest matches
    the pin, and ``always_one`` must not run under it."""
    name = write_env(envs, "toctou", {"verify.py": SWAP_VERIFY}, executor)
    config = pinned(envs, name)  # the vetted directory: verify:score
    vetted = rewrite_ref(envs, name, "verify:always_one")
    async with engine.Engine(config) as eng:
        assert eng.environment(name).verifier.ref == "verify:always_one"  # what the engine read ...
        (envs / name / "manifest.json").write_bytes(vetted)  # ... then the pinned manifest is back
        assert digest_directory(envs / name) == config.pins[name]
        with pytest.raises(VerificationError) as info:
            await eng.score([item(name, item_id="t")])
    reason = f"environment {name!r}: manifest.json changed after it was read; nothing was imported"
    check(info.value, environment=name, ref="verify:always_one", index=0, item_id="t", reason=reason)
    assert not swap_log.exists()
    async with engine.Engine(config) as eng:  # a new engine reads the vetted manifest, and runs its verifier
        result = await eng.run([item(name)])
    assert result.rewards == [0.25]
    assert result.provenance(0)["digest"] == config.pins[name]


# --- the plugin kind's internal failures ---


@pytest.mark.parametrize(
    "failure",
    [
        BadItem(3, "cannot copy the item for the plugin: TypeError: cannot pickle '_thread.lock' object"),
        BadItem(2, "returned '42' (str), which is not a real number"),
        PluginLoadError("cannot import module 'verify': ModuleNotFoundError: No module named 'nowhere'"),
        CallFailed("timed out after 0.5 s", 4, timed_out=True),
    ],
    ids=lambda failure: type(failure).__name__,
)
def test_internal_failures_are_failures_that_carry_their_reason_through_a_pickle(failure: Failure) -> None:
    """Each internal failure with a reason is an ``engine._errors.Failure``, so ``describe`` reads its reason, and
    it survives a pickle (a process boundary) whole: its type, its fields and its arguments."""
    assert isinstance(failure, Failure)
    again = pickle.loads(pickle.dumps(failure))
    assert type(again) is type(failure)
    assert vars(again) == vars(failure)
    assert again.args == failure.args
    assert describe(again) == failure.reason
