"""The pooled HTTP/1.1 transport under the engine's client, against real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import ssl
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
import trustme
from conftest import add_endpoint_env, add_rubric_env, item
from polling import eventually
from servers import (
    AwaitData,
    Close,
    Hold,
    Read,
    Request,
    Response,
    Send,
    Server,
    Sleep,
    established,
    json_handler,
    score,
)

import engine
from engine import JudgeConfig
from engine._http.transport import PoolTransport

pytestmark = pytest.mark.timeout(10)

async def never(request: Request) -> Response:
    """A handler that holds its request (the client gives up first)."""
    await asyncio.sleep(30)
    return Response()


async def answered_with(data: bytes) -> httpx.Response:
    """A POST through a ``PoolTransport`` to a server that reads it, sends back ``data`` and closes."""
    with Server.raw([[Read(), Send(data), Close()]]) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            return await client.post(f"{server.url}/", content=b"{}")


async def test_posts_and_reuses_one_connection() -> None:
    with Server.json(lambda r: {"echo": r.json(), "path": r.path}) as server:
        async with httpx.AsyncClient(transport=PoolTransport(4)) as client:
            for n in range(5):
                response = await client.post(f"{server.url}/score?x=1", json={"n": n})
                assert response.status_code == 200
                assert response.json() == {"echo": {"n": n}, "path": "/score?x=1"}
        assert server.opened == 1
        await eventually(lambda: server.open_connections == 0)


async def test_pool_limit_bounds_connections_per_origin() -> None:
    release = threading.Event()

    async def hold(request: Request) -> Response:
        await eventually(release.is_set)  # the server runs on its own loop and thread: poll the flag
        return Response.json({"ok": True})

    with Server(hold) as server:
        async with httpx.AsyncClient(transport=PoolTransport(3)) as client, anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(functools.partial(client.post, server.url, content=b"{}"))
            await eventually(lambda: server.in_flight == 3)
            await anyio.wait_all_tasks_blocked()
            assert server.opened == 3
            release.set()
        assert server.max_in_flight == 3
        assert len(server.requests) == 10


async def test_chunked_response_is_decoded() -> None:
    response = await answered_with(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/json\r\n\r\n"
        b"7\r\n{\"rewar\r\n8\r\nd\": 0.5}\r\n0\r\n\r\n"
    )
    assert response.json() == {"reward": 0.5}


async def test_body_delimited_by_close() -> None:
    response = await answered_with(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{\"reward\": 1}")
    assert response.json() == {"reward": 1}


async def test_close_before_a_complete_response_is_a_protocol_error() -> None:
    with pytest.raises(httpx.RemoteProtocolError, match="before the response was complete"):
        await answered_with(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"rew")


async def test_malformed_response_is_a_protocol_error() -> None:
    with pytest.raises(httpx.RemoteProtocolError, match="malformed HTTP response"):
        await answered_with(b"SMTP ready\r\n\r\n")


async def test_refused_connection_is_a_connect_error() -> None:
    with Server.json(lambda r: {}) as server:
        url = server.url
    async with httpx.AsyncClient(transport=PoolTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(url, content=b"{}")


async def test_read_timeout_closes_the_connection() -> None:
    with Server(never) as server:
        async with httpx.AsyncClient(transport=PoolTransport(), timeout=httpx.Timeout(5, read=0.2)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(server.url, content=b"{}")
        await eventually(lambda: server.open_connections == 0)


async def test_cancelled_request_closes_its_connection_and_frees_its_slot() -> None:
    with Server(never) as server:
        async with httpx.AsyncClient(transport=PoolTransport(1)) as client:
            with anyio.move_on_after(0.2):
                await client.post(server.url, content=b"{}")
            await eventually(lambda: server.open_connections == 0)
            server.handler = json_handler(lambda r: {"again": True})
            assert (await client.post(server.url, content=b"{}")).json() == {"again": True}


async def cut_short(client: httpx.AsyncClient, server: Server, count: int) -> None:
    """Start ``count`` requests the server holds, and cancel them once it holds them all."""
    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(functools.partial(client.post, server.url, content=b"{}"))
        await eventually(lambda: server.in_flight == count)
        tg.cancel_scope.cancel()


async def test_connections_of_cancelled_requests_close_once_their_block_is_left() -> None:
    with Server(never) as server:
        transport = PoolTransport(2)
        async with httpx.AsyncClient(transport=transport) as client:
            with transport.closes_deferred():  # another batch, still running: it holds nothing up
                with transport.closes_deferred():  # this batch
                    await cut_short(client, server, 2)
                    await anyio.sleep(0.1)  # the client had time to close them, and the server to see it
                    assert server.open_connections == 2  # not yet: the abort reaches its caller first
                await eventually(lambda: server.open_connections == 0)
                server.handler = json_handler(lambda r: {"again": True})
                assert (await client.post(server.url, content=b"{}")).json() == {"again": True}  # the slots are free


async def test_a_request_woken_for_a_connection_and_then_cancelled_hands_it_on() -> None:
    # Pool of one: the first request holds the connection, two more wait for it. As the first one's
    # response comes, the first waiter is woken and, in the same step, cancelled (as an abort does):
    # the second must get the connection, not wait out its pool timeout while it lies idle.
    release = threading.Event()

    async def first_held(request: Request) -> Response:
        if request.body == b"first":
            await eventually(release.is_set)
        return Response.json({"ok": request.body.decode()})

    with Server(first_held) as server:
        async with httpx.AsyncClient(transport=PoolTransport(1), timeout=httpx.Timeout(30)) as client:

            async def first_then_cancel_the_waiter() -> None:
                await client.post(server.url, content=b"first")
                woken.cancel()  # the waiter was handed the connection, and has not run yet

            first = asyncio.create_task(first_then_cancel_the_waiter())
            await eventually(lambda: server.in_flight == 1)
            woken = asyncio.create_task(client.post(server.url, content=b"woken"))
            await anyio.wait_all_tasks_blocked()
            second = asyncio.create_task(client.post(server.url, content=b"second"))
            await anyio.wait_all_tasks_blocked()
            release.set()
            await first
            response = await second  # the pytest timeout fails it if it waits for a free connection
            assert response.json() == {"ok": "second"}
            assert woken.cancelled()  # (so this did test a woken waiter that gave up)
async def test_connections_held_for_closing_count_against_the_limit_and_close_with_the_transport() -> None:
    with Server(never) as server:
        transport = PoolTransport(1)
        async with httpx.AsyncClient(transport=transport) as client:
            with transport.closes_deferred():
                await cut_short(client, server, 1)
                with pytest.raises(httpx.PoolTimeout):  # its connection still holds the only slot
                    await client.post(server.url, content=b"{}", timeout=httpx.Timeout(5, pool=0.1))
                await client.aclose()
                await eventually(lambda: server.open_connections == 0)
        assert server.opened == 1


async def test_not_reused_after_connection_close() -> None:
    async def close_each(request: Request) -> Response:
        return Response.json({"n": len(request.body)}, headers={"connection": "close"})

    with Server(close_each) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            for _ in range(3):
                assert (await client.post(server.url, content=b"{}")).json() == {"n": 2}
        assert server.opened == 3


async def test_unsupported_scheme() -> None:
    async with httpx.AsyncClient(transport=PoolTransport()) as client:
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.post("ftp://127.0.0.1/x", content=b"{}")


# --- interim responses, stale connections, sockets left behind (raw-socket servers, Server.raw) ---

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
RUBRICS = Path(__file__).parent / "rubrics"


def answer(body: bytes) -> bytes:
    """A complete JSON 200 (keep-alive) with ``body``."""
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def reward(n: float) -> bytes:
    return answer(json.dumps({"reward": n}).encode())


def own_reward(request: Request) -> bytes:
    """The endpoint's answer to an engine item: the reward its task carries (``task["r"]``)."""
    return reward(request.json()["task"]["r"])


