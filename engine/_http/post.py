"""The one HTTP call the engine makes: a bounded POST with retries, for endpoint verifiers and the judge alike.

Its routes, bounds and deadline: docs/design.md, Transport; how every other kind of work times out: Timeouts.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import httpx
import tenacity

from engine._errors import Failure
from engine._http.retry import (
    RETRY_STATUSES,
    Scrub,
    Sleep,
    TransientStatus,
    is_throttle,
    is_transient,
    last_failure,
    make_retrying,
)
from engine._http.transport import MAX_BODY, TOTAL_TIMEOUT, PoolTransport, ResponseTooLarge
from engine._reasons import describe, is_timeout

__all__ = ["BACKSTOP", "Bounds", "CallTimeout", "Pacer", "Post", "check_size", "read_capped"]

# seconds after a call's deadline when this module's own timer cuts it, for a transport that may not
# keep deadlines itself (one that does fails the phase that overran first, a moment earlier)
BACKSTOP = 0.05
# the phases of a call are not timed one by one: one deadline covers the whole call
_NO_PHASE_TIMEOUTS: dict[str, float | None] = {"connect": None, "read": None, "write": None, "pool": None}

Before = Callable[[int], Awaitable[None]]  # called before each try with its number (1, 2, ...)


class Pacer(Protocol):
    """What is told each try's outcome, and paces tries: an adaptive window (``engine._core.window.Window``)."""

    @property
    def epoch(self) -> int: ...  # the window's shrinks so far, read as a try is sent

    async def paused(self) -> None: ...  # before a call's first try: a Retry-After's pause waited out

    async def readmit(self) -> None: ...  # before a retry: a throttled try's slot taken again

    def answered(self, epoch: int) -> None: ...  # a try sent in ``epoch`` succeeded

    def throttled(self, epoch: int, retry_after: float | None) -> None: ...  # it was told to slow down


class Bounds(Protocol):
    """What bounds a call, as an endpoint's ``Limits`` and the ``JudgeConfig`` both say it."""

    @property
    def timeout(self) -> float: ...  # seconds for the whole call

    @property
    def max_body(self) -> int: ...  # bytes of a response read at most

    @property
    def max_attempts(self) -> int: ...  # tries, the first included

    @property
    def retry_deadline(self) -> float: ...  # seconds from the first try after which none starts


class CallTimeout(httpx.TimeoutException):
    """No response within a call's whole timeout (waiting for a connection, connecting and reading together)."""

    def __init__(self, seconds: float, request: httpx.Request | None = None) -> None:
        self.reason = f"timed out waiting for the response (timeout: {seconds:g} s for the whole call)"
        super().__init__(self.reason, request=request)


def _failed(exc: BaseException) -> Failure:
    """A POST that failed for good (its retries spent, or a failure no retry would mend), in words, and whether it
    ran out of time; raised ``from`` the last try's own error (a ``ConnectError``, a ``TransientStatus``), never
    tenacity's wrapper of it."""
    return Failure(describe(exc), timed_out=is_timeout(exc))


def check_size(response: httpx.Response, limit: int) -> None:
    """Refuse a read response over ``limit`` bytes: the cap for a transport that does not enforce it itself."""
    if len(response.content) > limit:
        raise ResponseTooLarge(limit)


async def read_capped(response: httpx.Response, limit: int, request: httpx.Request) -> httpx.Response:
    """``response`` read in full, refused past ``limit`` bytes as the engine's transport refuses it.

    For a transport that does not keep the cap itself (httpx's own, under a proxy): a longer
    announced body is refused before it is read, a body that grows past the cap as soon as it does,
    and a compressed one (the engine asks for ``identity``) at once. A response the engine's
    transport read already is only checked.
    """
    if response.is_stream_consumed:
        await response.aclose()
        check_size(response, limit)
        return response
    try:
        length = response.headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > limit:
            raise ResponseTooLarge(limit, int(length))
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise httpx.DecodingError(f"the response is compressed (Content-Encoding: {encoding}), not asked for")
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(limit)
            chunks.append(chunk)
    finally:
        await response.aclose()
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        content=b"".join(chunks),
        request=request,
        extensions=response.extensions,
    )


