"""``engine serve`` gathering small plugin requests into one engine batch (``engine._serve.gather``).

Real ``engine serve`` processes, real clients. Requests are made to arrive together either by many
concurrent ``Engine.connect`` clients or by a *burst*: connections opened (and used once) beforehand,
then every request written on its own connection while the service is stopped (SIGSTOP), so that once
it goes on (SIGCONT) it reads them all in one pass of its event loop and gathers them, however loaded
the machine. ``/metrics``' ``engine_gathered_requests`` and ``engine_gathered_batches`` show from
outside that they were (more requests than batches). A plugin's requests are gathered only once its
batches have measured it cheap (``engine_gather_item_seconds``): each test makes sure of that first
(:func:`cheap_plugin`), with items that return at once. Each request must still get what it would get
alone: its rewards and provenance, its own error named by its own index, its own malformed-item error;
a client that hangs up stops only its own wait, and a batch whose every client has gone is cancelled
(an async plugin writes a file when it is).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import resource
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from polling import each_pass_until, started, wait_until
from servers import Request, Response, Server
from test_serve import Service, it, start_service, stop

import engine
from engine._serve.gather import Gatherer, Gone
from engine._serve.limits import GATHER_CALL, ServeConfig

pytestmark = pytest.mark.timeout(120)  # services are processes: slow to start on a loaded 2-core machine

TIMEOUT = 2.0  # seconds: the slow plugin's call timeout
BURST = 5000  # the most requests one burst sends at once
FILES = BURST + 1000  # open files this process and the service need for it
BATCHES = ("engine_gathered_batches_total", ())
GATHERED = ("engine_gathered_requests_total", ())
GONE = ("engine_http_requests_total", (("route", "/v1/score"), ("status", "499")))
ITEM_SECONDS = "engine_gather_item_seconds"
SLOW_TIMEOUTS = ("engine_verifier_timeouts_total", (("kind", "plugin"), ("verifier", "slow/verify:score")))

ECHO = """\
def score(task, trajectory):
    if trajectory == "boom":
        raise RuntimeError(f"boom on {task.get('k')}")
    return SIGN * int(trajectory) / 1000
"""
WAIT = """\
import asyncio
import pathlib


async def score(task, trajectory):
    pathlib.Path(task["started"]).touch()
    try:
        while not pathlib.Path(task["until"]).exists():
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:
        pathlib.Path(task["cancelled"]).touch()
        raise
    return float(trajectory)
"""
CRASH = """\
import os


def score(task, trajectory):
    if trajectory == "crash":
        os._exit(7)
    return int(trajectory) / 1000
"""
SLOW = """\
import time


def score(task, trajectory):
    time.sleep(task.get("seconds", 0))
    return 0.5
