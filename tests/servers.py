"""Real servers on 127.0.0.1 for the tests: one class, ``Server``, in a few modes.

Every mode listens on its own port from construction on (``server.port``, ``server.url``), records
each connection it accepts (``server.connections``: the client's port, the requests read on it, whether
the client went away) and each request it reads (``server.requests``), and runs apart from the code
under test (the blocking engine runs yet another loop of its own), so nothing the client does can
stall it. ``tls=`` a trustme leaf certificate makes any mode speak HTTPS.

``Server(handler)``
    HTTP/1.1 on an event loop in a background thread: each request is handed to ``handler`` (an
    ``async def`` of a ``Request`` returning a ``Response``), with Content-Length bodies, keep-alive
    and ``Connection: close``. While a handler holds a request the server keeps reading the socket,
    so it sees the client hang up, counts it and cancels the handler. A ``Response`` can misbehave
    for the fault tests: trickle its body, send it chunked, reset part way, or be raw bytes.
``Server.json(reply)``
    The same, answering every request with ``reply(request)`` as a JSON 200.
``Server.judge(*script, default=...)``
    An OpenAI-compatible chat completions API at ``server.base_url``: replies come from the script
    in order, then from ``default`` (``score(1)`` unless given) for every further request.
``Server.raw(scripts)``
    Bytes scripted step by step, one connection at a time, on plain threads with blocking sockets:
    connection ``n`` follows ``scripts[n]`` (the last script for any further one). When its script
    ends the server keeps the connection open without reading it until the client goes away or the
    server stops (that is also how "a server that stops reading" is written, ``Hold``); it sees the
    client go (FIN or reset) without reading what is still queued.
``Server.full()``
    A port whose accept queue is full: it never accepts, and the kernel drops a client's SYN.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import polling

if TYPE_CHECKING:
    import trustme

__all__ = [
    "AwaitData",
    "Close",
    "Connection",
    "Drip",
    "Hold",
    "Read",
    "Request",
    "Reset",
    "Response",
    "Send",
    "Server",
    "Sleep",
    "all_closed",
    "assert_rate_held",
    "completion",
    "established",
    "held",
    "json_handler",
    "judges",
    "score",
    "status",
]

STOP_STEPS = 1000  # loop steps a stopping server waits for the connections it is accepting
CLOSE_STEPS = 3  # event-loop steps a stopping server gives its closed connections to close their sockets
IO_TIMEOUT = 30.0  # seconds a raw step may block on the socket before the connection is dropped
WATCH = 0.01  # seconds between two looks at a held raw connection
COMPLETIONS = "/v1/chat/completions"  # the judge mode's one route


# --- requests and responses -------------------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
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
Reply = Response | Callable[[Request], Response | Awaitable[Response]]

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """A request head's method, target and headers (names in lower case)."""
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


def json_handler(reply: Callable[[Request], Any]) -> Handler:
    """A handler that answers every request with ``reply(request)`` as a JSON 200."""

    async def handle(request: Request) -> Response:
        return Response.json(reply(request))

    return handle


def held(condition: Callable[[], object], reply: Response, timeout: float = polling.POLL_TIMEOUT) -> Handler:
    """A reply that holds its request, on the server's loop, until ``condition()`` holds (or the client goes)."""

    async def hold(request: Request) -> Response:
        await polling.eventually(condition, timeout, message=f"a held {request.path} request was never released")
        return reply

    return hold


# --- raw mode: the steps of a connection's script ------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """Read one request: its head, and a body of its Content-Length."""


@dataclass(frozen=True)
class Send:
    """Send bytes; ``data`` may be a function of the last request read."""

    data: bytes | Callable[[Request], bytes]


@dataclass(frozen=True)
class Drip:
    """Send bytes ``size`` at a time, ``pause`` seconds apart."""

    data: bytes
    size: int = 3
    pause: float = 0.002


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Close:
    """Close the connection (a FIN; a reset instead if the client's bytes are still unread)."""


@dataclass(frozen=True)
class Reset:
    """Close the connection with a reset (SO_LINGER 0)."""


@dataclass(frozen=True)
class AwaitData:
    """Wait until the client sends more bytes (or goes away), without reading them."""


@dataclass(frozen=True)
class Hold:
    """Stop reading; keep the connection open until the client goes away or the server stops."""


Step = Read | Send | Drip | Sleep | Close | Reset | AwaitData | Hold


# --- the server --------------------------------------------------------------------------------------


