"""``POST /get_reward``: OpenRLHF's remote reward protocol, turned into a batch of items and back.

The protocol, and why a failure just answered is answered again from memory: docs/design.md, The service.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from engine._openrlhf import items

__all__ = ["REPLAY_LARGEST", "REPLAY_MOST", "REPLAY_WINDOW", "Replays", "answer", "items_from"]

# OpenRLHF's retries come a second after each answer, four of them: 30 s covers them with room for a loaded
# machine, and is short enough that a request sent again on purpose (a fixed verifier) is scored again.
REPLAY_WINDOW = 30.0
REPLAY_MOST = 1024  # failures remembered at once (a digest and the error's answer each): the oldest go first
REPLAY_LARGEST = 64 * 1024  # bytes of an answer remembered: a longer one (a plugin's huge message) is scored again


def items_from(body: Any, environment: str | None) -> list[dict[str, Any]]:
    """The batch a ``/get_reward`` body asks for; ``ValueError``/``TypeError`` saying what is wrong with it."""
    if not isinstance(body, dict):
        raise TypeError("the body must be a JSON object with 'query', 'prompts' and 'labels'")
    queries = body.get("query")
    if not isinstance(queries, list):
        raise ValueError("'query' must be a list of strings (prompt + response)")
    prompts = body.get("prompts", [""] * len(queries))
    labels = body.get("labels", [None] * len(queries))
    for name, value in (("prompts", prompts), ("labels", labels)):
        if not isinstance(value, list):
            raise ValueError(f"'{name}' must be a list, one per query, not {type(value).__name__}")
    return items(queries, prompts, labels, environment, "the service was started without --environment")


def answer(rewards: list[float]) -> dict[str, Any]:
    """What OpenRLHF reads back: the rewards, as scores too (it logs those), and nothing more to log."""
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}


class Replays:
    """The ``/get_reward`` failures just answered, by their request body's digest, for ``window`` seconds.

    Args:
        window: Seconds a failure is answered again for an identical body.
        most: Failures remembered at once; past it the oldest is forgotten.
        clock: Monotonic seconds (the tests' to step).
    """

    def __init__(self, window: float = REPLAY_WINDOW, most: int = REPLAY_MOST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._window, self._most, self._clock = window, most, clock
        self._seen: OrderedDict[bytes, tuple[float, int, bytes]] = OrderedDict()  # oldest first: one window
        self.replayed = 0  # requests answered from a remembered failure (the metrics count them)

    def find(self, body: bytes) -> tuple[int, bytes] | None:
        """The status and answer of the failure of an identical body within the window, or None."""
        now = self._clock()
        seen = self._seen
        while seen:
            key, (at, _, _) = next(iter(seen.items()))
            if now - at < self._window:
                break
            del seen[key]
        found = seen.get(_digest(body))
        if found is None:
            return None
        self.replayed += 1
        return found[1], found[2]

    def remember(self, body: bytes, status: int, answer: bytes) -> None:
        """Answer ``body`` with ``status`` and ``answer`` for the next ``window`` seconds (if ``answer`` is small:
        memory stays under ``most`` times ``REPLAY_LARGEST``)."""
        if len(answer) > REPLAY_LARGEST:
            return
        key = _digest(body)
        self._seen.pop(key, None)
        self._seen[key] = (self._clock(), status, answer)
        while len(self._seen) > self._most:
            self._seen.popitem(last=False)


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=20).digest()  # 160 bits: no two bodies of a run share one
