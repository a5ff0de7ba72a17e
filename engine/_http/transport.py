"""The HTTP transport under the engine's ``httpx.AsyncClient``: keep-alive HTTP/1.1 pools on asyncio.

Why not httpx's own, what it speaks, when it sends a request again, and its bounds and deadlines:
docs/design.md, Transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
import ssl
import struct
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import httptools
import httpx

__all__ = ["MAX_BODY", "TOTAL_TIMEOUT", "PoolTransport", "ResponseTooLarge", "size_text"]

DEFAULT_MAX_CONNECTIONS = 1024
CLOSE_WAIT = 1.0  # seconds aclose() waits for closed sockets to be released
MAX_HEAD = 64 * 1024  # bytes: a response's status line and headers (interim responses' included)
FRAMING = 8  # bytes of chunk framing, extensions and trailers allowed per body byte, beyond MAX_HEAD
MAX_BODY = "max_body"  # the request extension that caps the response body, in bytes
TOTAL_TIMEOUT = "total_timeout"  # the request extension: seconds the whole call may take
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: closing the socket sends a reset at once


def size_text(size: int) -> str:
    """A byte count for people: ``1 MiB``, ``64 KiB``, ``1.5 MiB``, ``1000 bytes``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} byte{'s' if size != 1 else ''}"


class ResponseTooLarge(httpx.TransportError):
    """A response longer than the caller's cap (``max_body``), refused without reading the rest."""

    def __init__(self, limit: int, announced: int | None = None, *, head: bool = False, framing: bool = False) -> None:
        if head:
            self.reason = f"response headers over {size_text(limit)}"
        elif framing:
            self.reason = f"response chunk framing and trailers over {size_text(limit)} beyond the body's own size"
        elif announced is not None:
            self.reason = f"response body of {announced} bytes is over the {size_text(limit)} limit (max_body)"
        else:
            self.reason = f"response body over the {size_text(limit)} limit (max_body)"
        super().__init__(self.reason)


def _ends(request: httpx.Request, phase: str, deadline: float | None) -> float | None:
    """The loop time by which ``phase`` must end: its own timeout from now, or the call's deadline if sooner."""
    timeout: Mapping[str, float | None] = request.extensions.get("timeout", {})
    seconds = timeout.get(phase)
    if seconds is None:
        return deadline
    end = asyncio.get_running_loop().time() + seconds
    return end if deadline is None else min(end, deadline)


def _refusal(headers: list[tuple[bytes, bytes]], limit: int) -> Exception | None:
    """Why a response must be refused on its head alone, under a body cap of ``limit`` bytes (one pass)."""
    for name, value in headers:
        size = len(name)
        if size == 14 and name.lower() == b"content-length":
            if value.strip().isdigit() and int(value) > limit:  # httptools refuses a malformed length itself
                return ResponseTooLarge(limit, int(value))
        elif size == 16 and name.lower() == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            named = value.strip().decode("latin-1")
            return httpx.DecodingError(f"the response is compressed (Content-Encoding: {named}), not asked for")
    return None


class _Unsolicited(Exception):
    """A response began after the request's own was complete: the connection is out of step."""


