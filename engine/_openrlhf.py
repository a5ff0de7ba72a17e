"""OpenRLHF's samples as engine items: the one mapping that ``engine serve``'s ``/get_reward``
(``engine._serve.openrlhf``) and the OpenRLHF adapter (``engine.adapters.openrlhf``) both use.

It imports nothing of the engine's: both stand on it. The mapping: :func:`items`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

__all__ = ["items"]


def items(
    queries: Sequence[Any],
    prompts: Sequence[Any],
    labels: Sequence[Any] | None,
    environment: str | None,
    unset: str,
) -> list[dict[str, Any]]:
    """The items of OpenRLHF's samples, in order.

    A query is the prompt followed by the response: the trajectory is the query with its prompt taken
    off the front (the whole query when it does not start with it). A label that is a JSON object, or
    a string holding one, is the item (``environment``, ``task``, optional ``id``); any other label is
    the task's ``reference``, the prompt its ``prompt`` (what a rubric grades), in ``environment``.

    Args:
        queries: Each sample's prompt followed by its response.
        prompts: Each sample's prompt.
        labels: Each sample's label; None is a label None per sample (each a reference).
        environment: Where a label that is not an item is scored (``--environment``, ``ENGINE_ENVIRONMENT``).
        unset: When ``environment`` is None, what the error says the caller would have done to name one.

    Returns:
        One item per sample, in order.

    Raises:
        ValueError: The three lists differ in length, or a label that is not an item has no environment.
        TypeError: A query or prompt is not a string.
    """
    if len(prompts) != len(queries) or (labels is not None and len(labels) != len(queries)):
        counted = "no" if labels is None else len(labels)
        raise ValueError(
            f"queries, prompts and labels must be of one length, got {len(queries)} queries, "
            f"{len(prompts)} prompts and {counted} labels"
        )
    out = []
    for index, (query, prompt) in enumerate(zip(queries, prompts, strict=True)):
        if not isinstance(query, str) or not isinstance(prompt, str):
            raise TypeError(f"sample {index}: a query and its prompt must be strings")
        trajectory = query[len(prompt) :] if query.startswith(prompt) else query
        label = labels[index] if labels is not None else None
        item = _as_item(label)
        if item is None:
            if environment is None:
                raise ValueError(
                    f"sample {index}: its label is not an item (a JSON object with 'environment' and 'task'), "
                    f"and {unset} to score such labels in"
                )
            item = {"environment": environment, "task": {"prompt": prompt, "reference": label}}
        out.append({**item, "trajectory": trajectory})
    return out


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
