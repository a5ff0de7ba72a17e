"""Trainer adapters: one line in a trainer's config scores its rollouts with the engine.

One module per trainer (``trl``, ``verl``, ``openrlhf``, ``slime``, ``verifiers``), each a thin mapping from its call
convention to engine items: docs/design.md, Trainer adapters.
"""

from __future__ import annotations

from engine.adapters._runtime import close_engines

__all__ = ["close_engines"]