class Post:
    """POSTs to one URL: each try bounded by ``timeout`` seconds and ``max_body`` bytes of answer,
    transient failures tried again within ``max_attempts`` and ``retry_deadline``.

    ``via`` is how requests reach the URL. The engine's transport (an endpoint's, unless a proxy
    takes it) gets them directly: it keeps the deadline and the cap itself, and an endpoint call
    needs none of a client's per-request machinery (auth, cookies, redirects, which are off),
    which would cost ~60 us of CPU per call. A client (the judge's) sends them with its own
    headers and cookies, to whichever transport it mounts for the URL; that, and any other
    transport, gets a timer around the whole call and is read a piece at a time under the cap.

    ``retry_statuses`` are the statuses tried again (the judge's every 5xx, an endpoint's fewer);
    every other is returned. ``sleep`` is what retries wait with. ``retries`` counts the tries
    after a first, over this object's life. ``window``, if given, is told each try's outcome (a throttle,
    by ``is_throttle``; a success) and paces the tries (a ``Retry-After`` waited out, a retry readmitted).
    """

    def __init__(
        self,
        url: str | httpx.URL,
        via: httpx.AsyncBaseTransport | httpx.AsyncClient,
        bounds: Bounds,
        *,
        sleep: Sleep,
        retry_statuses: frozenset[int] = RETRY_STATUSES,
        window: Pacer | None = None,
    ) -> None:
        self._window = window
        timeout, max_body = bounds.timeout, bounds.max_body
        self._timeout = timeout
        self._max_body = max_body
        self._max_attempts = bounds.max_attempts
        self._retry_deadline = bounds.retry_deadline
        self._sleep = sleep
        self._retry_statuses = retry_statuses
        self._extensions = {"timeout": _NO_PHASE_TIMEOUTS, TOTAL_TIMEOUT: timeout, MAX_BODY: max_body}
        self._build: Callable[..., httpx.Request]
        self._send: Callable[[httpx.Request], Awaitable[httpx.Response]]
        if isinstance(via, httpx.AsyncClient):
            self._build = functools.partial(via.build_request, "POST", url)
            self._send = functools.partial(via.send, stream=True)
        else:
            self._build = functools.partial(httpx.Request, "POST", httpx.URL(url))
            self._send = via.handle_async_request
        # the engine's transport, reached directly, keeps the call's deadline and max_body itself
        self._kept = isinstance(via, PoolTransport)
        self.retries = 0

    async def __call__(
        self, body: bytes, headers: Mapping[str, str], scrub: Scrub | None = None, before: Before | None = None
    ) -> httpx.Response:
        """The response to ``body``, with any status but a transient one; raises ``Failure`` (see :func:`_failed`).

        ``scrub`` cleans the excerpt of a transient answer's body that a reason quotes; ``before``,
        if given, is awaited before each try (to count it, or wait for a rate limit).
        """
        if self._window is not None:
            await self._window.paused()
        started = time.monotonic()
        try:
            if before is not None:
                await before(1)
            return await self._try(body, headers, scrub)
        except Exception as exc:
            if not is_transient(exc):
                if isinstance(exc, httpx.HTTPError):
                    raise _failed(exc) from exc
                raise
            first = exc
        return await self._retry(body, headers, scrub, before, first, started)

    async def _retry(
        self,
        body: bytes,
        headers: Mapping[str, str],
        scrub: Scrub | None,
        before: Before | None,
        first: Exception,
        started: float,
    ) -> httpx.Response:
        """Try again after the transient failure ``first`` of a call that started at ``started``.

        The first try ran outside tenacity, whose loop costs ~60 us more per call: only a transient
        failure enters it, replayed as its first try so that tenacity counts it and waits after it.
        """
        retrying = make_retrying(self._max_attempts, self._retry_deadline, self._sleep, started=started)
        try:
            async for attempt in retrying:
                with attempt:
                    number = attempt.retry_state.attempt_number
                    if number == 1:
                        raise first
                    self.retries += 1
                    if self._window is not None:
                        await self._window.readmit()
                    if before is not None:
                        await before(number)
                    response = await self._try(body, headers, scrub)
        except tenacity.RetryError as exc:
            raise _failed(exc) from last_failure(exc)
        except httpx.HTTPError as exc:  # a failure no retry mends, on a later try
            raise _failed(exc) from exc
        return response

    async def _try(self, body: bytes, headers: Mapping[str, str], scrub: Scrub | None) -> httpx.Response:
        """One request; ``TransientStatus`` for an answer whose status asks to try again."""
        window = self._window
        if window is None:
            return await self._send_one(body, headers, scrub)
        epoch = window.epoch
        try:
            response = await self._send_one(body, headers, scrub)
        except TransientStatus as exc:
            if is_throttle(exc.status, exc.retry_after):
                window.throttled(epoch, exc.retry_after)
            raise
        if response.is_success:
            window.answered(epoch)
        return response

    async def _send_one(self, body: bytes, headers: Mapping[str, str], scrub: Scrub | None) -> httpx.Response:
        request = self._build(content=body, headers=headers, extensions=self._extensions)
        try:
            if self._kept:
                response = await self._send(request)  # read in full already, under the cap
            else:
                response = await self._timed(request)
        except httpx.ReadTimeout:
            raise CallTimeout(self._timeout, request) from None
        if response.status_code in self._retry_statuses:
            raise TransientStatus(response, scrub)
        return response

    async def _timed(self, request: httpx.Request) -> httpx.Response:
        """A call through a route that may keep neither the call's deadline nor its ``max_body``: a timer
        keeps the one, reading the body a piece at a time under the cap the other (not the hot path)."""
        deadline = asyncio.timeout(self._timeout + BACKSTOP)
        try:
            async with deadline:
                return await read_capped(await self._send(request), self._max_body, request)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise CallTimeout(self._timeout, request) from None
