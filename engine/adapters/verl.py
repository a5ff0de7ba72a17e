"""verl: ``compute_score`` for ``reward.custom_reward_function`` (``path`` this file, ``name`` compute_score).

verl calls it once per sample, concurrently, as one asyncio task per sample on each reward worker's
loop, with ``reward_kwargs`` from its config: ``config`` (the engine's config file) or ``url`` (an
``engine serve``'s, with ``token``), and ``environment`` (default: the sample's ``data_source``);
without ``config`` and ``url``, ``ENGINE_CONFIG`` or ``ENGINE_URL``. The concurrent calls of one loop are
gathered into engine batches (``engine.adapters._runtime.Coalescer``), so 1,024 per-sample calls cost
about one batch of 1,024. ``task`` = ``{"reference": ground_truth, **extra_info}``, a ``question`` in
``extra_info`` becoming ``prompt`` when there is no ``prompt``; ``trajectory`` = ``solution_str``. It
returns a float every time (so its keys never differ), or raises: a batch that fails fails every call
in it, each with the ``VerificationError`` naming the item that failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.adapters._runtime import coalescer, source_of

__all__ = ["compute_score"]


def item(
    data_source: str,
    solution_str: Any,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None,
    environment: str | None,
) -> dict[str, Any]:
    """The engine item of one verl sample (see the module's docstring)."""
    task = {"reference": ground_truth, **(extra_info or {})}
    if "prompt" not in task and "question" in task:
        task["prompt"] = task.pop("question")
    return {"environment": environment or data_source, "task": task, "trajectory": solution_str}


async def compute_score(
    data_source: str,
    solution_str: Any,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    *,
    config: str | None = None,
    url: str | None = None,
    token: str | None = None,
    environment: str | None = None,
) -> float:
    """The reward of one sample, scored with the loop's other concurrent samples in one engine batch."""
    source = source_of(config, url, token)
    return await coalescer(source).score(item(data_source, solution_str, ground_truth, extra_info, environment))
