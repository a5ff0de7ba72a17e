"""verifiers (v1): ``engine_reward``, plugged as ``"engine.adapters.verifiers:engine_reward"``.

How verifiers awaits it, and what of its task and trace is scored: docs/design.md, Trainer adapters.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from engine.adapters._runtime import coalescer, environment_from, source_of

__all__ = ["engine_reward"]

# The fields of verifiers' own TaskData kept in the task: what the model was asked. The rest of its own
# fields (image, workdir, skills, network_allow, timeout, resources, artifacts, idx...) say how the
# rollout runs, not what is scored.
_KEPT = frozenset({"prompt", "system_prompt", "id"})


@functools.cache
def _runtime_fields(cls: type) -> frozenset[str]:
    """The fields verifiers' ``TaskData`` declares itself (less ``_KEPT``), if ``cls`` is one of its models."""
    for base in cls.__mro__:
        if base.__name__ == "TaskData" and base.__module__ == "verifiers.v1.task":
            declared = getattr(base, "model_fields", {})
            return frozenset(declared) - _KEPT
    return frozenset()


def _task_fields(task: Any) -> dict[str, Any]:
    if isinstance(task, Mapping):
        return dict(task)
    dump = getattr(task, "model_dump", None)
    if not callable(dump):
        raise TypeError(f"verifiers' task must be its TaskData (a pydantic model) or a mapping, "
                        f"got {type(task).__name__}")
    # the python form: nested models (the prompt's messages) become plain mappings, every other value is kept as
    # it is (the JSON form would write a NaN as null, a Decimal or bytes as a string): the engine's boundary then
    # keeps it exactly or refuses it
    fields = dump(exclude_none=True)
    if not isinstance(fields, Mapping):
        raise TypeError(f"{type(task).__name__}.model_dump() returned {type(fields).__name__}, not a mapping")
    model: type = type(task)
    dropped = _runtime_fields(model)
    return {key: value for key, value in fields.items() if key not in dropped}


def _trajectory(trace: Any) -> str:
    reply = getattr(trace, "last_reply", None)
    if not isinstance(reply, str):
        raise TypeError(
            f"verifiers' trace must be a v1 Trace (its last_reply, the model's final reply, is the trajectory), "
            f"got {type(trace).__name__}"
        )
    return reply


def item(task: Any, trace: Any) -> dict[str, Any]:
    """The engine item of one verifiers task and trace.

    ``task`` = the task's fields (``model_dump()``, ``None`` fields left out, and without the fields
    that ``TaskData`` itself declares to place and run the rollout: ``image``, ``timeout``,
    ``resources``...; its ``prompt`` and ``system_prompt`` stay), its ``environment`` (else
    ``ENGINE_ENVIRONMENT``) and ``id`` taken out, its ``answer`` becoming ``reference`` when there is
    none; ``trajectory`` = ``trace.last_reply``, the text of the model's final reply.

    Raises:
        TypeError: ``task`` is neither a pydantic model nor a mapping, or ``trace`` has no ``last_reply``.
        ValueError: no environment (neither the task's ``environment`` nor ``ENGINE_ENVIRONMENT``).
    """
    fields = _task_fields(task)
    environment = fields.pop("environment", None)
    item_id = fields.pop("id", None)
    if "reference" not in fields and "answer" in fields:
        fields["reference"] = fields.pop("answer")
    out = {
        "environment": environment_from(environment, "give the task an 'environment' field"),
        "task": fields,
        "trajectory": _trajectory(trace),
    }
    if item_id is not None:
        out["id"] = item_id
    return out


async def engine_reward(task: Any, trace: Any) -> float:
    """The reward of ``trace`` for ``task``, as verifiers' ``Task.score`` awaits a plugged reward.

    Args:
        task: the task's ``TaskData`` (or a mapping of its fields).
        trace: the rollout's v1 ``Trace``; its ``last_reply`` is the trajectory.

    Returns:
        The engine's reward for the item.

    Raises:
        engine.VerificationError: the item failed; verifiers records it on the trace, which fails.
        TypeError, ValueError: the task or trace is not one the adapter can read, or no engine is configured.
    """
    return await coalescer(source_of(None, None, None)).score(item(task, trace))
