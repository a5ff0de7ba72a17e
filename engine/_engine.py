"""The engine: resolves each item's environment to its verifier, and scores batches.

``Engine`` is the async API; ``engine._blocking.BlockingEngine`` wraps it for synchronous trainers.
One engine owns one ``httpx.AsyncClient`` (one connection pool, and httpx's own pools to any
proxies the environment names: ``engine._http.network``), one thread pool limiter for sync plugins, and
the live limits of every verifier, all shared by every batch it scores.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import Any, Self

import anyio
import httpx

from engine._config import DEFAULT_TIMEOUT, EngineConfig, load_config
from engine._core.contract import ChunkedVerifier, Items, MalformedItem, Verifier, task_of
from engine._core.report import BatchResult, VerifierReport
from engine._core.scheduler import Gate, Lane, in_flight_cap, logger, run_lanes, total
from engine._environments.manifest import Environment, load_environment
from engine._errors import ConfigError, VerificationError
from engine._http.network import Proxies, Routes, ssl_context
from engine._http.retry import Sleep
from engine._http.transport import PoolTransport
from engine._reasons import describe
from engine._verifiers.endpoint.verifier import EndpointVerifier
from engine._verifiers.plugin.verifier import PluginVerifier
from engine._verifiers.rubric.judge import Judge
from engine._verifiers.rubric.registry import RubricRegistry
from engine._verifiers.rubric.verifier import RubricVerifier

__all__ = ["Engine"]

# a directory's name: no path separator, no leading dot, at most NAME_MAX (255) bytes, as Linux allows
_ENV_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


def _which(index: int, item: Mapping[str, Any]) -> str:
    """How a message names an item: its position, and its ``id`` if it has one."""
    item_id = item.get("id")
    return f"item {index}" if item_id is None else f"item {index} (id {item_id!r})"


def _check_item(index: int, item: Any) -> str:
    """The item's environment name; ``TypeError``/``ValueError`` naming the item if it is malformed.

    (Its task and trajectory are checked where they are read, by ``engine._core.contract.task_of`` or a
    plugin's chunk runner: looking at every item once more here would cost a cheap plugin's batch
    a fifth of its speed.)
    """
    if not isinstance(item, Mapping):
        raise TypeError(f"item {index} is a {type(item).__name__}, not a mapping")
    if "environment" not in item:
        raise ValueError(
            f"{_which(index, item)} has no 'environment' (an item needs 'environment', 'task', 'trajectory')"
        )
    name = item["environment"]
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise ValueError(f"{_which(index, item)}: 'environment' must be an environment's directory name, got {name!r}")
    return name


def _at_item(exc: VerificationError, index: int, item: Mapping[str, Any]) -> VerificationError:
    """``exc``, naming the item it failed on: its position, its ``id`` and its environment."""
    exc.index, exc.item_id, exc.environment = index, item.get("id"), item["environment"]
    return exc


def _group(items: list[Any], positions: Iterable[int]) -> dict[str, list[int]]:
    """The items at ``positions`` by environment, in one pass; ``TypeError``/``ValueError`` naming a malformed one."""
    groups: defaultdict[str, list[int]] = defaultdict(list)
    try:
        for index in positions:
            groups[items[index]["environment"]].append(index)
    except (KeyError, TypeError, IndexError):
        for index in positions:  # something is malformed: find it, and say what
            _check_item(index, items[index])
        raise AssertionError("unreachable: an item failed the fast path but passes the check") from None
    for indices in groups.values():
        _check_item(indices[0], items[indices[0]])
    return dict(groups)


def _guess(items: list[Any]) -> str | None:
    """The environment of a batch that looks like one environment's: its first and last items agree."""
    if not items:
        return None
    first = _check_item(0, items[0])
    last = items[-1]
    return first if isinstance(last, Mapping) and last.get("environment") == first else None


