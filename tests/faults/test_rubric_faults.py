"""Judge faults through the public API: each is one VerificationError naming the rubric, never a score.

A real OpenAI-compatible judge on 127.0.0.1 (``Server.judge``, ``tests/servers.py``) scores each
item with the number its response says, until the test makes it fail: it goes down mid-batch
(refusing, hanging, answering 503, resetting), or answers something no score can be read from. The batch mixes plugin
items with rubric items judged one at a time, so the failing item is known. Each test checks the
error (ref, index, id, reason), that there is no result, that the engine scores the next batch,
and that nothing leaked. Retry waits go to a recorder and take no time.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from asserts import check_error
from conftest import SleepRecorder, add_rubric_env, item
from servers import Request, Response, Server, all_closed, completion, score, status

from engine import Engine, EngineConfig, JudgeConfig, Limits, VerificationError, load_config
from engine._reasons import REDACTED
from faults.conftest import Snapshot

RUBRICS = Path(__file__).parent.parent / "rubrics"
ARITH = "alice/arithmetic-correctness"  # its latest version, 2, scores on [0, 10]
REF = f"{ARITH}@2"
MIB = 1 << 20
TIMEOUT = 0.3  # seconds: the judge's timeout in the tests that time out

Reply = Response | Callable[[Request], Awaitable[Response]]


def judged(answer: str, item_id: Any = None) -> dict[str, Any]:
    """A rubric item whose response is ``answer``: the judge scores it with that number."""
    return item("graded", answer, item_id, prompt="What is 6 * 7?", reference="42")


PLUGIN = item("arith_async", "42", reference="42")  # a plugin item scored 1.0 on the event loop (no thread)
BATCH = [PLUGIN, judged("7"), judged("4"), judged("2", "bad"), judged("9"), PLUGIN]
HEALTHY = 2  # replies the judge gives before the fault: the item at index 3 meets it
BAD = 3
NEXT = [judged("5"), PLUGIN]


def answer_of(request: Request) -> str:
    """The item's response, as the judge read it in the prompt."""
    user = next(m["content"] for m in request.json()["messages"] if m["role"] == "user")
    return str(user.split("<response>\n", 1)[1].split("\n</response>", 1)[0])


class Judge:
    """The judge server's behaviour: scores the answer, or replies with ``fault`` once ``after`` replies are given."""

    def __init__(self) -> None:
        self.fault: Reply | None = None
        self.after = HEALTHY
        self.replies = 0
        self.faulted = 0  # requests that met the fault

    async def __call__(self, request: Request) -> Response:
        self.replies += 1
        fault = self.fault
        if fault is None or self.replies <= self.after:
            return score(int(answer_of(request)))
        self.faulted += 1
        return fault if isinstance(fault, Response) else await fault(request)


@dataclass
class Setup:
    server: Server
    judge: Judge
    envs: Path
    rubrics: Path

    def config(self, **judge: Any) -> EngineConfig:
        """One rubric call at a time, so that the fault meets a known item."""
        return EngineConfig(
            environments=self.envs,
            rubrics=self.rubrics,
            allow_unpinned=True,
            judge=JudgeConfig(base_url=self.server.base_url, model="judge-test", **judge),
            refs={ARITH: Limits(max_concurrency=1)},
        )


@pytest.fixture
def setup(envs: Path, tmp_path: Path) -> Iterator[Setup]:
    rubrics = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, rubrics)
    add_rubric_env(envs, "graded", ARITH)
    judge = Judge()
    server = Server.judge(default=judge)
    with server:
        yield Setup(server, judge, envs, rubrics)


check = partial(check_error, ref=REF, kind="rubric", environment="graded", index=BAD, item_id="bad")


