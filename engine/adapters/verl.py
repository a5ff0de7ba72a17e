"""verl: ``compute_score`` for ``reward.custom_reward_function`` (``path`` this file, ``name`` compute_score).

How verl calls it on its two paths, and how many calls one engine batch gathers: docs/design.md, Trainer adapters.
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
    """The engine item of one verl sample.

    ``environment`` = ``environment`` if given, else ``data_source``; ``task`` = ``{"reference":
    ground_truth, **extra_info}``, a ``question`` in ``extra_info`` becoming ``prompt`` when there is no
    ``prompt``; ``trajectory`` = ``solution_str``.
    """
    task = {"reference": ground_truth, **(extra_info or {})}
    if "prompt" not in task and "question" in task:
        task["prompt"] = task.pop("question")
    # verl's streaming path hands np.str_ data sources: the engine names them as the str they are
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
    """The reward of one sample, scored with the loop's other concurrent calls in one engine batch.

    Args:
        data_source: the sample's environment, unless ``environment`` is given.
        solution_str: the decoded response: the item's trajectory.
        ground_truth: the task's ``reference``.
        extra_info: the rest of the task (verl adds ``num_turns`` and its rollout's fields).
        config: the engine's config file (or ``url``; neither: the environment variables).
        url: an ``engine serve``'s URL.
        token: its token, with ``url``.
        environment: the environment of every sample.

    Returns:
        The sample's reward.

    Raises:
        engine.VerificationError: the sample's verification failed (naming it: index 0).
        ValueError: no engine configured, or both; an unknown environment.
        TypeError: a value the engine cannot take.
    """
    source = source_of(config, url, token)
    return await coalescer(source).score(item(data_source, solution_str, ground_truth, extra_info, environment))
