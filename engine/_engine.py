"""The engine: the public API, and the lifecycle of what every batch it scores shares.

One engine owns one ``httpx.AsyncClient`` (and httpx's pools to any proxies the environment names), one thread
limiter for sync plugins, the judge and the cap on items in flight; the verifiers are ``engine._registry``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import httpx

from engine._cache.store import VerdictStore
from engine._config import EngineConfig, load_config
from engine._core import meters
from engine._core.contract import Verifier, check_first_index
from engine._core.forks import Owner
from engine._core.report import BatchResult
from engine._core.scheduler import score_batch
from engine._core.stats import Stats
from engine._core.threads import in_thread, wait_future
from engine._environments.manifest import Environment
from engine._errors import Failure, VerificationError
from engine._http.network import Proxies, Routes, ssl_context
from engine._http.retry import Sleep
from engine._http.transport import PoolTransport
from engine._registry import Registry, Shared
from engine._remote.client import TIMEOUT as REMOTE_TIMEOUT
from engine._remote.client import RemoteEngine
from engine._verifiers.rubric.judge import Judge

__all__ = ["Engine"]


def _batch_scope(transport: httpx.AsyncBaseTransport) -> Callable[[], AbstractContextManager[None]]:
    """What each batch runs inside: the engine's own transport closes the connections of the calls an
    abort cuts short when the batch ends (``PoolTransport.closes_deferred``); any other transport as it is."""
    deferred: Callable[[], AbstractContextManager[None]] | None = getattr(transport, "closes_deferred", None)
    return deferred if deferred is not None else contextlib.nullcontext


class Engine:
    """Scores batches of rollouts: one float per item, in input order, or one ``VerificationError``.

    Use it as an async context manager::

        async with Engine.from_config("engine.toml") as eng:
            rewards = await eng.score(items)

    It is the async API; ``BlockingEngine`` wraps it for synchronous trainers. Its connection pool,
    threads, imported plugins and limits are shared by every batch it scores while it is open.

    An open engine belongs to the process that opened it: in a child forked since (its connections,
    threads and worker processes are the parent's), ``load`` and ``run`` raise ``RuntimeError``, and
    leaving its ``async with`` block there closes nothing.

    Args:
        config: The engine's configuration; the defaults when None.
        transport: Replaces the HTTP transport under the shared client (it then takes every request,
            proxied or not).
        sleep: What retries wait with (tests inject one that takes no time).

    Raises:
        ConfigError: On entering its ``async with`` block: a ``refs`` key names no verifier, a ``pins``
            entry no environment, or the environment names a proxy httpx cannot use.
        CacheError: On entering its ``async with`` block: the ``[cache]`` file is not a verdict cache.
        RuntimeError: On entering its ``async with`` block: the engine is open already.
    """

    _opened_as = "async with Engine(...) as eng"

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        self._injected_transport = transport
        self._batch_scope: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
        self._routes: Routes | None = None
        self._sleep = sleep
        self._client: httpx.AsyncClient | None = None
        self._owner: Owner | None = None  # the process that opened it
        self._cache: VerdictStore | None = None
        self._in_flight = meters.slots(self.config.max_in_flight)
        self._registry = Registry(self.config, sleep=sleep)
        self.rubrics = self._registry.rubrics
        self._stats = Stats()

    @classmethod
    def from_config(cls, path: str | Path, **kwargs: Any) -> Self:
        """An engine configured by a TOML file.

        Args:
            path: The config file.
            kwargs: As the constructor takes them (``transport``, ``sleep``).

        Returns:
            The engine, not yet open.

        Raises:
            ConfigError: The file is missing, is not TOML, or holds a bad key or value (named).
        """
        return cls(load_config(path), **kwargs)

    @staticmethod
    def connect(
        url: str, *, token: str | None = None, timeout: float | None = REMOTE_TIMEOUT, **kwargs: Any
    ) -> RemoteEngine:
        """The engine served by ``engine serve`` at ``url``, with this class's ``score`` and ``run``.

        Use it as this class is used (``async with Engine.connect("http://127.0.0.1:8000") as eng``):
        the same rewards, reports, provenance and errors, raised here; every client of one service
        shares its verifiers' limits. Every answer is checked against the batch sent (one finite float
        reward per item, well-formed reports): anything else is ``ServiceError``.

        Args:
            url: The service's ``http://`` or ``https://`` URL.
            token: The service's bearer token (``--token-env``): printable ASCII without spaces.
            timeout: Seconds one request may take to be answered (connect, send, receive): 600 (ten
                minutes) by default, ``None`` to wait forever; past it, ``ServiceError``.
            kwargs: ``retry_budget`` (seconds a saturated service is asked again), ``sleep``, ``transport``.

        Returns:
            The client, not yet open.

        Raises:
            ValueError: The URL, token or timeout cannot be used (a token's message never holds it).
        """
        return RemoteEngine(url, token=token, timeout=timeout, **kwargs)

    async def __aenter__(self) -> Self:
        if self._client is not None:
            raise RuntimeError("this engine is already open")
        if self.config.refs or self.config.pins:
            # a refs key that names no verifier would leave its verifier at the defaults in silence, a pin of
            # no environment would pin nothing; it reads the directory (and for refs every manifest): in a
            # thread of its own (one of anyio's pool would outlive the engine)
            await wait_future(in_thread(self._registry.check_names, "engine-names"))
        size = self.config.max_in_flight
        # a private CA is added to the default trust; without one the transport makes httpx's default context
        tls = ssl_context(self.config.ca_bundle) if self.config.ca_bundle is not None else None
        transport = self._injected_transport or PoolTransport(size, ssl_context=tls)
        # The environment's proxies, as httpx would honour them for a client without a transport of its
        # own; an injected transport takes every request, as it would in httpx. (A proxy httpx cannot
        # use is a ConfigError here, before the engine holds anything.)
        proxies = Proxies.from_environment() if self._injected_transport is None else Proxies({})
        # a file that is not a cache fails the open, before any judge call (CacheError), as a bad config does;
        # last of what can fail here: the transport made above holds no connection yet
        cache = await VerdictStore.open(self.config.cache) if self.config.cache is not None else None
        self._routes = Routes(transport, proxies, tls=tls, max_connections=size)
        self._batch_scope = _batch_scope(transport)
        judge = self.config.judge
        self._client = httpx.AsyncClient(  # httpx sizes only a pool it builds itself: ours is sized above
            transport=transport,
            mounts=self._routes.mounts_for(judge.url) if judge is not None else None,
            timeout=None,  # every request carries its own deadline (engine._http.post): none falls back to this
            follow_redirects=False,
        )
        threads = meters.threads(self.config.threads)
        # the budget is this opening's: spent from nothing each time the engine opens (one engine serve: one job)
        graded_by = (
            Judge(judge, self._client, sleep=self._sleep, refs=self.config.refs)
            if judge is not None
            else None
        )
        self._cache = cache if graded_by is not None and graded_by.config.dedupe else None
        if cache is not None and self._cache is None:
            await cache.aclose()  # no judge keeps verdicts: the file was checked, and is not held
        self._registry.open(Shared(self._routes, threads, graded_by, self._cache))
        self._owner = Owner()
        return self

    def _check_process(self) -> None:
        """``RuntimeError`` if it was opened in another process (this one was forked from it since)."""
        if self._owner is not None:
            self._owner.check("this engine", self._opened_as)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._owner is not None and not self._owner.here:  # a forked child's copy: all it holds is the parent's
            return
        self._owner = None
        client, self._client, self._batch_scope = self._client, None, contextlib.nullcontext
        routes, self._routes = self._routes, None
        cache, self._cache = self._cache, None
        try:
            await self._registry.aclose()  # plugins with worker processes stop them
        finally:
            if client is not None:
                await client.aclose()
            if routes is not None:
                await routes.aclose()
            if cache is not None:
                await cache.aclose()  # the batches' verdicts written behind them are written first

    def environment(self, name: str) -> Environment:
        """An environment of the configured directory, its manifest loaded once for the engine's life.

        Args:
            name: The environment's directory name.

        Returns:
            The environment.

        Raises:
            ValueError: There is no such environment (or ``name`` is not a directory name).
            ManifestError: Its manifest cannot be read or is invalid.
        """
        return self._registry.environment(name)

    async def load(self, name: str) -> None:
        """Make an environment's verifier ready now, so that the first batch does not wait for it.

        A plugin's digest is checked against its pin and its module imported (its worker processes
        start on their first call); an endpoint or a rubric has nothing to load (a rubric that
        cannot be resolved fails here).

        Args:
            name: The environment's directory name.

        Raises:
            VerificationError: The verifier cannot be made ready (named, with the environment).
            ValueError: There is no such environment.
            ManifestError: Its manifest cannot be read or is invalid.
            RuntimeError: The engine is not open, or was opened in another process (this is a fork).
        """
        self._check_process()
        verifier = self._verifier(name)
        try:
            await verifier.load()
        except Failure as exc:  # no item asked: the error names the verifier and the environment
            raise VerificationError(verifier.kind, verifier.ref, exc.reason, key=verifier.key, environment=name,
                                    timed_out=exc.timed_out, cannot_load=exc.of_environment,
                                    plugin_frames=exc.frames) from exc.__cause__

    def _verifier(self, name: str) -> Verifier:
        """The verifier of environment ``name``, as a batch would resolve it (internal: what tests look into)."""
        return self._registry.verifier_for(self.environment(name))

    async def score(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> list[float]:
        """Score a batch: its rewards only, as :meth:`run` scores it.

        Args:
            items: As :meth:`run` takes them.
            first_index: As :meth:`run` takes it.

        Returns:
            One float reward per item, in input order.

        Raises:
            VerificationError, TypeError, ValueError, RuntimeError: As :meth:`run` raises them.
        """
        return (await self.run(items, first_index=first_index)).rewards

    async def run(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> BatchResult:
        """Score a batch: its rewards in input order, with per-verifier reports and provenance.

        Args:
            items: Mappings with ``environment`` (a directory name under the configured environments),
                ``task`` (a mapping), ``trajectory`` (as submitted) and optionally ``id``. A list is
                scored as it is: it must not change while it is being scored.
            first_index: The place of the first item in the caller's stream: errors name an item by its
                position in ``items`` plus ``first_index``, so a caller scoring a stream a chunk at a time
                (a backfill, a trainer's micro-batches) has each error name the item where it knows it.

        Returns:
            The batch's result: ``rewards`` (one float per item, in input order), a report per
            verifier, which verifier scored each item, and the judge's usage.

        Raises:
            VerificationError: The first item whose verifier failed, after everything else in flight
                was cancelled: the whole batch aborts, never a zero in the item's place.
            TypeError, ValueError: A malformed item (named), an unknown environment, or a bad ``first_index``;
                ``ManifestError`` (a ``ValueError`` too) for an environment whose manifest is invalid.
            RuntimeError: The engine is not open, or was opened in another process (this is a fork).
        """
        items = items if type(items) is list else list(items)
        check_first_index(first_index, len(items))
        self._check_process()
        with self._batch_scope():
            batch = score_batch(items, self._registry.resolver(), self._in_flight, first_index=first_index)
            return await self._stats.counted(batch)

    def stats(self, *, reset: bool = True) -> dict[str, float]:
        """The engine's figures since the last reset, per verifier, ready for a trainer's metrics (wandb ...).

        Args:
            reset: Start a new window: the next call counts from now.

        Returns:
            Keys ``engine/<verifier>/<figure>``, ``<verifier>`` the verifier's key (as in ``[refs."..."]``),
            figures ``items``, ``reward_mean``, ``errors`` (aborted batches), ``retries``, ``timeouts``,
            ``latency_p50_s``, ``latency_p99_s``, ``judge_tokens`` and ``judge_spend`` (at ``[judge]``'s prices).
            Across ranks the counts sum (items, errors, retries, timeouts, judge_tokens, judge_spend) and
            ``reward_mean`` averages weighted by items; the percentiles do not average.
        """
        return self._stats.snapshot(reset)
