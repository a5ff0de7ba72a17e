"""OpenRLHF: a file for ``--reward.remote_url /path/to/this/file.py`` (``engine adapters openrlhf-path`` prints it).

OpenRLHF loads this file by its path and calls ``reward_func(queries, prompts, labels, **kw)`` from each
vLLM actor's loop through ``asyncio.to_thread``, one sample at a time. Its arguments map to items as
``engine serve``'s ``/get_reward`` maps them: ``queries`` are the prompts with their responses, and each
item's ``trajectory`` is its query less its prompt (the whole query when it does not start with it); a
label that is a JSON object (or a string holding one) is the item's ``environment``, ``task`` and
``id``, any other label the task's ``reference``, ``{"prompt": prompt, "reference": label}``, in the
environment ``ENGINE_ENVIRONMENT`` names. The engine is configured by environment variables:
``ENGINE_CONFIG``, or ``ENGINE_URL`` and ``ENGINE_TOKEN``. The calls of all threads
are scored on one background loop, the concurrent ones gathered into engine batches. It returns
``{"rewards": [...], "scores": [...], "extra_logs": {}}``, lists of floats, or raises.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

# The one mapping of OpenRLHF's samples, which `engine serve`'s /get_reward uses too: a private module, the
# adapters' only import of one (tests/test_adapters_structure.py allows exactly this one; it says why).
from engine._openrlhf import items
from engine.adapters._runtime import ENV_ENVIRONMENT, coalescer, in_background, source_of

__all__ = ["reward_func"]


async def _score(batch: list[dict[str, Any]]) -> list[float]:
    return await coalescer(source_of(None, None, None)).score_many(batch)


def reward_func(
    queries: Sequence[str], prompts: Sequence[Any], labels: Sequence[Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """OpenRLHF's reward function: one reward per query, in order, or a raised error."""
    environment = os.environ.get(ENV_ENVIRONMENT) or None  # read at each call, as the engine's variables are
    batch = items(queries, prompts, labels, environment, f"{ENV_ENVIRONMENT} is not set")
    rewards = in_background(_score, batch)
    if len(rewards) != len(queries):
        raise RuntimeError(f"{len(rewards)} rewards for {len(queries)} queries")
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": {}}
