"""A rubric verifier's verdicts: identical items judged once (in a batch, and across the batches in flight), and
verdicts kept in the cache.

An item's verdict is decided by the exact request the judge is sent (model, messages built from the rubric's text,
the task and the flattened trajectory, temperature, max_tokens, response_format), the judge's URL, the prompt's
version and the rubric (ref, digest, scale): its key is a sha256 of all of them. Why rubric verifiers only, and
why a judge at temperature > 0 still dedupes: docs/design.md, "The verdict cache".
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from engine._cache.store import Verdict, VerdictStore
from engine._core.contract import Sifted, task_of
from engine._errors import Failure
from engine._verifiers.rubric.judge import Judge
from engine._verifiers.rubric.prompt import PROMPT_VERSION
from engine._verifiers.rubric.registry import Rubric

__all__ = ["SIFT_SLICE", "InFlight", "Verdicts"]

SIFT_SLICE = 1024  # items keyed between two yields to the event loop (~10 ms of work)


def _prefix(judge: Judge, rubric: Rubric) -> hashlib._Hash:
    """The hash of what every verdict of this rubric and judge shares, before each item's body is added."""
    lo, hi = rubric.scale
    head = f"engine-verdict\0{PROMPT_VERSION}\0{rubric.ref}\0{rubric.digest}\0{lo!r},{hi!r}\0{judge.config.url}\0"
    return hashlib.sha256(head.encode())


class _Call:
    """One judge call in flight for a verdict key: its reward once it returns (None: it failed, or was cancelled)."""

    __slots__ = ("done", "reward")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reward: float | None = None


class InFlight:
    """An open engine's judge calls in flight, by verdict key: an item of another batch (another request to
    ``engine serve``, another rank's) identical to one being judged waits for that call instead of paying again.

    A call that fails or is cancelled (its batch aborted) shares nothing: its waiters then call, each on its own
    and at once (never queued behind one another: a failure that repeats would take each a call's time more), so a
    failure is never passed on to an item it did not happen to.
    """

    def __init__(self) -> None:
        self._calls: dict[bytes, _Call] = {}
        self.waiting = 0  # items waiting for another's call now

    async def judged(self, key: bytes, call: Callable[[], Awaitable[float]]) -> tuple[float, bool]:
        """The reward for ``key``, and whether it came from another batch's call (True) rather than ``call``."""
        other = self._calls.get(key)
        if other is not None:
            self.waiting += 1
            try:
                await other.done.wait()
            finally:
                self.waiting -= 1
            if other.reward is not None:
                return other.reward, True
            return await call(), False
        mine = self._calls[key] = _Call()
        try:
            mine.reward = await call()
            return mine.reward, False
        finally:
            del self._calls[key]
            mine.done.set()


class Verdicts:
    """One batch's verdicts of one rubric verifier: the keys it has seen, the cache's hits, the new verdicts.

    ``store`` is the engine's cache, or None (dedup only).
    """

    def __init__(self, judge: Judge, rubric: Rubric, key: str, store: VerdictStore | None) -> None:
        self._judge = judge
        self._rubric = rubric
        self._key = key
        self._store = store
        self._prefix = _prefix(judge, rubric)
        self._first_of: dict[bytes, int] = {}  # key -> the index of the batch's item judged (or hit) for it
        self._hit: dict[int, Verdict] = {}  # index of an item served from the cache -> its verdict
        self._hit_key: dict[int, bytes] = {}  # and its key
        self._hit_keys: list[bytes] = []  # one entry per item served from the cache
        self._scored: list[tuple[bytes, float, float]] = []  # (key, reward, unix time) of each judge call returned

    def key(self, body: bytes) -> bytes:
        """The verdict key of the item the judge would be sent ``body`` for."""
        digest = self._prefix.copy()
        digest.update(body)
        key: bytes = digest.digest()
        return key

    async def sift(self, items: Sequence[Mapping[str, Any]], indices: Sequence[int], first: int) -> Sifted:
        """``indices`` sifted: the first of each key is called unless the cache holds it, the rest share its reward."""
        judge, rubric = self._judge, self._rubric
        keys = []
        for position, index in enumerate(indices):
            if position and not position % SIFT_SLICE:
                await anyio.lowlevel.checkpoint()
            task, trajectory = task_of(first + index, items[index])
            try:
                keys.append(self.key(judge.request_body(rubric, task, trajectory)))
            except Failure as exc:
                exc.position = position
                raise
        first_of = self._first_of
        fresh: list[tuple[int, bytes]] = []
        later: list[tuple[int, int]] = []  # (index, the index of the first item of its key)
        for index, key in zip(indices, keys, strict=True):
            original = first_of.get(key)
            if original is None:
                first_of[key] = index
                fresh.append((index, key))
            else:
                later.append((index, original))
        found = await self._store.lookup([key for _, key in fresh]) if self._store is not None and fresh else {}
        sifted = Sifted(call=[])
        for index, key in fresh:
            verdict = found.get(key)
            if verdict is None:
                sifted.call.append(index)
            else:
                self._hit[index] = verdict
                self._hit_key[index] = key
                self._hit_keys.append(key)
                self._served(sifted, index, verdict)
        for index, original in later:
            verdict = self._hit.get(original)
            if verdict is not None:  # a copy of a hit is served from the cache too
                self._hit_keys.append(self._hit_key[original])
                self._served(sifted, index, verdict)
            else:
                sifted.copies.append(index)
                sifted.originals.append(original)
        return sifted

    @staticmethod
    def _served(sifted: Sifted, index: int, verdict: Verdict) -> None:
        sifted.hits.append(index)
        sifted.hit_rewards.append(verdict[0])
        sifted.hit_times.append(verdict[1])

    def scored(self, body: bytes, reward: float) -> None:
        """A judge call for ``body`` returned ``reward``: kept at the batch's end (a failure never gets here)."""
        if self._store is not None:
            self._scored.append((self.key(body), reward, time.time()))

    def finish(self) -> None:
        """Write the batch's new verdicts, and mark its hits used, behind the batch (not waited for)."""
        if self._store is not None:
            scored, hits, self._scored, self._hit_keys = self._scored, self._hit_keys, [], []
            self._store.write(self._key, scored, hits, time.time())