async def aborts(
    setup: Setup, config: EngineConfig, sleeps: SleepRecorder, reason: str, *, recovers: bool = True
) -> VerificationError:
    """Run BATCH, which must fail on its bad item, then the next batch; check that nothing leaked.

    ``recovers``: whether the judge is back for the next batch (else the next batch is plugin items).
    """
    tasks, snapshot = asyncio.all_tasks(), Snapshot.take()
    outcome = None
    async with Engine(config, sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            outcome = await eng.run(BATCH)
        check(info.value, reason=reason)
        assert outcome is None  # no result list, not even a partial one
        # the items after the bad one never reached the judge
        assert "9" not in [answer_of(request) for request in setup.server.requests]
        if recovers:
            setup.judge.fault = None
            assert await eng.score(NEXT) == [0.5, 1.0]
        else:
            assert await eng.score([PLUGIN, PLUGIN]) == [1.0, 1.0]
    await all_closed(setup.server)
    assert asyncio.all_tasks() <= tasks, asyncio.all_tasks() - tasks
    snapshot.settled()
    return info.value


# --- outages mid-batch ---------------------------------------------------------------------------


async def test_the_judge_going_down_mid_batch(setup: Setup, sleeps: SleepRecorder) -> None:
    server = setup.server

    async def go_down(request: Request) -> Response:
        # Stop listening, and close the kept-alive connection after this reply: every try after
        # this one is refused. This reply is the last healthy one.
        server.stop_listening()
        reply = score(int(answer_of(request)))
        reply.headers["connection"] = "close"
        return reply

    setup.judge.fault, setup.judge.after = go_down, HEALTHY - 1
    reason = "judge request failed: gave up after 3 attempts; last: could not connect"
    await aborts(setup, setup.config(max_attempts=3), sleeps, reason, recovers=False)
    assert len(sleeps.calls) == 2


async def test_the_judge_hanging_mid_batch_is_cut_at_its_deadline(setup: Setup, sleeps: SleepRecorder) -> None:
    async def hang(request: Request) -> Response:
        await asyncio.sleep(30)  # cancelled by the server when the client hangs up
        return score(1)

    setup.judge.fault = hang
    reason = "judge request failed: timed out waiting for the response (timeout: 0.3 s for the whole call)"
    await aborts(setup, setup.config(timeout=TIMEOUT), sleeps, reason)
    assert setup.judge.faulted == 1 and sleeps.calls == []  # a judge that got the request is not asked twice


async def test_a_transport_of_ones_own_is_bounded_too(setup: Setup, sleeps: SleepRecorder) -> None:
    """Under ``Engine(transport=...)`` with httpx's own transport, the judge's own timer cuts the request."""

    async def hang(request: Request) -> Response:
        await asyncio.sleep(30)
        return score(1)

    setup.judge.fault = hang
    async with Engine(setup.config(timeout=TIMEOUT), transport=httpx.AsyncHTTPTransport(), sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.run(BATCH)
    timed_out = "judge request failed: timed out waiting for the response (timeout: 0.3 s for the whole call)"
    check(info.value, reason=timed_out)  # a judge that was not cut would have answered 1 after 30 s
    await all_closed(setup.server)


async def test_a_reply_trickling_past_the_deadline_is_cut_off(setup: Setup, sleeps: SleepRecorder) -> None:
    reply = score(2)
    setup.judge.fault = Response(200, reply.body + b" " * 40, reply.headers, piece=1, trickle=0.05)
    await aborts(setup, setup.config(timeout=TIMEOUT), sleeps, "timed out waiting for the response")
    assert setup.server.body_bytes_sent < len(reply.body) + 40


async def test_a_503_storm_beyond_the_budget(setup: Setup, sleeps: SleepRecorder) -> None:
    setup.judge.fault = status(503, retry_after="2")
    reason = "judge request failed: gave up after 4 attempts; last: HTTP 503"
    await aborts(setup, setup.config(max_attempts=4), sleeps, reason)
    # three retries, each after the Retry-After; the judge's window paused the other first tries no longer
    assert sleeps.calls.count(2.0) == 3 and all(0 < seconds <= 2.0 for seconds in sleeps.calls)
    assert setup.judge.faulted == 4


async def test_a_500_storm_within_the_budget_is_ridden_out(setup: Setup, sleeps: SleepRecorder) -> None:
    """The judge retries every 5xx: a gateway in front of a model answers 500 when it is overloaded."""
    storm = 0

    async def overloaded_then_fine(request: Request) -> Response:
        nonlocal storm
        storm += 1
        return status(500) if storm <= 3 else score(int(answer_of(request)))

    setup.judge.fault = overloaded_then_fine
    async with Engine(setup.config(max_attempts=5), sleep=sleeps) as eng:
        result = await eng.run(BATCH)
    assert result.rewards == [1.0, 0.7, 0.4, 0.2, 0.9, 1.0]
    assert result.usage["retries"] == 3 and len(sleeps.calls) == 3


async def test_a_connection_reset_mid_reply(setup: Setup, sleeps: SleepRecorder) -> None:
    reply = score(2)
    setup.judge.fault = Response(200, reply.body, reply.headers, reset_after=20, piece=10)
    await aborts(setup, setup.config(), sleeps, "the server closed the connection before the response was complete")
    assert setup.judge.faulted == 1  # a reply cut off is not retried: the judge did the work


# --- replies with no score -----------------------------------------------------------------------

BAD_REPLIES = {
    "no score": (completion('{"reason": "looks right"}'), "the judge's reply has no 'score'"),
    "a score that is a string": (completion('{"score": "7"}'), "the judge's 'score' is not a number"),
    "prose": (completion("I would give it a 7."), "the judge's reply is not a JSON object"),
    "an empty reply": (completion("", finish_reason="length"), "the judge's reply is empty (cut off at max_tokens)"),
    "no choices": (Response.json({"choices": []}), "the judge's response has no choices"),
    "not JSON": (Response(200, b"<html>upstream timeout</html>"), "judge response is not JSON: '<html>"),
    "invalid UTF-8": (Response(200, b'{"choices": "\xff"}'), "judge response is not JSON"),
    "a redirect": (Response(307, b"", {"location": "/v2/chat/completions"}), "judge answered HTTP 307"),
}


@pytest.mark.parametrize("fault", list(BAD_REPLIES))
async def test_a_reply_with_no_usable_score(setup: Setup, sleeps: SleepRecorder, fault: str) -> None:
    setup.judge.fault, reason = BAD_REPLIES[fault]
    await aborts(setup, setup.config(), sleeps, reason)
    assert setup.judge.faulted == 1 and sleeps.calls == []  # never retried
    assert all(request.path == "/v1/chat/completions" for request in setup.server.requests)


# --- size ----------------------------------------------------------------------------------------


async def test_an_oversized_reply_is_refused(setup: Setup, sleeps: SleepRecorder) -> None:
    padding = "x" * (2 * MIB)
    setup.judge.fault = completion(orjson.dumps({"score": 7, "reason": padding}).decode())
    reason = "judge request failed: response body of "
    err = await aborts(setup, setup.config(), sleeps, reason)
    assert err.reason.endswith("bytes is over the 1 MiB limit (max_body)")


async def test_a_reply_over_a_configured_cap_with_no_length_is_cut_off(
    setup: Setup, sleeps: SleepRecorder, tmp_path: Path
) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        f'environments = "envs"\nrubrics = "rubrics"\nallow_unpinned = true\n\n'
        f'[judge]\nbase_url = "{setup.server.base_url}"\nmodel = "judge-test"\nmax_body = 8192\n\n'
        f'[refs."{ARITH}"]\nmax_concurrency = 1\n'
    )
    config = load_config(path)
    assert config.judge is not None and config.judge.max_body == 8192
    endless = b"x" * (16 * MIB)
    setup.judge.fault = Response(200, endless, chunked=True, piece=4096)
    await aborts(setup, config, sleeps, "judge request failed: response body over the 8 KiB limit (max_body)")
    assert setup.server.body_bytes_sent < len(endless) // 2


# --- the API key ---------------------------------------------------------------------------------

KEY_VAR = "ENGINE_TEST_JUDGE_KEY"
KEY = "sk-test-51c0ffee/9e2d"


@pytest.mark.parametrize("code", [401, 503])
async def test_a_reply_echoing_the_api_key_never_puts_it_in_a_message(
    setup: Setup, sleeps: SleepRecorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    code: int
) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)

    async def echo(request: Request) -> Response:
        sent = request.headers["authorization"].replace("/", "\\/")
        # the key straddles the 200-character cut of an excerpt
        return Response(code, b"z" * 150 + f' {{"error": "invalid key {sent}"}}'.encode())

    setup.judge.fault = echo
    caplog.set_level(logging.DEBUG)
    err = await aborts(setup, setup.config(api_key_env=KEY_VAR, max_attempts=2), sleeps, f"HTTP {code}")
    for text in (str(err), repr(err), caplog.text):
        assert "c0ffee" not in text, text
    assert REDACTED in err.reason
