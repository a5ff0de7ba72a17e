"""verl: ``compute_score`` for ``reward.custom_reward_function`` (``path`` this file, ``name`` compute_score).

verl 0.9.1 hands it the keyword arguments under ``reward.custom_reward_function.reward_kwargs``
(``verl/trainer/ppo/reward.py``; keys under ``reward.reward_kwargs`` never reach it): ``config`` (the
engine's config file) or ``url`` (an ``engine serve``'s, with ``token``), and ``environment``
(default: the sample's ``data_source``); without ``config`` and ``url``, ``ENGINE_CONFIG`` or
``ENGINE_URL`` in the reward worker's process. verl's ``NaiveRewardManager`` calls it once per sample,
one asyncio task per sample on its reward worker's loop; the calls that reach one loop together are
gathered into engine batches (``engine.adapters._runtime.Coalescer``), each call getting exactly what
it would get alone. How many calls one batch gathers depends on verl's path: the batch path
(``RewardLoopManager.compute_rm_score``) hands each worker its chunk at once, the streaming path
(``AgentLoopWorker``, one Ray call per finished sample to a random worker) as samples finish
(docs/trainers/verl.md has the measured counts). ``task`` = ``{"reference": ground_truth,
**extra_info}``, a ``question`` in ``extra_info`` becoming ``prompt`` when there is no ``prompt``;
``trajectory`` = ``solution_str``; verl's numpy values (``num_turns``, ``np.str_`` data sources) are
accepted (the engine names an ``np.str_`` environment as the str it is). It returns a float every time (so its
keys never differ), or raises: the ``VerificationError`` naming the call's own sample when that sample
fails, the engine's ``ValueError``/``TypeError`` on misuse (an unknown environment, no engine
configured). verl then fails the step (see docs/trainers/verl.md).
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
