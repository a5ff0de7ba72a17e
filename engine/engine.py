"""The engine: resolves each item's environment to its verifier, and scores batches.

``Engine`` is the async API; ``engine.blocking.BlockingEngine`` wraps it for synchronous trainers.
One engine owns one ``httpx.AsyncClient`` (one connection pool), one thread pool limiter for sync
plugins, and the live limits of every verifier, all shared by every batch it scores.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import Any, Self

import anyio
import httpx

from .config import DEFAULT_TIMEOUT, EngineConfig, load_config
from .endpoint import EndpointVerifier
from .errors import VerificationError, describe
from .judge import Judge, RubricVerifier
from .manifest import Environment, load_environment
from .plugin import PluginVerifier
from .report import BatchResult, VerifierReport
from .retry import Sleep
from .rubric import RubricRegistry
from .scheduler import Gate, Lane, in_flight_cap, logger, run_lanes
from .transport import PoolTransport
from .verifier import ChunkedVerifier, MalformedItem, Verifier, task_of

__all__ = ["Engine"]

_ENV_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_environment_of = operator.itemgetter("environment")


def _check_item(index: int, item: Any) -> str:
    """The item's environment name; ``TypeError``/``ValueError`` naming the item if it is malformed.

    (Its task and trajectory are checked where they are read, by ``engine.verifier.task_of`` or a
    plugin's chunk runner: looking at every item once more here would cost a cheap plugin's batch
    a fifth of its speed.)
    """
    if not isinstance(item, Mapping):
        raise TypeError(f"item {index} is a {type(item).__name__}, not a mapping")
    if "environment" not in item:
        raise ValueError(f"item {index} has no 'environment' (an item needs 'environment', 'task', 'trajectory')")
    name = item["environment"]
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise ValueError(f"item {index}: 'environment' must be an environment's directory name, got {name!r}")
    return name


def _at_item(exc: VerificationError, index: int, item: Mapping[str, Any]) -> VerificationError:
    """``exc``, naming the item it failed on: its position, its ``id`` and its environment."""
    exc.index, exc.item_id, exc.environment = index, item.get("id"), item["environment"]
    return exc


def _group(items: list[Any]) -> dict[str, Sequence[int]]:
    """The positions of the items of each environment, in one pass over the batch."""
    try:
        names = list(map(_environment_of, items))
        if names and names.count(names[0]) == len(names):  # one environment: the common case
            return {_check_item(0, items[0]): range(len(names))}
        groups: defaultdict[str, list[int]] = defaultdict(list)
        for index, name in enumerate(names):
            groups[name].append(index)
    except (KeyError, TypeError, IndexError):
        pass
    else:
        for indices in groups.values():
            _check_item(indices[0], items[indices[0]])
        return dict(groups)
    for index, item in enumerate(items):  # something is malformed: find it, and say what
        _check_item(index, item)
    raise AssertionError("unreachable: an item failed the fast path but passes the check")


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
        self._transport = self._injected_transport or PoolTransport(size)
        self._client = httpx.AsyncClient(  # httpx sizes only a pool it builds itself: ours is sized above
            transport=self._transport,
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

    def environment(self, name: str) -> Environment:
        """The environment called ``name``, loaded once; ``ValueError`` if there is none."""
        env = self._environments.get(name)
        if env is None:
            path = self.config.environments / name
            if not path.is_dir():
                raise ValueError(f"unknown environment {name!r}: no directory {path}")
            env = self._environments[name] = load_environment(path)
        return env

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
                assert self._transport is not None  # set with the client
                verifier = EndpointVerifier(spec.ref, limits, self._transport, sleep=self._sleep)
            self._verifiers[key] = verifier
        return verifier

    def _lanes(self, items: list[Any]) -> list[Lane]:
        lanes: dict[Verifier, Lane] = {}
        rubrics: dict[str, Verifier] = {}
        for name, indices in _group(items).items():
            try:
                verifier = self.verifier_for(self.environment(name), rubrics)
            except VerificationError as exc:
                logger.error("batch aborted: %s", _at_item(exc, indices[0], items[indices[0]]))
                raise
            lane = lanes.get(verifier)
            if lane is None:
                limits = self.config.limits_for(verifier.key)
                gate = self._gates.get(verifier.key)
                if gate is None:
                    gate = self._gates[verifier.key] = Gate.from_limits(limits)
                lanes[verifier] = Lane(verifier, gate, limits.max_concurrency, indices)
            else:  # two environments with one verifier (the same endpoint URL): one lane, one limit
                lane.indices = sorted([*lane.indices, *indices])
        return list(lanes.values())

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
        lanes = self._lanes(batch)

        def failed(exc: VerificationError, index: int) -> VerificationError:
            return _at_item(exc, index, batch[index])

        async def call(lane: Lane, chunk: Sequence[int]) -> list[float]:
            v = lane.verifier
            if len(chunk) > 1 or v.chunk_size(1) > 1:  # serial chunk mode: even a lone item is a chunk
                assert isinstance(v, ChunkedVerifier)  # only they ask for chunks
                items = batch[chunk[0] : chunk[-1] + 1] if isinstance(chunk, range) else [batch[i] for i in chunk]
                try:
                    return await v.verify_chunk(items)
                except MalformedItem as exc:
                    task_of(chunk[exc.position], batch[chunk[exc.position]])  # raises, naming the item
                    raise AssertionError("unreachable: the chunk runner and task_of disagree") from exc
                except VerificationError as exc:
                    raise failed(exc, chunk[exc.index or 0])  # noqa: B904 (it is the same error, its cause kept)
                except Exception as exc:  # as for one item: which item it was is unknown, so the first
                    raise failed(VerificationError(v.kind, v.ref, describe(exc)), chunk[0]) from exc
            index = chunk[0]
            task, trajectory = task_of(index, batch[index])
            try:
                return [await v.verify(task, trajectory)]
            except VerificationError as exc:
                raise failed(exc, index)  # noqa: B904 (it is the same error, its cause kept)
            except Exception as exc:
                raise failed(VerificationError(v.kind, v.ref, describe(exc)), index) from exc

        started = perf_counter()
        retries_before = [lane.verifier.retries for lane in lanes]
        rewards = await run_lanes(len(batch), lanes, call, self._in_flight)
        elapsed = perf_counter() - started
        verifier_of = [0] * len(batch)
        reports = []
        for position, (lane, retries) in enumerate(zip(lanes, retries_before, strict=True)):
            v = lane.verifier
            if position:
                for index in lane.indices:
                    verifier_of[index] = position
            reports.append(
                VerifierReport(
                    kind=v.kind,
                    ref=v.ref,
                    key=v.key,
                    provenance=v.provenance(),
                    items=len(lane.indices),
                    reward_sum=lane.reward_sum,
                    latencies=lane.latencies,
                    waited=lane.waited,
                    busy=lane.busy,
                    peak_in_flight=lane.peak,
                    retries=v.retries - retries,
                )
            )
        usage: dict[str, int] = {}
        for lane in lanes:
            if isinstance(lane.verifier, RubricVerifier):  # a fresh one per batch: its usage is this batch's
                for name, count in lane.verifier.usage.as_dict().items():
                    usage[name] = usage.get(name, 0) + count
        return BatchResult(rewards=rewards, verifiers=reports, elapsed=elapsed, verifier_of=verifier_of, usage=usage)
