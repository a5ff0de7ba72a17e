"""A ``VerificationError``'s typed fields, set where the failure is made: ``timed_out``, ``key``, ``cannot_load``.

Each kind of verifier runs out of time for real (a plugin that sleeps, an endpoint and a judge on 127.0.0.1
that never answer within the timeout); environments that cannot load are real directories (a module that
does not import, a pin that does not match, a rubric that is not there). The fields survive a pickle (a Ray
actor's, a worker's process boundary) and ``engine serve`` -> ``Engine.connect``; a peer that sends one of the
wrong type is refused, named, not trusted.
"""

from __future__ import annotations

import asyncio
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_support import copy_env
from conftest import add_endpoint_env, add_env, add_rubric_env, item, process_twin
from servers import Request, Response, Server, score
from test_serve import Service, start_service, stop

import engine
from engine import ConfigError, EngineConfig, JudgeConfig, Limits, RubricError, ServiceError, VerificationError
from engine._errors import Failure, InputError, WriteError

RUBRICS = Path(__file__).parent / "rubrics"
TIMEOUT = 1.0  # seconds a verifier has here: each hang below is far longer
HANG = 30.0  # seconds a hanging call would take: a process plugin's worker, an endpoint or a judge is cut first
THREAD_HANG = 5.0  # a thread plugin's call cannot be killed: its abandoned thread ends this much later


def fields(error: VerificationError) -> tuple[str, bool, bool]:
    return error.key, error.timed_out, error.cannot_load


async def raised(config: EngineConfig, items: list[dict[str, Any]]) -> VerificationError:
    async with engine.Engine(config) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.score(items)
    return info.value


# --- timed out -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_plugin_that_runs_out_of_time_is_timed_out(envs: Path, executor: str) -> None:
    name = "faulty" if executor == "thread" else process_twin(envs, "faulty", workers=1)
    key = f"{name}/faults:by_task"
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={key: Limits(timeout=TIMEOUT)})
    seconds = THREAD_HANG if executor == "thread" else HANG
    error = await raised(config, [item(name, mode="ok"), item(name, mode="hang", seconds=seconds)])
    assert fields(error) == (key, True, False)
    assert (error.kind, error.ref, error.index) == ("plugin", "faults:by_task", 1)


async def test_a_plugin_that_raises_timeout_error_itself_did_not_run_out_of_time(envs: Path) -> None:
    """``timed_out`` is the engine's finding, not a plugin's words: its own TimeoutError is its failure."""
    add_env(envs, "says_timeout", "plugin", "verify:score")
    (envs / "says_timeout" / "verify.py").write_text(
        "def score(task, trajectory):\n    raise TimeoutError('timed out, says the plugin')\n"
    )
    error = await raised(EngineConfig(environments=envs, allow_unpinned=True), [item("says_timeout")])
    assert fields(error) == ("says_timeout/verify:score", False, False)
    assert error.reason.startswith("raised")  # its own failure, in the engine's words for a plugin's


async def test_an_endpoint_that_does_not_answer_in_time_is_timed_out(envs: Path) -> None:
    async def slow(request: Request) -> Response:
        await asyncio.sleep(HANG)
        return Response.json({"reward": 1.0})

    with Server(slow) as server:
        url = server.url + "/score"
        add_endpoint_env(envs, "remote", url)
        config = EngineConfig(environments=envs, refs={url: Limits(timeout=TIMEOUT, max_attempts=1)})
        error = await raised(config, [item("remote")])
    assert fields(error) == (url, True, False)
    assert error.reason.startswith("timed out")


async def test_an_endpoint_that_cannot_be_reached_did_not_run_out_of_time(envs: Path) -> None:
    with Server(lambda request: Response.json({"reward": 1.0})) as server:
        url = server.url + "/score"
    add_endpoint_env(envs, "gone", url)  # the server is stopped: connections are refused at once
    config = EngineConfig(environments=envs, refs={url: Limits(max_attempts=1)})
    error = await raised(config, [item("gone")])
    assert fields(error) == (url, False, False)


def judged(envs: Path, tmp_path: Path, base_url: str, **judge: Any) -> EngineConfig:
    rubrics = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, rubrics)
    return EngineConfig(environments=envs, rubrics=rubrics,
                        judge=JudgeConfig(base_url=base_url, model="judge-test", **judge))


