"""The client of ``engine serve``: what ``Engine.connect`` and ``BlockingEngine.connect`` return.

Its ``score`` and ``run`` behave as an in-process engine's; what cannot cross, and what it checks of
every answer: docs/design.md, "Remote engine".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import anyio
import httpx
import tenacity

from engine import _json as json
from engine._core.contract import check_first_index
from engine._core.forks import Owner
from engine._core.portal import Blocking
from engine._core.report import BatchResult
from engine._core.stats import Stats
from engine._errors import ServiceError
from engine._http.headers import token_problem
from engine._http.retry import Sleep, TransientStatus, last_failure, make_retrying
from engine._reasons import Scrubber
from engine._remote.wire import decode_error, decode_result

__all__ = ["CONNECT_TIMEOUT", "RETRY_BUDGET", "TIMEOUT", "BlockingRemoteEngine", "RemoteEngine"]

RETRY_BUDGET = 120.0  # seconds a batch keeps asking a saturated service (503) before it gives up
CONNECT_TIMEOUT = 30.0  # seconds to connect (within the request's own timeout)
# seconds one request may take to be answered: longer than any sane training step's batch, short of forever
TIMEOUT = 600.0
SCORE = "/v1/score"


def _check_token(token: str | None) -> None:
    """``ValueError`` for a token no header can carry; the message says which character, never the token."""
    if token is None:
        return
    if not isinstance(token, str):
        raise TypeError(f"the token must be a string, got {type(token).__name__}")
    if problem := token_problem(token):
        raise ValueError(f"the token {problem}")


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0, or None to wait forever; got {timeout!r}")


class RemoteEngine:
    """An engine served by ``engine serve`` at ``url``; use it as an async context manager.

    As an in-process engine, an open client belongs to the process that opened it: a child forked since
    (whose copies of its connections are the parent's) is refused, and closing it there closes nothing.

    Args:
        url: Where the service is (``http://`` or ``https://``).
        token: Sent as ``Authorization: Bearer``; printable ASCII without spaces (0x21-0x7e).
        retry_budget: Seconds a saturated service (503) is asked again before ``ServiceError``.
        timeout: Seconds one request may take to be answered (connect, send the batch, receive the
            answer): 600 (ten minutes) unless given, ``None`` to wait forever.
        sleep: What retries wait with (tests inject one that takes no time).
        transport: Replaces httpx's.

    Raises:
        ValueError: ``url`` is not HTTP(S), ``token`` cannot be sent (the message never holds it), or
            ``timeout`` is not a number of seconds > 0 nor None.
    """

    _opened_as = "async with Engine.connect(url) as eng"

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        retry_budget: float = RETRY_BUDGET,
        timeout: float | None = TIMEOUT,
        sleep: Sleep = anyio.sleep,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the service's URL must start with http:// or https://, got {url!r}")
        _check_token(token)
        _check_timeout(timeout)
        self.url = url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
        self._scrub = Scrubber([token] if token is not None else [])
        self._timeout = timeout
        self._retry_budget = retry_budget
        self._sleep = sleep
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._owner: Owner | None = None  # the process that opened it
        self._stats = Stats()  # figures from the batches it scored: as an in-process engine's, from the same reports

    async def __aenter__(self) -> Self:
        if self._client is not None:
            raise RuntimeError("this engine is already open")
        self._client = httpx.AsyncClient(
            transport=self._transport,
            # the whole request's timeout is the client's own (one deadline, not httpx's per read)
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT),
            trust_env=False,  # the service is named by the caller; no proxy chosen from the environment
        )
        self._owner = Owner()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._owner is not None and not self._owner.here:  # a forked child's copy: its connections are the parent's
            return
        self._owner = None
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def score(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> list[float]:
        """One reward per item, in input order; see :meth:`run`."""
        return (await self.run(items, first_index=first_index)).rewards

    async def run(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> BatchResult:
        """Score a batch on the service, as ``Engine.run`` would in process."""
        batch = list(items)
        check_first_index(first_index, len(batch))  # as the engine checks it: one rule, on either side
        if self._owner is not None:
            self._owner.check("this engine", self._opened_as)
        try:  # every integer exact, a wide one too
            body = json.dumps({"items": batch, "first_index": first_index}, default=json.plain)
        except TypeError as exc:
            raise TypeError(f"the batch cannot be sent to the scoring service: {exc}") from None
        return await self._stats.counted(self._scored(body, len(batch)))

    async def _scored(self, body: bytes, count: int) -> BatchResult:
        result = decode_result(await self._post(SCORE, body), self.url, self._scrub)
        if len(result.rewards) != count:  # a reward short or over would shift every one after it in the trainer
            raise ServiceError(
                f"the scoring service at {self.url} answered {len(result.rewards)} rewards for {count} items sent",
                status=200,
            )
        return result

    def stats(self, *, reset: bool = True) -> dict[str, float]:
        """Like ``Engine.stats``: this client's batches' figures since the last reset (the service's own, over
        every client, are its ``/metrics``)."""
        return self._stats.snapshot(reset)

    async def _post(self, path: str, body: bytes) -> bytes:
        """The answer's body; the error it stands for raised; 503 asked again within the budget."""
        client = self._client
        if client is None:
            raise RuntimeError(f"the engine is not open: use '{self._opened_as}'")
        retrying = make_retrying(None, self._retry_budget, self._sleep)  # TransientStatus is raised for 503 only
        try:
            async for attempt in retrying:
                with attempt:
                    response = await self._answer(client, self.url + path, body)
                    if response.status_code == 503:
                        raise TransientStatus(response, self._scrub)
        except tenacity.RetryError as exc:
            raise ServiceError(
                f"the scoring service at {self.url} stayed saturated (503) for {self._retry_budget:g} s", status=503
            ) from last_failure(exc)
        if response.status_code != 200:  # its words become an error's: the token taken out (a stranger may echo it)
            raise decode_error(response.status_code, self._scrub.body(response.content), self.url)
        return response.content

    async def _answer(self, client: httpx.AsyncClient, url: str, body: bytes) -> httpx.Response:
        """One request's response, within the timeout; ``ServiceError`` if none came."""
        try:
            with anyio.fail_after(self._timeout):
                return await client.post(url, content=body, headers=self._headers)
        except TimeoutError:
            raise ServiceError(
                f"no answer came within {self._timeout:g} s from the scoring service at {self.url}"
            ) from None
        except httpx.HTTPError as exc:
            raise ServiceError(f"cannot reach the scoring service at {self.url}: {self._scrub(repr(exc))}") from exc


class BlockingRemoteEngine(Blocking[RemoteEngine]):
    """:class:`RemoteEngine` for synchronous trainers (``BlockingEngine.connect``); a context manager.

    One event loop runs in a background thread for its whole life (as ``BlockingEngine``'s), so
    every call reuses the same connections.
    """

    _opened_as = "with BlockingEngine.connect(url) as eng"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(RemoteEngine(url, **kwargs))
