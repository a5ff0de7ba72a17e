"""GRPO with TRL, rewarded by the engine's ``arithmetic`` environment (examples/engine.toml).

    pip install trl datasets       # not installed by `make`: TRL pulls a GPU stack
    .venv/bin/python examples/trainers/trl_grpo.py
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
    sys.exit("TRL is not installed: `pip install trl datasets`, then run this again")

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from engine.adapters.trl import EngineReward

CONFIG = Path(__file__).resolve().parents[1] / "engine.toml"

rows = [{"prompt": f"What is {a} + {b}? End with the number.", "reference": str(a + b)}
        for a in range(2, 40, 3) for b in range(3, 40, 7)]
trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=[EngineReward(CONFIG, environment="arithmetic")],  # the `reference` column joins the task
    args=GRPOConfig(output_dir="out/trl-grpo", max_steps=10, per_device_train_batch_size=8, num_generations=8,
                    logging_steps=1),
    train_dataset=Dataset.from_list(rows),
)
trainer.train()
