"""Endpoint verifiers against a real HTTP server on 127.0.0.1: answers, refusals and retries."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from asserts import check_error
from conftest import SleepRecorder, add_endpoint_env, item
from servers import Request, Response, Server, json_handler

import engine
from engine import EngineConfig, Limits, VerificationError
from engine._http.retry import TransientStatus


def scripted(*responses: Response) -> Any:
    """A handler answering with ``responses`` in turn, then repeating the last one."""
    queue = list(responses)

    async def handle(request: Request) -> Response:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return handle


@pytest.fixture
def serve(envs: Path) -> Iterator[Any]:
    """``serve(handler)`` starts a server and an environment ``remote`` pointing at it; returns the server."""
    servers: list[Server] = []

    def start(handler: Any, path: str = "/score") -> Server:
        server = Server(handler).__enter__()
        servers.append(server)
        add_endpoint_env(envs, "remote", server.url + path)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


async def fails(config: EngineConfig, items: list[dict[str, Any]], sleep: SleepRecorder) -> VerificationError:
    async with engine.Engine(config, sleep=sleep) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.score(items)
    assert type(info.value) is VerificationError
    return info.value


check = partial(check_error, kind="endpoint", environment="remote")


async def test_posts_task_and_trajectory_and_reads_the_reward(serve: Any, config: EngineConfig) -> None:
    server = serve(json_handler(lambda request: {"reward": request.json()["task"]["r"], "detail": "ignored"}))
    items = [item("remote", [{"role": "assistant", "content": "hi"}], r=r) for r in (0.1, 0.9, 0, 1, -2.5)]
    async with engine.Engine(config) as eng:
        assert await eng.score(items) == [0.1, 0.9, 0.0, 1.0, -2.5]
    # the requests arrive concurrently, in any order
    assert sorted(request.json()["task"]["r"] for request in server.requests) == [-2.5, 0, 0.1, 0.9, 1]
    for request in server.requests:
        assert (request.method, request.path) == ("POST", "/score")
        assert request.headers["content-type"] == "application/json"
        assert request.json()["trajectory"] == [{"role": "assistant", "content": "hi"}]
        assert set(request.json()) == {"task", "trajectory"}


async def test_connection_refused_is_retried_then_named(envs: Path, sleeps: SleepRecorder) -> None:
    with Server.json(lambda request: {"reward": 1.0}) as gone:
        url = gone.url + "/score"
    add_endpoint_env(envs, "remote", url)  # nothing listens there any more
    config = EngineConfig(environments=envs, refs={url: Limits(max_attempts=3)})
    err = await fails(config, [item("remote", item_id="c")], sleeps)
    check(err, url, index=0, item_id="c", reason="gave up after 3 attempts; last: could not connect")
    assert len(sleeps.calls) == 2  # connect errors are retried
    assert isinstance(err.__cause__, httpx.ConnectError)  # the last try's own error, not tenacity's wrapper


async def test_a_transient_status_that_outlasts_the_budget_is_the_cause(
    serve: Any, config: EngineConfig, sleeps: SleepRecorder
) -> None:
    server = serve(scripted(Response(503, b"busy")))
    config = EngineConfig(environments=config.environments, refs={server.url + "/score": Limits(max_attempts=2)})
    err = await fails(config, [item("remote")], sleeps)
    assert "gave up after 2 attempts; last: HTTP 503: busy" in err.reason
    assert isinstance(err.__cause__, TransientStatus)
    assert err.__cause__.status == 503


@pytest.mark.parametrize("code", [400, 404, 501])
async def test_non_2xx_fails_at_once_with_status_and_body(
    serve: Any, config: EngineConfig, sleeps: SleepRecorder, code: int
) -> None:
    server = serve(scripted(Response(code, b'{"error": "task\n   is malformed"}')))
    err = await fails(config, [item("remote", item_id="q")], sleeps)
    check(err, server.url + "/score", index=0, item_id="q", reason=f'HTTP {code}: {{"error": "task is malformed"}}')
    assert len(server.requests) == 1  # not retried
    assert sleeps.calls == []


async def test_long_body_is_cut_to_an_excerpt(serve: Any, config: EngineConfig, sleeps: SleepRecorder) -> None:
    serve(scripted(Response(400, b"x" * 5000)))
    err = await fails(config, [item("remote")], sleeps)
    assert err.reason.startswith("HTTP 400: xxx")
    assert err.reason.endswith("...")
    assert len(err.reason) < 300


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"<html>oops</html>", "response is not JSON: <html>oops</html>"),
        (b"", "response is not JSON: (empty body)"),
        (b'{"reward": NaN}', 'response is not JSON: {"reward": NaN}'),
        (b"[0.5]", "response is a JSON list, not an object"),
        (b"0.5", "response is a JSON float, not an object"),
        (b'{"score": 0.5}', "response has no 'reward' field"),
        (b'{"reward": true}', "'reward' is true, not a number"),
        (b'{"reward": false}', "'reward' is false, not a number"),
        (b'{"reward": "0.5"}', "'reward' is \"0.5\", not a number"),
        (b'{"reward": null}', "'reward' is null, not a number"),
        (b'{"reward": [1]}', "'reward' is [1], not a number"),
    ],
)
async def test_bad_answers(serve: Any, config: EngineConfig, sleeps: SleepRecorder, body: bytes, reason: str) -> None:
    server = serve(scripted(Response(200, body, {"content-type": "application/json"})))
    err = await fails(config, [item("remote", item_id=1)], sleeps)
    check(err, server.url + "/score", index=0, item_id=1, reason=reason)
    assert len(server.requests) == 1
    assert sleeps.calls == []


async def test_integer_reward_is_a_float(serve: Any, config: EngineConfig) -> None:
    serve(scripted(Response(200, b'{"reward": 1}')))
    async with engine.Engine(config) as eng:
        rewards = await eng.score([item("remote")])
    assert rewards == [1.0]
    assert type(rewards[0]) is float


async def test_503_storm_gives_up_after_the_attempt_budget(serve: Any, envs: Path, sleeps: SleepRecorder) -> None:
    server = serve(scripted(Response(503, b"overloaded")))
    url = server.url + "/score"
    config = EngineConfig(environments=envs, refs={url: Limits(max_attempts=4)})
    err = await fails(config, [item("remote", item_id="s")], sleeps)
    reason = "gave up after 4 attempts; last: HTTP 503: overloaded"
    check(err, url, index=0, item_id="s", reason=reason)
    assert len(server.requests) == 4
    assert len(sleeps.calls) == 3


async def test_503_then_success_is_retried(serve: Any, config: EngineConfig, sleeps: SleepRecorder) -> None:
    server = serve(scripted(Response(503, b"busy"), Response(502), Response.json({"reward": 0.625})))
    async with engine.Engine(config, sleep=sleeps) as eng:
        assert await eng.score([item("remote")]) == [0.625]
    assert len(server.requests) == 3
    assert len(sleeps.calls) == 2
    assert all(0 < s <= 1 for s in sleeps.calls)  # backoff, no Retry-After given


async def test_429_retry_after_is_honoured(serve: Any, config: EngineConfig, sleeps: SleepRecorder) -> None:
    server = serve(scripted(Response(429, b"slow down", {"retry-after": "1"}), Response.json({"reward": 0.5})))
    async with engine.Engine(config, sleep=sleeps) as eng:
        assert await eng.score([item("remote")]) == [0.5]
    assert sleeps.calls == [1.0]
    assert len(server.requests) == 2


async def test_retry_after_beyond_the_deadline_gives_up_without_waiting(
    serve: Any, envs: Path, sleeps: SleepRecorder
) -> None:
    server = serve(scripted(Response(429, b"come back tomorrow", {"retry-after": "86400"})))
    url = server.url + "/score"
    config = EngineConfig(environments=envs, refs={url: Limits(retry_deadline=10)})
    err = await fails(config, [item("remote")], sleeps)
    assert "gave up after 1 attempt;" in err.reason
    assert "HTTP 429: come back tomorrow" in err.reason
    assert sleeps.calls == []
    assert len(server.requests) == 1


async def test_the_retry_deadline_counts_from_the_first_try(serve: Any, envs: Path, sleeps: SleepRecorder) -> None:
    # as for the judge (one retry driver): a first try that outlasts retry_deadline leaves no time for a retry
    async def slow_busy(request: Request) -> Response:
        await asyncio.sleep(0.5)
        return Response(503, b"busy", {"retry-after": "0"})

    server = serve(slow_busy)
    url = server.url + "/score"
    config = EngineConfig(environments=envs, refs={url: Limits(retry_deadline=0.2)})
    err = await fails(config, [item("remote")], sleeps)
    assert "gave up after 1 attempt; last: HTTP 503: busy" in err.reason, err.reason
    assert len(server.requests) == 1 and sleeps.calls == []


async def test_read_timeout_fails_and_is_not_retried(serve: Any, envs: Path, sleeps: SleepRecorder) -> None:
    async def hold(request: Request) -> Response:
        await asyncio.sleep(30)  # cancelled when the client hangs up
        return Response.json({"reward": 1.0})

    server = serve(hold)
    url = server.url + "/score"
    # a second: the call connects and sends within it on a loaded machine, and so times out waiting for the response
    config = EngineConfig(environments=envs, refs={url: Limits(timeout=1.0)})
    err = await fails(config, [item("remote", item_id="t")], sleeps)
    check(err, url, index=0, item_id="t", reason="timed out waiting for the response")
    assert len(server.requests) == 1
    assert sleeps.calls == []


async def test_item_json_cannot_carry_is_named(serve: Any, config: EngineConfig, sleeps: SleepRecorder) -> None:
    server = serve(json_handler(lambda request: {"reward": 1.0}))
    err = await fails(config, [item("remote", trajectory=b"raw bytes", item_id="j")], sleeps)
    check(err, server.url + "/score", index=0, item_id="j", reason="cannot send the item as JSON")
    assert server.requests == []


async def drip(request: Request) -> Response:
    """A 200 whose 30 bytes of body trickle in a byte every 100 ms (3 s in all: ten times the call's timeout)."""
    return Response(200, b'{"reward": 1.0}' + b" " * 15, {"content-type": "application/json"}, piece=1, trickle=0.1)


async def test_timeout_bounds_the_whole_call(envs: Path, sleeps: SleepRecorder) -> None:
    """The timeout is per call, not per read: a server trickling bytes cannot stretch a call."""
    with Server(drip) as server:
        url = f"{server.url}/score"
        add_endpoint_env(envs, "remote", url)
        config = EngineConfig(environments=envs, refs={url: Limits(timeout=0.3)})
        async with engine.Engine(config, sleep=sleeps) as eng:
            with pytest.raises(VerificationError, match="timed out"):  # a timeout per read would never fire
                await eng.score([item("remote")])
