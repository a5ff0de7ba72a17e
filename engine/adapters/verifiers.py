"""verifiers (v1): ``engine_reward``, plugged as ``"engine.adapters.verifiers:engine_reward"``.

verifiers awaits a v1 reward function with ``task`` and ``trace`` by name; an exception marks the trace
failed. The engine is configured by environment variables (``ENGINE_CONFIG``, or ``ENGINE_URL`` and
``ENGINE_TOKEN``). The task (a mapping, or a model with ``model_dump()``) becomes the item's task, its
``environment`` (else ``ENGINE_ENVIRONMENT``) and ``id`` taken out, its ``answer`` becoming
``reference`` when there is none; the trajectory is the trace's ``completion``, else its ``messages``
(a mapping's keys or an object's attributes), else the trace itself. Concurrent calls on one loop are
gathered into engine batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.adapters._runtime import coalescer, environment_from, source_of

__all__ = ["engine_reward"]


def _as_mapping(value: Any, what: str) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        dumped = dump()
        if isinstance(dumped, Mapping):
            return dumped
    raise TypeError(f"verifiers' {what} must be a mapping or a model with model_dump(), got {type(value).__name__}")


def _trajectory(trace: Any) -> Any:
    for name in ("completion", "messages"):
        value = trace.get(name) if isinstance(trace, Mapping) else getattr(trace, name, None)
        if value is not None:
            return value
    return trace


def item(task: Any, trace: Any) -> dict[str, Any]:
    """The engine item of one verifiers task and trace (see the module's docstring)."""
    fields = dict(_as_mapping(task, "task"))
    environment = fields.pop("environment", None)
    item_id = fields.pop("id", None)
    if "reference" not in fields and "answer" in fields:
        fields["reference"] = fields.pop("answer")
    out = {
        "environment": environment_from(environment, "give the task an 'environment'"),
        "task": fields,
        "trajectory": _trajectory(trace),
    }
    if item_id is not None:
        out["id"] = item_id
    return out


async def engine_reward(task: Any, trace: Any) -> float:
    """The reward of ``trace`` for ``task``, or a raised error (verifiers marks the trace failed)."""
    return await coalescer(source_of(None, None, None)).score(item(task, trace))
