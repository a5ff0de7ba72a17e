"""slime: ``custom_rm`` for ``--custom-rm-path engine.adapters.slime.custom_rm`` (with or without ``--group-rm``).

How slime calls it, for one sample or a group: docs/design.md, Trainer adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.adapters._runtime import coalescer, environment_from, source_of

__all__ = ["custom_rm"]


def item(sample: Any) -> dict[str, Any]:
    """The engine item of one slime ``Sample``.

    ``environment`` = its ``metadata["environment"]``, else ``ENGINE_ENVIRONMENT``; ``task`` =
    ``{"prompt": sample.prompt, "reference": sample.label, **the rest of its metadata}`` (no ``reference``
    when the label is None); ``trajectory`` = ``sample.response``; ``id`` = ``sample.index``.
    """
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
    """The reward of a slime sample, or the rewards of a group of samples (``--group-rm``).

    Args:
        args: slime's arguments; unused (the engine is configured by ``ENGINE_CONFIG``, or ``ENGINE_URL``
            and ``ENGINE_TOKEN``).
        sample: One ``Sample``, or a list of them.

    Returns:
        The sample's reward, or one reward per sample of the group, in order.

    Raises:
        engine.VerificationError: A sample failed verification.
        ValueError: No engine configured, or no environment for a sample.
        TypeError: A sample's metadata that is not a mapping, or a value the engine cannot take.
    """
    gather = coalescer(source_of(None, None, None))
    if isinstance(sample, list | tuple):
        rewards = await gather.score_many([item(one) for one in sample])
        if len(rewards) != len(sample):
            raise RuntimeError(f"{len(rewards)} rewards for a group of {len(sample)} samples")
        return rewards
    return await gather.score(item(sample))