"""


def plugin(envs: Path, name: str, source: str, **verifier: Any) -> None:
    (envs / name).mkdir(parents=True)
    (envs / name / "verify.py").write_text(source)
    manifest = {"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score", **verifier}}
    (envs / name / "manifest.json").write_bytes(orjson.dumps(manifest))


def make_envs(root: Path, url: str) -> None:
    envs = root / "envs"
    plugin(envs, "echo", "SIGN = 1\n" + ECHO)
    plugin(envs, "echo2", "SIGN = -1\n" + ECHO)  # another verifier, another sign: a reward tells which scored it
    plugin(envs, "wait", WAIT)
    plugin(envs, "slow", SLOW)
    plugin(envs, "crash", CRASH, executor="process", workers=2)
    (envs / "remote").mkdir()
    manifest = {"kind": "environment", "verifier": {"kind": "endpoint", "ref": url + "/score"}}
    (envs / "remote" / "manifest.json").write_bytes(orjson.dumps(manifest))


def configured(root: Path, url: str) -> str:
    make_envs(root, url)
    return f'[refs."slow/verify:score"]\ntimeout = {TIMEOUT}\n'


async def length(request: Request) -> Response:
    await anyio.sleep(0.01)
    return Response.json({"reward": float(len(request.json()["trajectory"]))})


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Server]:
    with Server(length) as server:
        yield server


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, endpoint: Server) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("gather")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < FILES:  # a connection per request of a burst, in both processes
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILES if hard == resource.RLIM_INFINITY else min(FILES, hard),
                                                    hard))
    try:
        # connections opened before a burst wait idle while the rest are opened (seconds, on a loaded machine)
        running = start_service(root, configured(root, endpoint.url), "--max-items", "300", "--graceful-timeout", "10",
                                "--keep-alive", "300")
        for item in (echo(1), echo(1, "echo2"), it("crash", "1")):
            cheap_plugin(running, item)
        yield running
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    code, err = stop(running)
    assert code == 0, err
    for leak in ("Traceback", "never retrieved", "was destroyed but it is pending", "Warning"):
        assert leak not in err, err


def echo(n: int, environment: str = "echo", item_id: Any = None) -> dict[str, Any]:
    """An item whose reward is n / 1000 (``echo``) or -n / 1000 (``echo2``)."""
    return it(environment, str(n), item_id, k=n)


def expected(item: dict[str, Any]) -> float:
    return (1 if item["environment"] == "echo" else -1) * int(item["trajectory"]) / 1000


# --- bursts: requests that reach the service together ------------------------------------------------


class Connection:
    """One HTTP/1.1 connection to the service, on a blocking socket (kept alive between requests)."""

    def __init__(self, service: Service) -> None:
        port = int(service.url.rsplit(":", 1)[1])
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=90)
        self.file = self.sock.makefile("rb")
        self.send("GET", "/healthz", None)  # accepted and read by the service before the burst
        assert self.answer()[0] == 200

    def send(self, method: str, path: str, body: Any) -> None:
        self.sock.sendall(request_bytes(method, path, body))

    def answer(self) -> tuple[int, Any]:
        """The status and JSON body of the answer to the request sent last."""
        status = int(self.file.readline().split()[1])
        size = 0
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                size = int(value)
        return status, orjson.loads(self.file.read(size))

    def hang_up(self) -> None:
        self.file.close()
        self.sock.close()


def request_bytes(method: str, path: str, body: Any) -> bytes:
    content = b"" if body is None else orjson.dumps(body)
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    return (head + f"content-length: {len(content)}\r\n\r\n").encode() + content


def connections(service: Service, count: int) -> list[Connection]:
    return [Connection(service) for _ in range(count)]


@contextlib.contextmanager
def paused(service: Service) -> Iterator[None]:
    """The service stopped meanwhile (SIGSTOP): what is sent to it then, it reads in one pass of its loop."""
    stat = Path(f"/proc/{service.process.pid}/stat")
    service.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: stat.read_text().rpartition(")")[2].split()[0] == "T", 60, "the service never stopped")
        yield
    finally:
        service.process.send_signal(signal.SIGCONT)


def warm(service: Service, requests: list[tuple[str, Any]]) -> None:
    """The plugins ``requests`` name measured cheap (a loaded machine may have measured one slow since); before
    what is gathered is counted, as these requests, once measured cheap, are gathered too."""
    named: set[str] = {item["environment"] for _, body in requests
                       for item in body.get("items", body.get("labels", []))
                       if isinstance(item, dict) and isinstance(item.get("environment"), str)}
    for name in sorted(named & set(WARM)):
        cheap_plugin(service, WARM[name]())


def counted_burst(
    service: Service, requests: list[tuple[str, Any]]
) -> tuple[list[tuple[int, Any]], tuple[float, float], tuple[float, float]]:
    """A :func:`burst` of ``requests``, their plugins measured cheap first; with what the service had gathered
    (:func:`gathered`) just before it and just after."""
    warm(service, requests)
    before = gathered(service)
    answers = burst(service, requests)
    return answers, before, gathered(service)


def burst(service: Service, requests: list[tuple[str, Any]]) -> list[tuple[int, Any]]:
    """Each ``(path, body)`` POSTed on a connection of its own, all at once; their answers in order."""
    opened = connections(service, len(requests))
    try:
        with paused(service):
            for connection, (path, body) in zip(opened, requests, strict=True):
                connection.send("POST", path, body)
        return [connection.answer() for connection in opened]
    finally:
        for connection in opened:
            connection.hang_up()


WARM = {  # an item of each plugin that returns at once: what measures it cheap
    "echo": lambda: echo(1),
    "echo2": lambda: echo(1, "echo2"),
    "crash": lambda: it("crash", "1"),
    "slow": lambda: it("slow", "", n=0),
}


def score_body(items: list[Any], first_index: int = 0) -> tuple[str, Any]:
    return "/v1/score", {"items": items, "first_index": first_index}


def gathered(service: Service) -> tuple[float, float]:
    """Requests gathered and the batches they went in, so far."""
    metrics = service.metrics()
    return metrics.get(GATHERED, 0), metrics.get(BATCHES, 0)


def shared(before: tuple[float, float], after: tuple[float, float]) -> bool:
    """Whether some requests between ``before`` and ``after`` shared a batch."""
    return after[0] - before[0] > after[1] - before[1] > 0


def alone(service: Service, path: str, body: Any) -> tuple[int, Any]:
    """The answer to one request sent by itself (a batch of its own)."""
    response = service.post(path, body)
    return response.status_code, response.json()


def cheap_plugin(service: Service, item: dict[str, Any]) -> None:
    """``item`` (one that returns at once) scored alone until its plugin is measured cheap: the service then
    gathers its requests (a plugin not measured yet, or measured slow, has its requests scored alone)."""
    key = ITEM_SECONDS, (("verifier", f"{item['environment']}/verify:score"),)

    def measured_cheap() -> bool:
        status, body = alone(service, *score_body([item]))
        assert status == 200, body
        return service.metrics().get(key, math.inf) <= GATHER_CALL

    wait_until(measured_cheap, 60, f"{item['environment']} was never measured cheap")


def check_result(answer: tuple[int, Any], items: list[dict[str, Any]]) -> None:
    """``answer`` is a 200 holding exactly ``items``' own rewards, verifiers and counts."""
    status, body = answer
    assert status == 200, body
    assert body["rewards"] == [expected(item) for item in items]
    names = [body["verifiers"][which]["provenance"]["environment"] for which in body["verifier_of"]]
    assert names == [item["environment"] for item in items]
    # in the order their items first come, as a batch of its own lists them
    order = [report["provenance"]["environment"] for report in body["verifiers"]]
    assert order == list(dict.fromkeys(item["environment"] for item in items))
    for which, report in enumerate(body["verifiers"]):
        mine = [item for item, verifier in zip(items, body["verifier_of"], strict=True) if verifier == which]
        assert report["items"] == len(mine)
        assert report["reward_sum"] == pytest.approx(sum(expected(item) for item in mine))