async def test_a_judge_that_does_not_answer_in_time_is_a_timed_out_rubric(envs: Path, tmp_path: Path) -> None:
    """Its reason starts with the judge's words (``judge request failed: timed out ...``), which a match on the
    reason's start missed: the field says it, and ``Engine.stats`` counts it as a timeout."""
    async def slow(request: Request) -> Response:
        await asyncio.sleep(HANG)
        return score(1)

    add_rubric_env(envs, "graded", "alice/arithmetic-correctness@1")
    with Server.judge(default=slow) as judge:
        config = judged(envs, tmp_path, judge.base_url, timeout=TIMEOUT, max_attempts=1)
        async with engine.Engine(config) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.score([item("graded", "42", prompt="6 * 7?", reference="42")])
            stats = eng.stats()
    assert fields(info.value) == ("alice/arithmetic-correctness", True, False)
    assert info.value.reason.startswith("judge request failed: timed out")
    assert (stats["engine/alice/arithmetic-correctness/errors"],
            stats["engine/alice/arithmetic-correctness/timeouts"]) == (1, 1)


# --- cannot load -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_module_that_does_not_import_cannot_load(envs: Path, executor: str) -> None:
    name = "broken_import" if executor == "thread" else process_twin(envs, "broken_import", workers=1)
    error = await raised(EngineConfig(environments=envs, allow_unpinned=True), [item("twin_a"), item(name)])
    assert fields(error) == (f"{name}/verify:score", False, True)
    assert error.index == 1


async def test_a_pin_that_does_not_match_cannot_load_and_neither_can_engine_load(envs: Path) -> None:
    config = EngineConfig(environments=envs, pins={"twin_a": "sha256:" + "0" * 64})
    error = await raised(config, [item("twin_a")])
    assert fields(error) == ("twin_a/verify:score", False, True)
    async with engine.Engine(config) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.load("twin_a")
    assert fields(info.value) == ("twin_a/verify:score", False, True)
    assert info.value.index is None


async def test_a_rubric_that_is_not_there_cannot_load(envs: Path, tmp_path: Path) -> None:
    add_rubric_env(envs, "missing", "nobody/nothing@2")
    with Server.judge() as judge:
        error = await raised(judged(envs, tmp_path, judge.base_url), [item("twin_a"), item("missing")])
    assert isinstance(error, RubricError)
    assert fields(error) == ("nobody/nothing", False, True)  # the key drops the version pin
    assert (error.environment, error.index) == ("missing", 1)


async def test_a_rubric_without_a_judge_cannot_load(envs: Path) -> None:
    add_rubric_env(envs, "graded", "alice/arithmetic-correctness@1")
    error = await raised(EngineConfig(environments=envs), [item("graded")])
    assert fields(error) == ("alice/arithmetic-correctness", False, True)


async def test_an_items_own_failure_is_neither(config: EngineConfig) -> None:
    error = await raised(config, [item("faulty", mode="raise")])
    assert fields(error) == ("faulty/faults:by_task", False, False)


# --- a pickle, and the wire --------------------------------------------------------------------------------


def every_field() -> VerificationError:
    error = VerificationError("plugin", "verify:score", "timed out after 1 s", key="env/verify:score",
                              environment="env", index=3, item_id={"row": 7}, timed_out=True, cannot_load=False)
    error.add_note("input: rows.jsonl, line 8")
    return error