def interim_then(final: Any) -> list[Any]:
    """Serve a request: a 100 Continue, a pause (the client has it alone), an Early Hints, then ``final``."""
    return [Read(), Send(CONTINUE), Sleep(0.05), Send(EARLY_HINTS), Sleep(0.02), Send(final)]


async def post(server: Server, client: httpx.AsyncClient, n: int = 0) -> Any:
    return (await client.post(server.url, json={"n": n})).json()


async def test_interim_responses_are_skipped_and_the_final_one_is_the_requests() -> None:
    with Server.raw([interim_then(reward(1)) + interim_then(reward(2))]) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            assert await post(server, client) == {"reward": 1}
            assert await post(server, client) == {"reward": 2}
        assert len(server.connections) == 1


async def test_a_101_nobody_asked_for_is_a_protocol_error() -> None:
    switching = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
    with Server.raw([[Read(), Send(switching), Hold()]]) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            with pytest.raises(httpx.RemoteProtocolError, match="switched protocols"):
                await post(server, client)


async def test_endpoint_items_on_one_connection_each_get_their_own_reward_after_interim_responses(
    envs: Path,
) -> None:
    with Server.raw([interim_then(own_reward) * 3]) as server:
        add_endpoint_env(envs, "remote", f"{server.url}/score")
        config = engine.EngineConfig(environments=envs, max_in_flight=1)  # one connection, the items in turn
        async with engine.Engine(config) as eng:
            assert await eng.score([item("remote", r=r) for r in (0.25, 0.5, 0.75)]) == [0.25, 0.5, 0.75]
        assert [len(connection.requests) for connection in server.connections] == [3]


