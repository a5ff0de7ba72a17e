"""The connections ``engine serve`` keeps open: each sends a request's head in time, and the oldest idle makes room."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine._remote.wire import dump_error

__all__ = ["Guard"]

SWEEPS = 4  # looks at the heads under way per head timeout (at most a second apart): one closes late by that much


class Guard:
    """What every connection of one service shares: its bounds, the connections waiting, the counts.

    A connection has ``head_timeout`` seconds for a request's head from when it opens, and from the
    first byte of each later request: then it is closed (a client that sends a line and stops holds
    nothing for long). A kept-alive connection idle between requests is uvicorn's keep-alive timeout's
    to close (``--keep-alive``): closing it sooner only races its client's next request. Past ``most``
    connections open, one waiting is closed to make room: the one whose head has taken longest, else
    the one idle longest (its client reconnects); while every other is being answered, the new one is.
    No token is needed to open a connection or send a head (the token is read from it): these bounds
    are what an unauthorised client meets.

    A request's body has ``body_timeout`` seconds from the end of its head: then it is answered 408
    and its connection closed. Heads and bodies are timed by a sweep every ``SWEEPS``th of the shorter
    timeout (at most 1 s apart), not a timer each: a timer (or a cancel scope) made and cancelled per
    request cost more than the rest of the bookkeeping together.
    """

    def __init__(self, head_timeout: float, body_timeout: float, most: int) -> None:
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.most = most
        self.heads: dict[Any, float] = {}  # connections sending a head, with when it started: the oldest first
        self.bodies: dict[Any, float] = {}  # requests whose body is still coming, with when their head ended
        self.idle: dict[Any, None] = {}  # kept-alive connections between requests, the longest idle first
        self.open = 0
        self.timed_out = 0  # connections closed for a head not in time
        self.bodies_timed_out = 0  # requests answered 408 for a body not in time
        self.made_room = 0  # connections closed to make room for another
        self._sweep: asyncio.TimerHandle | None = None

    def _swept(self) -> None:
        """Close the connections whose head or body is late; look again later while any is under way."""
        self._sweep = None
        now = time.monotonic()
        for connection in _started_before(self.heads, now - self.head_timeout):
            self.timed_out += 1
            connection.drop()
        for connection in _started_before(self.bodies, now - self.body_timeout):
            self.bodies_timed_out += 1
            connection.body_late(self.body_timeout)
        self._arm()

    def _arm(self) -> None:
        if self._sweep is None and (self.heads or self.bodies):
            interval = min(1.0, min(self.head_timeout, self.body_timeout) / SWEEPS)
            self._sweep = asyncio.get_running_loop().call_later(interval, self._swept)

    def cancel(self) -> None:
        """Stop sweeping (the service is stopping)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's httptools protocol, under these bounds."""
        guard = self

        class Guarded(HttpToolsProtocol):
            _counted = False  # in guard.open: from its start until it is closed (by either side)

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                guard.open += 1
                self._counted = True
                self._head_starts()
                if guard.open > guard.most:
                    guard.made_room += 1
                    victim = next(iter(guard.heads))  # the head under way longest (this one's: all others answered)
                    if victim is self and guard.idle:
                        victim = next(iter(guard.idle))
                    victim.drop()

            def connection_lost(self, exc: Exception | None) -> None:
                self._uncount()
                super().connection_lost(exc)

            def on_message_begin(self) -> None:
                super().on_message_begin()
                if self not in guard.heads:  # a kept-alive connection's next request: its head starts now
                    guard.idle.pop(self, None)
                    self._head_starts()

            def on_headers_complete(self) -> None:
                guard.heads.pop(self, None)
                guard.bodies[self] = time.monotonic()
                guard._arm()
                super().on_headers_complete()

            def on_message_complete(self) -> None:
                guard.bodies.pop(self, None)
                super().on_message_complete()

            def on_response_complete(self) -> None:
                super().on_response_complete()
                if self.timeout_keep_alive_task is not None:  # kept alive, and nothing pipelined: idle again
                    guard.idle[self] = None

            def _head_starts(self) -> None:
                guard.heads[self] = time.monotonic()
                guard._arm()

            def body_late(self, timeout: float) -> None:
                """Answer 408 (unless an answer has begun: the application did not wait for the body) and close."""
                guard.bodies.pop(self, None)
                if self.cycle is not None and not self.cycle.response_started and not self.transport.is_closing():
                    message = f"the body was not received within {timeout:g} s"
                    body = dump_error(TimeoutError(message), kind="Timeout", message=message)
                    self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
                self.drop()

            def drop(self) -> None:
                self._uncount()  # now, not once the loop reports it lost: a burst must not close more than it must
                if not self.transport.is_closing():
                    self.transport.close()

            def _uncount(self) -> None:
                guard.heads.pop(self, None)
                guard.bodies.pop(self, None)
                guard.idle.pop(self, None)
                if self._counted:
                    self._counted = False
                    guard.open -= 1

        return Guarded


def _started_before(waiting: dict[Any, float], moment: float) -> list[Any]:
    """The connections of ``waiting`` (in the order they started) that started before ``moment``."""
    late = []
    for connection, started in waiting.items():
        if started >= moment:
            break
        late.append(connection)
    return late
