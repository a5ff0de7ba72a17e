"""GRPO with verl 0.9.1, each sample's reward from the engine (``engine.adapters.verl.compute_score``).

    pip install verl==0.9.1        # not installed by `make`: verl pulls a GPU stack and Ray
    python examples/trainers/verl_ppo.py

verl reads the reward function's keyword arguments from ``reward.custom_reward_function.reward_kwargs``
(``verl/trainer/ppo/reward.py``), and calls it once per sample on its reward workers. This writes a
small arithmetic dataset and launches ``verl.trainer.main_ppo`` on it (a GPU and the model are needed);
``tests/trainers/test_verl.py`` composes this launch line with verl's own config code.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "engine.toml"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def rows() -> list[dict[str, object]]:
    """The dataset: verl's columns, ``data_source`` naming the engine's environment."""
    return [{"data_source": "arithmetic",  # the environment, unless reward_kwargs names one
             "prompt": [{"role": "user", "content": f"What is {a} * {b}? End with the number."}],
             "reward_model": {"style": "rule", "ground_truth": str(a * b)},
             "extra_info": {"question": f"What is {a} * {b}?"}}
            for a in range(2, 30) for b in range(2, 12)]


def launch_line(data: Path, config: Path = CONFIG, model: str = MODEL) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the engine as its reward function."""
    import engine.adapters.verl

    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        f"data.train_files={data}", f"data.val_files={data}", "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=10",
        f"reward.custom_reward_function.path={engine.adapters.verl.__file__}",
        "reward.custom_reward_function.name=compute_score",
        f"+reward.custom_reward_function.reward_kwargs.config={config}",
    ]


def main() -> None:
    if importlib.util.find_spec("verl") is None or importlib.util.find_spec("pyarrow") is None:
        sys.exit("verl is not installed: `pip install verl==0.9.1`, then run this again")
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.parquet"
        pq.write_table(pa.Table.from_pylist(rows()), data)
        subprocess.run(launch_line(data), check=True)


if __name__ == "__main__":
    main()