@dataclass
class Connection:
    """What one accepted connection saw."""

    number: int  # numbered from 1, in order of acceptance
    peer_port: int  # the client's local port
    requests: list[Request] = field(default_factory=list)  # each request read on it
    closed_by_client: bool = False  # the client's FIN or reset arrived (raw mode)
    scripted: threading.Event = field(default_factory=threading.Event)  # its raw script is over (held or closed)
    done: threading.Event = field(default_factory=threading.Event)  # the server is finished with it


class Server:
    """``with Server(handler) as server: ... server.url ...``; its records are read from any thread."""

    def __init__(
        self,
        handler: Handler | None = None,
        *,
        scripts: Sequence[Sequence[Step]] | None = None,
        tls: trustme.LeafCert | None = None,
        accepting: bool = True,
    ) -> None:
        """One mode of three: ``handler`` (HTTP), ``scripts`` (raw bytes), or neither and not ``accepting``."""
        if sum([handler is not None, scripts is not None, not accepting]) != 1:
            raise ValueError("a Server needs one of a handler, raw scripts, or accepting=False")
        if scripts is not None and not scripts:
            raise ValueError("a raw Server needs at least one script")
        self.handler = handler
        self.scripts = [list(script) for script in scripts] if scripts is not None else None
        self.context: ssl.SSLContext | None = None
        if tls is not None:
            self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.configure_cert(self.context)
        self.connections: list[Connection] = []
        self.requests: list[Request] = []
        self.request_times: list[float] = []  # time.monotonic() at each request's arrival
        self.in_flight = 0  # requests a handler holds
        self.max_in_flight = 0
        self.body_bytes_sent = 0  # bytes of streamed response bodies written
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=4096 if accepting else 0)
        self.port: int = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []  # raw mode's accepted sockets; the full queue's fillers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def json(cls, reply: Callable[[Request], Any], *, tls: trustme.LeafCert | None = None) -> Server:
        """A server answering every request with ``reply(request)`` as a JSON 200."""
        return cls(json_handler(reply), tls=tls)

    @classmethod
    def judge(cls, *script: Reply, default: Reply | None = None, tls: trustme.LeafCert | None = None) -> Server:
        """A chat completions API: ``Server.judge(score(1), status(429))``; ``server.handler`` is its ``Judge``."""
        return cls(Judge(script, default), tls=tls)

    @classmethod
    def raw(cls, scripts: Sequence[Sequence[Step]], *, tls: trustme.LeafCert | None = None) -> Server:
        """A server whose bytes follow ``scripts``, one per connection: ``Server.raw([[Read(), Send(b"...")]])``."""
        return cls(scripts=scripts, tls=tls)

    @classmethod
    def full(cls) -> Server:
        """A port whose accept queue is full once the server is entered: a connect to it hangs."""
        return cls(accepting=False)

    @property
    def url(self) -> str:
        return f"{'https' if self.context else 'http'}://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """Where a judge's OpenAI-compatible API is."""
        return f"{self.url}/v1"

    @property
    def opened(self) -> int:
        """Connections accepted."""
        return len(self.connections)

    @property
    def closed(self) -> int:
        """Connections over (the client closed them, or they ended)."""
        return sum(connection.done.is_set() for connection in list(self.connections))

    @property
    def open_connections(self) -> int:
        return self.opened - self.closed

    def bodies(self) -> list[Any]:
        """The JSON bodies of the chat completion requests received so far, in arrival order."""
        return [request.json() for request in list(self.requests) if request.path == COMPLETIONS]

    def user_messages(self) -> list[str]:
        """The user message of every chat completion request received so far."""
        return [next(m["content"] for m in body["messages"] if m["role"] == "user") for body in self.bodies()]

    def __enter__(self) -> Server:
        if self.handler is not None:
            self._loop = asyncio.new_event_loop()
            self._threads.append(threading.Thread(target=self._loop.run_forever, daemon=True))
            self._threads[0].start()
            self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        elif self.scripts is not None:
            self._threads.append(threading.Thread(target=self._accept, daemon=True))
            self._threads[0].start()
        else:
            self._fill()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._threads[0].join(5)
            self._loop.close()
            return
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (closing alone does not)
        if self._threads:
            self._threads[0].join(IO_TIMEOUT)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):  # a socket already closed
                    sock.shutdown(socket.SHUT_RDWR)
                if self.scripts is None:
                    sock.close()  # a filler of the full queue (raw mode's threads close their own)
        for thread in self._threads[1:]:
            thread.join(IO_TIMEOUT)

    def stop_listening(self) -> None:
        """Refuse new connections from now on (the ones open carry on); callable from a handler."""
        if self._server is not None:
            self._server.close()
            return
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (closing alone does not)
        self._listener.close()

    def _connected(self, peer_port: int) -> Connection:
        with self._lock:
            connection = Connection(len(self.connections) + 1, peer_port)
            self.connections.append(connection)
        return connection

    def _received(self, connection: Connection, request: Request) -> Request:
        with self._lock:
            connection.requests.append(request)
            self.requests.append(request)
            self.request_times.append(time.monotonic())
        return request

    # --- HTTP mode: an event loop in a thread ---

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._connection, sock=self._listener, ssl=self.context, backlog=4096)

    async def _stop(self) -> None:
        assert self._server is not None
        # A connection being accepted is a task of the loop's for a few steps, and Python 3.11 drops its
        # socket unclosed (a ResourceWarning: an error in the tests) if the server closes before that task
        # attaches it. So: let such tasks finish (a bounded number of steps), then close the server, cancel
        # every handler (each closes its connection), and give the closed transports the loop steps in
        # which they close their sockets (connection_lost).
        this = asyncio.current_task()
        for _ in range(STOP_STEPS):
            if all(task is this or task in self._tasks for task in asyncio.all_tasks()):
                break
            await asyncio.sleep(0)
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for _ in range(CLOSE_STEPS):
            await asyncio.sleep(0)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        connection = self._connected(writer.get_extra_info("peername")[1])
        try:
            while await self._exchange(reader, writer, connection):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the server is stopping: the connection is over either way
        finally:
            connection.done.set()
            writer.close()  # the socket closes a loop step later, in connection_lost
            self._tasks.discard(task)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: Connection
    ) -> bool:
        """Serve one request; False when the connection is over."""
        head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
        if not head:
            return False
        method, path, headers = parse_head(head[:-4])
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        request = self._received(connection, Request(method, path, headers, body, connection.number))
        assert self.handler is not None
        with self._lock:
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

    # --- raw mode: a thread per connection ---

    def _accept(self) -> None:
        assert self.scripts is not None
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # the listener was closed: the server is stopping
            connection = self._connected(peer[1])
            with self._lock:
                self._sockets.append(sock)
            script = self.scripts[min(connection.number - 1, len(self.scripts) - 1)]
            thread = threading.Thread(target=self._serve, args=(sock, connection, script), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, connection: Connection, script: list[Step]) -> None:
        sock.settimeout(IO_TIMEOUT)
        buffer = b""
        last: Request | None = None
        try:
            if self.context is not None:
                plain, sock = sock, self.context.wrap_socket(sock, server_side=True)  # plain is detached
                with self._lock:
                    self._sockets[self._sockets.index(plain)] = sock
            for step in script:
                if isinstance(step, Read):
                    request, buffer = _read_request(sock, buffer, connection.number)
                    if request is None:
                        connection.closed_by_client = True
                        return
                    last = self._received(connection, request)
                elif isinstance(step, Send):
                    if callable(step.data):
                        assert last is not None, "a Send of a function of the request needs a Read before it"
                        sock.sendall(step.data(last))
                    else:
                        sock.sendall(step.data)
                elif isinstance(step, Drip):
                    for start in range(0, len(step.data), step.size):
                        sock.sendall(step.data[start : start + step.size])
                        if self._stopping.wait(step.pause):
                            return
                elif isinstance(step, Sleep):
                    if self._stopping.wait(step.seconds):
                        return
                elif isinstance(step, Close):
                    return
                elif isinstance(step, Reset):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                elif isinstance(step, AwaitData):
                    if not buffer:
                        self._watch(sock, connection, data=True)
                elif isinstance(step, Hold):
                    break
            connection.scripted.set()
            self._watch(sock, connection, data=False)
        except OSError:
            connection.closed_by_client = True  # a reset, or the server stopping under a blocked call
        finally:
            sock.close()
            connection.scripted.set()
            connection.done.set()

    def _watch(self, sock: socket.socket, connection: Connection, *, data: bool) -> None:
        """Wait, without reading, until the client goes away (or sends bytes, if ``data``) or the server stops."""
        poller = select.poll()
        events = select.POLLRDHUP | select.POLLHUP | select.POLLERR
        poller.register(sock, events | (select.POLLIN if data else 0))
        while not self._stopping.is_set():
            ready = poller.poll(WATCH * 1000)
            if ready:
                if ready[0][1] & events:
                    connection.closed_by_client = True
                return

    # --- full mode: a queue of connections never accepted ---

    def _fill(self) -> None:
        """Queue connections until one is not accepted at once: the kernel drops the next SYN."""
        for _ in range(8):
            filler = socket.socket()
            with self._lock:
                self._sockets.append(filler)
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            if not select.select([], [filler], [], 0.2)[1]:
                return
        self.__exit__(None, None, None)
        raise AssertionError("the listener's accept queue never filled")


