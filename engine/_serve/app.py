"""The service's ASGI application: a few routes, written straight on ASGI (no framework).

Its routes, admission, and what a client that hangs up cancels: docs/design.md, The service.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from engine._core.contract import check_first_index
from engine._core.report import BatchResult
from engine._errors import VerificationError
from engine._remote.wire import INTERNAL, JSON, dump_error, dump_result, error_status
from engine._serve import openrlhf
from engine._serve.body import SMALL, TooMany, parse, parse_small
from engine._serve.gather import Gatherer, Gone, Scorer, hung_up
from engine._serve.limits import Admission, ServeConfig
from engine._serve.metrics import Metrics

if TYPE_CHECKING:
    from engine._serve.connections import Guard  # uvicorn's: imported by the server only

__all__ = ["App"]

logger = logging.getLogger("engine.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
STOPPED = "Stopped"  # the kind of error a request still running when the service stops is answered with
GONE = 499  # the status a request whose client hung up is counted under (nginx's): none was sent


class _Refused(Exception):
    """A request the service will not score: answered ``status`` with the error's shape."""

    def __init__(self, status: int, kind: str, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status = status
        self.kind = kind
        self.message = message
        self.headers = headers or []
        super().__init__(message)

    @property
    def body(self) -> bytes:
        return dump_error(self, kind=self.kind, message=self.message)


class App:
    """The ASGI application around one open engine."""

    def __init__(self, engine: Scorer, config: ServeConfig, guard: Guard | None = None) -> None:
        self.engine = engine
        self.config = config
        self.guard = guard
        self._retry_after = [(b"retry-after", str(config.retry_after).encode())]  # what each 503 asks a client
        self.admission = Admission(config.max_queued)
        self.open_requests = 0
        self.metrics = Metrics(self._gauges, self._counters, lambda: self.gatherer.costs)
        self.gatherer = Gatherer(engine, self.metrics.batch, self.metrics.failed, most=config.gather_items)
        self.replays = openrlhf.Replays()  # /get_reward's failures just answered, for OpenRLHF's retries
        self._token = config.token.encode() if config.token is not None else None
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive], Awaitable[tuple[int, bytes, str]]]] = {
            ("POST", "/v1/score"): self._score,
            ("POST", "/get_reward"): self._get_reward,
            ("GET", "/healthz"): self._healthz,
            ("GET", "/metrics"): self._metrics,
        }
        self._paths = {path for _, path in self._routes}

    def _gauges(self) -> dict[str, tuple[str, float]]:
        gauges: dict[str, tuple[str, float]] = {
            "engine_items_admitted": ("Items admitted across requests, queued or in flight.", self.admission.held),
            "engine_http_requests_in_progress": ("Requests being answered.", self.open_requests),
        }
        if self.guard is not None:
            gauges["engine_connections_open"] = ("Connections open.", self.guard.open)
        return gauges

    def _counters(self) -> dict[str, tuple[str, float]]:
        counters: dict[str, tuple[str, float]] = {} if self.guard is None else {
            "engine_connections_head_timeouts": ("Connections closed for a request head not in within --head-timeout.",
                                                 self.guard.timed_out),
            "engine_connections_made_room": ("Connections closed to make room past --max-connections.",
                                              self.guard.made_room),
            "engine_body_timeouts": ("Requests answered 408 for a body not in within --body-timeout.",
                                     self.guard.bodies_timed_out),
        }
        return counters | {
            "engine_gathered_batches": ("Engine batches of requests that may share one (a few plugin items).",
                                        self.gatherer.batches),
            "engine_gathered_requests": ("Requests those batches took: more than batches when they shared.",
                                         self.gatherer.gathered),
            "engine_get_reward_replayed": ("/get_reward requests answered from the identical request's failure "
                                           "just seen (OpenRLHF's retries), not scored again.", self.replays.replayed),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the engine is opened around the server, not by it
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = time.perf_counter()
        path, method = scope["path"], scope["method"]
        route = self._routes.get((method, path))
        label = path if path in self._paths else "other"
        self.open_requests += 1
        headers: list[tuple[bytes, bytes]] = []
        try:
            try:
                self._authorize(scope)
                if route is None:
                    if label != "other":
                        raise _Refused(405, "MethodNotAllowed", f"{method} is not allowed on {path}")
                    raise _Refused(404, "NotFound", f"no route {method} {path}")
                status, body, content_type = await route(scope, receive)
            except _Refused as refused:
                status, body, content_type, headers = refused.status, refused.body, JSON, refused.headers
            except (VerificationError, ValueError, TypeError) as exc:
                status, body, content_type = error_status(exc), dump_error(exc), JSON
            await _respond(send, status, body, content_type, headers)
        except Gone:
            status = GONE
        except asyncio.CancelledError:
            # uvicorn cancels what still runs at --graceful-timeout after SIGTERM: not scored, and said so in the
            # error's shape (the client asks again after Retry-After), not as uvicorn's 500 and a traceback
            stopped = _Refused(503, STOPPED, "the service stopped before this batch was scored: send it again",
                               self._retry_after)
            status = stopped.status
            await _respond(send, status, stopped.body, JSON, stopped.headers)
        except Exception as exc:  # a bug: answered as one, never as a reward or a verifier's failure
            logger.exception("engine serve: internal error answering %s %s", method, path)
            status = 500
            await _respond(send, status, dump_error(exc, kind=INTERNAL), JSON, [])
        finally:
            self.open_requests -= 1
        self.metrics.request(label, status, time.perf_counter() - started)

    def _authorize(self, scope: Scope) -> None:
        if self._token is None:
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._token):
            raise _Refused(401, "Unauthorized", "a bearer token is required (Authorization: Bearer <token>)",
                           [(b"www-authenticate", b"Bearer")])

    async def _read(self, scope: Scope, receive: Receive) -> Any:
        """The request's JSON body, read no further than ``max_bytes``."""
        return await self._parse(await self._bytes(scope, receive))

    async def _bytes(self, scope: Scope, receive: Receive) -> bytes:
        """The request's body, read no further than ``max_bytes``."""
        limit = self.config.max_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _Refused(413, "TooLarge", f"the body is {int(value)} bytes, over this service's {limit}")
        chunks, size, more = [], 0, True
        while more:  # the service's connections time a body that does not come (engine._serve.connections)
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(413, "TooLarge", f"the body is over this service's {limit} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _parse(self, data: bytes) -> Any:
        try:
            return parse_small(data) if len(data) <= SMALL else await parse(data, self.config.max_items)
        except TooMany as exc:
            raise _Refused(413, "TooLarge", f"the batch has more than {exc.limit} items, this service's most") from None

    async def _scored(self, items: list[Any], first_index: int, receive: Receive) -> BatchResult:
        """``items`` scored by the engine, admitted first; ``Gone`` if the client hangs up meanwhile."""
        count = len(items)
        check_first_index(first_index, count)  # up front: a place past int64 could not be named in an error
        if count > self.config.max_items:
            raise _Refused(413, "TooLarge", f"the batch has {count} items, over this service's {self.config.max_items}")
        if not self.admission.admit(count):
            raise _Refused(503, "Saturated", f"the service has {self.admission.held} items admitted: try again later",
                           self._retry_after)
        if self.gatherer.takes(items, first_index):  # a few plugin items: they share a batch with others'
            try:
                return await self.gatherer.run(items, first_index, receive)
            finally:
                self.admission.release(count)
        try:
            with anyio.CancelScope() as scope:
                # A plain asyncio task waits for the hang-up: far cheaper a request than a task group, whose
                # cancellation (to stop its watcher) cost more than the rest of the service's work (measured)
                watch = asyncio.ensure_future(hung_up(receive))

                def cancel_if_hung_up(done: asyncio.Future[bool]) -> None:
                    if not done.cancelled() and done.exception() is None and done.result():
                        scope.cancel()

                watch.add_done_callback(cancel_if_hung_up)
                try:
                    result = await self.engine.run(items, first_index=first_index)
                except VerificationError as exc:
                    self.gatherer.failed(exc)  # the metrics count it; a timeout makes a plugin slow
                    raise
                finally:
                    watch.cancel()
        finally:
            self.admission.release(count)
        if scope.cancelled_caught:
            raise Gone
        self.gatherer.scored(result)  # the metrics count it; a plugin measured cheap has its requests gathered
        return result

    async def _score(self, scope: Scope, receive: Receive) -> tuple[int, bytes, str]:
        body = await self._read(scope, receive)
        if not isinstance(body, dict) or not isinstance(body.get("items"), list):
            raise TypeError('the body must be a JSON object {"items": [...]}')
        unknown = set(body) - {"items", "first_index"}
        if unknown:
            raise ValueError(f"unknown keys in the body: {', '.join(sorted(unknown))}")
        result = await self._scored(body["items"], body.get("first_index", 0), receive)
        return 200, dump_result(result), JSON

    async def _get_reward(self, scope: Scope, receive: Receive) -> tuple[int, bytes, str]:
        data = await self._bytes(scope, receive)
        replay = self.replays.find(data)  # OpenRLHF asking again after a failure: not scored twice
        if replay is not None:
            return replay[0], replay[1], JSON
        items = openrlhf.items_from(await self._parse(data), self.config.environment)
        try:
            result = await self._scored(items, 0, receive)
        except VerificationError as exc:
            status, body = error_status(exc), dump_error(exc)
            self.replays.remember(data, status, body)
            return status, body, JSON
        return 200, orjson.dumps(openrlhf.answer(result.rewards)), JSON

    async def aclose(self) -> None:
        """Stop what is still scored for requests (the server has answered or cancelled them all)."""
        await self.gatherer.aclose()

    async def _healthz(self, scope: Scope, receive: Receive) -> tuple[int, bytes, str]:
        return 200, b'{"status":"ok"}', JSON

    async def _metrics(self, scope: Scope, receive: Receive) -> tuple[int, bytes, str]:
        return 200, self.metrics.exposition(), CONTENT_TYPE_LATEST


async def _respond(send: Send, status: int, body: bytes, content_type: str, headers: list[tuple[bytes, bytes]]) -> None:
    head = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
