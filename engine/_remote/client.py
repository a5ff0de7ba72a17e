"""The client of ``engine serve``: what ``Engine.connect`` and ``BlockingEngine.connect`` return.

Its ``score`` and ``run`` behave as an in-process engine's: the same rewards in the same order, the
same reports and provenance, the same ``VerificationError`` (kind, ref, reason, environment, index,
item id) raised here, and ``ValueError``/``TypeError`` with the same message for malformed items.
What cannot cross: an error's chained ``__cause__`` (its words are in the reason), and items that are
not JSON (a task holding a set, bytes, an object): ``TypeError`` before anything is sent. A service
that is saturated (503) is asked again after its ``Retry-After``, within ``retry_budget`` seconds;
anything else that is not an answer is ``ServiceError``.

Imports nothing above ``engine._core`` (and ``engine._http``'s retry policy): ``engine._engine`` sits above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import anyio
import httpx
import orjson
import tenacity

from engine._core.forks import Owner
from engine._core.portal import Blocking
from engine._core.report import BatchResult
from engine._core.stats import Stats
from engine._errors import ServiceError
from engine._http.retry import Sleep, backoff, parse_retry_after
from engine._remote.wire import decode_error, decode_result

__all__ = ["CONNECT_TIMEOUT", "RETRY_BUDGET", "BlockingRemoteEngine", "RemoteEngine"]

RETRY_BUDGET = 120.0  # seconds a batch keeps asking a saturated service (503) before it gives up
CONNECT_TIMEOUT = 30.0  # seconds to connect; a batch itself may take as long as its verifiers do
SCORE = "/v1/score"


class _Saturated(Exception):
    """A 503: the service asks to be asked again after ``retry_after`` seconds."""

    def __init__(self, retry_after: float | None) -> None:
        self.retry_after = retry_after
        super().__init__(retry_after)


def _wait(state: tenacity.RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome is not None else None
    if isinstance(exc, _Saturated) and exc.retry_after is not None:
        return exc.retry_after
    return backoff(state.attempt_number)


def _jsonable(value: Any) -> Any:
    """What orjson cannot write itself but an in-process engine takes: any other mapping, as a dict."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


class RemoteEngine:
    """An engine served by ``engine serve`` at ``url``; use it as an async context manager.

    ``token`` is sent as ``Authorization: Bearer``. ``sleep`` is what retries wait with (tests inject
    one that takes no time); ``transport`` replaces httpx's.

    As an in-process engine, an open client belongs to the process that opened it: a child forked since
    (whose copies of its connections are the parent's) is refused, and closing it there closes nothing.
    """

    _opened_as = "async with Engine.connect(url) as eng"

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        retry_budget: float = RETRY_BUDGET,
        sleep: Sleep = anyio.sleep,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the service's URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
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
        if type(first_index) is not int or first_index < 0:
            raise ValueError(f"first_index must be a whole number >= 0, got {first_index!r}")
        if self._owner is not None:
            self._owner.check("this engine", self._opened_as)
        try:
            body = orjson.dumps({"items": list(items), "first_index": first_index}, default=_jsonable)
        except orjson.JSONEncodeError as exc:
            raise TypeError(f"the batch cannot be sent to the scoring service: {exc}") from None
        return await self._stats.counted(self._scored(body))

    async def _scored(self, body: bytes) -> BatchResult:
        return decode_result(orjson.loads(await self._post(SCORE, body)))

    def stats(self, *, reset: bool = True) -> dict[str, float]:
        """Like ``Engine.stats``: this client's batches' figures since the last reset (the service's own, over
        every client, are its ``/metrics``)."""
        return self._stats.snapshot(reset)

    async def _post(self, path: str, body: bytes) -> bytes:
        """The answer's body; the error it stands for raised; 503 asked again within the budget."""
        client = self._client
        if client is None:
            raise RuntimeError(f"the engine is not open: use '{self._opened_as}'")
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_before_delay(self._retry_budget),
            wait=_wait,
            retry=tenacity.retry_if_exception_type(_Saturated),
            sleep=self._sleep,
        )
        url = self.url + path
        try:
            async for attempt in retrying:
                with attempt:
                    try:
                        response = await client.post(url, content=body, headers=self._headers)
                    except httpx.HTTPError as exc:
                        raise ServiceError(f"cannot reach the scoring service at {self.url}: {exc!r}") from exc
                    if response.status_code == 503:
                        raise _Saturated(parse_retry_after(response.headers.get("retry-after")))
        except tenacity.RetryError as exc:
            raise ServiceError(
                f"the scoring service at {self.url} stayed saturated (503) for {self._retry_budget:g} s", status=503
            ) from exc
        if response.status_code != 200:
            raise decode_error(response.status_code, response.content, self.url)
        return response.content


class BlockingRemoteEngine(Blocking[RemoteEngine]):
    """:class:`RemoteEngine` for synchronous trainers (``BlockingEngine.connect``); a context manager.

    One event loop runs in a background thread for its whole life (as ``BlockingEngine``'s), so
    every call reuses the same connections.
    """

    _opened_as = "with BlockingEngine.connect(url) as eng"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(RemoteEngine(url, **kwargs))
