"""slime: ``custom_rm`` for ``--custom-rm-path engine.adapters.slime.custom_rm`` (with or without ``--group-rm``).

slime awaits ``custom_rm(args, sample)`` for one sample, or ``custom_rm(args, samples)`` for a group
(``--group-rm``), on its rollout loop. The engine is configured by environment variables
(``ENGINE_CONFIG``, or ``ENGINE_URL`` and ``ENGINE_TOKEN``); a sample's environment is its
``metadata["environment"]``, else ``ENGINE_ENVIRONMENT``. ``task`` = ``{"prompt": sample.prompt,
"reference": sample.label, **the rest of its metadata}`` (no ``reference`` when the label is None),
``trajectory`` = ``sample.response``, ``id`` = ``sample.index``. Concurrent calls on one loop, single
samples and groups alike, are gathered into engine batches. A group gets exactly one reward per
sample (slime pairs them with ``zip(strict=False)``, which would drop the rest of a short list in
silence): anything else raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.adapters._runtime import coalescer, environment_from, source_of

__all__ = ["custom_rm"]


def item(sample: Any) -> dict[str, Any]:
    """The engine item of one slime ``Sample`` (see the module's docstring)."""
    metadata = getattr(sample, "metadata", None) or {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"a sample's metadata must be a mapping, got {type(metadata).__name__}")
    rest = {key: value for key, value in metadata.items() if key not in ("environment", "id")}
    task: dict[str, Any] = {"prompt": sample.prompt}
    label = getattr(sample, "label", None)
    if label is not None:
        task["reference"] = label
    out: dict[str, Any] = {
        "environment": environment_from(metadata.get("environment"), "give the sample metadata['environment']"),
        "task": {**task, **rest},
        "trajectory": sample.response,
    }
    index = getattr(sample, "index", None)
    if index is not None:
        out["id"] = index
    return out


async def custom_rm(args: Any, sample: Any) -> float | list[float]:
    """The reward of ``sample``, or the rewards of a group of samples (a list), one per sample, in order."""
    gather = coalescer(source_of(None, None, None))
    if isinstance(sample, list | tuple):
        rewards = await gather.score_many([item(one) for one in sample])
        if len(rewards) != len(sample):
            raise RuntimeError(f"{len(rewards)} rewards for a group of {len(sample)} samples")
        return rewards
    return await gather.score(item(sample))
