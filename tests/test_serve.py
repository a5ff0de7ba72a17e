"""``engine serve`` and its client: real ``engine serve`` processes on 127.0.0.1, real clients.

One service (module-scoped, with a token) answers most tests: the protocol both ways, every error
field crossing the wire, malformed items, OpenRLHF's ``/get_reward``, 401, 413, ``/metrics``, two
client processes sharing one endpoint's ``max_concurrency = 4``, a client that hangs up, a plugin
worker that crashes. A second, with a queue of 4 items, answers 503; a third is stopped by SIGTERM
with a batch in flight. An endpoint server in this process (``tests/servers.py``) is the verifier
whose requests show what the service did: how many at once, whether they stopped.
"""

from __future__ import annotations

import functools
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from cli_support import RUBRICS, child_env, copy_env, engine_command, invoke
from conftest import add_endpoint_env, add_rubric_env
from polling import eventually, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import Request, Response, Server, score, status

import engine
from engine import RubricError, ServiceError, VerificationError

pytestmark = pytest.mark.timeout(90)  # services are processes: slow to start on a loaded 2-core machine

TOKEN = "s3cret-token"
START_TIMEOUT = 60.0  # seconds for a service to answer /healthz
LIMIT = 4  # the endpoint's max_concurrency, which every client of one service shares


# tests/envs' environments that cannot score (import_log: not without $ENGINE_TEST_IMPORT_LOG set), which a service
# refuses to start with (its check at start)
CANNOT_SCORE = ("broken_import", "import_log", "no_attr", "not_callable")


