"""OpenRLHF: a file for ``--reward.remote_url /path/to/this/file.py`` (``engine adapters openrlhf-path`` prints it).

How OpenRLHF calls it, and why a failure is logged at ERROR before it is raised: docs/design.md, Trainer adapters.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

# The one mapping of OpenRLHF's samples, which `engine serve`'s /get_reward uses too: a private module, the
# adapters' only import of one (tests/test_adapters_structure.py allows exactly this one; it says why).
from engine._openrlhf import items
from engine.adapters._runtime import ENV_ENVIRONMENT, coalescer, in_background, source_of

__all__ = ["reward_func"]

logger = logging.getLogger("engine")


async def _score(batch: list[dict[str, Any]]) -> list[float]:
    return await coalescer(source_of(None, None, None)).score_many(batch)


def reward_func(
    queries: Sequence[str], prompts: Sequence[Any], labels: Sequence[Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """OpenRLHF's reward function: one reward per query, in order, or a raised error (logged at ERROR first).

    Args:
        queries: Each sample's prompt followed by its response; the response is the item's trajectory.
        prompts: Each sample's prompt.
        labels: Each sample's label: an item (a JSON object, or a string holding one), or else the task's
            ``reference``, ``{"prompt": prompt, "reference": label}``, in ``ENGINE_ENVIRONMENT``'s environment.
        **kw: What else OpenRLHF passes; unused.

    Returns:
        ``{"rewards": [...], "scores": [...], "extra_logs": {}}``, one float per query in each list.

    Raises:
        engine.VerificationError: A sample failed verification.
        ValueError: The samples cannot be items (no environment for a reference label, lengths that differ).
        TypeError: A query or prompt that is not a string.
    """
    try:
        environment = os.environ.get(ENV_ENVIRONMENT) or None  # read at each call, as the engine's variables are
        batch = items(queries, prompts, labels, environment, f"{ENV_ENVIRONMENT} is not set")
        rewards = in_background(_score, batch)
        if len(rewards) != len(queries):
            raise RuntimeError(f"{len(rewards)} rewards for {len(queries)} queries")
    except Exception as exc:
        # OpenRLHF logs what we raise at INFO only, and fails far later on the None it records: this is the line
        logger.error("engine: OpenRLHF's reward_func failed, so OpenRLHF records no reward for these %d sample(s) "
                     "(and stops later on the missing reward): %s: %s", len(queries), type(exc).__name__,
                     _described(exc))
        raise
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": {}}


def _described(exc: BaseException) -> str:
    """The error with its notes (which say, for a gathered batch, whose item failed), on one line each."""
    return "; ".join([str(exc), *getattr(exc, "__notes__", ())])
