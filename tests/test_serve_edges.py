"""``engine serve`` tried as a hostile client, a careless one and a faulty plugin would: real services, real sockets.

Half-sent heads and bodies, more connections than it keeps, a body of 100 MiB of empty items, integers
wider than 64 bits, a ``first_index`` at the edge of int64, plugins that raise ``KeyboardInterrupt`` or
``SystemExit``, a request cut off at the graceful deadline, tokens read with their newline.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from cli_support import child_env, engine_command
from polling import wait_until
from test_serve import Service, start_service, stop
from test_serve_gather import WAIT, plugin

import engine
from engine._serve.body import SMALL

pytestmark = pytest.mark.timeout(120)

TOKEN = "edge-token"
HEAD_TIMEOUT = 2.0  # the module's service: seconds a head may take
BODY_TIMEOUT = 1.0  # the impatient service's: seconds a body may take (the module's has the default, a minute)
MOST = 64  # the module's service: connections it keeps open
WIDE = 2**64 + 1  # an integer orjson would read as a float

EXACT = f"""\
def score(task, trajectory):
    wanted = task["wanted"]
    return 1.0 if type(wanted) is int and wanted in ({WIDE}, -(2**63) - 1, 10**40) else 0.0
"""
INTERRUPTED = """\
def score(task, trajectory):
    if trajectory == "boom":
        raise KeyboardInterrupt("the plugin's own")
    return 0.5
"""
INTERRUPTED_ASYNC = """\
async def score(task, trajectory):
    if trajectory == "boom":
        raise KeyboardInterrupt("the plugin's own")
    return 0.5
"""
EXITS_ASYNC = """\
import sys


async def score(task, trajectory):
    if trajectory == "boom":
        sys.exit(3)
    return 0.5
"""
FAILS = """\
def score(task, trajectory):
    if trajectory == "boom":
        raise ValueError("no")
    return 0.5
"""


def make_envs(root: Path) -> None:
    envs = root / "envs"
    plugin(envs, "exact", EXACT)
    plugin(envs, "interrupted", INTERRUPTED)
    plugin(envs, "interrupted_async", INTERRUPTED_ASYNC)
    plugin(envs, "exits_async", EXITS_ASYNC)
    plugin(envs, "fails", FAILS)
    plugin(envs, "wait", WAIT)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("edges")
    make_envs(root)
    # the default body timeout: a large body's upload takes seconds on a loaded machine; idle connections are
    # kept a second (uvicorn's 5 s was most of the keep-alive test's time)
    running = start_service(root, "", "--head-timeout", str(HEAD_TIMEOUT), "--max-connections", str(MOST),
                            "--max-items", "1000", "--keep-alive", "1", token=TOKEN)
    yield running
    code, err = stop(running)
    assert code == 0, err
    assert "Traceback" not in err, err


def item(environment: str, trajectory: Any = "", **task: Any) -> dict[str, Any]:
    return {"environment": environment, "task": task, "trajectory": trajectory}


def port(service: Service) -> int:
    return int(service.url.rsplit(":", 1)[1])


def metric(service: Service, name: str) -> float:
    return service.metrics().get((name, ()), 0.0)


# --- integers wider than 64 bits -----------------------------------------------------------------------------


@pytest.mark.parametrize("wanted", [str(WIDE), str(-(2**63) - 1), "1" + "0" * 40])
@pytest.mark.parametrize("padding", [0, SMALL], ids=["small body", "large body"])
def test_a_wide_integer_reaches_the_plugin_exactly(service: Service, wanted: str, padding: int) -> None:
    """orjson reads such an integer as a float: the plugin got 1.8446744073709552e+19 and scored 0.0 with 200."""
    trajectory = orjson.dumps("x" * padding).decode()
    body = f'{{"items": [{{"environment": "exact", "task": {{"wanted": {wanted}}}, "trajectory": {trajectory}}}]}}'
    response = service.post("/v1/score", body.encode())
    assert response.status_code == 200, response.text
    assert response.json()["rewards"] == [1.0]


@pytest.mark.parametrize("wanted", [WIDE, -(2**63) - 1, 10**40])
async def test_a_wide_integer_crosses_the_client_and_the_service_exactly(service: Service, wanted: int) -> None:
    async with engine.Engine.connect(service.url, token=TOKEN) as eng:
        assert await eng.score([item("exact", wanted=wanted)] * 3) == [1.0] * 3


async def test_a_wide_integer_id_of_a_failing_item_comes_back_exactly(service: Service) -> None:
    """The service read it exactly, and could not write it into the error: a 500."""
    body = f'{{"items": [{{"environment": "fails", "task": {{}}, "trajectory": "boom", "id": {WIDE}}}]}}'
    response = service.post("/v1/score", body.encode())
    assert response.status_code == 422, response.text
    assert f'"item_id":{WIDE}' in response.text
    async with engine.Engine.connect(service.url, token=TOKEN) as eng:
        with pytest.raises(engine.VerificationError) as info:
            await eng.score([{**item("fails", "boom"), "id": WIDE}])
    assert info.value.item_id == WIDE


async def test_a_nan_in_a_task_is_refused_by_the_client_not_sent_as_null(service: Service) -> None:
    """orjson writes NaN as null: the plugin would have received None."""
    async with engine.Engine.connect(service.url, token=TOKEN) as eng:
        with pytest.raises(TypeError, match="NaN and infinities are not JSON numbers"):
            await eng.score([item("exact", wanted=float("nan"))])


@pytest.mark.parametrize("padding", [0, SMALL], ids=["small body", "large body"])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e400"])
def test_a_number_json_cannot_mean_is_refused_whatever_the_size_of_the_body(
    service: Service, number: str, padding: int
) -> None:
    trajectory = orjson.dumps("x" * padding).decode()
    body = f'{{"items": [{{"environment": "exact", "task": {{"wanted": {number}}}, "trajectory": {trajectory}}}]}}'
    response = service.post("/v1/score", body.encode())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("the body is not JSON")


# --- half-sent requests and too many connections --------------------------------------------------------------


def half_sent(service: Service, count: int) -> list[socket.socket]:
    """``count`` connections that each send a request line and one header, and stop (no token: none is needed)."""
    opened = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port(service)), timeout=60)
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        opened.append(sock)
    return opened


def closed_by_the_service(sock: socket.socket) -> bool:
    """Whether the service closed ``sock`` (waits for it: far longer than the head timeout)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def scored(service: Service) -> list[float]:
    response = service.post("/v1/score", {"items": [item("fails")]})
    assert response.status_code == 200, response.text
    rewards: list[float] = response.json()["rewards"]
    return rewards


