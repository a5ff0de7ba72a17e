"""GRPO with verl, each sample's reward from the engine (``engine.adapters.verl.compute_score``).

    pip install verl               # not installed by `make`: verl pulls a GPU stack and Ray
    .venv/bin/python examples/trainers/verl_ppo.py

verl calls compute_score once per sample; the adapter gathers the concurrent calls into engine batches.
"""

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

if importlib.util.find_spec("verl") is None or importlib.util.find_spec("pyarrow") is None:
    sys.exit("verl is not installed: `pip install verl`, then run this again")

import pyarrow as pa
import pyarrow.parquet as pq

import engine.adapters.verl

CONFIG = Path(__file__).resolve().parents[1] / "engine.toml"

rows = [{"data_source": "arithmetic",  # the environment, unless reward_kwargs names one
         "prompt": [{"role": "user", "content": f"What is {a} * {b}? End with the number."}],
         "reward_model": {"style": "rule", "ground_truth": str(a * b)},
         "extra_info": {"question": f"What is {a} * {b}?"}}
        for a in range(2, 30) for b in range(2, 12)]
with tempfile.TemporaryDirectory() as tmp:
    data = Path(tmp) / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    subprocess.run([
        sys.executable, "-m", "verl.trainer.main_ppo",
        f"data.train_files={data}", f"data.val_files={data}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "trainer.total_training_steps=10",
        f"reward.custom_reward_function.path={engine.adapters.verl.__file__}",
        "reward.custom_reward_function.name=compute_score",
        f"+reward.reward_kwargs.config={CONFIG}",
    ], check=True)