def servable(envs: Path) -> Path:
    """``envs``, a copy of tests/envs, without the environments a service refuses to start with (``CANNOT_SCORE``)."""
    for name in CANNOT_SCORE:
        shutil.rmtree(envs / name, ignore_errors=True)
    return envs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Service:
    """A running ``engine serve`` process: its URL, config and environments."""

    process: subprocess.Popen[str]
    url: str
    config: Path
    envs: Path
    token: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` parsed by prometheus-client's parser: (sample name, labels) -> value."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


def healthy(service: Service) -> bool:
    if service.process.poll() is not None:
        out, err = service.process.communicate()
        raise AssertionError(f"engine serve exited {service.process.returncode}:\n{out}\n{err}")
    try:
        return httpx.get(service.url + "/healthz", headers=service.headers, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def start_service(root: Path, config: str, *args: str, token: str | None = None) -> Service:
    """``engine serve`` on a free port of 127.0.0.1, with ``config`` (beside ``envs/``), once it answers."""
    config_path = root / "engine.toml"
    config_path.write_text('environments = "envs"\nallow_unpinned = true\n' + config)
    port = free_port()
    command = engine_command("serve", "--config", config_path, "--port", str(port), *args)
    env = {"SERVE_TOKEN": token} if token else {}
    if token:
        command += ["--token-env", "SERVE_TOKEN"]
    process = subprocess.Popen(command, cwd=root, env=child_env(env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    service = Service(process, f"http://127.0.0.1:{port}", config_path, root / "envs", token)
    try:
        wait_until(lambda: healthy(service), START_TIMEOUT, "engine serve never answered /healthz")
    except BaseException:
        stop(service)
        raise
    return service


def stop(service: Service, *, signalled: bool = False) -> tuple[int, str]:
    """Stop the service (SIGTERM unless ``signalled`` already, then kill); its exit status and stderr.

    Not a second SIGTERM to a service already stopping: one that lands while the interpreter exits finds
    the default handler back in place (Python restores it at exit) and ends the process by the signal.
    """
    if service.process.poll() is None and not signalled:
        service.process.send_signal(signal.SIGTERM)
    try:
        _, err = service.process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        service.process.kill()
        _, err = service.process.communicate()
    return service.process.returncode, err


# --- the endpoint the services' endpoint environments call --------------------------------------------


class Endpoint:
    """``/score`` answers after a short wait; ``/hold`` holds until ``release`` is set; ``/broken`` is 500."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def __call__(self, request: Request) -> Response:
        if request.path == "/broken":
            return Response.json({"error": "down"}, 500)
        if request.path == "/hold":
            await eventually(self.release.is_set, 60, "a held request was never released")
        else:
            await anyio.sleep(0.02)
        return Response.json({"reward": float(len(request.json()["trajectory"]))})


def grade(request: Request) -> Response:
    """The judge: 4 on the rubric's scale of 1 to 5 (a reward of 0.75), with its token counts, or 500 for a task
    whose prompt says FAIL."""
    if "FAIL" in request.body.decode():
        return status(500)
    return score(4, usage={"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12})


@pytest.fixture(scope="module")
def judge() -> Iterator[Server]:
    with Server.judge(default=grade) as server:
        yield server


@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[Server, Endpoint]]:
    handler = Endpoint()
    with Server(handler) as server:
        yield server, handler


def make_envs(root: Path, url: str) -> None:
    envs = root / "envs"
    envs.mkdir(parents=True)
    for name in ("arith", "cheap", "faulty"):
        copy_env(name, envs)
    for name, path in (("remote", "/score"), ("held", "/hold"), ("broken", "/broken")):
        (envs / name).mkdir()
        manifest = {"kind": "environment", "verifier": {"kind": "endpoint", "ref": url + path}}
        (envs / name / "manifest.json").write_bytes(orjson.dumps(manifest))
    (envs / "crash").mkdir()
    (envs / "crash" / "verify.py").write_text(textwrap.dedent("""\
        import os

        def score(task, trajectory):
            if task.get("crash"):
                os._exit(7)
            return 0.25
        """))
    manifest = {"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score", "executor": "process",
                                                    "workers": 1}}
    (envs / "crash" / "manifest.json").write_bytes(orjson.dumps(manifest))
    add_rubric_env(envs, "graded", "bob/helpfulness")
    shutil.copytree(RUBRICS, root / "rubrics")


def limits(url: str, judge: str) -> str:
    return (
        f'rubrics = "rubrics"\n[refs."{url}/score"]\nmax_concurrency = {LIMIT}\n'
        f'[refs."{url}/hold"]\nmax_concurrency = {LIMIT}\n[refs."{url}/broken"]\nmax_attempts = 1\n'
        f'[judge]\nbase_url = "{judge}"\nmodel = "judge-test"\nmax_attempts = 1\n'
    )


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, endpoint: tuple[Server, Endpoint], judge: Server
) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("serve")
    make_envs(root, endpoint[0].url)
    running = start_service(root, limits(endpoint[0].url, judge.base_url), "--environment", "arith",
                            "--max-items", "200", "--max-bytes", "100000", token=TOKEN)
    # a rubric that cannot be resolved, for its error's class on the wire: added once the service runs, as the
    # check at its start refuses one (an environment added later is loaded when first asked for)
    add_rubric_env(root / "envs", "rubbed", "nobody/missing")
    yield running
    code, err = stop(running)
    assert code == 0, err


def it(environment: str, trajectory: Any = "", item_id: Any = None, **task: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"environment": environment, "task": task, "trajectory": trajectory}
    if item_id is not None:
        out["id"] = item_id
    return out


def mixed_batch() -> list[dict[str, Any]]:
    batch = [it("cheap", n=n, item_id=f"c{n}") for n in range(30)]
    batch[3] = it("arith", "4", reference="4")
    batch[7] = it("remote", "abc", item_id=7)
    batch[11] = it("arith", "5", reference="4")
    return batch


async def in_process(service: Service, method: str, items: Any, **kwargs: Any) -> Any:
    async with engine.Engine.from_config(service.config) as eng:
        return await getattr(eng, method)(items, **kwargs)


async def remote(service: Service, method: str, items: Any, **kwargs: Any) -> Any:
    async with engine.Engine.connect(service.url, token=service.token) as eng:
        return await getattr(eng, method)(items, **kwargs)


async def raised(call: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        await call
    return info.value


# --- the protocol both ways ---------------------------------------------------------------------------


async def test_a_batch_through_the_service_is_the_batch_in_process(service: Service) -> None:
    batch = mixed_batch()
    here = await in_process(service, "run", batch, first_index=100)
    there = await remote(service, "run", batch, first_index=100)
    assert there.rewards == here.rewards
    assert [r for r in there.rewards if r not in (0.0, 1.0)]  # the cheap plugin's own values, not a constant
    assert there.rewards[7] == 3.0
    assert there.verifier_of == here.verifier_of
    assert [there.provenance(i) for i in range(len(batch))] == [here.provenance(i) for i in range(len(batch))]
    assert [(r.kind, r.ref, r.key, r.items) for r in there.verifiers] == [
        (r.kind, r.ref, r.key, r.items) for r in here.verifiers
    ]
    # summed in whatever order the chunks ended: equal up to rounding
    assert [r.reward_sum for r in there.verifiers] == pytest.approx([r.reward_sum for r in here.verifiers])
    assert isinstance(there, engine.BatchResult) and isinstance(there.verifiers[0], engine.VerifierReport)


def test_the_blocking_client_scores_as_the_blocking_engine(service: Service) -> None:
    batch = mixed_batch()
    with engine.BlockingEngine.from_config(service.config) as eng:
        here = eng.score(batch)
    with engine.BlockingEngine.connect(service.url, token=TOKEN) as eng:
        assert eng.score(batch) == here
        assert eng.run(batch).rewards == here
        with pytest.raises(VerificationError) as info:
            eng.score([it("faulty", mode="raise", item_id="x")])
    assert (info.value.kind, info.value.index, info.value.item_id) == ("plugin", 0, "x")


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param([it("cheap", n=1), it("faulty", mode="raise", item_id={"row": [1, 2]})], id="plugin-raises"),
        pytest.param([it("cheap", n=1)] * 3 + [it("broken", "x", item_id="b")], id="endpoint-500"),
        pytest.param([it("cheap", n=1), it("crash", crash=True, item_id=9)], id="worker-crashes"),
        pytest.param([it("rubbed", prompt="p", item_id="r")], id="rubric-missing"),
        pytest.param([it("graded", "ok", prompt="p")] * 2 + [it("graded", "ok", prompt="FAIL", item_id=2)],
                     id="judge-500"),
    ],
)
async def test_every_field_of_an_error_crosses_the_wire(service: Service, batch: list[dict[str, Any]]) -> None:
    here = await raised(in_process(service, "score", batch, first_index=40))
    there = await raised(remote(service, "score", batch, first_index=40))
    assert type(there) is type(here) and isinstance(here, VerificationError)
    assert isinstance(there, VerificationError)
    fields = ("kind", "ref", "reason", "environment", "index", "item_id")
    # a crashed worker's pid is the service's worker's, not this process's
    assert [pids(getattr(there, name)) for name in fields] == [pids(getattr(here, name)) for name in fields]
    assert pids(str(there)) == pids(str(here))
    assert there.index is not None and there.index >= 40


def pids(value: Any) -> Any:
    return re.sub(r"pid \d+", "pid N", value) if isinstance(value, str) else value


async def test_the_service_keeps_serving_after_a_worker_crash_and_a_failing_endpoint(service: Service) -> None:
    for bad in (it("crash", crash=True), it("broken", "x"), it("graded", "x", prompt="FAIL")):
        with pytest.raises(VerificationError):
            await remote(service, "score", [bad])
    assert await remote(service, "score", [it("crash"), it("remote", "ab"), it("graded", "x", prompt="p")]) == [
        0.25, 2.0, 0.75]


async def test_a_rubric_error_keeps_its_class(service: Service) -> None:
    there = await raised(remote(service, "score", [it("rubbed", prompt="p")]))
    assert type(there) is RubricError and there.ref == "nobody/missing"


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param([it("cheap", n=1), [1, 2]], id="not-a-mapping"),
        pytest.param([{"task": {}, "trajectory": ""}], id="no-environment"),
        pytest.param([it("nowhere")], id="unknown-environment"),
        pytest.param([it("cheap", n=1), {"environment": "arith", "trajectory": "4", "id": 3}], id="no-task"),
        pytest.param([it("cheap", n=1), {"environment": "cheap", "task": [1], "trajectory": ""}], id="bad-task"),
    ],
)
async def test_a_malformed_item_raises_the_same_error_on_the_client(service: Service, batch: list[Any]) -> None:
    here = await raised(in_process(service, "score", batch, first_index=2))
    there = await raised(remote(service, "score", batch, first_index=2))
    assert type(here) in (TypeError, ValueError)
    assert (type(there), str(there)) == (type(here), str(here))


def test_errors_on_the_wire_have_every_field(service: Service) -> None:
    response = service.post("/v1/score", {"items": [it("faulty", mode="raise", item_id="z")], "first_index": 5})
    assert response.status_code == 422
    assert response.json() == {"error": {
        "type": "VerificationError", "kind": "plugin", "ref": "faults:by_task", "key": "faulty/faults:by_task",
        "environment": "faulty", "index": 5, "item_id": "z", "timed_out": False, "cannot_load": False,
        "message": "raised Boom: the plugin blew up (at faults.py:16, in by_task)",  # where, in the plugin
    }}
    response = service.post("/v1/score", {"items": [[1]]})
    assert response.status_code == 400
    assert response.json()["error"] == {"type": "TypeError", "kind": None, "ref": None, "key": None,
                                        "environment": None, "index": None, "item_id": None, "timed_out": False,
                                        "cannot_load": False, "message": "item 0 is a list, not a mapping"}
    response = service.post("/v1/score", b"{not json")
    assert (response.status_code, response.json()["error"]["type"]) == (400, "ValueError")


def test_get_reward_speaks_openrlhf(service: Service) -> None:
    body = {
        "query": ["Q: 2+2? A: 4", "Q: 2+2? A: 5", "other 4", "P:abcd"],
        "prompts": ["Q: 2+2? A: ", "Q: 2+2? A: ", "Q: 2+2? A: ", "P:"],
        "labels": ["4", "4", "other 4", {"environment": "remote", "task": {}, "id": "r"}],
    }
    response = service.post("/get_reward", body)
    assert response.status_code == 200, response.text
    # the query less its prompt; the whole query when it does not start with it; an object label is the item
    assert response.json() == {"rewards": [1.0, 0.0, 1.0, 4.0], "scores": [1.0, 0.0, 1.0, 4.0], "extra_logs": {}}
    body["labels"][3] = orjson.dumps({"environment": "faulty", "task": {"mode": "raise"}, "id": "r"}).decode()
    response = service.post("/get_reward", body)
    error = response.json()["error"]
    assert response.status_code == 422
    assert (error["type"], error["environment"], error["index"], error["item_id"]) == (
        "VerificationError", "faulty", 3, "r")


def test_get_reward_answers_openrlhfs_retry_of_a_failure_from_that_failure(service: Service) -> None:
    """OpenRLHF posts a request again after a 422 (5 tries): a byte-identical body is answered from the failure
    just seen, not scored again; other bytes are scored."""
    body = orjson.dumps({"query": ["P:x"], "prompts": ["P:"],
                         "labels": [{"environment": "faulty", "task": {"mode": "raise"}, "id": "again"}]})
    replayed = ("engine_get_reward_replayed_total", ())
    before = service.metrics().get(replayed, 0)
    first, again = service.post("/get_reward", body), service.post("/get_reward", body)
    assert first.status_code == again.status_code == 422 and first.content == again.content
    assert first.json()["error"]["item_id"] == "again"
    assert service.metrics()[replayed] - before == 1
    other = service.post("/get_reward", body + b"\n")
    assert other.status_code == 422 and service.metrics()[replayed] - before == 1
    fine = service.post("/get_reward", {"query": ["Q: 4"], "prompts": ["Q: "], "labels": ["4"]})
    assert fine.json()["rewards"] == [1.0]


def test_replays_forget_after_their_window_and_past_their_most() -> None:
    from engine._serve.openrlhf import Replays

    now = [0.0]
    replays = Replays(window=30.0, most=2, clock=lambda: now[0])
    replays.remember(b"a", 422, b"A")
    now[0] = 29.9
    assert replays.find(b"a") == (422, b"A") and replays.find(b"b") is None
    now[0] = 30.0
    assert replays.find(b"a") is None  # past the window: scored again
    for body in (b"x", b"y", b"z"):
        replays.remember(body, 422, body.upper())
    assert (replays.find(b"x"), replays.find(b"y"), replays.find(b"z")) == (None, (422, b"Y"), (422, b"Z"))
    assert replays.replayed == 3


def test_replays_keep_no_answer_larger_than_their_largest() -> None:
    """A plugin's message may be megabytes: such a failure is scored again rather than held (memory stays bounded)."""
    from engine._serve.openrlhf import REPLAY_LARGEST, Replays

    replays = Replays()
    replays.remember(b"big", 422, b"x" * (REPLAY_LARGEST + 1))
    replays.remember(b"small", 422, b"x" * REPLAY_LARGEST)
    assert replays.find(b"big") is None and replays.find(b"small") == (422, b"x" * REPLAY_LARGEST)


# --- the service's own refusals ------------------------------------------------------------------------


async def test_the_token_is_refused_missing_or_wrong_and_accepted_right(service: Service) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"}):
        response = httpx.post(service.url + "/v1/score", content=b'{"items": []}', headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "Unauthorized"
    assert httpx.get(service.url + "/metrics").status_code == 401
    with pytest.raises(ServiceError) as info:
        await remote(Service(service.process, service.url, service.config, service.envs, None), "score", [])
    assert info.value.status == 401
    assert await remote(service, "score", [it("cheap", n=2)]) == [2 / 7]


async def test_a_request_over_the_limits_is_refused_with_413(service: Service) -> None:
    response = service.post("/v1/score", {"items": [it("cheap", n=n) for n in range(201)]})
    assert (response.status_code, response.json()["error"]["type"]) == (413, "TooLarge")
    response = service.post("/v1/score", {"items": [it("cheap", "x" * 100_001, n=1)]})
    assert (response.status_code, response.json()["error"]["type"]) == (413, "TooLarge")
    with pytest.raises(ServiceError) as info:
        await remote(service, "score", [it("cheap", n=n) for n in range(201)])
    assert info.value.status == 413


def test_a_body_larger_than_it_says_is_refused_while_it_is_read(service: Service) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"items": ['
        for _ in range(200):
            yield orjson.dumps(it("cheap", "y" * 1000, n=1)) + b","
        yield b"]}"

    response = httpx.post(service.url + "/v1/score", content=chunks(), headers=service.headers, timeout=60)
    assert (response.status_code, response.json()["error"]["type"]) == (413, "TooLarge")


def test_non_loopback_is_refused_without_a_token(tmp_path: Path) -> None:
    (tmp_path / "engine.toml").write_text('environments = "."\n')
    ran = invoke("serve", "--host", "0.0.0.0", "--config", tmp_path / "engine.toml", cwd=tmp_path)
    assert ran.returncode == 2
    assert "not a loopback address, without a token" in ran.stderr
    ran = invoke("serve", "--host", "0.0.0.0", "--token-env", "SERVE_NO_SUCH_VAR", "--config",
                 tmp_path / "engine.toml", cwd=tmp_path)
    assert ran.returncode == 2
    assert "SERVE_NO_SUCH_VAR" in ran.stderr


# --- many clients, one engine ---------------------------------------------------------------------------

CLIENT = """
import pathlib, sys, time
import engine
url, token, count, me, meeting = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], pathlib.Path(sys.argv[5])
items = [{"environment": "remote", "task": {"client": me}, "trajectory": "x" * (n % 5), "id": n} for n in range(count)]
(meeting / me).touch()
deadline = time.monotonic() + 60
while len(list(meeting.iterdir())) < 2 and time.monotonic() < deadline:  # both start scoring together
    time.sleep(0.01)
with engine.BlockingEngine.connect(url, token=token) as eng:
    rewards = eng.score(items)
assert rewards == [float(n % 5) for n in range(count)], rewards
print("scored", len(rewards))
"""


def test_two_client_processes_share_the_endpoints_limit(
    service: Service, endpoint: tuple[Server, Endpoint], tmp_path: Path
) -> None:
    server, _ = endpoint
    count = 60
    overlapped = False
    # they meet before scoring, but a loaded machine may still run one client's whole batch before the other's
    # first request: a few rounds (bounded) until the two batches are seen in flight together
    for round_number in range(5):
        meeting = tmp_path / f"round{round_number}"
        meeting.mkdir()
        before = len(server.requests)
        server.max_in_flight = 0
        clients = [
            subprocess.Popen([sys.executable, "-c", CLIENT, service.url, TOKEN, str(count), name, str(meeting)],
                             env=child_env(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name in ("a", "b")
        ]
        for client in clients:
            out, err = client.communicate(timeout=80)
            assert client.returncode == 0, err
            assert f"scored {count}" in out
        seen = [request.json()["task"]["client"] for request in server.requests[before:]]
        assert sorted(seen) == ["a"] * count + ["b"] * count
        assert server.max_in_flight <= LIMIT  # never passed, by two processes at once
        if seen.index("b") < len(seen) - 1 - seen[::-1].index("a"):  # the two batches overlapped
            overlapped = True
            break
    assert overlapped
    assert server.max_in_flight == LIMIT  # reached


async def test_a_client_that_hangs_up_cancels_its_batch(service: Service, endpoint: tuple[Server, Endpoint]) -> None:
    server, handler = endpoint
    assert not handler.release.is_set()
    gone = service.metrics().get(("engine_http_requests_total", (("route", "/v1/score"), ("status", "499"))), 0)
    before = len(server.requests)
    body = orjson.dumps({"items": [it("held", n=n) for n in range(40)]})
    async with httpx.AsyncClient(headers=service.headers, timeout=60) as client, anyio.create_task_group() as group:
        # never answered: cancelled below
        group.start_soon(functools.partial(client.post, service.url + "/v1/score", content=body))
        await eventually(lambda: server.in_flight == LIMIT, message="the batch never reached the endpoint")
        group.cancel_scope.cancel()  # the client hangs up
    await eventually(lambda: server.in_flight == 0, message="the endpoint's held requests were never cancelled")
    key = ("engine_http_requests_total", (("route", "/v1/score"), ("status", "499")))
    await eventually(lambda: service.metrics().get(key, 0) == gone + 1)
    assert len(server.requests) - before == LIMIT  # none started after the hang-up
    assert await remote(service, "score", [it("remote", "a")]) == [1.0]  # the service goes on


async def test_metrics_parse_and_count_what_was_scored(service: Service) -> None:
    before = service.metrics()
    graded = [it("graded", "an answer", prompt="a question")] * 3
    await remote(service, "score", [it("cheap", n=n) for n in range(25)] + [it("remote", "ab"), *graded])
    with pytest.raises(VerificationError):
        await remote(service, "score", [it("faulty", mode="raise")])
    after = service.metrics()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    cheap = {"kind": "plugin", "verifier": "cheap/verify:score"}
    assert grew("engine_verifier_items_total", **cheap) == 25
    assert grew("engine_verifier_latency_seconds_count", **cheap) == 25
    assert grew("engine_verifier_latency_seconds_bucket", le="+Inf", **cheap) == 25
    assert grew("engine_verifier_items_total", kind="endpoint", verifier=endpoint_url(service) + "/score") == 1
    assert grew("engine_verifier_errors_total", kind="plugin", verifier="faulty/faults:by_task",
                type="VerificationError") == 1
    assert grew("engine_http_requests_total", route="/v1/score", status="200") == 1
    assert grew("engine_http_requests_total", route="/v1/score", status="422") == 1
    assert grew("engine_http_request_seconds_count", route="/v1/score") == 2
    rubric = {"kind": "rubric", "verifier": "bob/helpfulness"}
    assert grew("engine_verifier_items_total", **rubric) == 3
    # three identical items: judged once, two deduped
    assert grew("engine_verifier_spent_total", what="total_tokens", **rubric) == 12  # the judge's tokens
    assert grew("engine_verifier_spent_total", what="requests", **rubric) == 1
    assert grew("engine_verifier_deduped_total", **rubric) == 2
    assert grew("engine_verifier_cache_hits_total", **rubric) == 0
    assert after[("engine_items_admitted", ())] == 0
    assert ("engine_verifier_retries_total", tuple(sorted(cheap.items()))) in after
    assert ("engine_verifier_peak_in_flight", tuple(sorted(cheap.items()))) in after


def endpoint_url(service: Service) -> str:
    manifest = orjson.loads((service.envs / "remote" / "manifest.json").read_bytes())
    url: str = manifest["verifier"]["ref"]
    return url.removesuffix("/score")


# --- saturation and shutdown ------------------------------------------------------------------------------


@pytest.fixture
def small_service(tmp_path: Path, endpoint: tuple[Server, Endpoint], judge: Server) -> Iterator[Service]:
    """A service whose queue holds 4 items; the endpoint's held requests released on leaving."""
    make_envs(tmp_path, endpoint[0].url)
    running = start_service(tmp_path, limits(endpoint[0].url, judge.base_url), "--max-queued", "4", "--max-items", "4")
    try:
        yield running
    finally:
        endpoint[1].release.set()
        stop(running)
        endpoint[1].release.clear()


async def test_a_saturated_service_answers_503_and_the_client_retries(
    small_service: Service, endpoint: tuple[Server, Endpoint]
) -> None:
    server, handler = endpoint
    held: list[list[float]] = []
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the client's wait before asking again: the queue empties meanwhile
        waits.append(seconds)
        handler.release.set()
        await eventually(lambda: held, message="the held batch never finished")

    async def hold() -> None:
        held.append(await remote(small_service, "score", [it("held", "abc")] * 4))

    async with anyio.create_task_group() as group:
        group.start_soon(hold)
        await eventually(lambda: server.in_flight == LIMIT, message="the held batch never reached the endpoint")
        response = small_service.post("/v1/score", {"items": [it("cheap", n=1)]})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "Saturated"
        with pytest.raises(ServiceError) as info:  # no budget left for a retry
            async with engine.Engine.connect(small_service.url, retry_budget=0.5) as eng:
                await eng.score([it("cheap", n=1)])
        assert info.value.status == 503
        async with engine.Engine.connect(small_service.url, sleep=sleep) as eng:
            assert await eng.score([it("cheap", n=3)]) == [3 / 7]
    assert waits == [1.0]
    assert held == [[3.0] * 4]


async def test_sigterm_finishes_the_batch_in_flight_then_exits_0(
    small_service: Service, endpoint: tuple[Server, Endpoint]
) -> None:
    server, handler = endpoint
    done: list[list[float]] = []

    async def batch() -> None:
        done.append(await remote(small_service, "score", [it("held", "ab"), it("held", "abcd")]))

    def refused() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", int(small_service.url.rsplit(":", 1)[1])), timeout=5):
                return False
        except OSError:
            return True

    async with anyio.create_task_group() as group:
        group.start_soon(batch)
        await eventually(lambda: server.in_flight == 2, message="the batch never reached the endpoint")
        small_service.process.send_signal(signal.SIGTERM)
        await eventually(refused, 30, "the service still accepts connections after SIGTERM")
        assert small_service.process.poll() is None  # still answering the batch in flight
        handler.release.set()
    assert done == [[2.0, 4.0]]
    code, err = stop(small_service, signalled=True)
    assert code == 0, err
    assert "Shutting down" in err


# --- what is not an answer ---------------------------------------------------------------------------------


class Broken:
    """Stands in for an engine with a bug (a real one cannot be made to have one on purpose)."""

    async def run(self, items: Any, *, first_index: int = 0) -> Any:
        raise RuntimeError("a bug in the service")


async def test_a_bug_in_the_service_is_a_500_and_a_service_error_never_a_reward() -> None:
    from engine._serve.app import App
    from engine._serve.limits import ServeConfig

    transport = httpx.ASGITransport(app=App(Broken(), ServeConfig()))
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post("http://service/v1/score", content=b'{"items": []}')
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalError"
    async with engine.Engine.connect("http://service", transport=transport) as eng:
        with pytest.raises(ServiceError, match="HTTP 500: InternalError: a bug in the service") as info:
            await eng.score([it("cheap", n=1)])
    assert info.value.status == 500 and not isinstance(info.value, VerificationError)


async def test_no_service_or_a_stranger_answering_is_a_service_error() -> None:
    with Server(_text) as stranger:
        async with engine.Engine.connect(stranger.url) as eng:
            with pytest.raises(ServiceError, match="answered HTTP 502") as info:
                await eng.score([it("cheap", n=1)])
    assert info.value.status == 502
    async with engine.Engine.connect(f"http://127.0.0.1:{free_port()}") as eng:
        with pytest.raises(ServiceError, match="cannot reach the scoring service"):
            await eng.score([it("cheap", n=1)])


async def _text(request: Request) -> Response:
    return Response(502, b"<html>bad gateway</html>", {"content-type": "text/html"})


async def test_sigterm_cancels_a_batch_still_running_at_the_deadline_and_exits_0(
    tmp_path: Path, endpoint: tuple[Server, Endpoint], judge: Server
) -> None:
    server, handler = endpoint
    make_envs(tmp_path, server.url)
    service = start_service(tmp_path, limits(server.url, judge.base_url), "--graceful-timeout", "1")
    try:
        async with anyio.create_task_group() as group:
            failed: list[BaseException] = []

            async def batch() -> None:
                with pytest.raises(ServiceError) as info:  # the service gave up on it: no answer, no reward
                    await remote(service, "score", [it("held", "ab")])
                failed.append(info.value)

            group.start_soon(batch)
            await eventually(lambda: server.in_flight == 1, message="the batch never reached the endpoint")
            service.process.send_signal(signal.SIGTERM)
        assert failed
        await eventually(lambda: server.in_flight == 0, message="the held request was never cancelled")
        assert not handler.release.is_set()
        code, err = stop(service, signalled=True)
        assert code == 0, err
        assert "timeout graceful shutdown exceeded" in err
    finally:
        stop(service)


def test_a_service_says_what_it_serves_at_start_and_logs_a_failed_batch_once_at_error(tmp_path: Path) -> None:
    """Its config, its environments checked, its address; then the line a trainer's user looks for beside the
    trainer's own traceback (the OpenRLHF and TRL pages), once."""
    for name in ("arith", "faulty"):
        copy_env(name, tmp_path / "envs")
    add_endpoint_env(tmp_path / "envs", "remote", f"http://127.0.0.1:{free_port()}/score")  # not contacted at start
    service = start_service(tmp_path, "")
    try:
        response = service.post("/v1/score", {"items": [it("arith", "4", reference="4"),
                                                        it("faulty", mode="raise", item_id="z")]})
        assert response.status_code == 422
    finally:
        _, err = stop(service)
    lines = err.splitlines()
    said = [
        f"INFO:     engine serve: config {service.config}, environments under {service.envs}",
        "INFO:     engine serve: 3 environments, each checked and able to score: arith (plugin), faulty (plugin), "
        "remote (endpoint)",
        f"INFO:     Uvicorn running on {service.url} (Press CTRL+C to quit)",
    ]
    assert all(line in lines for line in said), err
    assert [lines.index(line) for line in said] == sorted(lines.index(line) for line in said), err
    assert [line for line in lines if "batch aborted" in line] == [
        "ERROR:    batch aborted: plugin verifier 'faults:by_task' (environment 'faulty') failed on item 1 (id 'z'): "
        "raised Boom: the plugin blew up (at faults.py:16, in by_task)"
    ], err


def test_a_service_with_a_broken_environment_refuses_to_start_naming_each(tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    for name in ("arith", "broken_import", "no_attr"):
        copy_env(name, envs)
    (envs / "garbled").mkdir()
    (envs / "garbled" / "manifest.json").write_text("{not json")
    (envs / "_shared").mkdir()  # no manifest (a helpers' folder): no environment, so not checked
    (tmp_path / "engine.toml").write_text('environments = "envs"\nallow_unpinned = true\n')
    port = free_port()
    done = subprocess.run(engine_command("serve", "--config", tmp_path / "engine.toml", "--port", str(port)),
                          cwd=tmp_path, env=child_env(None), capture_output=True, text=True, timeout=START_TIMEOUT,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "Uvicorn running" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    first = next(n for n, line in enumerate(lines) if line.startswith("error: "))
    assert lines[first] == (f"error: 3 of 4 environments under {envs} cannot score, so the service does not start "
                            "(engine check says more):"), done.stderr
    assert [line.split(": ", 1)[0] for line in lines[first + 1:]] == ["  broken_import", "  garbled", "  no_attr"]
    for name, reason in (("broken_import", "plugin 'verify:score'; verifier: cannot import module 'verify': "
                                           "ModuleNotFoundError"),
                         ("garbled", f"manifest: {envs / 'garbled' / 'manifest.json'}: invalid JSON"),
                         ("no_attr", "plugin 'verify:missing'; verifier: module 'verify' has no attribute 'missing'")):
        assert any(line.startswith(f"  {name}: {reason}") for line in lines), (name, done.stderr)
