"""The retry policy as pure functions: what is transient, how long to wait, when to stop."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import format_datetime

import httpx
import pytest
import tenacity
from conftest import SleepRecorder

from engine._http.post import Post
from engine._http.retry import (
    BACKOFF_BASE,
    BACKOFF_MAX,
    RETRY_STATUSES,
    TransientStatus,
    backoff,
    is_transient,
    make_retrying,
    parse_retry_after,
)
from engine._reasons import describe
from engine._remote import client
from engine._verifiers.endpoint import verifier as endpoint
from engine._verifiers.rubric import judge

REQUEST = httpx.Request("POST", "http://127.0.0.1:9/score")


def status(code: int, retry_after: str | None = None, body: bytes = b"busy") -> TransientStatus:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return TransientStatus(httpx.Response(code, headers=headers, content=body, request=REQUEST))


@pytest.mark.parametrize("code", sorted(RETRY_STATUSES))
def test_retry_statuses_are_transient(code: int) -> None:
    assert is_transient(status(code))


def test_connect_failures_are_transient() -> None:
    assert is_transient(httpx.ConnectError("refused", request=REQUEST))
    assert is_transient(httpx.ConnectTimeout("slow to connect", request=REQUEST))


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ReadTimeout("no answer", request=REQUEST),  # the verifier may still be working
        httpx.WriteTimeout("stuck", request=REQUEST),
        httpx.RemoteProtocolError("garbage", request=REQUEST),
        ValueError("HTTP 400"),
        RuntimeError("boom"),
    ],
)
def test_everything_else_is_not(exc: Exception) -> None:
    assert not is_transient(exc)


def test_transient_status_carries_status_retry_after_and_body() -> None:
    exc = status(429, "7", body=b"slow   down\nplease")
    assert exc.status == 429
    assert exc.retry_after == 7.0
    assert str(exc) == "HTTP 429: slow down please"
    assert status(503).retry_after is None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5", 5.0), (" 2.5 ", 2.5), ("0", 0.0), ("-3", 0.0), ("-1", 0.0), (None, None), ("soon", None), ("", None),
     ("nan", None), ("NaN", None), ("inf", None), ("-inf", None), ("Infinity", None)],  # no number of seconds
)
def test_parse_retry_after_seconds_and_garbage(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value) == seconds


def test_parse_retry_after_http_date() -> None:
    when = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC)
    header = format_datetime(when, usegmt=True)
    assert header == "Wed, 21 Oct 2015 07:28:00 GMT"
    assert parse_retry_after(header, now=when.timestamp() - 30) == pytest.approx(30.0)
    assert parse_retry_after(header, now=when.timestamp() + 30) == 0.0  # a date in the past: no wait


@pytest.fixture
def eastern_local_time() -> Iterator[None]:
    """Local time five hours behind GMT, so a date read as local time is off by 18000 s."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "EST+05"
    time.tzset()
    yield
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


@pytest.mark.parametrize(
    "header",
    [
        "Sun, 06 Nov 1994 08:49:37 GMT",  # IMF-fixdate
        "Sunday, 06-Nov-94 08:49:37 GMT",  # obsolete RFC 850 form
        "Sun Nov  6 08:49:37 1994",  # obsolete asctime form: no zone written, GMT all the same
        "Sun, 06 Nov 1994 08:49:37 -0000",
    ],
)
def test_http_dates_are_gmt_whatever_the_local_zone(header: str, eastern_local_time: None) -> None:
    when = datetime(1994, 11, 6, 8, 49, 37, tzinfo=UTC).timestamp()
    assert parse_retry_after(header, now=when - 12) == pytest.approx(12.0)


def test_backoff_bounds_and_cap() -> None:
    for attempt in range(1, 30):
        step = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (attempt - 1))
        assert backoff(attempt, rng=lambda: 0.0) == pytest.approx(step / 2)
        assert backoff(attempt, rng=lambda: 1.0) == pytest.approx(step)
        assert step / 2 <= backoff(attempt, rng=lambda: 0.37) <= step
    assert backoff(1, rng=lambda: 1.0) == pytest.approx(BACKOFF_BASE)
    assert backoff(2, rng=lambda: 1.0) == pytest.approx(2 * BACKOFF_BASE)
    assert backoff(100, rng=lambda: 1.0) == BACKOFF_MAX


