"""A real HTTP/1.1 server on 127.0.0.1 for the tests, with a scriptable handler and counters.

It runs its own event loop in a background thread, so it never shares a loop with the code under
test (the blocking engine runs yet another loop of its own). It speaks just enough HTTP/1.1 for a
client: Content-Length bodies, keep-alive, and ``Connection: close``. While a handler holds a
request, the server keeps reading the socket, so it sees the client hang up and counts it.

A ``Response`` can also misbehave, for the fault tests: trickle its body a piece at a time, send it
chunked (no length), reset the connection part way through the body, or be raw bytes instead of
a well-formed response. ``body_bytes_sent`` counts the body bytes the server got onto the wire.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import polling


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int  # which connection it came on, numbered from 1

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    # faults, all off by default
    raw: bytes | None = None  # sent instead of a formatted response; then the server closes the connection
    chunked: bool = False  # Transfer-Encoding: chunked, one chunk per piece, and no Content-Length
    piece: int = 65536  # bytes per write of the body, when trickled, chunked or reset
    trickle: float | None = None  # seconds to wait before each piece of the body
    reset_after: int | None = None  # send this many body bytes, then reset the connection (TCP RST)

    @property
    def streamed(self) -> bool:
        return self.chunked or self.trickle is not None or self.reset_after is not None

    @classmethod
    def json(cls, value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return cls(status, orjson.dumps(value), {"content-type": "application/json", **(headers or {})})


Handler = Callable[[Request], Awaitable[Response]]

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


class TestServer:
    """``with TestServer(handler) as server: ... server.url ...``; counters are read from any thread."""

    __test__ = False  # not a pytest test class

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[Request] = []
        self.request_times: list[float] = []  # time.monotonic() at each request's arrival
        self.opened = 0  # connections accepted
        self.closed = 0  # connections the client closed (or that ended)
        self.in_flight = 0
        self.max_in_flight = 0
        self.body_bytes_sent = 0  # bytes of response bodies written (streamed responses only)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self.opened - self.closed

    def __enter__(self) -> TestServer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._connection, "127.0.0.1", 0, backlog=4096)

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def wait_until(self, predicate: Callable[[TestServer], bool], timeout: float = polling.POLL_TIMEOUT) -> bool:
        """Poll ``predicate(self)`` until it holds or ``timeout`` passes; returns its last value."""
        try:
            polling.wait_until(lambda: predicate(self), timeout)
        except AssertionError:
            return False
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self.opened += 1
            number = self.opened
        try:
            while await self._exchange(reader, writer, number):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the server is stopping: the connection is over either way
        finally:
            with self._lock:
                self.closed += 1
            writer.close()
            self._tasks.discard(task)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        """Serve one request; False when the connection is over."""
        head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
        if not head:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        request = Request(method, path, headers, body, number)
        with self._lock:
            self.requests.append(request)
            self.request_times.append(time.monotonic())
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            # Serve the request while watching the socket: EOF there means the client hung up.
            handling = asyncio.ensure_future(self.handler(request))
            hangup = asyncio.ensure_future(reader.read(1))
            try:
                await asyncio.wait({handling, hangup}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                pending = [future for future in (handling, hangup) if not future.done()]
                for future in pending:
                    future.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            if not hangup.cancelled():
                return False  # the client hung up (or pipelined, which this server does not serve)
            response = handling.result()
        finally:
            with self._lock:
                self.in_flight -= 1
        if response.raw is not None:
            writer.write(response.raw)
            await writer.drain()
            return False
        keep_alive = headers.get("connection", "").lower() != "close"
        reason = REASONS.get(response.status, "Status")
        length = "transfer-encoding: chunked" if response.chunked else f"content-length: {len(response.body)}"
        out = [f"HTTP/1.1 {response.status} {reason}", length]
        out += [f"{name}: {value}" for name, value in response.headers.items()]
        if not keep_alive:
            out.append("connection: close")
        head = ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")
        if not response.streamed:
            writer.write(head + response.body)
            await writer.drain()
            return keep_alive
        writer.write(head)
        await writer.drain()
        return await self._stream(writer, response) and keep_alive

    async def _stream(self, writer: asyncio.StreamWriter, response: Response) -> bool:
        """Write the body a piece at a time, as ``response`` says; False if the connection was reset."""
        body, step = response.body, response.piece
        end = len(body) if response.reset_after is None else min(response.reset_after, len(body))
        for start in range(0, end, step):
            if response.trickle is not None:
                await asyncio.sleep(response.trickle)
            piece = body[start : min(start + step, end)]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if response.chunked else piece)
            await writer.drain()  # raises once the client has gone
            with self._lock:
                self.body_bytes_sent += len(piece)
        if response.reset_after is not None:
            # SO_LINGER 0: close() sends a reset instead of a FIN
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        if response.chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        return True


def json_handler(reply: Callable[[Request], Any]) -> Handler:
    """A handler that answers every request with ``reply(request)`` as a JSON 200."""

    async def handle(request: Request) -> Response:
        return Response.json(reply(request))

    return handle


async def all_closed(server: TestServer, timeout: float = polling.POLL_TIMEOUT) -> None:
    """Wait, without blocking the event loop, until the server has no open connection."""
    await polling.eventually(
        lambda: not server.open_connections, timeout, message=f"{server.open_connections} connection(s) still open"
    )
