"""GRPO with TRL, rewarded by the engine's ``math`` environment (examples/engine.toml): math-verify reads
each row's ``answer`` column (the task is ``{"prompt": ..., "answer": ...}``) against the completion.

    pip install -r tests/trainers/requirements-trl.txt      # TRL 1.16.0, as the trainers suite runs it
    python examples/trainers/trl_grpo.py

ENGINE_EXAMPLE_MODEL (a model id or directory; Qwen/Qwen2.5-0.5B-Instruct by default) and
ENGINE_EXAMPLE_MAX_STEPS (10) change the run: the trainers suite runs this file on a tiny model built in
code, for 2 steps. Each step logs ``engine/math/verify:score/reward_mean`` beside TRL's ``rewards/math/mean``.
"""

import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
    sys.exit("TRL is not installed: `pip install -r tests/trainers/requirements-trl.txt`, then run this again")

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from engine.adapters.trl import EngineReward

CONFIG = Path(__file__).resolve().parents[1] / "engine.toml"
MODEL = os.environ.get("ENGINE_EXAMPLE_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
MAX_STEPS = int(os.environ.get("ENGINE_EXAMPLE_MAX_STEPS", "10"))

rows = [
    {"prompt": f"What is {a} + {b}? End with the number.", "answer": str(a + b)}
    for a in range(2, 40, 3)
    for b in range(3, 40, 7)
]
trainer = GRPOTrainer(
    model=MODEL,
    # built before the model loads: a missing config or an unknown environment is raised here
    reward_funcs=[EngineReward(CONFIG, environment="math")],
    args=GRPOConfig(
        output_dir="out/trl-grpo",
        max_steps=MAX_STEPS,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=64,
        logging_steps=1,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),  # TRL's default bf16 needs a GPU
    ),
    train_dataset=Dataset.from_list(rows),
)
trainer.train()
