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

from collections.abc import Sequence
from typing import Any

import orjson

from engine.adapters._runtime import coalescer, environment_from, in_background, source_of

__all__ = ["reward_func"]


def _as_item(label: Any) -> dict[str, Any] | None:
    """The item a label stands for (its ``environment``, ``task`` and ``id``), or None for a reference."""
    if isinstance(label, str) and label.lstrip().startswith("{"):
        try:
            label = orjson.loads(label)
        except orjson.JSONDecodeError:
            return None  # a reference that happens to start with a brace
    if not isinstance(label, dict):
        return None
    return {key: label[key] for key in ("environment", "task", "id") if key in label}


def items(queries: Sequence[str], prompts: Sequence[Any], labels: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The engine items of OpenRLHF's arguments (see the module's docstring)."""
    if len(prompts) != len(queries) or (labels is not None and len(labels) != len(queries)):
        raise ValueError(
            f"queries, prompts and labels differ in length: {len(queries)}, {len(prompts)}, {len(labels or [])}"
        )
    out = []
    for position, (query, prompt) in enumerate(zip(queries, prompts, strict=True)):
        if not isinstance(query, str) or not isinstance(prompt, str):
            raise TypeError(f"sample {position}: a query and its prompt must be strings")
        response = query[len(prompt) :] if query.startswith(prompt) else query
        label = labels[position] if labels is not None else None
        item = _as_item(label)
        if item is None:
            environment = environment_from(None, "give each label as an item (a JSON object with environment and task)")
            item = {"environment": environment, "task": {"prompt": prompt, "reference": label}}
        out.append({**item, "trajectory": response})
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
