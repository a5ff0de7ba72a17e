"""Trainer adapters: one line in a trainer's config scores its rollouts with the engine.

One module per trainer, each a thin mapping from the trainer's call convention to engine items:

* ``engine.adapters.trl``: ``EngineReward`` / ``AsyncEngineReward`` for ``GRPOTrainer(reward_funcs=[...])``;
* ``engine.adapters.verl``: ``compute_score`` for ``reward.custom_reward_function``;
* ``engine.adapters.openrlhf``: a file for ``--reward.remote_url`` (``engine adapters openrlhf-path``);
* ``engine.adapters.slime``: ``custom_rm`` for ``--custom-rm-path``;
* ``engine.adapters.verifiers``: ``engine_reward`` for verifiers v1.

Each opens one engine per process (per event loop where the trainer calls it from one), lazily, and
closes it at exit; a failed verification is raised, never turned into a number. The adapters use
only ``engine``'s public names (the OpenRLHF one also ``engine._openrlhf``, the mapping of samples it
shares with ``engine serve``), and import no trainer: none is needed to import them.
"""

from __future__ import annotations

from engine.adapters._runtime import close_engines

__all__ = ["close_engines"]
