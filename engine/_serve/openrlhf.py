"""``POST /get_reward``: OpenRLHF's remote reward protocol, turned into a batch of items and back.

OpenRLHF (``--reward.remote_url``) posts ``{"query": [...], "prompts": [...], "labels": [...]}``, one
entry per sample, and reads ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. A query is
the prompt followed by the response: the trajectory is the query with its prompt taken off the front
(the whole query when it does not start with it). A label that is a JSON object, or a string holding
one, is the item (``environment``, ``task``, optional ``id``); any other label is the task's
``reference``, in the environment the service was started with (``--environment``), the prompt as
the task's ``prompt`` (what a rubric grades).
"""

from __future__ import annotations

from typing import Any

import orjson

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
    if not isinstance(prompts, list) or not isinstance(labels, list) or not len(prompts) == len(labels) == len(
        queries
    ):
        raise ValueError(
            f"'query', 'prompts' and 'labels' must be lists of one length, got {len(queries)} queries, "
            f"{_length(prompts)} prompts and {_length(labels)} labels"
        )
    return [_item(i, query, prompt, label, environment) for i, (query, prompt, label) in
            enumerate(zip(queries, prompts, labels, strict=True))]


def _length(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else f"not a list ({type(value).__name__})"


def _item(index: int, query: Any, prompt: Any, label: Any, environment: str | None) -> dict[str, Any]:
    if not isinstance(query, str) or not isinstance(prompt, str):
        raise TypeError(f"sample {index}: a query and its prompt must be strings")
    trajectory = query[len(prompt) :] if query.startswith(prompt) else query
    item = _as_item(label)
    if item is not None:
        return {**item, "trajectory": trajectory}
    if environment is None:
        raise ValueError(
            f"sample {index}: its label is not an item (a JSON object with 'environment' and 'task'), and the "
            "service was started without --environment to score such labels in"
        )
    return {"environment": environment, "task": {"prompt": prompt, "reference": label}, "trajectory": trajectory}


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


def answer(rewards: list[float]) -> dict[str, Any]:
    """What OpenRLHF reads back: the rewards, as scores too (it logs those), and nothing more to log."""
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