class Engine:
    """Scores batches of rollouts: one float per item, in input order, or one ``VerificationError``.

    Use it as an async context manager::

        async with Engine.from_config("engine.toml") as eng:
            rewards = await eng.score(items)

    ``transport`` replaces the HTTP transport under the shared client; ``sleep`` is what retries
    wait with (tests inject one that takes no time).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        self._injected_transport = transport
        self._transport: httpx.AsyncBaseTransport | None = None
        self._routes: Routes | None = None
        self._sleep = sleep
        self._client: httpx.AsyncClient | None = None
        self._threads: anyio.CapacityLimiter | None = None
        self._in_flight = in_flight_cap(self.config.max_in_flight)
        self._environments: dict[str, Environment] = {}
        self._verifiers: dict[str, Verifier] = {}
        self._gates: dict[str, Gate] = {}
        self._judge: Judge | None = None
        self.rubrics = RubricRegistry(self.config.rubrics)

    @classmethod
    def from_config(cls, path: str | Path, **kwargs: Any) -> Self:
        """An engine configured by the TOML file at ``path``."""
        return cls(load_config(path), **kwargs)

    async def __aenter__(self) -> Self:
        if self._client is not None:
            raise RuntimeError("this engine is already open")
        size = self.config.max_in_flight
        # a private CA is added to the default trust; without one the transport makes httpx's default context
        tls = ssl_context(self.config.ca_bundle) if self.config.ca_bundle is not None else None
        transport = self._injected_transport or PoolTransport(size, ssl_context=tls)
        # The environment's proxies, as httpx would honour them for a client without a transport of its
        # own; an injected transport takes every request, as it would in httpx. (A proxy httpx cannot
        # use is a ConfigError here, before the engine holds anything.)
        proxies = Proxies.from_environment() if self._injected_transport is None else Proxies({})
        self._routes = Routes(transport, proxies, tls=tls, max_connections=size)
        self._transport = transport
        judge = self.config.judge
        self._client = httpx.AsyncClient(  # httpx sizes only a pool it builds itself: ours is sized above
            transport=self._transport,
            mounts=self._routes.mounts_for(judge.url) if judge is not None else None,
            timeout=DEFAULT_TIMEOUT,
            follow_redirects=False,
        )
        self._threads = anyio.CapacityLimiter(self.config.threads)
        if self.config.judge is not None:
            self._judge = Judge(self.config.judge, self._client, sleep=self._sleep)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        client, self._client, self._judge, self._transport = self._client, None, None, None
        routes, self._routes = self._routes, None
        verifiers = list(self._verifiers.values())
        self._verifiers.clear()
        try:
            for verifier in verifiers:  # plugins with worker processes stop them
                aclose = getattr(verifier, "aclose", None)
                if aclose is not None:
                    await aclose()
        finally:
            if client is not None:
                await client.aclose()
            if routes is not None:
                await routes.aclose()

    def environment(self, name: str) -> Environment:
        """The environment called ``name``, loaded once; ``ValueError`` if there is none."""
        env = self._environments.get(name)
        if env is None:
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment's directory name")
            path = self.config.environments / name
            if not path.is_dir():
                raise ValueError(f"unknown environment {name!r}: no directory {path}")
            env = self._environments[name] = load_environment(path)
        return env

    def _environment_of(self, index: int, item: Mapping[str, Any]) -> Environment:
        """The environment of item ``index``; ``ValueError`` naming the item if there is none."""
        try:
            return self.environment(item["environment"])
        except ConfigError:  # its manifest is bad: the error names the file
            raise
        except ValueError as exc:
            raise ValueError(f"{_which(index, item)}: {exc}") from None

    def verifier_for(self, env: Environment, rubrics: dict[str, Verifier] | None = None) -> Verifier:
        """The verifier of ``env``.

        Plugins and endpoints live as long as the engine (imports and connections are reused);
        a rubric is resolved anew for each batch (``rubrics`` holds the batch's resolutions), so
        every item of a batch is judged against the same version even if a new one appears while
        it runs. Raises ``VerificationError`` when a rubric cannot be resolved or graded.
        """
        if rubrics is None:
            rubrics = {}
        if self._client is None or self._threads is None:
            raise RuntimeError("the engine is not open: use 'async with Engine(...) as eng'")
        spec = env.verifier
        if spec.kind == "rubric":
            verifier = rubrics.get(spec.ref)
            if verifier is None:
                if self._judge is None:
                    raise VerificationError("rubric", spec.ref, "no [judge] is configured to grade rubrics")
                verifier = rubrics[spec.ref] = RubricVerifier(self.rubrics.resolve(spec.ref), self._judge)
            return verifier
        key = env.verifier_key
        verifier = self._verifiers.get(key)
        if verifier is None:
            limits = self.config.limits_for(key)
            if spec.kind == "plugin":
                verifier = PluginVerifier(
                    env,
                    limits,
                    pin=self.config.pins.get(env.name),
                    allow_unpinned=self.config.allow_unpinned,
                    thread_limiter=self._threads,
                )
            else:
                assert self._routes is not None  # set with the client
                verifier = EndpointVerifier(spec.ref, limits, self._routes.transport_for(spec.ref), sleep=self._sleep)
            self._verifiers[key] = verifier
        return verifier

    def _lanes(
        self, items: list[Any], groups: Mapping[str, Sequence[int]], rubrics: dict[str, Verifier], guess: bool = False
    ) -> list[Lane]:
        """A lane per verifier for ``groups`` (environment -> positions); ``guess``: the one group is a guess."""
        lanes: dict[Verifier, Lane] = {}
        for name, indices in groups.items():
            try:
                verifier = self.verifier_for(self._environment_of(indices[0], items[indices[0]]), rubrics)
            except VerificationError as exc:
                raise _at_item(exc, indices[0], items[indices[0]])  # noqa: B904 (it is the same error)
            lane = lanes.get(verifier)
            if lane is None:
                limits = self.config.limits_for(verifier.key)
                gate = self._gates.get(verifier.key)
                if gate is None:
                    gate = self._gates[verifier.key] = Gate.from_limits(limits)
                environment = name if guess else None
                lanes[verifier] = Lane(verifier, gate, limits.max_concurrency, indices, environment)
            else:  # two environments with one verifier (the same endpoint URL): one lane, one limit
                lane.indices = sorted([*lane.indices, *indices])
        return list(lanes.values())

    def _first_lanes(self, batch: list[Any], rubrics: dict[str, Verifier]) -> list[Lane]:
        """The batch's lanes: one guessed lane if it looks like one plugin environment's, else grouped.

        A guess pays only for plugins, where a pass over the batch to group it costs a tenth of
        the work; for the other kinds it costs nothing next to a call, and grouping first keeps
        a malformed batch from sending any request (or spending any judge tokens).
        """
        guess = _guess(batch)
        if guess is not None:
            try:
                verifier = self.verifier_for(self._environment_of(0, batch[0]), rubrics)
            except VerificationError as exc:
                raise _at_item(exc, 0, batch[0])  # noqa: B904 (it is the same error)
            if isinstance(verifier, ChunkedVerifier):
                return self._lanes(batch, {guess: range(len(batch))}, rubrics, guess=True)
        return self._lanes(batch, _group(batch, range(len(batch))), rubrics)

    async def score(self, items: Iterable[Mapping[str, Any]]) -> list[float]:
        """One reward per item, in input order; see :meth:`run` for the rules."""
        return (await self.run(items)).rewards

    async def run(self, items: Iterable[Mapping[str, Any]]) -> BatchResult:
        """Score a batch: its rewards in input order, with per-verifier reports and provenance.

        Each item is a mapping with ``environment`` (a directory name under the configured
        environments), ``task`` (a mapping), ``trajectory`` (as submitted) and optionally ``id``.
        Raises ``VerificationError`` for the first item whose verifier fails, after cancelling
        everything else in flight; ``TypeError``/``ValueError`` for malformed items.
        """
        # A list is scored as it is (copying a large batch costs a cheap plugin ~5% of its speed):
        # it must not change while it is being scored.
        batch = items if type(items) is list else list(items)
        rubrics: dict[str, Verifier] = {}  # one resolution of each rubric for the whole batch
        try:
            lanes = self._first_lanes(batch, rubrics)
        except VerificationError as exc:
            logger.error("batch aborted: %s", exc)
            raise
        retries_before = {lane.verifier: lane.verifier.retries for lane in lanes}

        def regroup(left: list[int]) -> list[Lane]:
            """Lanes for items a guessed lane gave back (the batch was not all one environment's)."""
            more = self._lanes(batch, _group(batch, left), rubrics)
            for lane in more:
                retries_before.setdefault(lane.verifier, lane.verifier.retries)
            return more

        def failed(exc: VerificationError, index: int) -> VerificationError:
            return _at_item(exc, index, batch[index])

        async def call(lane: Lane, chunk: Sequence[int]) -> list[float]:
            v = lane.verifier
            if len(chunk) > 1 or v.chunk_size(1) > 1:  # serial chunk mode: even a lone item is a chunk
                assert isinstance(v, ChunkedVerifier)  # only they ask for chunks
                try:
                    return await v.verify_chunk(Items(batch, chunk))
                except MalformedItem as exc:
                    index = chunk[exc.position]
                    _check_item(index, batch[index])  # raises, naming the item,
                    task_of(index, batch[index])  # here or here
                    raise AssertionError("unreachable: the chunk runner and task_of disagree") from exc
                except VerificationError as exc:
                    # a position the verifier could not know names the chunk's first item (its reason says so)
                    position = exc.index if exc.index is not None and 0 <= exc.index < len(chunk) else 0
                    raise failed(exc, chunk[position])  # noqa: B904 (it is the same error, its cause kept)
                except Exception as exc:  # as for one item: which item it was is unknown, so the first
                    raise failed(VerificationError(v.kind, v.ref, describe(exc)), chunk[0]) from exc
            index = chunk[0]
            item = batch[index]
            if lane.environment is not None and (
                not isinstance(item, Mapping) or item.get("environment") != lane.environment
            ):
                return []  # not the guessed environment's: the engine regroups the rest of the batch
            task, trajectory = task_of(index, item)
            try:
                return [await v.verify(task, trajectory)]
            except VerificationError as exc:
                raise failed(exc, index)  # noqa: B904 (it is the same error, its cause kept)
            except Exception as exc:
                raise failed(VerificationError(v.kind, v.ref, describe(exc)), index) from exc

        started = perf_counter()
        rewards = [math.nan] * len(batch)
        transport = self._transport
        with transport.closes_deferred() if isinstance(transport, PoolTransport) else contextlib.nullcontext():
            await run_lanes(rewards, lanes, call, self._in_flight, regroup)
        return self._result(rewards, lanes, retries_before, perf_counter() - started)

    def _result(
        self, rewards: list[float], lanes: list[Lane], retries_before: Mapping[Verifier, int], elapsed: float
    ) -> BatchResult:
        """The batch's result: one report per verifier, whose items may have run in several lanes."""
        by_verifier: dict[Verifier, list[Lane]] = {}
        for lane in lanes:
            if lane.given_back:  # a guess that was wrong: the items it scored are the others
                given_back = set(lane.given_back)
                lane.indices = [index for index in lane.indices if index not in given_back]
            by_verifier.setdefault(lane.verifier, []).append(lane)
        verifier_of = [0] * len(rewards)
        reports = []
        for position, (v, its) in enumerate(by_verifier.items()):
            if position:
                for lane in its:
                    for index in lane.indices:
                        verifier_of[index] = position
            reports.append(
                VerifierReport(
                    kind=v.kind,
                    ref=v.ref,
                    key=v.key,
                    provenance=v.provenance(),
                    items=sum(len(lane.indices) for lane in its),
                    reward_sum=total([lane.reward_sum for lane in its]),
                    latencies=[seconds for lane in its for seconds in lane.latencies],
                    latency_items=[count for lane in its for count in lane.latency_items],
                    waited=sum(lane.waited for lane in its),
                    busy=sum(lane.busy for lane in its),
                    peak_in_flight=max(lane.peak for lane in its),
                    retries=v.retries - retries_before[v],
                )
            )
        usage: dict[str, int] = {}
        for v in by_verifier:
            if isinstance(v, RubricVerifier):  # a fresh one per batch: its usage is this batch's
                for name, count in v.usage.as_dict().items():
                    usage[name] = usage.get(name, 0) + count
        return BatchResult(rewards=rewards, verifiers=reports, elapsed=elapsed, verifier_of=verifier_of, usage=usage)