class Flaky:
    """An operation failing with ``failures`` in turn, then returning ``"done"``."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "done"


async def run(retrying: tenacity.AsyncRetrying, operation: Flaky) -> str:
    async for attempt in retrying:
        with attempt:
            result = await operation()
    return result


async def test_retries_transient_failures_then_succeeds(sleeps: SleepRecorder) -> None:
    operation = Flaky(status(503), httpx.ConnectError("refused", request=REQUEST), status(429, "1.5"))
    assert await run(make_retrying(5, 60.0, sleeps), operation) == "done"
    assert operation.calls == 4
    assert len(sleeps.calls) == 3
    assert BACKOFF_BASE / 2 <= sleeps.calls[0] <= BACKOFF_BASE
    assert 2 * BACKOFF_BASE / 2 <= sleeps.calls[1] <= 2 * BACKOFF_BASE
    assert sleeps.calls[2] == 1.5  # a Retry-After longer than the backoff is waited for as asked


@pytest.mark.parametrize("retry_after", ["0", "-1", "nan", "inf", "0.001"])
async def test_a_retry_after_asking_for_no_wait_is_waited_the_backoff_at_least(
    sleeps: SleepRecorder, retry_after: str
) -> None:
    # wait = max(Retry-After, backoff): a server answering 429 "Retry-After: 0" is not asked again at once
    operation = Flaky(*(status(code, retry_after) for code in (429, 503, 429, 503, 429)))
    assert await run(make_retrying(6, 60.0, sleeps), operation) == "done"
    assert len(sleeps.calls) == 5
    for attempt, wait in enumerate(sleeps.calls, start=1):
        step = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (attempt - 1))
        assert step / 2 <= wait <= step, (attempt, sleeps.calls)  # the backoff itself: nothing asked for is longer


async def test_stops_after_max_attempts(sleeps: SleepRecorder) -> None:
    operation = Flaky(*(status(503) for _ in range(10)))
    with pytest.raises(tenacity.RetryError) as info:
        await run(make_retrying(3, 60.0, sleeps), operation)
    assert operation.calls == 3
    assert len(sleeps.calls) == 2
    assert info.value.last_attempt.attempt_number == 3
    assert isinstance(info.value.last_attempt.exception(), TransientStatus)


async def test_stops_before_a_wait_that_would_pass_the_deadline(sleeps: SleepRecorder) -> None:
    operation = Flaky(status(503, "5"), status(503, "5"))
    with pytest.raises(tenacity.RetryError) as info:
        await run(make_retrying(10, 2.0, sleeps), operation)
    assert operation.calls == 1
    assert sleeps.calls == []  # it did not sleep 5 s only to give up afterwards
    assert info.value.last_attempt.attempt_number == 1


async def test_without_a_cap_on_tries_only_the_deadline_stops_it(sleeps: SleepRecorder) -> None:
    operation = Flaky(*(status(503) for _ in range(30)))
    assert await run(make_retrying(None, 60.0, sleeps), operation) == "done"  # the waits take no time here
    assert operation.calls == 31 and len(sleeps.calls) == 30
    assert max(sleeps.calls) <= BACKOFF_MAX
    operation = Flaky(status(503, "5"), status(503, "5"))
    with pytest.raises(tenacity.RetryError):
        await run(make_retrying(None, 2.0, sleeps), operation)
    assert operation.calls == 1  # a wait past the deadline is not begun


async def test_non_transient_failure_is_raised_at_once(sleeps: SleepRecorder) -> None:
    operation = Flaky(ValueError("HTTP 400: bad request"))
    with pytest.raises(ValueError, match="HTTP 400"):
        await run(make_retrying(5, 60.0, sleeps), operation)
    assert operation.calls == 1
    assert sleeps.calls == []


def test_endpoint_and_judge_call_one_bounded_post_and_drive_no_retries_of_their_own() -> None:
    # one driver and one POST (engine._http.post): neither verifier times, caps or retries a call itself
    for module in (endpoint, judge):
        source = inspect.getsource(module)
        assert "tenacity" not in vars(module) and "make_retrying" not in source, module.__name__
        assert "CallTimeout" not in source and "read_capped" not in source, module.__name__
        assert Post in vars(module).values(), module.__name__


def test_the_services_client_retries_with_the_one_driver() -> None:
    source = inspect.getsource(client)
    assert make_retrying in vars(client).values()
    assert "AsyncRetrying" not in source and "wait_before_retry" not in source and "stop_" not in source


# --- describing failures in words (engine._reasons.describe) ---


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (
            httpx.ConnectError("[Errno 111] Connection refused", request=REQUEST),
            "could not connect: [Errno 111] Connection refused",
        ),
        (httpx.ConnectError("", request=REQUEST), "could not connect: ConnectError"),
        (httpx.ReadTimeout("", request=REQUEST), "timed out waiting for the response"),
        (httpx.ConnectTimeout("", request=REQUEST), "timed out connecting"),
        (httpx.PoolTimeout("", request=REQUEST), "timed out waiting for a free connection"),
        (httpx.RemoteProtocolError("peer closed", request=REQUEST), "HTTP error (RemoteProtocolError): peer closed"),
        (TimeoutError(), "timed out"),
        (KeyError("reward"), "KeyError: 'reward'"),
        (RuntimeError(), "RuntimeError"),
    ],
)
def test_describe(exc: BaseException, reason: str) -> None:
    assert describe(exc) == reason


async def test_describe_a_retry_that_gave_up(sleeps: SleepRecorder) -> None:
    with pytest.raises(tenacity.RetryError) as info:
        await run(make_retrying(2, 60.0, sleeps), Flaky(status(503), status(502, body=b"bad gateway")))
    assert describe(info.value) == "gave up after 2 attempts; last: HTTP 502: bad gateway"
