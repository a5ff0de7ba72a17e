"""Endpoint verifiers: POST the item to an HTTP URL, read ``{"reward": <number>}`` back.

Each call is the one bounded POST with retries (docs/design.md, Transport); the protocol: :class:`EndpointVerifier`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import httpx
import orjson

from engine import _json
from engine._config import Limits
from engine._core.contract import check_reward
from engine._errors import Failure
from engine._http.headers import fill_headers
from engine._http.network import credentials_refusal, shown_url, url_problem, without_credentials
from engine._http.post import Pacer, Post
from engine._http.retry import Scrub, Sleep
from engine._reasons import Scrubber, describe, excerpt, is_timeout
from engine._verifiers._json import Words, number_field

__all__ = ["EndpointVerifier", "encode_item", "parse_reward"]

# identity: a compressed body could inflate past max_body after the transport has checked it
HEADERS = {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}


def encode_item(task: Mapping[str, Any], trajectory: Any) -> bytes:
    """The request body; raises ``TypeError`` for values JSON cannot carry (NaN too: orjson would write null)."""
    return _json.dumps({"task": task, "trajectory": trajectory}, default=_json.plain)


def _show(content: bytes, scrub: Scrub | None) -> str:
    """An excerpt of a body for a message, scrubbed before it is cut (no part of a secret survives the cut)."""
    if scrub is None:
        return excerpt(content) or "(empty body)"
    return excerpt(scrub(content.decode(errors="replace"))) or "(empty body)"


_WORDS = Words(
    not_object="response is a JSON {kind}, not an object: {shown}",
    missing="response has no 'reward' field: {shown}",
    not_number="'reward' is {value}, not a number",
)


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
    reward = number_field(
        data, "reward", _WORDS, lambda: _show(content, scrub), lambda value: _show(orjson.dumps(value), scrub)
    )
    return check_reward(reward)


class EndpointVerifier:
    """One verifier URL; one instance per URL per engine, whatever environments use it.

    The request body is ``{"task": ..., "trajectory": ...}`` serialized with orjson; the answer must be
    a JSON object whose ``reward`` is a JSON number (not a boolean, string, null or NaN). Every call is
    the one bounded POST: ``timeout`` seconds for the whole of it, and ``max_body`` bytes of response
    body, refused rather than read past. Transient failures are retried within the verifier's budget;
    anything else fails the item at once. Redirects are never followed (a 3xx is an answer like any
    other non-2xx: an error). Headers configured for the endpoint take their values from environment
    variables, read at each call; their values never appear in an error message.

    Requests go straight to the engine's transport (the connection pool under its shared
    ``httpx.AsyncClient``), or to a proxy's when the environment names one (docs/design.md, Transport).
    """

    kind = "endpoint"
    chunker: None = None  # one HTTP request per item

    def __init__(
        self,
        url: str,
        limits: Limits,
        transport: httpx.AsyncBaseTransport,
        *,
        sleep: Sleep = anyio.sleep,
        window: Pacer | None = None,
    ) -> None:
        self.ref = self.key = url
        self.limits = limits
        plain = without_credentials(url)
        if plain is not None:  # never echo the URL: it holds a password
            raise ValueError(f"an endpoint's URL must not carry credentials: {credentials_refusal(plain)}")
        problem = url_problem(url)
        if problem is not None:
            raise ValueError(f"an endpoint's URL is unusable: {problem}")
        if httpx.URL(url).scheme not in ("http", "https"):
            raise ValueError(f"an endpoint's URL must be http:// or https://, got {shown_url(url)!r}")
        self._post = Post(url, transport, limits, sleep=sleep, window=window)  # the window its meter's slots are
        self._plain_headers = httpx.Headers(HEADERS)  # built once: httpx copies a Headers without parsing it again
        self._templates = tuple(limits.headers.items())

    @property
    def retries(self) -> int:
        """Transient failures retried, over the engine's life."""
        return self._post.retries

    def spent(self) -> Mapping[str, int]:
        return {}  # an endpoint reports no cost

    async def load(self) -> None:
        pass  # nothing to prepare: each call connects (or reuses a connection) as it goes

    async def aclose(self) -> None:
        pass  # its connections are the engine's transport's

    def provenance(self) -> Mapping[str, Any]:
        return {"kind": self.kind, "ref": self.ref}

    def _headers(self) -> tuple[dict[str, str], Scrub]:
        """This call's headers, their variables read now, and what scrubs the variables' values from text."""
        extra, secrets = fill_headers(self._templates, Failure)
        return {**HEADERS, **extra}, Scrubber(secrets)

    async def _call(self, body: bytes, headers: Mapping[str, str], scrub: Scrub | None) -> float:
        response = await self._post(body, headers, scrub)  # its Failure is this call's, its cause chained
        try:
            return parse_reward(response, scrub)
        except (TypeError, ValueError) as exc:
            raise Failure(str(exc)) from None

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        try:
            body = encode_item(task, trajectory)
        except TypeError as exc:
            raise Failure(f"cannot send the item as JSON: {exc}") from exc
        if not self._templates:
            return await self._call(body, self._plain_headers, None)
        headers, scrub = self._headers()
        try:
            return await self._call(body, headers, scrub)
        except Exception as exc:
            # Keep no cause: its chain holds the request, with the headers, and unscrubbed bodies.
            reason = exc.reason if isinstance(exc, Failure) else describe(exc)
            raise Failure(scrub(reason), timed_out=is_timeout(exc)) from None