# --- many clients, each its own answer ----------------------------------------------------------------


async def test_many_one_item_requests_get_their_own_rewards_and_were_gathered(service: Service) -> None:
    warm(service, [score_body([echo(1)]), score_body([echo(1, "echo2")])])
    before = gathered(service)
    count, clients = 200, 32
    items = [echo(n, "echo" if n % 3 else "echo2", item_id=f"i{n}") for n in range(count)]
    results: dict[int, engine.BatchResult] = {}
    queue = list(range(count))

    async def client() -> None:
        async with engine.Engine.connect(service.url) as eng:
            while queue:
                n = queue.pop()
                results[n] = await eng.run([items[n]], first_index=n)

    async with anyio.create_task_group() as group:
        for _ in range(clients):
            group.start_soon(client)
    assert sorted(results) == list(range(count))
    for n, result in results.items():
        assert result.rewards == [expected(items[n])]
        assert result.provenance(0)["environment"] == items[n]["environment"]
        assert result.verifier_of == [0]
        assert [(report.items, report.reward_sum) for report in result.verifiers] == [(1, expected(items[n]))]
    after = gathered(service)
    # Requests are gathered while their plugin is measured cheap, which a stall of a loaded machine may undo for
    # a few (scored alone, they measure it again): so, shared batches, and no more gathered than sent. That
    # every one of them could be, the gatherer's rule says (test_one_item_requests_measured_cheap_are_all_taken).
    assert shared(before, after), (before, after)
    assert after[0] - before[0] <= count
    assert shared(before, after), (before, after)  # and some were


def test_a_burst_of_mixed_requests_each_get_their_own_result(service: Service) -> None:
    bodies: list[tuple[str, Any]] = []
    wanted: list[list[dict[str, Any]]] = []
    for n in range(24):  # 1..3 items, both environments within one request, ids repeated across requests
        items = [echo(n * 10 + k, ("echo", "echo2")[(n + k) % 2], item_id="same") for k in range(1 + n % 3)]
        bodies.append(score_body(items, first_index=(n * 7) % 5))
        wanted.append(items)
    labels = [{"environment": "echo2", "task": {}, "id": "g"}, {"environment": "echo", "task": {}}]
    bodies.append(("/get_reward", {"query": ["P:17", "P:905"], "prompts": ["P:", "P:"], "labels": labels}))
    answers, before, after = counted_burst(service, bodies)
    for answer, items in zip(answers, wanted, strict=False):
        check_result(answer, items)
    assert answers[-1] == (200, {"rewards": [-0.017, 0.905], "scores": [-0.017, 0.905], "extra_logs": {}})
    assert after[0] - before[0] == len(bodies)
    assert shared(before, after), (before, after)