def judge_reply(request: Request) -> bytes:
    """A judge's completion scoring an item with the number its response says."""
    messages = request.json()["messages"]
    text = next(message["content"] for message in messages if message["role"] == "user")
    answered = text.split("<response>\n", 1)[1].split("\n</response>", 1)[0]
    return answer(score(int(answered)).body)


async def test_judged_items_on_one_connection_each_get_their_own_score_after_interim_responses(
    envs: Path, tmp_path: Path
) -> None:
    rubrics = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, rubrics)
    add_rubric_env(envs, "judged", "alice/arithmetic-correctness")  # its latest version scores 0..10
    with Server.raw([interim_then(judge_reply) * 2]) as server:
        judge = JudgeConfig(base_url=server.base_url, model="judge-test", max_concurrency=1)
        config = engine.EngineConfig(environments=envs, rubrics=rubrics, judge=judge, max_in_flight=1)
        items = [item("judged", answer, prompt="What is 6 * 7?", reference="42") for answer in ("3", "7")]
        async with engine.Engine(config) as eng:
            assert await eng.score(items) == [0.3, 0.7]
        assert [len(connection.requests) for connection in server.connections] == [2]


def closes_when_the_next_request_comes(reply: Any) -> list[Any]:
    """Serve one request, keep the connection (no ``Connection: close``), and close it when another arrives unread."""
    return [Read(), Send(reply), AwaitData(), Close()]


async def test_a_request_on_a_kept_connection_the_server_closed_goes_again_on_a_new_one() -> None:
    with Server.raw([closes_when_the_next_request_comes(reward(1)), [Read(), Send(reward(2))]]) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            assert await post(server, client) == {"reward": 1}
            assert await post(server, client, 2) == {"reward": 2}
        assert [request.json() for request in server.requests] == [{"n": 0}, {"n": 2}]  # each once
        assert len(server.connections) == 2


async def test_endpoint_items_survive_a_server_that_closes_each_kept_connection(envs: Path) -> None:
    with Server.raw([closes_when_the_next_request_comes(own_reward)]) as server:
        add_endpoint_env(envs, "remote", f"{server.url}/score")
        config = engine.EngineConfig(environments=envs, max_in_flight=1)
        async with engine.Engine(config) as eng:
            assert await eng.score([item("remote", r=r) for r in (1, 2, 3, 4)]) == [1, 2, 3, 4]
        assert sorted(request.json()["task"]["r"] for request in server.requests) == [1, 2, 3, 4]


async def test_a_request_is_sent_again_once_only() -> None:
    with Server.raw([closes_when_the_next_request_comes(reward(1)), [Close()]]) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            assert await post(server, client) == {"reward": 1}
            with pytest.raises(httpx.TransportError):  # the new connection fails too: that is the end of it
                await post(server, client)
        assert len(server.connections) == 2


