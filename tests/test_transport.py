"""The pooled HTTP/1.1 transport under the engine's client, against real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import httpx
import pytest
from httpserver import Request, Response, TestServer, json_handler
from polling import eventually

from engine.transport import PoolTransport

pytestmark = pytest.mark.timeout(10)

RawHandler = Callable[[anyio.abc.SocketStream], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: RawHandler) -> AsyncIterator[str]:
    """A TCP server on 127.0.0.1 whose handler writes whatever bytes a test needs; yields its URL."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler)
        try:
            yield f"http://127.0.0.1:{port}/"
        finally:
            tg.cancel_scope.cancel()


async def never(request: Request) -> Response:
    """A handler that holds its request (the client gives up first)."""
    await asyncio.sleep(30)
    return Response()


async def read_request(stream: anyio.abc.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive()
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = lengths[0] if lengths else 0
    while len(body) < length:
        body += await stream.receive()
    return head


async def answered_with(data: bytes) -> httpx.Response:
    """A POST through a ``PoolTransport`` to a server that reads it, sends back ``data`` and closes."""

    async def handler(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await read_request(stream)
            await stream.send(data)

    async with raw_server(handler) as url, httpx.AsyncClient(transport=PoolTransport()) as client:
        try:
            return await client.post(url, content=b"{}")
        except httpx.TransportError as exc:  # raised out here, not wrapped by the server's task group
            failure = exc
    raise failure


async def test_posts_and_reuses_one_connection() -> None:
    with TestServer(json_handler(lambda r: {"echo": r.json(), "path": r.path})) as server:
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
        while not release.is_set():  # the server runs on its own loop and thread: poll the flag
            await asyncio.sleep(0.005)
        return Response.json({"ok": True})

    with TestServer(hold) as server:
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
    with TestServer(json_handler(lambda r: {})) as server:
        url = server.url
    async with httpx.AsyncClient(transport=PoolTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(url, content=b"{}")


async def test_read_timeout_closes_the_connection() -> None:
    with TestServer(never) as server:
        async with httpx.AsyncClient(transport=PoolTransport(), timeout=httpx.Timeout(5, read=0.2)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(server.url, content=b"{}")
        await eventually(lambda: server.open_connections == 0)


async def test_cancelled_request_closes_its_connection_and_frees_its_slot() -> None:
    with TestServer(never) as server:
        async with httpx.AsyncClient(transport=PoolTransport(1)) as client:
            with anyio.move_on_after(0.2):
                await client.post(server.url, content=b"{}")
            await eventually(lambda: server.open_connections == 0)
            server.handler = json_handler(lambda r: {"again": True})
            assert (await client.post(server.url, content=b"{}")).json() == {"again": True}


async def cut_short(client: httpx.AsyncClient, server: TestServer, count: int) -> None:
    """Start ``count`` requests the server holds, and cancel them once it holds them all."""
    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(functools.partial(client.post, server.url, content=b"{}"))
        await eventually(lambda: server.in_flight == count)
        tg.cancel_scope.cancel()


async def test_connections_of_cancelled_requests_close_once_the_deferring_block_is_left() -> None:
    with TestServer(never) as server:
        transport = PoolTransport(2)
        async with httpx.AsyncClient(transport=transport) as client:
            with transport.closes_deferred():
                with transport.closes_deferred():  # blocks nest (two batches at once): the last one out closes
                    await cut_short(client, server, 2)
                await anyio.sleep(0.1)  # the client had time to close them, and the server to see it
                assert server.open_connections == 2
            await eventually(lambda: server.open_connections == 0)
            server.handler = json_handler(lambda r: {"again": True})
            assert (await client.post(server.url, content=b"{}")).json() == {"again": True}  # the slots are free


async def test_connections_held_for_closing_count_against_the_limit_and_close_with_the_transport() -> None:
    with TestServer(never) as server:
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

    with TestServer(close_each) as server:
        async with httpx.AsyncClient(transport=PoolTransport()) as client:
            for _ in range(3):
                assert (await client.post(server.url, content=b"{}")).json() == {"n": 2}
        assert server.opened == 3


async def test_unsupported_scheme() -> None:
    async with httpx.AsyncClient(transport=PoolTransport()) as client:
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.post("ftp://127.0.0.1/x", content=b"{}")
