"""Endpoint faults through the public API: each is one VerificationError, and the engine carries on.

Every fault is injected by a real HTTP server on 127.0.0.1 (``tests/servers.py``) into one item
of a mixed batch: items of environment ``good`` go to one endpoint, items of ``remote`` to another
on the same server, and only the ``remote`` item whose task says ``bad`` meets the fault. Each test
checks that the batch raises a ``VerificationError`` naming the ``remote`` URL, the bad item's
index and id and a readable reason, with no result; that the same engine scores the next batch;
and that nothing leaked: no connection left open on the server, no socket in this process, no
asyncio task. Retry waits go to a recorder and take no time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from asserts import check_error
from conftest import SleepRecorder, add_endpoint_env, item
from servers import Request, Response, Server, all_closed

from engine import ConfigError, Engine, EngineConfig, Limits, ManifestError, VerificationError, load_config
from engine._http.transport import PoolTransport
from engine._reasons import REDACTED
from engine._verifiers.endpoint.verifier import EndpointVerifier
from faults.conftest import Snapshot

GOOD, REMOTE = "good", "remote"
MIB = 1 << 20
TIMEOUT = 0.3  # seconds: the remote endpoint's timeout in the tests that time out

Fault = Response | Callable[[Request], Awaitable[Response]]

BATCH = [
    item(GOOD, r=0.25),
    item(REMOTE, r=0.5),
    item(REMOTE, "the bad one", "bad", r=0.0, bad=True),
    item(GOOD, r=1.0),
    item(REMOTE, r=0.75),
]
BAD = 2  # the bad item's index in BATCH
NEXT = [item(GOOD, r=0.125), item(REMOTE, r=0.375), item(REMOTE, r=-1.5)]


class Faulty:
    """The server's handler: ``{"reward": task["r"]}``, except the fault for a task that says ``bad``."""

    def __init__(self) -> None:
        self.fault: Fault = Response.json({"reward": 0.0})
        self.bad_requests = 0  # requests for bad items (counted on the server's thread)

    async def __call__(self, request: Request) -> Response:
        task = request.json()["task"]
        if not task.get("bad"):
            return Response.json({"reward": task["r"]})
        self.bad_requests += 1
        fault = self.fault
        return fault if isinstance(fault, Response) else await fault(request)


@dataclass
class Remote:
    server: Server
    handler: Faulty
    url: str  # the remote endpoint's URL: the ref every error must name
    envs: Path

    def config(self, **limits: Any) -> EngineConfig:
        """An engine config with ``limits`` for the remote endpoint (the good one keeps the defaults)."""
        return EngineConfig(environments=self.envs, refs={self.url: Limits(**limits)})


@pytest.fixture
def remote(envs: Path) -> Iterator[Remote]:
    handler = Faulty()
    with Server(handler) as server:
        add_endpoint_env(envs, GOOD, server.url + "/good")
        add_endpoint_env(envs, REMOTE, server.url + "/score")
        yield Remote(server, handler, server.url + "/score", envs)


def point_remote_at(envs: Path, url: str) -> None:
    """Make environment ``remote`` call ``url`` instead."""
    (envs / REMOTE / "manifest.json").write_text(
        f'{{"kind": "environment", "verifier": {{"kind": "endpoint", "ref": "{url}"}}}}'
    )


check = partial(check_error, kind="endpoint", environment=REMOTE, index=BAD, item_id="bad")