# --- a verifier's failure, a malformed item ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_failing_item_is_its_own_requests_error_and_the_others_get_their_rewards(
    service: Service, where: str
) -> None:
    """The failing request first in the batch with its failing item first; in the middle; last with it last."""
    good = [[echo(n * 3 + k, ("echo", "echo2")[k % 2], item_id=k) for k in range(1 + n % 2)] for n in range(12)]
    place = {"first": 0, "middle": 6, "last": 12}[where]
    failing = [echo(900), echo(901, "echo2", item_id=7), echo(902)]
    position = {"first": 0, "middle": 1, "last": 2}[where]
    failing[position] = it(failing[position]["environment"], "boom", {"row": 3}, k=5)
    bodies = [score_body(items, first_index=10 * n) for n, items in enumerate(good)]
    bodies.insert(place, score_body(failing, first_index=40))
    on_its_own = alone(service, *bodies[place])
    errors = ("engine_verifier_errors_total", (("kind", "plugin"), ("type", "VerificationError"),
                                               ("verifier", f"{failing[position]['environment']}/verify:score")))
    failed = service.metrics()[errors]
    answers, before, after = counted_burst(service, bodies)
    assert service.metrics()[errors] == failed + 1  # counted once, as the request that got it
    assert answers[place] == on_its_own
    status, body = answers.pop(place)
    assert status == 422
    assert body["error"] == {
        "type": "VerificationError", "kind": "plugin", "ref": "verify:score",
        "key": f"{failing[position]['environment']}/verify:score", "environment": failing[position]["environment"],
        "index": 40 + position, "item_id": {"row": 3}, "timed_out": False, "cannot_load": False,
        "message": "raised RuntimeError: boom on 5 (at verify.py:4, in score)",
    }
    for answer, items in zip(answers, good, strict=True):
        check_result(answer, items)
    assert shared(before, after), (before, after)


def test_two_failing_requests_in_one_batch_each_get_their_own_error(service: Service) -> None:
    bodies = [score_body([echo(n), echo(n + 1, "echo2")], first_index=n) for n in range(10)]
    bodies[2] = score_body([echo(5), it("echo2", "boom", "b2", k=2)], first_index=20)
    bodies[7] = score_body([it("echo", "boom", "b7", k=7), echo(6)], first_index=70)
    labels = [{"environment": "echo", "task": {"k": 3}, "id": "g"}] * 2
    bodies.append(("/get_reward", {"query": ["P:1", "P:boom"], "prompts": ["P:", "P:"], "labels": labels}))
    answers, before, after = counted_burst(service, bodies)
    assert shared(before, after), (before, after)
    errors = {n: body["error"] for n, (status, body) in enumerate(answers) if status != 200}
    assert {n: (e["environment"], e["index"], e["item_id"], e["message"]) for n, e in errors.items()} == {
        2: ("echo2", 21, "b2", "raised RuntimeError: boom on 2 (at verify.py:4, in score)"),
        7: ("echo", 70, "b7", "raised RuntimeError: boom on 7 (at verify.py:4, in score)"),
        10: ("echo", 1, "g", "raised RuntimeError: boom on 3 (at verify.py:4, in score)"),  # from 0 in /get_reward
    }
    for n in set(range(10)) - {2, 7}:
        check_result(answers[n], bodies[n][1]["items"])


def test_each_failed_request_of_a_gathered_batch_is_logged_once_by_its_own_index(
    tmp_path: Path, endpoint: Server
) -> None:
    """The service's ERROR line is the failed request's, as its batch alone would log it: a gathered batch's own
    failure is not (its index is the gathered batch's, and the requests it held are scored again alone, where
    a timeout that is a request's own fails, and is logged, a second time)."""
    running = start_service(tmp_path, configured(tmp_path, endpoint.url))
    try:
        bodies = [score_body([echo(n)], first_index=n) for n in range(8)]
        bodies[5] = score_body([echo(1), it("echo", "boom", "b5", k=5)], first_index=50)
        answers, before, after = counted_burst(running, bodies)
        assert shared(before, after), (before, after)
        assert [status for status, _ in answers] == [200] * 5 + [422] + [200] * 2, answers
        bodies = [score_body([it("slow", "", n)], first_index=n) for n in range(3)]
        bodies.append(score_body([it("slow", "", "over", seconds=TIMEOUT * 1.5)], first_index=30))
        answers, before, after = counted_burst(running, bodies)
        assert shared(before, after), (before, after)
        assert [status for status, _ in answers] == [200] * 3 + [422], answers
    finally:
        code, err = stop(running)
    assert code == 0, err
    assert [line for line in err.splitlines() if "batch aborted" in line] == [
        "ERROR:    batch aborted: plugin verifier 'verify:score' (environment 'echo') failed on item 51 (id 'b5'): "
        "raised RuntimeError: boom on 5 (at verify.py:4, in score)",
        f"ERROR:    batch aborted: plugin verifier 'verify:score' (environment 'slow') failed on item 30 (id 'over'): "
        f"timed out after {TIMEOUT:g} s",
    ], err


def test_a_malformed_item_fails_its_own_request_only(service: Service) -> None:
    bad = [echo(1), {"environment": "echo", "task": [1], "trajectory": "2"}]
    bodies = [score_body([echo(n, ("echo", "echo2")[n % 2])], first_index=n) for n in range(10)]
    bodies.insert(4, score_body(bad, first_index=3))
    on_its_own = alone(service, *bodies[4])
    assert on_its_own[0] == 400
    answers, before, after = counted_burst(service, bodies)
    assert shared(before, after), (before, after)
    assert answers.pop(4) == on_its_own
    for n, answer in enumerate(answers):
        check_result(answer, [echo(n, ("echo", "echo2")[n % 2])])


