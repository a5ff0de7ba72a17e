"""OpenRLHF: a file for ``--reward.remote_url /path/to/this/file.py`` (``engine adapters openrlhf-path`` prints it).

OpenRLHF loads this file by its path and calls ``reward_func(queries, prompts, labels, **kw)`` from each
vLLM actor's loop through ``asyncio.to_thread``, one sample at a time. ``queries`` are the prompts with
their responses, as OpenRLHF builds them: each item's ``trajectory`` is its query less its prompt (the
whole query when it does not start with it); ``task`` = ``{"prompt": prompt, "reference": label}``. The
engine is configured by environment variables: ``ENGINE_CONFIG``, or ``ENGINE_URL`` and
``ENGINE_TOKEN``, and ``ENGINE_ENVIRONMENT``, the environment of every item. The calls of all threads
are scored on one background loop, the concurrent ones gathered into engine batches. It returns
``{"rewards": [...], "scores": [...], "extra_logs": {}}``, lists of floats, or raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.adapters._runtime import coalescer, environment_from, in_background, source_of

__all__ = ["reward_func"]


def items(queries: Sequence[str], prompts: Sequence[Any], labels: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The engine items of OpenRLHF's arguments (see the module's docstring)."""
    if len(prompts) != len(queries) or (labels is not None and len(labels) != len(queries)):
        raise ValueError(
            f"queries, prompts and labels differ in length: {len(queries)}, {len(prompts)}, {len(labels or [])}"
        )
    environment = environment_from(None, "OpenRLHF names none")
    out = []
    for position, (query, prompt) in enumerate(zip(queries, prompts, strict=True)):
        task: dict[str, Any] = {"prompt": prompt}
        if labels is not None:
            task["reference"] = labels[position]
        response = query[len(prompt) :] if isinstance(prompt, str) and query.startswith(prompt) else query
        out.append({"environment": environment, "task": task, "trajectory": response})
    return out


async def _score(batch: list[dict[str, Any]]) -> list[float]:
    return await coalescer(source_of(None, None, None)).score_many(batch)


def reward_func(
    queries: Sequence[str], prompts: Sequence[Any], labels: Sequence[Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """OpenRLHF's reward function: one reward per query, in order, or a raised error."""
    rewards = in_background(_score, items(queries, prompts, labels))
    if len(rewards) != len(queries):
        raise RuntimeError(f"{len(rewards)} rewards for {len(queries)} queries")
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": {}}
