"""PPO with OpenRLHF, rewarded through ``--reward.remote_url`` pointing at the engine's adapter file.

    pip install openrlhf           # not installed by `make`: OpenRLHF pulls a GPU stack, vLLM and Ray
    .venv/bin/python examples/trainers/openrlhf_ppo.py

The adapter file is configured by environment variables: ENGINE_CONFIG and ENGINE_ENVIRONMENT.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

if importlib.util.find_spec("openrlhf") is None:
    sys.exit("OpenRLHF is not installed: `pip install openrlhf`, then run this again")

EXAMPLES = Path(__file__).resolve().parents[1]
adapter = subprocess.run([sys.executable, "-m", "engine", "adapters", "openrlhf-path"], check=True,
                         capture_output=True, text=True).stdout.strip()
env = {**os.environ, "ENGINE_CONFIG": str(EXAMPLES / "engine.toml"), "ENGINE_ENVIRONMENT": "arithmetic"}
subprocess.run([
    sys.executable, "-m", "openrlhf.cli.train_ppo_ray",
    "--pretrain", "Qwen/Qwen2.5-0.5B-Instruct", "--reward.remote_url", adapter,
    "--prompt_data", str(EXAMPLES / "rollouts.jsonl"), "--input_key", "task.prompt", "--label_key", "task.reference",
    "--max_samples", "64", "--max_epochs", "1", "--save_path", "out/openrlhf-ppo",
], check=True, env=env)