# --- clients that hang up -------------------------------------------------------------------------------


def waiting(tmp_path: Path, name: str, trajectory: str = "1") -> dict[str, Any]:
    """An item of the ``wait`` plugin: it touches ``started``, waits for ``until``, touches ``cancelled``."""
    task = {what: str(tmp_path / f"{name}.{what}") for what in ("started", "until", "cancelled")}
    return {"environment": "wait", "task": task, "trajectory": trajectory}


def cheap_wait(service: Service, tmp_path: Path) -> None:
    """The ``wait`` plugin measured cheap, by items that do not wait (its earlier batches may have waited)."""
    item = waiting(tmp_path, "warm")
    Path(item["task"]["until"]).touch()
    cheap_plugin(service, item)


def exists(tmp_path: Path, *names: str) -> bool:
    return all((tmp_path / name).exists() for name in names)


def test_a_batch_whose_clients_all_hang_up_is_cancelled(service: Service, tmp_path: Path) -> None:
    cheap_wait(service, tmp_path)
    gone = service.metrics().get(GONE, 0)
    before = gathered(service)
    opened = connections(service, 2)
    try:
        with paused(service):
            for connection, name in zip(opened, ("a", "b"), strict=True):
                connection.send("POST", "/v1/score", {"items": [waiting(tmp_path, name)]})
        wait_until(lambda: exists(tmp_path, "a.started", "b.started"), 60, "the batch never started")
        assert shared(before, gathered(service))  # one batch for both
    finally:
        for connection in opened:
            connection.hang_up()
    wait_until(lambda: exists(tmp_path, "a.cancelled", "b.cancelled"), 60, "the plugin's calls were never cancelled")
    wait_until(lambda: service.metrics().get(GONE, 0) == gone + 2, 60, "the hang-ups were never counted")


def test_one_client_hanging_up_leaves_the_others_answer(service: Service, tmp_path: Path) -> None:
    cheap_wait(service, tmp_path)
    gone = service.metrics().get(GONE, 0)
    before = gathered(service)
    stays, leaves = connections(service, 2)
    try:
        with paused(service):
            stays.send("POST", "/v1/score", {"items": [waiting(tmp_path, "a", "3")], "first_index": 1})
            leaves.send("POST", "/v1/score", {"items": [waiting(tmp_path, "b")]})
        wait_until(lambda: exists(tmp_path, "a.started", "b.started"), 60, "the batch never started")
        assert shared(before, gathered(service))
        leaves.hang_up()
        wait_until(lambda: service.metrics().get(GONE, 0) == gone + 1, 60, "the hang-up was never seen")
        assert not exists(tmp_path, "a.cancelled")
    finally:
        leaves.hang_up()
        (tmp_path / "a.until").touch()
        (tmp_path / "b.until").touch()  # the call of the client gone ends too (nobody cancels a batch still read)
    status, body = stays.answer()
    stays.hang_up()
    assert (status, body["rewards"], body["verifiers"][0]["items"]) == (200, [3.0], 1)
    assert not exists(tmp_path, "a.cancelled")


# --- slow plugins are not gathered ---------------------------------------------------------------------------


def test_a_slow_plugins_requests_are_not_gathered_and_hold_no_cheap_one(service: Service, tmp_path: Path) -> None:
    """The ``wait`` plugin measured slow (an item that waited 0.3 s): its next request goes alone, and cheap
    requests that arrive with it are answered while its item still waits (gathered with it, they would wait)."""
    slow = waiting(tmp_path, "slow")
    timer = threading.Timer(0.3, Path(slow["task"]["until"]).touch)
    timer.start()
    try:
        assert alone(service, *score_body([slow]))[0] == 200
    finally:
        timer.join()
    seconds = service.metrics()[ITEM_SECONDS, (("verifier", "wait/verify:score"),)]
    assert seconds > GATHER_CALL
    warm(service, [score_body([echo(0)])])
    before = gathered(service)
    held, *cheap_ones = opened = connections(service, 4)
    try:
        with paused(service):
            held.send("POST", "/v1/score", {"items": [waiting(tmp_path, "held", "2")]})
            for n, connection in enumerate(cheap_ones):
                connection.send("POST", "/v1/score", {"items": [echo(n)], "first_index": n})
        wait_until(lambda: exists(tmp_path, "held.started"), 60, "the slow item never started")
        for n, connection in enumerate(cheap_ones):  # answered while the slow item waits
            check_result(connection.answer(), [echo(n)])
        assert not exists(tmp_path, "held.until")
        (tmp_path / "held.until").touch()
        status, body = held.answer()
        assert (status, body["rewards"]) == (200, [2.0])
    finally:
        (tmp_path / "held.until").touch()
        for connection in opened:
            connection.hang_up()
    after = gathered(service)
    assert after[0] - before[0] == 3  # the cheap ones only