class _Connection(asyncio.Protocol):
    """One TCP connection and the response being read on it (httptools calls the ``on_*`` methods)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._headers_done = False  # the final response's head is complete (an interim one's does not count)
        self._received = 0  # bytes received since the request was sent
        self._head_end = 0  # bytes received when the final head was complete (its data_received call's end)
        self._body_size = 0
        self._limit: int | None = None  # the cap on this response's body, if any
        self._timer: asyncio.TimerHandle | None = None  # the response's deadline
        self.reusable = False
        self.sent = 0  # requests sent on this connection, the current one included
        self.lost: asyncio.Future[None] = loop.create_future()  # done once the socket is closed

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # bytes while idle, or after the response: nobody asked for them
            self.reusable = False
            self.close()
            return
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the server asked for a protocol upgrade"))
        except httptools.HttpParserError as exc:  # _Unsolicited too: the response is delivered, this closes
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
        if not self._headers_done:
            if self._received > MAX_HEAD:  # httptools buffers an unfinished head
                self._fail(ResponseTooLarge(MAX_HEAD, head=True))
        elif self._received - self._head_end - self._body_size > MAX_HEAD + FRAMING * self._body_size:
            # chunk extensions and trailers are buffered by httptools too, and count against no body cap
            self._fail(ResponseTooLarge(MAX_HEAD, framing=True))

    def eof_received(self) -> None:
        self.reusable = False  # returning None: the transport closes itself, so it is never handed out again

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if not self.lost.done():
            self.lost.set_result(None)
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if exc is None and self._headers_done and not self._delimited():
            self.on_message_complete()  # the body was delimited by the close itself (a reset is no delimiter)
        else:
            reason = f"the server closed the connection before the response was complete ({exc or 'EOF'})"
            self._fail(httpx.RemoteProtocolError(reason) if exc is None else httpx.ReadError(reason))

    def _delimited(self) -> bool:
        names = {name.lower() for name, _ in self._headers}
        return b"content-length" in names or b"transfer-encoding" in names

    # httptools callbacks
    def on_message_begin(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # a second response to one request: stop parsing, close
            raise _Unsolicited

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._headers_done:  # after the head: a chunked body's trailers, dropped
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim response: its end resets the head, the final one follows
            if status < 100:
                self._fail(httpx.RemoteProtocolError(f"invalid status code {status:03d}"))
            elif status == 101:
                self._fail(httpx.RemoteProtocolError("the server switched protocols (101), which was not asked for"))
            return
        self._headers_done = True
        self._head_end = self._received
        if self._limit is not None:
            refusal = _refusal(self._headers, self._limit)
            if refusal is not None:
                self._fail(refusal)

    def on_body(self, body: bytes) -> None:
        if not self._headers_done:  # httptools reads a body after some 1xx heads; none may have one (RFC 9110)
            self._fail(httpx.RemoteProtocolError("an interim (1xx) response carries a body"))
            return
        self._body_size += len(body)
        limit = self._limit
        if limit is not None and self._body_size > limit:
            self._fail(ResponseTooLarge(limit))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if not self._headers_done:  # the end of an interim (1xx) response: nothing of it is the final one's
            self._headers, self._body, self._body_size = [], [], 0
            return
        self.reusable = self._parser.should_keep_alive()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result((self._parser.get_status_code(), self._headers, b"".join(self._body)))

    # used by the pool
    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.abort()

    @property
    def replayable(self) -> bool:
        """True if the request just sent may go again: the connection was reused and no response byte came."""
        return self.sent > 1 and not self._received

    @property
    def alive(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def send(
        self, data: bytes, limit: int | None, ends: float | None
    ) -> asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]]:
        """Write a request; the future of its response's status, headers and body.

        At ``ends`` (loop time) the future fails with ``TimeoutError`` and the connection is closed.
        A plain timer, not an ``asyncio.timeout`` block around the await: at 1,024 calls in flight
        every object a waiting call holds is one more for the garbage collector to scan and
        promote, and the block costs five of them.
        """
        assert self._transport is not None
        self._waiter = waiter = self._loop.create_future()
        self._headers, self._body, self._headers_done, self.reusable = [], [], False, False
        self._received = self._head_end = self._body_size = 0
        self._limit = limit
        self.sent += 1
        self._transport.write(data)
        if ends is not None:
            self._timer = self._loop.call_at(ends, self._expire)
        return waiter

    def _expire(self) -> None:
        self._timer = None
        self._fail(TimeoutError())

    def disarm(self) -> None:
        """Stop the response's timer (it is done, or nobody waits for it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Close gracefully: for a connection with no request in flight."""
        self.reusable = False
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now, with a reset: for one a request was cut short on (unsent bytes are discarded)."""
        self.reusable = False
        transport = self._transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):  # the socket may be gone already
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            transport.abort()


# The connections of requests cancelled inside the current closes_deferred() block (a batch): a context
# variable, so each block closes its own, whatever other blocks run on the same transport meanwhile.
_cut_short_here: contextvars.ContextVar[list[_Connection] | None] = contextvars.ContextVar(
    "engine_transport_cut_short", default=None
)


@dataclass(eq=False)
class _Pool:
    """The connections to one origin: idle ones to reuse, and a bound on how many exist."""

    limit: int
    idle: deque[_Connection]
    waiters: deque[asyncio.Future[None]]
    count: int = 0


class PoolTransport(httpx.AsyncBaseTransport):
    """A keep-alive connection pool per origin, at most ``max_connections`` connections to each."""

    def __init__(self, max_connections: int = DEFAULT_MAX_CONNECTIONS, ssl_context: ssl.SSLContext | None = None):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._limit = max_connections
        self._ssl = ssl_context
        self._pools: dict[tuple[bytes, bytes, int], _Pool] = {}
        self._closed = False
        self._cut_short: dict[_Connection, _Pool] = {}  # connections of cancelled requests, not yet closed

    @contextlib.contextmanager
    def closes_deferred(self) -> Iterator[None]:
        """Inside it, a request cancelled in this block (or a task started in it) has its connection closed
        just after the block is left (in the next turn of the loop), not at once; other blocks' are theirs."""
        mine: list[_Connection] = []
        token = _cut_short_here.set(mine)
        try:
            yield
        finally:
            _cut_short_here.reset(token)
            if mine:
                asyncio.get_running_loop().call_soon(self._close_cut_short, mine)

    def _close_cut_short(self, connections: list[_Connection]) -> None:
        for connection in connections:
            pool = self._cut_short.pop(connection, None)
            if pool is not None:  # (aclose() may have closed it already)
                connection.abort()
                self._release(pool, connection)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl

    async def _connect(
        self, request: httpx.Request, origin: tuple[bytes, bytes, int], deadline: float | None
    ) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self._ssl_context() if scheme == b"https" else None
        try:
            async with asyncio.timeout_at(_ends(request, "connect", deadline)):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), host.decode("ascii"), port, ssl=tls
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout("timed out connecting", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        return connection

    async def _acquire(
        self,
        request: httpx.Request,
        pool: _Pool,
        origin: tuple[bytes, bytes, int],
        deadline: float | None,
        fresh: bool = False,
    ) -> _Connection:
        """A connection for ``request``: an idle one if there is one, else a new one (always new if ``fresh``)."""
        while pool.idle and not fresh:
            connection = pool.idle.pop()
            if connection.alive:
                return connection
            pool.count -= 1
        if fresh and pool.idle and pool.count >= pool.limit:  # make room: the idle ones may be as stale
            pool.idle.popleft().close()
            pool.count -= 1
        if pool.count >= pool.limit:
            waiter = asyncio.get_running_loop().create_future()
            pool.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(_ends(request, "pool", deadline)):
                    await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._wake(pool)  # woken, but leaving (an abort, the deadline): the next waiter goes instead
                else:
                    waiter.cancel()
                    if waiter in pool.waiters:
                        pool.waiters.remove(waiter)
                if isinstance(exc, TimeoutError):
                    raise httpx.PoolTimeout("timed out waiting for a connection", request=request) from exc
                raise
            return await self._acquire(request, pool, origin, deadline, fresh)
        pool.count += 1
        try:
            return await self._connect(request, origin, deadline)
        except BaseException:
            self._release(pool, None)
            raise

    def _release(self, pool: _Pool, connection: _Connection | None) -> None:
        """Give a connection back (None: it is gone), and wake one request waiting for one."""
        if connection is not None and connection.reusable and connection.alive and not self._closed:
            pool.idle.append(connection)
        else:
            if connection is not None:
                connection.close()
            pool.count -= 1
        self._wake(pool)

    @staticmethod
    def _wake(pool: _Pool) -> None:
        """Wake one request waiting for a connection of ``pool``, if any waits."""
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        scheme = url.raw_scheme
        if scheme not in (b"http", b"https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}", request=request)
        origin = (scheme, url.raw_host, url.port or (443 if scheme == b"https" else 80))
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(self._limit, deque(), deque())
        body = await request.aread()
        head = [request.method.encode("ascii"), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for name, value in request.headers.raw:
            head += [name, b": ", value, b"\r\n"]
        data = b"".join(head) + b"\r\n" + body
        extensions = request.extensions
        total: float | None = extensions.get(TOTAL_TIMEOUT)
        deadline = None if total is None else asyncio.get_running_loop().time() + total
        connection = await self._acquire(request, pool, origin, deadline)
        limit: int | None = extensions.get(MAX_BODY)
        ends = _ends(request, "read", deadline)
        replayed = False
        while True:
            try:
                try:
                    status, headers, content = await connection.send(data, limit, ends)
                except TimeoutError as exc:
                    raise httpx.ReadTimeout("timed out waiting for the response", request=request) from exc
                except httpx.RequestError as exc:
                    exc.request = request
                    raise
                finally:
                    connection.disarm()
            except BaseException as exc:
                connection.reusable = False  # so it is closed, not pooled
                deferred = _cut_short_here.get()
                if deferred is not None and isinstance(exc, asyncio.CancelledError):
                    deferred.append(connection)  # an abort: its caller first, the close right after its block
                    self._cut_short[connection] = pool
                    raise
                connection.abort()
                self._release(pool, connection)
                dropped = isinstance(exc, httpx.ReadError | httpx.RemoteProtocolError)  # EOF or reset, not a timeout
                if replayed or not dropped or not connection.replayable:
                    raise
                # a kept connection the server had closed, before any byte of a response: once more, on a new one
                replayed = True
                connection = await self._acquire(request, pool, origin, deadline, fresh=True)
                ends = _ends(request, "read", deadline)
                continue
            break
        self._release(pool, connection)
        # stream=, not content=: the latter would add a Content-Length the server did not send (to a chunked reply)
        response = httpx.Response(
            status, headers=headers, stream=httpx.ByteStream(content), extensions={"http_version": b"HTTP/1.1"}
        )
        response.read()
        return response

    async def aclose(self) -> None:
        """Close the idle connections (and any left by cancelled requests); wait until their sockets are closed."""
        self._closed = True
        closing = [connection for pool in self._pools.values() for connection in pool.idle]
        for connection in closing:
            connection.close()
        for connection in self._cut_short:
            connection.abort()
            closing.append(connection)
        self._cut_short.clear()
        self._pools.clear()
        if not closing:
            return
        _, open_still = await asyncio.wait([connection.lost for connection in closing], timeout=CLOSE_WAIT)
        if open_still:  # a graceful close the peer never completes (a TLS close_notify unanswered): reset them
            for connection in closing:
                if not connection.lost.done():
                    connection.abort()
            await asyncio.wait(open_still, timeout=CLOSE_WAIT)
