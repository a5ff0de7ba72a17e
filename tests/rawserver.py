"""A raw-socket server on 127.0.0.1 whose bytes each test scripts, one connection at a time.

Each accepted connection follows a script: a list of steps (read a request, send bytes, drip them,
sleep, close, reset, wait for the client's next bytes, stop reading). Connection ``n`` follows
``scripts[n]``, the last script for any further one. When its script ends, the server keeps the
connection open without reading it, until the client goes away or the server stops; that is also
how "a server that stops reading" is written (``Hold``). The server records what each connection
received and when the client went away (FIN or reset, seen without reading what is still queued),
so a test can tell a prompt close from a socket left open.

It runs on plain threads with blocking sockets, apart from the code under test's event loop, so
nothing the client does can stall it (and nothing it does depends on the client's loop).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["AwaitData", "Close", "Drip", "Hold", "RawServer", "Read", "Reset", "Send", "Sleep", "established"]

IO_TIMEOUT = 30.0  # seconds a step may block on the socket before the connection is dropped
POLL = 0.01  # seconds between two looks at a held connection


@dataclass(frozen=True)
class Read:
    """Read one request: its head, and a body of its Content-Length."""


@dataclass(frozen=True)
class Send:
    """Send bytes; ``data`` may be a function of the last request read (its head and body)."""

    data: bytes | Callable[[bytes], bytes]


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


@dataclass
class Connection:
    """What one accepted connection saw."""

    peer_port: int
    requests: list[bytes] = field(default_factory=list)  # each request read, head and body
    closed_by_client: bool = False  # the client's FIN or reset arrived
    scripted: threading.Event = field(default_factory=threading.Event)  # its script is over (held or closed)
    done: threading.Event = field(default_factory=threading.Event)  # the server is finished with it


class RawServer:
    """``with RawServer([[Read(), Send(b"...")]]) as server: ... server.url ...``"""

    def __init__(self, scripts: Sequence[Sequence[Step]]) -> None:
        if not scripts:
            raise ValueError("a RawServer needs at least one script")
        self.scripts = [list(script) for script in scripts]
        self.connections: list[Connection] = []
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/score"

    @property
    def requests(self) -> list[bytes]:
        """Every request read, over all connections, in order of connection."""
        return [request for connection in list(self.connections) for request in connection.requests]

    def __enter__(self) -> RawServer:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (closing alone does not)
        self._threads[0].join(IO_TIMEOUT)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):  # a socket already closed
                    sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads[1:]:
            thread.join(IO_TIMEOUT)

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # the listener was closed: the server is stopping
            connection = Connection(peer[1])
            with self._lock:
                index = len(self.connections)
                self.connections.append(connection)
                self._sockets.append(sock)
            script = self.scripts[min(index, len(self.scripts) - 1)]
            thread = threading.Thread(target=self._serve, args=(sock, connection, script), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, connection: Connection, script: list[Step]) -> None:
        sock.settimeout(IO_TIMEOUT)
        buffer = b""
        last = b""
        try:
            for step in script:
                if isinstance(step, Read):
                    request, buffer = _read_request(sock, buffer)
                    if request is None:
                        connection.closed_by_client = True
                        return
                    connection.requests.append(last := request)
                elif isinstance(step, Send):
                    sock.sendall(step.data(last) if callable(step.data) else step.data)
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
            ready = poller.poll(POLL * 1000)
            if ready:
                if ready[0][1] & events:
                    connection.closed_by_client = True
                return


def _read_request(sock: socket.socket, buffer: bytes) -> tuple[bytes | None, bytes]:
    """One request from ``buffer`` and the socket; (None, ...) at EOF before one began; the bytes left over."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            if buffer:
                raise ConnectionError("EOF inside a request head")
            return None, b""
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("EOF inside a request body")
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


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
