"""The connections ``engine serve`` keeps open: each sends a request's head in time, and the oldest idle makes room."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["Guard"]


class Guard:
    """What every connection of one service shares: its bounds, the connections waiting for a head, the counts.

    A connection has ``head_timeout`` seconds for a request's head from when it opens, and from the
    first byte of each later request: then it is closed (a client that sends a line and stops holds
    nothing for long). A kept-alive connection idle between requests is uvicorn's keep-alive timeout's
    to close (``--keep-alive``): closing it sooner only races its client's next request. Past ``most`` connections
    open, the one that has waited longest for a head is closed to make room (a slow head, or an idle
    keep-alive: its client reconnects); while every other connection is being answered, the new one
    is. No token is needed to open a connection or send a head (the token is read from it): these
    bounds are what an unauthorised client meets.
    """

    def __init__(self, head_timeout: float, most: int) -> None:
        self.head_timeout = head_timeout
        self.most = most
        self.waiting: dict[Any, None] = {}  # connections waiting for a head, the longest waiting first
        self.open = 0
        self.timed_out = 0  # connections closed for a head not in time
        self.made_room = 0  # connections closed to make room for another

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's httptools protocol, under these bounds."""
        guard = self

        class Guarded(HttpToolsProtocol):
            _head_timer: asyncio.TimerHandle | None = None
            _counted = False  # in guard.open: from its start until it is closed (by either side)

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                guard.open += 1
                self._counted = True
                self._wait_for_head()
                if guard.open > guard.most:
                    guard.made_room += 1
                    next(iter(guard.waiting))._drop()  # this one, if every other is being answered

            def connection_lost(self, exc: Exception | None) -> None:
                self._uncount()
                super().connection_lost(exc)

            def on_message_begin(self) -> None:
                super().on_message_begin()
                if self._head_timer is None:  # a kept-alive connection's next request: its head starts now
                    self._wait_for_head()

            def on_headers_complete(self) -> None:
                self._stop_waiting()
                super().on_headers_complete()

            def on_response_complete(self) -> None:
                super().on_response_complete()
                if self.timeout_keep_alive_task is not None:  # kept alive, and nothing pipelined: idle again
                    self._wait_for_head(timed=False)  # idle is uvicorn's keep-alive timeout's to end

            def _wait_for_head(self, *, timed: bool = True) -> None:
                self._stop_waiting()
                guard.waiting[self] = None
                if timed:
                    self._head_timer = self.loop.call_later(guard.head_timeout, self._head_late)

            def _head_late(self) -> None:
                guard.timed_out += 1
                self._drop()

            def _stop_waiting(self) -> None:
                guard.waiting.pop(self, None)
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None

            def _drop(self) -> None:
                self._uncount()  # now, not once the loop reports it lost: a burst must not close more than it must
                if not self.transport.is_closing():
                    self.transport.close()

            def _uncount(self) -> None:
                self._stop_waiting()
                if self._counted:
                    self._counted = False
                    guard.open -= 1

        return Guarded