async def aborts(
    remote: Remote, config: EngineConfig, sleeps: SleepRecorder, reason: str, batch: list[dict[str, Any]] = BATCH
) -> VerificationError:
    """Run ``batch``, which must fail on its bad item, then the next batch; check that nothing leaked."""
    tasks, snapshot = asyncio.all_tasks(), Snapshot.take()
    outcome = None
    async with Engine(config, sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            outcome = await eng.run(batch)
        check(info.value, remote.url, reason)
        assert outcome is None  # no result list, not even a partial one
        assert await eng.score(NEXT) == [0.125, 0.375, -1.5]  # the same engine carries on
    await settled(remote.server, tasks, snapshot)
    return info.value


async def settled(server: Server, tasks: set[asyncio.Task[Any]], snapshot: Snapshot) -> None:
    """No connection left open on the server, no new asyncio task, thread, process, pipe or socket."""
    await all_closed(server)
    assert asyncio.all_tasks() <= tasks, asyncio.all_tasks() - tasks
    snapshot.settled()


# --- the network ---------------------------------------------------------------------------------


async def test_refused_connection_is_retried_within_the_budget_then_named(
    envs: Path, sleeps: SleepRecorder, remote: Remote
) -> None:
    with Server(remote.handler) as gone:
        dead = gone.url + "/score"  # nothing listens here any more
    point_remote_at(envs, dead)
    config = EngineConfig(environments=envs, refs={dead: Limits(max_attempts=3, max_concurrency=1)})
    tasks, snapshot = asyncio.all_tasks(), Snapshot.take()
    async with Engine(config, sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.run(BATCH)
        # one call at a time: the first remote item (index 1) is the one that fails
        check(info.value, dead, "gave up after 3 attempts; last: could not connect", index=1, item_id=None)
        assert len(sleeps.calls) == 2
        assert await eng.score([item(GOOD, r=0.5)]) == [0.5]
    await settled(remote.server, tasks, snapshot)


async def test_a_connect_that_hangs_times_out_and_is_retried(
    envs: Path, sleeps: SleepRecorder, remote: Remote
) -> None:
    """A server whose accept queue is full drops the SYN: the connect hangs, and the deadline cuts it."""
    with Server.full() as listener:
        full = f"{listener.url}/score"
        point_remote_at(envs, full)
        limits = Limits(timeout=0.2, max_attempts=2, max_concurrency=1)
        config = EngineConfig(environments=envs, refs={full: limits})
        tasks, snapshot = asyncio.all_tasks(), Snapshot.take()
        async with Engine(config, sleep=sleeps) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.run(BATCH)
            check(info.value, full, "gave up after 2 attempts; last: timed out connecting", index=1, item_id=None)
            assert await eng.score([item(GOOD, r=0.5)]) == [0.5]
        assert len(sleeps.calls) == 1
        await settled(remote.server, tasks, snapshot)


async def test_hang_is_cut_at_the_deadline_and_not_retried(remote: Remote, sleeps: SleepRecorder) -> None:
    async def hang(request: Request) -> Response:
        await asyncio.sleep(30)  # cancelled by the server when the client hangs up
        return Response.json({"reward": 1.0})

    remote.handler.fault = hang
    err = await aborts(remote, remote.config(timeout=TIMEOUT), sleeps, "timed out waiting for the response")
    assert "(timeout: 0.3 s for the whole call)" in err.reason  # cut by the call's timeout, not the 30 s hang
    assert remote.handler.bad_requests == 1 and sleeps.calls == []


async def test_a_body_trickling_past_the_deadline_is_cut_off(remote: Remote, sleeps: SleepRecorder) -> None:
    """Each byte comes well within the timeout, the whole body does not: the timeout bounds the call."""
    body = b'{"reward": 1.0}' + b" " * 25  # 40 bytes, one every 50 ms: 2 s in all
    remote.handler.fault = Response(200, body, {"content-type": "application/json"}, piece=1, trickle=0.05)
    await aborts(remote, remote.config(timeout=TIMEOUT), sleeps, "timed out waiting for the response")
    assert remote.server.body_bytes_sent < len(body)  # the client hung up part way through
    assert remote.handler.bad_requests == 1


async def test_a_connection_reset_mid_body_is_named(remote: Remote, sleeps: SleepRecorder) -> None:
    body = b'{"reward": 1.0, "padding": "' + b"x" * 4000 + b'"}'
    remote.handler.fault = Response(200, body, reset_after=100, piece=50)
    err = await aborts(remote, remote.config(), sleeps, "the server closed the connection before the response was")
    assert err.reason.startswith("HTTP error (ReadError)") or err.reason.startswith("HTTP error (RemoteProtocolError)")
    assert remote.handler.bad_requests == 1 and sleeps.calls == []  # a broken answer is not retried


async def test_a_redirect_is_not_followed(remote: Remote, sleeps: SleepRecorder) -> None:
    remote.handler.fault = Response(302, b"moved", {"location": "/elsewhere"})
    await aborts(remote, remote.config(), sleeps, "HTTP 302: moved")
    assert all(request.path in ("/good", "/score") for request in remote.server.requests)


# --- status storms -------------------------------------------------------------------------------


def storm(status: int, count: int, **headers: str) -> Callable[[Request], Awaitable[Response]]:
    """``status`` for the first ``count`` requests, then the right answer."""
    seen = 0

    async def reply(request: Request) -> Response:
        nonlocal seen
        seen += 1
        if seen <= count:
            return Response(status, f"storm {seen}".encode(), dict(headers))
        return Response.json({"reward": 0.0625})

    return reply


async def test_a_503_storm_that_ends_within_the_budget_is_ridden_out(remote: Remote, sleeps: SleepRecorder) -> None:
    remote.handler.fault = storm(503, 3)
    tasks, snapshot = asyncio.all_tasks(), Snapshot.take()
    async with Engine(remote.config(max_attempts=5), sleep=sleeps) as eng:
        result = await eng.run(BATCH)
        assert result.rewards == [0.25, 0.5, 0.0625, 1.0, 0.75]
        assert sum(report.retries for report in result.verifiers) == 3
    assert remote.handler.bad_requests == 4
    assert len(sleeps.calls) == 3 and all(0 < wait <= 1 for wait in sleeps.calls)  # backoff, not real time
    await settled(remote.server, tasks, snapshot)


async def test_a_503_storm_beyond_the_budget_gives_up(remote: Remote, sleeps: SleepRecorder) -> None:
    remote.handler.fault = storm(503, 100)
    await aborts(remote, remote.config(max_attempts=4), sleeps, "gave up after 4 attempts; last: HTTP 503: storm 4")
    assert remote.handler.bad_requests == 4 and len(sleeps.calls) == 3


async def test_a_500_storm_that_ends_within_the_budget_is_ridden_out(remote: Remote, sleeps: SleepRecorder) -> None:
    remote.handler.fault = storm(500, 2)
    async with Engine(remote.config(max_attempts=5), sleep=sleeps) as eng:
        assert (await eng.score(BATCH)) == [0.25, 0.5, 0.0625, 1.0, 0.75]
    assert remote.handler.bad_requests == 3 and len(sleeps.calls) == 2  # two 500s, then the answer


async def test_a_500_storm_beyond_the_budget_gives_up(remote: Remote, sleeps: SleepRecorder) -> None:
    """A verifier that really broke on an item answers 500 every time: the item fails once the budget is spent."""
    remote.handler.fault = storm(500, 100)
    await aborts(remote, remote.config(max_attempts=3), sleeps, "gave up after 3 attempts; last: HTTP 500: storm 3")
    assert remote.handler.bad_requests == 3 and len(sleeps.calls) == 2


async def test_a_501_is_not_retried(remote: Remote, sleeps: SleepRecorder) -> None:
    """Other 5xx (501 Not Implemented and the like) say the request can never work: no retry."""
    remote.handler.fault = storm(501, 1)  # would succeed on a second try, which never comes
    await aborts(remote, remote.config(max_attempts=5), sleeps, "HTTP 501: storm 1")
    assert remote.handler.bad_requests == 1 and sleeps.calls == []


async def test_429_with_retry_after_is_waited_for(remote: Remote, sleeps: SleepRecorder) -> None:
    remote.handler.fault = storm(429, 2, **{"retry-after": "3"})
    async with Engine(remote.config(retry_deadline=30), sleep=sleeps) as eng:
        assert (await eng.run(BATCH)).rewards == [0.25, 0.5, 0.0625, 1.0, 0.75]
    # exactly what the server asked for; the window paused a first try not yet sent at the 429, no longer
    assert sleeps.calls.count(3.0) == 2 and all(0 < seconds <= 3.0 for seconds in sleeps.calls)
    assert remote.handler.bad_requests == 3
    await all_closed(remote.server)


async def test_429_with_a_retry_after_past_the_deadline_gives_up_at_once(
    remote: Remote, sleeps: SleepRecorder
) -> None:
    remote.handler.fault = storm(429, 100, **{"retry-after": "120"})
    await aborts(remote, remote.config(retry_deadline=60), sleeps, "gave up after 1 attempt; last: HTTP 429: storm 1")
    # one attempt, and no wait for the 120 s it asked (the window pauses the other items' first tries, at most
    # for the deadline, while the batch aborts)
    assert remote.handler.bad_requests == 1 and all(seconds <= 60 for seconds in sleeps.calls)


# --- size ----------------------------------------------------------------------------------------


async def test_an_announced_oversized_body_is_refused_before_it_is_read(remote: Remote, sleeps: SleepRecorder) -> None:
    body = b'{"reward": 1.0, "padding": "' + b"x" * (2 * MIB) + b'"}'
    remote.handler.fault = Response(200, body, piece=64 * 1024, trickle=0.0)  # written a piece at a time
    reason = f"response body of {len(body)} bytes is over the 1 MiB limit (max_body)"
    await aborts(remote, remote.config(), sleeps, reason)
    assert remote.handler.bad_requests == 1


async def test_an_endless_chunked_body_is_cut_off_at_the_cap(remote: Remote, sleeps: SleepRecorder) -> None:
    body = b"x" * (32 * MIB)  # no length announced: only counting the bytes can stop it
    remote.handler.fault = Response(200, body, chunked=True, piece=64 * 1024)
    await aborts(remote, remote.config(), sleeps, "response body over the 1 MiB limit (max_body)")
    # the client hung up soon after the cap: the server could not get the rest onto the wire
    assert remote.server.body_bytes_sent < len(body) // 2


async def test_a_body_delimited_by_close_is_capped_too(remote: Remote, sleeps: SleepRecorder) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
    remote.handler.fault = Response(raw=head + b'{"reward": 1.0, "padding": "' + b"x" * 5000 + b'"}')
    await aborts(remote, remote.config(max_body=4096), sleeps, "response body over the 4 KiB limit (max_body)")


async def test_a_body_at_the_cap_is_read(remote: Remote, sleeps: SleepRecorder) -> None:
    body = b'{"reward": 0.5}'
    remote.handler.fault = Response(200, body + b" " * (1000 - len(body)))  # exactly max_body bytes
    async with Engine(remote.config(max_body=1000), sleep=sleeps) as eng:
        assert (await eng.run(BATCH)).rewards == [0.25, 0.5, 0.5, 1.0, 0.75]
        remote.handler.fault = Response(200, body + b" " * (1001 - len(body)))  # one byte more
        with pytest.raises(VerificationError, match="response body of 1001 bytes is over the 1000 bytes limit"):
            await eng.run(BATCH)


async def test_an_unasked_for_compressed_body_is_refused(remote: Remote, sleeps: SleepRecorder) -> None:
    remote.handler.fault = Response(200, b"\x1f\x8b\x08\x00", {"content-encoding": "gzip"})  # the head is enough
    await aborts(remote, remote.config(), sleeps, "the response is compressed (Content-Encoding: gzip), not asked for")
    assert remote.server.requests[-1].headers["accept-encoding"] == "identity"


async def test_an_endless_head_is_cut_off(remote: Remote, sleeps: SleepRecorder) -> None:
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-padding-%d: %s\r\n" % (n, b"p" * 1000) for n in range(200))
    remote.handler.fault = Response(raw=head)  # 200 KB of headers, and never the blank line that ends them
    await aborts(remote, remote.config(), sleeps, "response headers over 64 KiB")


async def test_a_transport_of_ones_own_is_bounded_too(remote: Remote, sleeps: SleepRecorder) -> None:
    """``Engine(transport=...)`` with httpx's own transport: one timer bounds a call, its body is read under the cap."""

    async def hang(request: Request) -> Response:
        await asyncio.sleep(30)
        return Response.json({"reward": 1.0})

    remote.handler.fault = hang
    transport = httpx.AsyncHTTPTransport()
    async with Engine(remote.config(timeout=TIMEOUT, max_body=1000), transport=transport, sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.run(BATCH)
        check(info.value, remote.url, "timed out waiting for the response (timeout: 0.3 s for the whole call)")
        remote.handler.fault = Response(200, b'{"reward": 1.0}' + b" " * 2000)
        with pytest.raises(VerificationError) as info:
            await eng.run(BATCH)
        check(info.value, remote.url, "response body of 2015 bytes is over the 1000 bytes limit (max_body)")
    await all_closed(remote.server)


# --- what the body says --------------------------------------------------------------------------

BAD_BODIES = {
    "invalid UTF-8": (b'{"reward": "\xff\xfe"}', "response is not valid UTF-8 (byte 12), so not JSON: "),
    "not JSON": (b"<html>all good</html>", "response is not JSON: <html>all good</html>"),
    "empty": (b"", "response is not JSON: (empty body)"),
    "a list": (b"[0.5]", "response is a JSON list, not an object: [0.5]"),
    "a number": (b"0.5", "response is a JSON float, not an object: 0.5"),
    "reward missing": (b'{"score": 0.5}', "response has no 'reward' field: {\"score\": 0.5}"),
    "null": (b'{"reward": null}', "'reward' is null, not a number"),
    "string": (b'{"reward": "0.5"}', "'reward' is \"0.5\", not a number"),
    "boolean": (b'{"reward": true}', "'reward' is true, not a number"),
    "NaN": (b'{"reward": NaN}', 'response is not JSON: {"reward": NaN}'),
    "Infinity": (b'{"reward": Infinity}', 'response is not JSON: {"reward": Infinity}'),
    "overflow": (b'{"reward": 1e999}', 'response is not JSON: {"reward": 1e999}'),
    "nested": (b'{"reward": {"value": 0.5}}', "'reward' is {\"value\":0.5}, not a number"),
    "a huge nested reward": (b'{"reward": [' + b"1," * 5000 + b"1]}", "'reward' is [1,1,1,"),
}


@pytest.mark.parametrize("fault", list(BAD_BODIES))
async def test_a_bad_body_is_named_and_not_retried(remote: Remote, sleeps: SleepRecorder, fault: str) -> None:
    body, reason = BAD_BODIES[fault]
    remote.handler.fault = Response(200, body, {"content-type": "application/json"})
    err = await aborts(remote, remote.config(), sleeps, reason)
    assert len(err.reason) < 300  # an excerpt, however long the body
    assert remote.handler.bad_requests == 1 and sleeps.calls == []


# --- URLs ----------------------------------------------------------------------------------------


async def test_only_http_and_https_urls(envs: Path) -> None:
    add_endpoint_env(envs, "ftp", "ftp://127.0.0.1/score")
    async with Engine(EngineConfig(environments=envs)) as eng:
        with pytest.raises(ManifestError, match="an http:// or https:// URL"):
            await eng.score([item("ftp")])
    # and below the manifest, the verifier and the transport each refuse one
    async with PoolTransport() as transport:
        with pytest.raises(ValueError, match="must be http:// or https://"):
            EndpointVerifier("file:///etc/passwd", Limits(), transport)
        with pytest.raises(httpx.UnsupportedProtocol):
            await transport.handle_async_request(httpx.Request("POST", "ftp://127.0.0.1/score"))


# --- headers from the environment ----------------------------------------------------------------

TOKEN_VAR = "ENGINE_TEST_VERIFIER_TOKEN"
TOKEN = "tok-3f9a/c1d2+e5b8_7a60"  # a '/' as base64 tokens have, which some JSON encoders escape


def write_config(tmp_path: Path, url: str, headers: str) -> Path:
    path = tmp_path / "engine.toml"
    path.write_text(f'environments = "envs"\n\n[refs."{url}"]\nmax_body = 65536\nheaders = {headers}\n')
    return path


def echo(request: Request) -> Response:
    """A verifier that echoes the credentials it got back in its complaint, as careless servers do."""
    task, auth = request.json()["task"], request.headers.get("authorization", "")
    if task.get("bad") == "400":  # the token straddles the 200-character cut of an excerpt
        return Response(400, b"e" * 160 + f" bad credentials {auth}".encode())
    if task.get("bad") == "503":
        escaped = auth.replace("/", "\\/")  # as PHP's json_encode writes it
        return Response(503, f'{{"error": "overloaded", "you sent": "{escaped}"}}'.encode())
    if task.get("bad") == "reward":
        return Response.json({"reward": auth.removeprefix("Bearer ")})
    return Response.json({"reward": task["r"]})


@pytest.mark.parametrize("fault", ["400", "503", "reward"])
async def test_header_values_come_from_the_environment_and_never_reach_a_message(
    remote: Remote,
    tmp_path: Path,
    sleeps: SleepRecorder,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    async def handle(request: Request) -> Response:
        return echo(request)

    remote.server.handler = handle
    monkeypatch.setenv(TOKEN_VAR, TOKEN)
    monkeypatch.setenv("ENGINE_TEST_TEAM", "team-rl")
    headers = f'{{ Authorization = "Bearer ${{{TOKEN_VAR}}}", X-Team = "${{ENGINE_TEST_TEAM}}" }}'
    path = write_config(tmp_path, remote.url, headers)
    assert TOKEN not in path.read_text()
    batch = [item(REMOTE, r=0.5), item(REMOTE, item_id="bad", bad=fault)]
    caplog.set_level(logging.DEBUG)
    async with Engine.from_config(path, sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.run(batch)
        assert await eng.score([item(REMOTE, r=0.25)]) == [0.25]
    err = info.value
    check(err, remote.url, REDACTED, index=1)
    for text in (str(err), err.reason, repr(err), caplog.text):
        assert "3f9a" not in text and "e5b8" not in text, text  # not the token, nor any part of it
    assert err.__cause__ is None  # a cause would carry the request, headers and all
    assert err.__suppress_context__
    sent = {request.headers["authorization"] for request in remote.server.requests}
    assert sent == {f"Bearer {TOKEN}"}
    assert {request.headers["x-team"] for request in remote.server.requests} == {"team-rl"}


async def test_an_unset_header_variable_fails_the_first_item_before_any_request(
    remote: Remote, tmp_path: Path, sleeps: SleepRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_VAR, raising=False)
    path = write_config(tmp_path, remote.url, f'{{ Authorization = "Bearer ${{{TOKEN_VAR}}}" }}')
    async with Engine.from_config(path, sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.run([item(REMOTE, item_id="first", r=1.0), item(REMOTE, r=0.5)])
        check(info.value, remote.url, f"header Authorization: environment variable {TOKEN_VAR} is not set", index=0,
              item_id="first")
        assert remote.server.requests == []
        monkeypatch.setenv(TOKEN_VAR, "late\r\nX-Injected: yes")  # a line break would forge a header
        with pytest.raises(VerificationError, match=f"variable {TOKEN_VAR} holds characters a header cannot carry"):
            await eng.run([item(REMOTE, r=1.0)])
        assert remote.server.requests == []
        monkeypatch.setenv(TOKEN_VAR, "set-later")  # read at each call: setting it now is enough
        assert await eng.score([item(REMOTE, r=0.75)]) == [0.75]
    assert remote.server.requests[0].headers["authorization"] == "Bearer set-later"


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ('{ Authorization = "Bearer sk-live-123" }', "must name an environment variable as ${NAME}"),
        ('{ Authorization = "Bearer $TOKEN" }', "must name an environment variable as ${NAME}"),
        ('{ Authorization = "${A} $B" }', "no other '$'"),
        ('{ Host = "${A}" }', "is set by the engine itself"),
        ('{ "Bad Name" = "${A}" }', "is not a valid HTTP header name"),
        ('"Bearer ${A}"', "must be a table"),
    ],
)
def test_bad_header_settings_name_the_key(tmp_path: Path, headers: str, message: str) -> None:
    path = write_config(tmp_path, "https://verifier.example/score", headers)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: refs.'https://verifier.example/score'.headers")
    assert message in str(info.value)
    assert "sk-live-123" not in str(info.value)  # a pasted secret is never echoed


def test_headers_belong_to_one_endpoint(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[defaults]\nheaders = { Authorization = "Bearer ${A}" }\n')
    with pytest.raises(ConfigError, match=r"defaults.headers: headers go under one endpoint's \[refs"):
        load_config(path)
    path.write_text('[refs."arith/verify:score"]\nheaders = { Authorization = "Bearer ${A}" }\n')
    with pytest.raises(ConfigError, match="only an endpoint"):
        load_config(path)
    path.write_text('[refs."alice/arithmetic-correctness"]\nmax_body = 10\n')
    with pytest.raises(ConfigError, match="max_body under \\[judge\\]"):
        load_config(path)
    path.write_text("[defaults]\nmax_body = 0\n")
    with pytest.raises(ConfigError, match=r"defaults\.max_body: must be a whole number >= 1, got 0"):
        load_config(path)
