"""``POST /get_reward``: OpenRLHF's remote reward protocol, turned into a batch of items and back.

OpenRLHF (``--reward.remote_url``) posts ``{"query": [...], "prompts": [...], "labels": [...]}``, one
entry per sample, and reads ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. The samples
map to items as the OpenRLHF adapter's do (``engine._openrlhf``); a label that is not an item is
scored in the environment the service was started with (``--environment``).
"""

from __future__ import annotations

from typing import Any

from engine._openrlhf import items

__all__ = ["answer", "items_from"]


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