@pytest.mark.parametrize(
    "then",
    [
        pytest.param([Read(), Send(b"HTTP/1.1 200 OK\r\ncontent-le"), Close()], id="after-a-byte-of-response"),
        pytest.param([Read(), Send(CONTINUE), Close()], id="after-an-interim-response"),
    ],
)
async def test_a_request_that_may_have_been_acted_on_is_not_sent_again(then: list[Any]) -> None:
    with Server.raw([[Read(), Send(reward(1)), *then], [Read(), Send(reward(2))]]) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            assert await post(server, client) == {"reward": 1}
            with pytest.raises(httpx.RemoteProtocolError):
                await post(server, client)
        assert len(server.connections) == 1


async def test_a_request_that_timed_out_on_a_kept_connection_is_not_sent_again() -> None:
    with Server.raw([[Read(), Send(reward(1)), Read(), Hold()], [Read(), Send(reward(2))]]) as server:
        async with httpx.AsyncClient(transport=PoolTransport(), timeout=httpx.Timeout(10, read=0.2)) as client:
            assert await post(server, client) == {"reward": 1}
            with pytest.raises(httpx.ReadTimeout):
                await post(server, client)
        assert len(server.connections) == 1


BIG = b"x" * (8 << 20)  # a request body the kernel's buffers cannot hold while the server does not read


async def released(server: Server) -> None:
    """The server saw the client go (a FIN or a reset), and no socket of the client's is ESTABLISHED."""
    (connection,) = server.connections
    await eventually(lambda: connection.closed_by_client, message="the server never saw the client go")
    assert not established(connection.peer_port)


async def test_a_timed_out_request_whose_body_was_never_read_leaves_no_socket_behind() -> None:
    with Server.raw([[Hold()]]) as server:
        async with httpx.AsyncClient(transport=PoolTransport(), timeout=httpx.Timeout(10, read=0.2)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(server.url, content=BIG)
        await released(server)


@pytest.mark.parametrize("deferred", [False, True], ids=["plain", "closes-deferred"])
async def test_a_cancelled_request_whose_body_was_never_read_leaves_no_socket_behind(deferred: bool) -> None:
    with Server.raw([[Hold()]]) as server:
        transport = PoolTransport()
        async with httpx.AsyncClient(transport=transport) as client:
            with transport.closes_deferred() if deferred else contextlib.nullcontext():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(client.post, server.url, content=BIG))
                    await eventually(lambda: server.connections)
                    await anyio.sleep(0.05)  # the body is on its way, as far as the buffers take it
                    tg.cancel_scope.cancel()
        await released(server)


async def test_an_endpoint_call_that_timed_out_on_an_unread_body_leaves_no_socket_behind(envs: Path) -> None:
    with Server.raw([[Hold()]]) as server:
        url = f"{server.url}/score"
        add_endpoint_env(envs, "remote", url)
        config = engine.EngineConfig(environments=envs, refs={url: engine.Limits(timeout=0.2)})
        async with engine.Engine(config) as eng:
            with pytest.raises(engine.VerificationError, match="timed out"):
                await eng.score([item("remote", "x" * (8 << 20))])
        await released(server)


async def test_closing_resets_a_kept_tls_connection_whose_server_never_answers_the_close(tmp_path: Path) -> None:
    # A graceful TLS close waits for the server's close_notify (asyncio: up to 30 s); a server that
    # answers one request and then holds its socket without reading never sends it.
    ca = trustme.CA()
    answered = [Read(), Send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"), Hold()]  # then reads nothing
    with Server.raw([answered], tls=ca.issue_cert("127.0.0.1")) as server:
        client_context = ssl.create_default_context()
        ca.configure_trust(client_context)
        transport = PoolTransport(ssl_context=client_context)
        async with httpx.AsyncClient(transport=transport) as client:
            assert (await client.post(f"{server.url}/", content=b"{}")).json() == {}
        (connection,) = server.connections
        assert not established(connection.peer_port)  # reset by aclose() once the graceful close went unanswered