def test_a_service_told_to_gather_nothing_gathers_nothing(tmp_path: Path, endpoint: Server) -> None:
    running = start_service(tmp_path, configured(tmp_path, endpoint.url), "--gather-items", "0")
    try:
        for _ in range(3):  # measured: it would be gathered now
            assert alone(running, *score_body([echo(1)]))[0] == 200
        answers = burst(running, [score_body([echo(n)], first_index=n) for n in range(8)])
        for n, answer in enumerate(answers):
            check_result(answer, [echo(n)])
        assert gathered(running) == (0, 0)
    finally:
        code, err = stop(running)
    assert code == 0, err


@pytest.mark.parametrize("value", [-1, 4097, 1.5])
def test_gather_items_is_validated(value: Any) -> None:
    with pytest.raises(ValueError, match="gather_items: must be a whole number from 0 to 4096") as info:
        ServeConfig(gather_items=value)
    assert isinstance(info.value, engine.ConfigError) and info.value.key == "gather_items"


# --- endpoint items are not gathered, and answer beside gathered ones ----------------------------------------


def test_an_endpoint_request_and_plugin_requests_sent_together_both_answer(service: Service) -> None:
    bodies = [score_body([it("remote", "abcd", "r")], first_index=2)]
    bodies += [score_body([echo(n)]) for n in range(6)]
    bodies.append(score_body([echo(9), it("remote", "ab")]))  # an endpoint item: the request is not gathered
    answers, before, after = counted_burst(service, bodies)
    assert answers[0][0] == 200 and answers[0][1]["rewards"] == [4.0]
    assert answers[0][1]["verifiers"][0]["kind"] == "endpoint"
    for n in range(6):
        check_result(answers[1 + n], [echo(n)])
    assert answers[-1][0] == 200 and answers[-1][1]["rewards"] == [0.009, 2.0]
    assert after[0] - before[0] == 6  # the plugin requests only


# --- the probe: what gathering must not change -------------------------------------------------------------


def test_items_slow_only_together_do_not_time_out_when_gathered(service: Service) -> None:
    """Eight items of a fifth of the call timeout each: alone, each is in time. Gathered after cheap calls
    (which make the plugin's next chunks hold many items, run one after the other), they are one chunk
    whose timeout the sixth overruns: a timeout that is no request's own. Each must be scored alone."""
    cheap = [it("slow", "", n=n) for n in range(200)]
    for _ in range(3):  # measured cheap: chunks of many items, one at a time, from now on
        assert alone(service, *score_body(cheap))[0] == 200
    bodies = [score_body([it("slow", "", n, seconds=TIMEOUT / 5)], first_index=n) for n in range(8)]
    timeouts = service.metrics().get(SLOW_TIMEOUTS, 0)
    answers, before, after = counted_burst(service, bodies)
    assert shared(before, after), (before, after)
    assert [(status, body.get("rewards")) for status, body in answers] == [(200, [0.5])] * 8, answers
    assert service.metrics().get(SLOW_TIMEOUTS, 0) == timeouts  # no request failed: no failure counted
    # an item over the timeout by itself still gets its own timeout, named by its own index
    bodies = [score_body([it("slow", "", n, seconds=TIMEOUT / 5)], first_index=n) for n in range(3)]
    bodies.append(score_body([it("slow", "", "over", seconds=TIMEOUT * 1.5)], first_index=30))
    answers = burst(service, bodies)
    assert [(status, body.get("rewards")) for status, body in answers[:3]] == [(200, [0.5])] * 3, answers
    status, body = answers[3]
    assert (status, body["error"]["index"], body["error"]["item_id"]) == (422, 30, "over")
    assert body["error"]["message"] == f"timed out after {TIMEOUT:g} s"
    assert service.metrics().get(SLOW_TIMEOUTS, 0) == timeouts + 1  # once, for the one request that failed


def test_a_crashing_worker_fails_its_own_request_only(service: Service) -> None:
    """A process plugin's worker killed by one item (os._exit): that request's error, named by its index."""
    bodies = [score_body([it("crash", str(n), n), it("crash", str(n + 1))], first_index=n) for n in range(8)]
    bodies.insert(5, score_body([it("crash", "9"), it("crash", "crash", "dies")], first_index=50))
    on_its_own = alone(service, *bodies[5])
    answers, before, after = counted_burst(service, bodies)
    assert shared(before, after), (before, after)
    status, body = answers.pop(5)
    assert (status, body["error"]["index"], body["error"]["item_id"]) == (422, 51, "dies")
    assert re.sub(r"pid \d+", "pid N", body["error"]["message"]) == re.sub(
        r"pid \d+", "pid N", on_its_own[1]["error"]["message"])
    for n, (status, body) in enumerate(answers):
        assert (status, body.get("rewards")) == (200, [n / 1000, (n + 1) / 1000]), body