def _read_request(sock: socket.socket, buffer: bytes, connection: int) -> tuple[Request | None, bytes]:
    """One request from ``buffer`` and the socket (None at EOF before one began), and the bytes left over."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            if buffer:
                raise ConnectionError("EOF inside a request head")
            return None, b""
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    method, path, headers = parse_head(head)
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("EOF inside a request body")
        rest += chunk
    return Request(method, path, headers, rest[:length], connection), rest[length:]


def established(port: int) -> bool:
    """True if a TCP socket on 127.0.0.1 with local ``port`` is ESTABLISHED (Linux: /proc/net/tcp)."""
    wanted = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[1] == wanted and fields[3] == "01":
                return True
    return False


async def all_closed(server: Server, timeout: float = polling.POLL_TIMEOUT) -> None:
    """Wait, without blocking the event loop, until the server has no open connection."""
    await polling.eventually(
        lambda: not server.open_connections, timeout, message=f"{server.open_connections} connection(s) still open"
    )


# --- judge mode: an OpenAI-compatible chat completions API ----------------------------------------------


class Judge:
    """The judge mode's handler: ``script`` replies in order, then ``default``; 404 off its one route."""

    def __init__(self, script: Sequence[Reply] = (), default: Reply | None = None) -> None:
        self.script: deque[Reply] = deque(script)
        self.default: Reply = default if default is not None else score(1)
        self._lock = threading.Lock()

    async def __call__(self, request: Request) -> Response:
        if request.method != "POST" or request.path != COMPLETIONS:
            return Response.json({"error": {"message": f"no route {request.method} {request.path}"}}, 404)
        with self._lock:
            reply = self.script.popleft() if self.script else self.default
        if isinstance(reply, Response):
            return reply
        result = reply(request)
        return await result if inspect.isawaitable(result) else result


