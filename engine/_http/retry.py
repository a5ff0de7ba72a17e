"""Which HTTP failures are retried, and how long to wait: pure functions, tested as such.

What is retried and what never is, and why: docs/design.md, "Transport", "Retries".
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC
from email.utils import parsedate_to_datetime

import httpx
import tenacity

from engine._reasons import excerpt, tls_verification_failure

__all__ = [
    "RETRY_STATUSES",
    "Scrub",
    "TransientStatus",
    "backoff",
    "is_throttle",
    "is_transient",
    "last_failure",
    "make_retrying",
    "parse_retry_after",
    "wait_before_retry",
]

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
BACKOFF_BASE = 0.1  # seconds before the first retry, doubled on each further one
BACKOFF_MAX = 10.0  # seconds, the longest wait between two tries without a Retry-After

Sleep = Callable[[float], Awaitable[None]]
Scrub = Callable[[str], str]  # removes secrets from a text before it goes into a message


class TransientStatus(Exception):
    """A response whose status asks to try again later; carries its ``Retry-After`` in seconds.

    ``scrub`` cleans the body before it is cut to an excerpt (so no part of a secret survives the cut).
    """

    def __init__(self, response: httpx.Response, scrub: Scrub | None = None) -> None:
        self.status = response.status_code
        self.retry_after = parse_retry_after(response.headers.get("retry-after"))
        body: str | bytes = response.content if scrub is None else scrub(response.content.decode(errors="replace"))
        self.reason = f"HTTP {self.status}: {excerpt(body) or '(empty body)'}"
        super().__init__(self.reason)


THROTTLE_STATUS = 429  # always a congestion signal; a 503 is one only with a Retry-After (else it is an outage)


def is_throttle(status: int, retry_after: float | None) -> bool:
    """Whether a transient answer says the caller is over a quota (an adaptive window shrinks), not that the
    server is down."""
    return status == THROTTLE_STATUS or (status == 503 and retry_after is not None)


def is_transient(exc: BaseException) -> bool:
    """True for failures worth another try (not a certificate that failed verification: it will fail again)."""
    if isinstance(exc, httpx.ConnectError):
        return tls_verification_failure(exc) is None
    return isinstance(exc, TransientStatus | httpx.ConnectTimeout)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date), or None.

    Never negative (a past date or ``-1`` is 0.0); None for what says no number of seconds (``nan``, ``inf``).
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an HTTP date is always GMT, even in the forms that do not say so
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff(attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Wait before try ``attempt + 1``: exponential with jitter (half to all of the step)."""
    step = min(BACKOFF_MAX, BACKOFF_BASE * 2.0 ** (attempt - 1))
    return step * (0.5 + 0.5 * rng())


def wait_before_retry(state: tenacity.RetryCallState) -> float:
    """The wait before the next try: the backoff, or the failed try's ``Retry-After`` if that is longer.

    The one retry driver's wait (:func:`make_retrying`'s): a server that says ``Retry-After: 0`` is still
    not asked again at once, which would hammer it as fast as it answers.
    """
    exc = state.outcome.exception() if state.outcome is not None else None
    floor = backoff(state.attempt_number)
    if isinstance(exc, TransientStatus) and exc.retry_after is not None:
        return max(exc.retry_after, floor)
    return floor


def last_failure(exc: tenacity.RetryError) -> BaseException | None:
    """The exception of the last try a retry loop gave up after: the cause to chain, not tenacity's wrapper."""
    return exc.last_attempt.exception()


class _StopBefore(tenacity.stop.stop_base):
    """Stop before a wait that would end past ``deadline`` seconds from ``started`` (``time.monotonic()``)."""

    def __init__(self, deadline: float, started: float) -> None:
        self.deadline = deadline
        self.started = started

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        now = retry_state.outcome_timestamp
        if now is None:
            now = time.monotonic()
        return now - self.started + retry_state.upcoming_sleep >= self.deadline


def make_retrying(
    max_attempts: int | None, deadline: float, sleep: Sleep, *, started: float | None = None
) -> tenacity.AsyncRetrying:
    """The one retry driver: a loop retrying what :func:`is_transient` says, waiting :func:`wait_before_retry`.

    Args:
        max_attempts: The most tries (None: as many as ``deadline`` leaves time for).
        deadline: Seconds from ``started`` past which no wait ends.
        sleep: What it waits with (tests inject one that takes no time).
        started: A ``time.monotonic()``: when the first try began, if it ran before the loop (else now).

    Returns:
        The loop; when it gives up, it raises ``tenacity.RetryError`` (see :func:`last_failure`); a failure
        that is not transient is raised as it is, at once.
    """
    origin = time.monotonic() if started is None else started
    stop: tenacity.stop.stop_base = _StopBefore(deadline, origin)
    if max_attempts is not None:
        stop = tenacity.stop_after_attempt(max_attempts) | stop
    return tenacity.AsyncRetrying(
        stop=stop,
        wait=wait_before_retry,
        retry=tenacity.retry_if_exception(is_transient),
        sleep=sleep,
        reraise=False,
    )