def test_more_items_than_one_batch_takes_are_all_scored_their_own(service: Service) -> None:
    """Twenty requests of 256 items: 16 fill a batch (``MAX_GATHERED``), the rest go in the next; one of 257
    is not gathered at all."""
    wanted = [[echo(n * 1000 + k, ("echo", "echo2")[k % 2], item_id=k) for k in range(256)] for n in range(20)]
    wanted.append([echo(k) for k in range(257)])
    bodies = [score_body(items, first_index=n) for n, items in enumerate(wanted)]
    answers, before, after = counted_burst(service, bodies)
    for answer, items in zip(answers, wanted, strict=True):
        check_result(answer, items)
    assert after[0] - before[0] == 20
    assert 2 <= after[1] - before[1] < 20


def test_clients_gone_before_their_batch_starts_cancel_it(service: Service, tmp_path: Path) -> None:
    """Requests read whole, then their clients hang up before the batch is flushed: it starts, is watched,
    and is cancelled; the service answers the next request."""
    cheap_wait(service, tmp_path)
    gone = service.metrics().get(GONE, 0)
    opened = connections(service, 2)
    with paused(service):
        for connection, name in zip(opened, ("a", "b"), strict=True):
            connection.send("POST", "/v1/score", {"items": [waiting(tmp_path, name)]})
            connection.hang_up()
    wait_until(lambda: service.metrics().get(GONE, 0) == gone + 2, 60, "the hang-ups were never counted")
    # the service read each body (one read) a pass of its loop before the end of the stream (the next read)
    assert exists(tmp_path, "a.started", "b.started")
    wait_until(lambda: exists(tmp_path, "a.cancelled", "b.cancelled"), 60, "the batch was never cancelled")
    check_result(alone(service, *score_body([echo(3)])), [echo(3)])


# --- shutdown -----------------------------------------------------------------------------------------------


@pytest.fixture
def stopping(tmp_path: Path, endpoint: Server) -> Iterator[Service]:
    """A service of its own, for a test to stop; a graceful period of 2 s."""
    running = start_service(tmp_path, configured(tmp_path, endpoint.url), "--graceful-timeout", "2")
    try:
        yield running
    finally:
        stop(running)


def test_sigterm_answers_the_gathered_batch_in_flight_then_exits_0(stopping: Service, tmp_path: Path) -> None:
    cheap_wait(stopping, tmp_path)
    opened = connections(stopping, 3)
    try:
        with paused(stopping):
            for n, connection in enumerate(opened):
                connection.send("POST", "/v1/score", {"items": [waiting(tmp_path, str(n), str(n))]})
        wait_until(lambda: exists(tmp_path, "0.started", "1.started", "2.started"), 60, "the batch never started")
        # in flight: a SIGTERM that landed while the service was paused could be handled before it read the
        # requests (a loaded machine's order), and shut their idle connections unread
        stopping.process.send_signal(signal.SIGTERM)
        for n in range(3):
            (tmp_path / f"{n}.until").touch()
        assert [(status, body.get("rewards")) for status, body in (c.answer() for c in opened)] == [
            (200, [0.0]), (200, [1.0]), (200, [2.0])]
    finally:
        for connection in opened:
            connection.hang_up()
    code, err = stop(stopping, signalled=True)
    assert code == 0, err
    assert not exists(tmp_path, "0.cancelled")


def test_sigterm_cancels_a_gathered_batch_still_running_at_the_deadline(stopping: Service, tmp_path: Path) -> None:
    cheap_wait(stopping, tmp_path)
    opened = connections(stopping, 2)
    try:
        with paused(stopping):
            for n, connection in enumerate(opened):
                connection.send("POST", "/v1/score", {"items": [waiting(tmp_path, str(n))]})
        wait_until(lambda: exists(tmp_path, "0.started", "1.started"), 60, "the batch never started")
        stopping.process.send_signal(signal.SIGTERM)
        code, err = stop(stopping, signalled=True)
        for connection in opened:  # no reward: 503 Stopped, as for a batch not gathered
            status, answered = connection.answer()
            assert (status, answered["error"]["type"]) == (503, "Stopped"), answered
    finally:
        for connection in opened:
            connection.hang_up()
    assert code == 0, err
    assert "timeout graceful shutdown exceeded" in err
    assert exists(tmp_path, "0.cancelled", "1.cancelled")
    for leak in ("never retrieved", "was destroyed but it is pending", "Warning", "Traceback"):
        assert leak not in err, err