def completion(
    content: str | None,
    *,
    usage: dict[str, int] | None = None,
    finish_reason: str = "stop",
    refusal: str | None = None,
) -> Response:
    """A chat completion whose first choice says ``content``."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if refusal is not None:
        message["refusal"] = refusal
    body: dict[str, Any] = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": "judge-test",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    return Response.json(body)


def score(value: Any, reason: str = "scripted", **kwargs: Any) -> Response:
    """A completion whose content is the JSON ``{"score": value, "reason": reason}``."""
    return completion(orjson.dumps({"score": value, "reason": reason}).decode(), **kwargs)


def status(code: int, *, retry_after: str | None = None, body: Any = None) -> Response:
    """An error response, with a ``Retry-After`` header when given."""
    headers = {"retry-after": retry_after} if retry_after is not None else None
    return Response.json(body if body is not None else {"error": {"message": f"scripted {code}"}}, code, headers)


@contextmanager
def judges(default: Reply | None = None) -> Iterator[Callable[..., Server]]:
    """A ``serve(*script, default=...)`` that starts judge servers, all stopped on exit (a fixture's body)."""
    started: list[Server] = []

    def start(*script: Reply, default: Reply | None = default) -> Server:
        server = Server.judge(*script, default=default).__enter__()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.__exit__(None, None, None)


def assert_rate_held(server: Server, count: int, rate: float, since: float) -> None:
    """The server saw ``count`` requests, none sooner than a bucket of ``rate`` refilling at ``rate``/s allows.

    ``since`` is ``time.monotonic()`` taken before the first request could start. A full bucket lets
    ``rate`` through at once, then one every ``1 / rate`` s: the k-th arrival (from 1) is no sooner
    than ``since + (k - rate) / rate``. A lagging loop (the client's or the server's) only stamps
    arrivals later, never sooner, so the bound is exact on a loaded machine too.
    """
    times = sorted(server.request_times)
    assert len(times) == count
    for k, at in enumerate(times, start=1):
        # 1 us: the loop's clock and this one are both time.monotonic(), read at different moments
        assert at - since >= (k - rate) / rate - 1e-6, (k, at - since)