def test_half_sent_heads_are_closed_and_authorised_clients_answered_meanwhile(service: Service) -> None:
    """300 connections that sent a line and a header were all still open after 45 s, and held the service."""
    before = metric(service, "engine_connections_head_timeouts_total")
    held = half_sent(service, MOST // 2)
    assert scored(service) == [0.5]  # answered while they are open
    assert all(closed_by_the_service(sock) for sock in held)
    assert metric(service, "engine_connections_head_timeouts_total") - before >= len(held)


def test_past_its_connections_the_service_closes_the_longest_waiting_and_keeps_answering(service: Service) -> None:
    before = metric(service, "engine_connections_made_room_total")
    held = half_sent(service, 5 * MOST)
    try:
        assert scored(service) == [0.5]  # its connection made room: the oldest half-sent one was closed
        assert metric(service, "engine_connections_made_room_total") - before >= 4 * MOST
        gauges = service.metrics()
        assert gauges[("engine_connections_open", ())] <= MOST
    finally:
        assert all(closed_by_the_service(sock) for sock in held)


@pytest.fixture
def impatient(tmp_path: Path) -> Iterator[Service]:
    """A service whose bodies have ``BODY_TIMEOUT`` seconds to arrive."""
    make_envs(tmp_path)
    running = start_service(tmp_path, "", "--body-timeout", str(BODY_TIMEOUT), token=TOKEN)
    yield running
    code, err = stop(running)
    assert code == 0, err


def test_a_body_not_sent_in_time_is_answered_408_and_closed(impatient: Service) -> None:
    with socket.create_connection(("127.0.0.1", port(impatient)), timeout=60) as sock:
        sock.sendall(f"POST /v1/score HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {TOKEN}\r\n"
                     "content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"items\": [".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert orjson.loads(body)["error"]["type"] == "Timeout"


def test_an_idle_kept_alive_connection_is_closed_and_the_client_reconnects(service: Service) -> None:
    with httpx.Client(headers=service.headers, timeout=60) as client:
        first = client.post(service.url + "/v1/score", content=orjson.dumps({"items": [item("fails")]}))
        wait_until(lambda: metric(service, "engine_connections_open") <= 1, 30, "the idle connection stayed open")
        again = client.post(service.url + "/v1/score", content=orjson.dumps({"items": [item("fails")]}))
    assert first.json()["rewards"] == again.json()["rewards"] == [0.5]


# --- a large body -------------------------------------------------------------------------------------------------


def peak_rss(service: Service) -> int:
    """The service's peak resident memory so far, in bytes (VmHWM)."""
    status = Path(f"/proc/{service.process.pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def test_a_body_of_a_hundred_mib_of_empty_items_is_refused_before_it_is_built(service: Service) -> None:
    """Parsed whole, such a body took 3.3 GiB before its item count was checked."""
    body = b'{"items": [' + b"{}," * (100 * 2**20 // 3 - 1) + b"{}]}"  # (joining a list of them took seconds)
    before = peak_rss(service)
    response = httpx.post(service.url + "/v1/score", content=body, headers=service.headers, timeout=90)
    assert response.status_code == 413, response.text
    assert "more than 1000 items" in response.json()["error"]["message"]
    assert peak_rss(service) - before < 4 * len(body)  # the body, joined, and as text: not 33 M dicts


def test_the_service_answers_others_while_it_parses_a_large_body(service: Service) -> None:
    """A large body is parsed an item at a time with turns for the loop: a health check is not held for it.

    The body is refused at its end (an unknown key), so the request's time is its reading and parsing."""
    heavy = item("fails", [[n, [n]] for n in range(2_000)])
    body = orjson.dumps({"items": [heavy] * 1000, "nothing": 1})
    gaps: list[float] = []
    done = threading.Event()

    def check_health() -> None:
        with httpx.Client(headers=service.headers, timeout=60) as client:
            last = time.perf_counter()
            while not done.is_set():
                assert client.get(service.url + "/healthz").status_code == 200
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

    checker = threading.Thread(target=check_health)
    checker.start()
    try:
        wait_until(lambda: len(gaps) >= 3, 30, "the health checks never started")
        started = time.perf_counter()
        response = httpx.post(service.url + "/v1/score", content=body, headers=service.headers, timeout=90)
        took = time.perf_counter() - started
    finally:
        done.set()
        checker.join(60)
    assert response.status_code == 400, response.text
    assert max(gaps) < took / 2, (max(gaps), took)


# --- plugins that raise what ends a process ----------------------------------------------------------------------


@pytest.mark.parametrize("environment", ["interrupted", "interrupted_async", "exits_async"])
def test_a_plugin_raising_keyboard_interrupt_or_system_exit_fails_its_item_and_the_service_serves_on(
    service: Service, environment: str
) -> None:
    """A thread plugin's KeyboardInterrupt ended the whole service: its other clients got 500, then nothing."""
    batch = [item(environment), item(environment, "boom"), item(environment)]
    response = service.post("/v1/score", {"items": batch, "first_index": 10})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["type"], error["environment"], error["index"]) == ("VerificationError", environment, 11)
    assert error["message"].startswith(("raised KeyboardInterrupt", "raised SystemExit"))
    assert service.post("/v1/score", {"items": [item(environment)]}).json()["rewards"] == [0.5]
    assert service.process.poll() is None


# --- first_index at the edge -----------------------------------------------------------------------------------


@pytest.mark.parametrize("first_index", [2**64 - 1, 2**63 - 1, 2**63])
def test_a_first_index_that_leaves_an_item_past_int64_is_refused_up_front(service: Service, first_index: int) -> None:
    """A failing second item at 2**64 - 1 was answered 500 with a traceback (its index could not be written)."""
    body = {"items": [item("fails"), item("fails", "boom")], "first_index": first_index}
    response = service.post("/v1/score", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "ValueError"
    assert "2**63 - 1" in response.json()["error"]["message"]


def test_the_last_place_an_index_holds_is_named_in_an_error(service: Service) -> None:
    body = {"items": [item("fails"), item("fails", "boom")], "first_index": 2**63 - 2}
    response = service.post("/v1/score", body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["index"] == 2**63 - 1


# --- stopping, and tokens ------------------------------------------------------------------------------------------


def test_a_request_cut_off_at_the_graceful_deadline_is_answered_503_with_retry_after(tmp_path: Path) -> None:
    make_envs(tmp_path)
    stopping = start_service(tmp_path, "", "--graceful-timeout", "1")
    started, never = tmp_path / "started", tmp_path / "never"
    answers: list[httpx.Response] = []
    waiting = item("wait", "1", started=str(started), until=str(never), cancelled=str(tmp_path / "cancelled"))
    asker = threading.Thread(target=lambda: answers.append(stopping.post("/v1/score", {"items": [waiting]})))
    asker.start()
    try:
        wait_until(started.exists, 60, "the plugin never started")
        stopping.process.terminate()
        asker.join(60)
        code, err = stop(stopping, signalled=True)
    finally:
        stop(stopping)
    [answer] = answers
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["type"] == "Stopped"
    assert code == 0, err
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err


@pytest.mark.parametrize(("token", "said"), [
    (TOKEN + "\n", "holds a newline at its end"),
    (" " + TOKEN, "holds a space at its start"),
    ("edge token", "holds a space at position 5 of 10"),
    ("edge-tökèn", "holds a non-ASCII character at position 7 of 10"),
])
def test_a_token_that_could_never_match_is_refused_at_start_naming_its_variable(
    tmp_path: Path, token: str, said: str
) -> None:
    """A secret file read into a variable keeps its newline: the service then refused every request."""
    (tmp_path / "envs").mkdir()
    (tmp_path / "engine.toml").write_text('environments = "envs"\n')
    done = subprocess.run(engine_command("serve", "--config", tmp_path / "engine.toml", "--token-env", "SERVE_TOKEN"),
                          env=child_env({"SERVE_TOKEN": token}), capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert f"--token-env SERVE_TOKEN: the token {said}" in done.stderr
    assert token.strip() not in done.stderr + done.stdout
