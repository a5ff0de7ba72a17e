"""Endpoint verifiers: POST the item to an HTTP URL, read ``{"reward": <number>}`` back.

Every endpoint shares the engine's one ``httpx.AsyncClient``. The request body is
``{"task": ..., "trajectory": ...}`` serialized with orjson; the answer must be a JSON object
whose ``reward`` is a JSON number (not a boolean, string, null or NaN). Transient failures are
retried within the verifier's budget (``engine._http.retry``); anything else fails the item at once.

Every call is bounded: ``timeout`` seconds for the whole of it (connecting, waiting for a pooled
connection, sending and reading together, not each in turn), and ``max_body`` bytes of response
body, which the engine's transport refuses to read past. Redirects are never followed (a 3xx is an
answer like any other non-2xx: an error). Headers configured for the endpoint take their values
from environment variables, read at each call; their values never appear in an error message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import anyio
import httpx
import orjson
import tenacity

from engine._config import Limits
from engine._core.contract import check_reward
from engine._errors import VerificationError
from engine._http.headers import fill_headers
from engine._http.network import credentials_refusal, read_capped, shown_url, url_problem, without_credentials
from engine._http.retry import RETRY_STATUSES, Scrub, Sleep, TransientStatus, is_transient, last_failure, make_retrying
from engine._http.transport import MAX_BODY, TOTAL_TIMEOUT, CallTimeout, PoolTransport, check_size
from engine._reasons import Scrubber, describe, excerpt

__all__ = ["EndpointVerifier", "encode_item", "parse_reward"]

# identity: a compressed body could inflate past max_body after the transport has checked it
HEADERS = {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}
# the phases of a call are not timed one by one: one deadline covers the whole call
_NO_PHASE_TIMEOUTS: dict[str, float | None] = {"connect": None, "read": None, "write": None, "pool": None}


def _default(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def encode_item(task: Mapping[str, Any], trajectory: Any) -> bytes:
    """The request body; raises ``TypeError`` for values JSON cannot carry."""
    return orjson.dumps({"task": task, "trajectory": trajectory}, default=_default)


def _show(content: bytes, scrub: Scrub | None) -> str:
    """An excerpt of a body for a message, scrubbed before it is cut (no part of a secret survives the cut)."""
    if scrub is None:
        return excerpt(content) or "(empty body)"
    return excerpt(scrub(content.decode(errors="replace"))) or "(empty body)"


def parse_reward(response: httpx.Response, scrub: Scrub | None = None) -> float:
    """The reward in a response; raises ``ValueError`` saying what is wrong with it.

    ``scrub`` cleans every excerpt of the body that goes into the message.
    """
    content = response.content
    if not response.is_success:
        raise ValueError(f"HTTP {response.status_code}: {_show(content, scrub)}")
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        try:
            content.decode()
        except UnicodeDecodeError as exc:
            shown = _show(content, scrub)
            raise ValueError(f"response is not valid UTF-8 (byte {exc.start}), so not JSON: {shown}") from None
        raise ValueError(f"response is not JSON: {_show(content, scrub)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"response is a JSON {type(data).__name__}, not an object: {_show(content, scrub)}")
    if "reward" not in data:
        raise ValueError(f"response has no 'reward' field: {_show(content, scrub)}")
    reward = data["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ValueError(f"'reward' is {_show(orjson.dumps(reward), scrub)}, not a number")
    return check_reward(reward)


class EndpointVerifier:
    """One verifier URL; one instance per URL per engine, whatever environments use it.

    Requests go straight to the engine's transport (the connection pool under its shared
    ``httpx.AsyncClient``): an endpoint call needs none of the client's per-request machinery
    (auth, cookies, redirects, which are off), and skipping it saves ~60 us of CPU per call. The
    first try also runs outside tenacity, whose loop costs ~60 us more; only a transient failure
    enters the retry loop.
    """

    kind = "endpoint"

    def __init__(
        self, url: str, limits: Limits, transport: httpx.AsyncBaseTransport, *, sleep: Sleep = anyio.sleep
    ) -> None:
        self.ref = self.key = url
        self.limits = limits
        plain = without_credentials(url)
        if plain is not None:  # never echo the URL: it holds a password
            raise ValueError(f"an endpoint's URL must not carry credentials: {credentials_refusal(plain)}")
        problem = url_problem(url)
        if problem is not None:
            raise ValueError(f"an endpoint's URL is unusable: {problem}")
        self._url = httpx.URL(url)
        if self._url.scheme not in ("http", "https"):
            raise ValueError(f"an endpoint's URL must be http:// or https://, got {shown_url(url)!r}")
        self._transport = transport
        self._sleep = sleep
        self._timeout = limits.timeout
        self._max_body = limits.max_body
        # The engine's transport keeps the call's deadline itself, each phase failing as itself (a
        # connect that times out is retried); any other gets one timer around the whole call.
        self._keeps_deadline = isinstance(transport, PoolTransport)
        self._extensions = {"timeout": _NO_PHASE_TIMEOUTS, TOTAL_TIMEOUT: limits.timeout, MAX_BODY: limits.max_body}
        self._plain_headers = httpx.Headers(HEADERS)  # built once: httpx copies a Headers without parsing it again
        self._templates = tuple(limits.headers.items())
        self.retries = 0  # transient failures retried, over the engine's life

    def spent(self) -> Mapping[str, int]:
        return {}  # an endpoint reports no cost

    async def load(self) -> None:
        pass  # nothing to prepare: each call connects (or reuses a connection) as it goes

    async def aclose(self) -> None:
        pass  # its connections are the engine's transport's

    def chunk_size(self, share: int) -> int:
        return 1  # one HTTP request per item

    def provenance(self) -> Mapping[str, Any]:
        return {"kind": self.kind, "ref": self.ref}

    def _fail(self, reason: str) -> VerificationError:
        return VerificationError(self.kind, self.ref, reason)

    def _headers(self) -> tuple[dict[str, str], Scrub]:
        """This call's headers, their variables read now, and what scrubs the variables' values from text."""
        extra, secrets = fill_headers(self._templates, self._fail)
        return {**HEADERS, **extra}, Scrubber(secrets)

    async def _post(self, body: bytes, headers: Mapping[str, str], scrub: Scrub | None) -> httpx.Response:
        request = httpx.Request("POST", self._url, content=body, headers=headers, extensions=self._extensions)
        try:
            if self._keeps_deadline:
                response = await self._transport.handle_async_request(request)  # read in full already
            else:
                response = await self._foreign(request)
        except httpx.ReadTimeout:
            raise CallTimeout(self._timeout, request) from None
        check_size(response, self._max_body)  # the engine's transport refused it already; another may not
        if response.status_code in RETRY_STATUSES:
            raise TransientStatus(response, scrub)
        return response

    async def _foreign(self, request: httpx.Request) -> httpx.Response:
        """A call through a transport other than the engine's (httpx's own, to a proxy), bounded by one timer.

        Such a transport keeps neither the call's deadline nor its ``max_body``: the timer keeps the
        one, reading the body a piece at a time under the cap the other (it is not on the hot path).
        """
        deadline = asyncio.timeout(self._timeout)
        try:
            async with deadline:
                response = await self._transport.handle_async_request(request)
                response = await read_capped(response, self._max_body, request)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise CallTimeout(self._timeout, request) from None
        return response

    async def _retry(
        self, body: bytes, headers: Mapping[str, str], scrub: Scrub | None, first: Exception
    ) -> httpx.Response:
        """Try again after a transient failure, within the verifier's budget (counted from ``first``)."""
        limits = self.limits
        retrying = make_retrying(limits.max_attempts, limits.retry_deadline, self._sleep)
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number == 1:
                        raise first  # the failed first try, replayed so that tenacity counts and waits for it
                    self.retries += 1
                    response = await self._post(body, headers, scrub)
        except tenacity.RetryError as exc:
            raise self._fail(describe(exc)) from last_failure(exc)
        return response

    async def _call(self, body: bytes, headers: Mapping[str, str], scrub: Scrub | None) -> float:
        try:
            response = await self._post(body, headers, scrub)
        except Exception as exc:
            if not is_transient(exc):
                raise
            response = await self._retry(body, headers, scrub, exc)
        try:
            return parse_reward(response, scrub)
        except (TypeError, ValueError) as exc:
            raise self._fail(str(exc)) from None

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        try:
            body = encode_item(task, trajectory)
        except TypeError as exc:
            raise self._fail(f"cannot send the item as JSON: {exc}") from exc
        if not self._templates:
            return await self._call(body, self._plain_headers, None)
        headers, scrub = self._headers()
        try:
            return await self._call(body, headers, scrub)
        except Exception as exc:
            # Keep no cause: its chain holds the request, with the headers, and unscrubbed bodies.
            reason = exc.reason if isinstance(exc, VerificationError) else describe(exc)
            raise self._fail(scrub(reason)) from None
