"""Endpoint verifiers: POST the item to an HTTP URL, read ``{"reward": <number>}`` back.

Every endpoint shares the engine's one ``httpx.AsyncClient``. The request body is
``{"task": ..., "trajectory": ...}`` serialized with orjson; the answer must be a JSON object
whose ``reward`` is a JSON number (not a boolean, string, null or NaN). Transient failures are
retried within the verifier's budget (``engine.retry``); anything else fails the item at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import httpx
import orjson

from .config import Limits
from .errors import VerificationError, excerpt
from .retry import RETRY_STATUSES, Sleep, TransientStatus, is_transient, make_retrying
from .verifier import check_reward

__all__ = ["EndpointVerifier", "encode_item", "parse_reward"]

HEADERS = {"content-type": "application/json", "accept": "application/json"}


def _default(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def encode_item(task: Mapping[str, Any], trajectory: Any) -> bytes:
    """The request body; raises ``TypeError`` for values JSON cannot carry."""
    return orjson.dumps({"task": task, "trajectory": trajectory}, default=_default)


def parse_reward(response: httpx.Response) -> float:
    """The reward in a response; raises ``ValueError`` saying what is wrong with it."""
    if not response.is_success:
        raise ValueError(f"HTTP {response.status_code}: {excerpt(response.content) or '(empty body)'}")
    try:
        data = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        raise ValueError(f"response is not JSON: {excerpt(response.content) or '(empty body)'}") from None
    if not isinstance(data, dict):
        raise ValueError(f"response is a JSON {type(data).__name__}, not an object: {excerpt(response.content)}")
    if "reward" not in data:
        raise ValueError(f"response has no 'reward' field: {excerpt(response.content)}")
    reward = data["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ValueError(f"'reward' is {orjson.dumps(reward).decode()}, not a number")
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
        self._url = httpx.URL(url)
        self._transport = transport
        self._sleep = sleep
        seconds = limits.timeout
        self._extensions = {"timeout": {"connect": seconds, "read": seconds, "write": seconds, "pool": seconds}}
        self.retries = 0  # transient failures retried, over the engine's life

    def chunk_size(self, share: int) -> int:
        return 1  # one HTTP request per item

    def provenance(self) -> Mapping[str, Any]:
        return {"kind": self.kind, "ref": self.ref}

    def _fail(self, reason: str) -> VerificationError:
        return VerificationError(self.kind, self.ref, reason)

    async def _post(self, body: bytes) -> httpx.Response:
        request = httpx.Request("POST", self._url, content=body, headers=HEADERS, extensions=self._extensions)
        response = await self._transport.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        if response.status_code in RETRY_STATUSES:
            raise TransientStatus(response)
        return response

    async def _retry(self, body: bytes, first: Exception) -> httpx.Response:
        """Try again after a transient failure, within the verifier's budget (counted from ``first``)."""
        limits = self.limits
        retrying = make_retrying(limits.max_attempts, limits.retry_deadline, self._sleep)
        async for attempt in retrying:
            with attempt:
                if attempt.retry_state.attempt_number == 1:
                    raise first  # the failed first try, replayed so that tenacity counts and waits for it
                self.retries += 1
                response = await self._post(body)
        return response

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        try:
            body = encode_item(task, trajectory)
        except TypeError as exc:
            raise self._fail(f"cannot send the item as JSON: {exc}") from exc
        try:
            response = await self._post(body)
        except Exception as exc:
            if not is_transient(exc):
                raise
            response = await self._retry(body, exc)
        try:
            return parse_reward(response)
        except (TypeError, ValueError) as exc:
            raise self._fail(str(exc)) from None