@pytest.mark.parametrize(
    "error",
    [
        every_field(),
        RubricError("alice/x@2", "no version 2", key="alice/x", environment="graded", index=0, item_id=None),
        ConfigError("must be a whole number >= 1, got 0", key="max_concurrency", table="defaults",
                    source=Path("engine.toml")),
        InputError(Path("rows.jsonl"), "not JSON", unit="line", number=4),
        WriteError(Path("out.jsonl"), OSError(28, "No space left on device"), 12),
        ServiceError("the service answered HTTP 500", status=500),
    ],
    ids=lambda error: type(error).__name__,
)
def test_every_engine_error_survives_a_pickle_whole(error: engine.EngineError) -> None:
    """Its class, its fields, its notes and its message: what a Ray actor's error brings to the driver."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert vars(again) == vars(error)
    assert (again.args, str(again)) == (error.args, str(error))


def test_a_failure_keeps_its_fields_through_a_pickle() -> None:
    failure = Failure("timed out after 1 s", position=2, timed_out=True, of_environment=True)
    again = pickle.loads(pickle.dumps(failure))
    assert (again.reason, again.position, again.timed_out, again.of_environment) == ("timed out after 1 s", 2,
                                                                                     True, True)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """``engine serve`` over a copy of the test environments: a plugin with a short timeout, one that cannot load."""
    root = tmp_path_factory.mktemp("service")
    for name in ("faulty", "twin_a"):
        copy_env(name, root / "envs")
    running = start_service(root, f'[refs."faulty/faults:by_task"]\ntimeout = {TIMEOUT}\n')
    # added once the service runs, as the check at its start refuses it (a new environment loads when first asked)
    copy_env("broken_import", root / "envs")
    yield running
    stop(running)


async def connected(service: Service, items: list[dict[str, Any]]) -> tuple[VerificationError, dict[str, float]]:
    async with engine.Engine.connect(service.url) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.score(items)
        return info.value, eng.stats()


async def test_a_timeout_crosses_the_wire_with_its_fields(service: Service) -> None:
    error, stats = await connected(service, [item("faulty", mode="hang", seconds=THREAD_HANG, item_id="slow")])
    assert fields(error) == ("faulty/faults:by_task", True, False)
    assert (error.index, error.item_id) == (0, "slow")
    assert (stats["engine/faulty/faults:by_task/errors"], stats["engine/faulty/faults:by_task/timeouts"]) == (1, 1)


async def test_an_environment_that_cannot_load_crosses_the_wire_with_its_fields(service: Service) -> None:
    error, stats = await connected(service, [item("twin_a"), item("broken_import")])
    assert fields(error) == ("broken_import/verify:score", False, True)
    assert stats["engine/broken_import/verify:score/timeouts"] == 0


@pytest.fixture
def answering() -> Iterator[Callable[[dict[str, Any]], Server]]:
    """``answering(error)``: a server on 127.0.0.1 answering every request with ``{"error": error}`` (422)."""
    started: list[Server] = []

    def start(error: dict[str, Any]) -> Server:
        async def handle(request: Request) -> Response:
            return Response.json({"error": error}, status=422)

        server = Server(handle).__enter__()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__(None, None, None)


async def from_peer(server: Server) -> BaseException:
    async with engine.Engine.connect(server.url) as eng:
        with pytest.raises(engine.EngineError) as info:
            await eng.score([item("arith")])
    return info.value


WELL_FORMED = {"type": "VerificationError", "kind": "plugin", "ref": "verify:score", "key": "arith/verify:score",
               "environment": "arith", "index": 0, "item_id": None, "timed_out": True, "cannot_load": False,
               "message": "timed out after 1 s"}


async def test_a_peers_typed_fields_are_read(answering: Callable[[dict[str, Any]], Server]) -> None:
    error = await from_peer(answering(WELL_FORMED))
    assert isinstance(error, VerificationError) and fields(error) == ("arith/verify:score", True, False)


@pytest.mark.parametrize("name", ["key", "timed_out", "cannot_load"])
async def test_a_peers_error_without_a_typed_field_is_refused_not_guessed(
    answering: Callable[[dict[str, Any]], Server], name: str
) -> None:
    """A default would be a guess: a timeout counted as none, a failure filed under another verifier's key."""
    error = await from_peer(answering({key: value for key, value in WELL_FORMED.items() if key != name}))
    assert isinstance(error, ServiceError) and not isinstance(error, VerificationError), error
    assert error.status == 422 and f"{name} is missing" in str(error), error


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("timed_out", "yes", "timed_out is a str, not true or false"),
        ("timed_out", 1, "timed_out is 1, not true or false"),
        ("cannot_load", None, "cannot_load is null, not true or false"),
        ("key", 5, "key is 5, not a string"),
        ("key", None, "key is null, not a string"),
        ("environment", ["arith"], "environment is a list, not a string or null"),
        ("index", "0", "index is a str, not a whole number >= 0 or null"),
        ("index", True, "index is a bool, not a whole number >= 0 or null"),
        ("index", -1, "index is -1, not a whole number >= 0 or null"),
    ],
)
async def test_a_peers_field_of_the_wrong_type_is_refused_and_named(
    answering: Callable[[dict[str, Any]], Server], name: str, value: Any, said: str
) -> None:
    error = await from_peer(answering({**WELL_FORMED, name: value}))
    assert isinstance(error, ServiceError), error
    assert error.status == 422 and said in str(error), error
    assert not isinstance(error, VerificationError)
