"""An OpenAI-compatible chat completions server for the judge tests, with scripted replies.

It is a real HTTP server (``tests/httpserver.py``) answering ``POST /v1/chat/completions``.
Replies come from a script, in order, then from ``default`` for every further request. A reply is a
``Response`` or a function of the request returning one (or awaiting one, to hold the request).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from httpserver import Request, Response, TestServer

Reply = Response | Callable[[Request], Response | Awaitable[Response]]

PATH = "/v1/chat/completions"


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


class JudgeServer(TestServer):
    """``with JudgeServer(score(1), status(429)) as judge: ... judge.base_url ...``"""

    def __init__(self, *script: Reply, default: Reply | None = None) -> None:
        super().__init__(self._serve)
        self.script: deque[Reply] = deque(script)
        self.default: Reply = default if default is not None else score(1)
        self._script_lock = threading.Lock()

    def __enter__(self) -> JudgeServer:
        super().__enter__()
        return self

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def bodies(self) -> list[Any]:
        """The JSON bodies of the completion requests received so far, in arrival order."""
        return [request.json() for request in self.requests if request.path == PATH]

    def user_messages(self) -> list[str]:
        """The user message of every completion request received so far."""
        return [next(m["content"] for m in body["messages"] if m["role"] == "user") for body in self.bodies()]

    async def _serve(self, request: Request) -> Response:
        if request.method != "POST" or request.path != PATH:
            return Response.json({"error": {"message": f"no route {request.method} {request.path}"}}, 404)
        with self._script_lock:
            reply = self.script.popleft() if self.script else self.default
        if isinstance(reply, Response):
            return reply
        result = reply(request)
        return await result if inspect.isawaitable(result) else result


def hold_until(predicate: Callable[[], bool], reply: Response, limit: float = 5.0) -> Callable[[Request], Any]:
    """A reply that waits, on the server's loop, until ``predicate()`` holds (at most ``limit`` s)."""

    async def held(request: Request) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while not predicate() and loop.time() < deadline:
            await asyncio.sleep(0.002)
        return reply

    return held


@contextmanager
def judge_servers(default: Reply | None = None) -> Iterator[Callable[..., JudgeServer]]:
    """A ``serve(*script, default=...)`` that starts judge servers, all stopped on exit (a fixture's body)."""
    servers: list[JudgeServer] = []

    def start(*script: Reply, default: Reply | None = default) -> JudgeServer:
        server = JudgeServer(*script, default=default).__enter__()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.__exit__(None, None, None)


def assert_rate_held(server: TestServer, count: int, rate: float) -> None:
    """The server saw ``count`` requests, no faster than a bucket of ``rate`` refilling at ``rate``/s.

    A full bucket lets ``rate`` through at once, then one every ``1 / rate`` s. The server stamps
    arrivals on its own loop, which on a loaded 2-core machine can lag and stamp a clump at once
    (seen: 23 within 33 ms at 20/s): 0.25 s of such jitter is allowed, plus 2 requests.
    """
    times = sorted(server.request_times)
    assert len(times) == count
    assert times[-1] - times[0] >= (count - rate) / rate * 0.8
    slack = 2 + rate * 0.25
    for i in range(count):
        for j in range(i + 1, count):
            assert j - i + 1 <= rate + rate * (times[j] - times[i]) + slack, (i, j, times[j] - times[i])