def test_five_thousand_one_item_requests_at_once_each_get_their_own(service: Service) -> None:
    """More one-item requests than ``MAX_GATHERED`` read in one pass of the loop: a batch flushed at its size
    mid-pass, the rest in the next; every request answered, each its own reward."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < FILES:
        pytest.skip(f"{BURST} connections need {FILES} open files; this machine allows fewer")
    count = BURST
    wanted = [[echo(n, ("echo", "echo2")[n % 2], item_id=n)] for n in range(count)]
    bodies = [score_body(items, first_index=n) for n, items in enumerate(wanted)]
    answers, before, after = counted_burst(service, bodies)
    for answer, items in zip(answers, wanted, strict=True):
        check_result(answer, items)
    assert after[0] - before[0] == count
    assert 2 <= after[1] - before[1] < count / 10


def test_a_gathered_requests_reward_sums_are_exact_as_alone(service: Service) -> None:
    """Each verifier's ``reward_sum`` is its items' exact sum (``math.fsum``), as a warm cheap plugin's batch
    of its own reports it (one chunk, summed by ``scheduler.total``): 0.1 + 0.2 + 0.3 added one by one is
    0.6000000000000001, not 0.6."""
    sums = [echo(100), echo(200), echo(300)]
    mixed = [echo(100), echo(700, "echo2"), echo(200), echo(300), echo(100, "echo2"), echo(200, "echo2")]
    bodies = [score_body([echo(n)], first_index=n) for n in range(10)]
    bodies[3:3] = [score_body(sums, first_index=3), score_body(mixed)]
    answers, before, after = counted_burst(service, bodies)
    assert shared(before, after), (before, after)
    for (status, body), items in zip(answers[3:5], (sums, mixed), strict=True):
        check_result((status, body), items)
        own = [(report["items"], report["reward_sum"]) for report in body["verifiers"]]
        names = dict.fromkeys(item["environment"] for item in items)
        exact = {name: [expected(item) for item in items if item["environment"] == name] for name in names}
        assert own == [(len(rewards), math.fsum(rewards)) for rewards in exact.values()]
    assert [report["reward_sum"] for report in answers[3][1]["verifiers"]] == [0.6]


# --- the gatherer closing ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def measured_gatherer(tmp_path: Path, item: dict[str, Any]) -> AsyncIterator[Gatherer]:
    """A gatherer on an engine of its own, ``item``'s plugin measured cheap (its requests are gathered)."""
    make_envs(tmp_path, "http://127.0.0.1:9")  # the endpoint is never called
    async with engine.Engine(engine.EngineConfig(environments=tmp_path / "envs", allow_unpinned=True)) as eng:
        gatherer = Gatherer(eng, lambda result: None, lambda exc: None)
        for _ in range(100):  # scored alone until measured cheap, as the service does
            if gatherer.takes([item], 0):
                break
            gatherer.scored(await eng.run([item]))
        assert gatherer.takes([item], 0), gatherer.costs
        yield gatherer


async def test_one_item_requests_measured_cheap_are_all_taken(tmp_path: Path) -> None:
    """One-item requests each with its own ``first_index`` and item id may all be gathered, once their plugin is
    measured cheap; an item of a plugin not measured yet, or a ``first_index`` the engine would refuse, may not."""
    async with measured_gatherer(tmp_path, echo(1)) as gatherer:
        assert all(gatherer.takes([echo(n, item_id=f"i{n}")], n) for n in range(200))
        assert not gatherer.takes([echo(1, "echo2")], 0)
        assert not gatherer.takes([echo(1)], -1)


async def never_hangs_up() -> dict[str, Any]:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def test_requests_still_in_the_window_when_the_gatherer_closes_are_gone_and_nothing_is_scored_after(
    tmp_path: Path,
) -> None:
    """``aclose`` (the service stopping) ends the window too: a request read but not yet in a batch is answered
    ``Gone``, and no batch starts after it (one would run on the engine being closed: "the engine is not open")."""
    async with measured_gatherer(tmp_path, echo(5)) as gatherer:
        (request,) = await started(gatherer.run([echo(5)], 0, never_hangs_up))  # read: in the window for more
        assert not request.done() and gatherer.batches == 0
        await gatherer.aclose()
        with pytest.raises(Gone):
            await request
        await anyio.sleep(0.05)  # past the window
        assert gatherer.batches == 0


async def test_a_request_whose_batch_is_cancelled_before_it_begins_is_gone(tmp_path: Path) -> None:
    """A batch's task cancelled before its first step never runs its own ``finally``: its requests must still be
    answered (``Gone``), not left waiting forever."""
    async with measured_gatherer(tmp_path, echo(5)) as gatherer:
        (request,) = await started(gatherer.run([echo(5)], 0, never_hangs_up))  # read: in the window for more
        # the window's next pass brought none: its batch is made, and has not begun (it begins a pass later)
        await each_pass_until(lambda: gatherer.batches == 1, message="no batch was made")
        assert not request.done()
        await gatherer.aclose()
        with pytest.raises(Gone):
            await asyncio.wait_for(request, 30)  # generous: it is answered at once, or never
