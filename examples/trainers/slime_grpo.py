"""GRPO with slime, rewarded by ``--custom-rm-path engine.adapters.slime.custom_rm`` (group-wise here).

    pip install slime              # not installed by `make`: slime pulls Megatron, SGLang and Ray
    .venv/bin/python examples/trainers/slime_grpo.py

The adapter is configured by environment variables: ENGINE_CONFIG and ENGINE_ENVIRONMENT (or each
sample's metadata["environment"]).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

spec = importlib.util.find_spec("slime")
if spec is None or spec.origin is None:
    sys.exit("slime is not installed: install it from its repository, then run this again")

EXAMPLES = Path(__file__).resolve().parents[1]
train = Path(spec.origin).resolve().parents[1] / "train.py"  # slime is launched by its repository's train.py
env = {**os.environ, "ENGINE_CONFIG": str(EXAMPLES / "engine.toml"), "ENGINE_ENVIRONMENT": "arithmetic"}
subprocess.run([
    sys.executable, str(train), "--hf-checkpoint", "Qwen/Qwen2.5-0.5B-Instruct",
    "--prompt-data", str(EXAMPLES / "rollouts.jsonl"), "--input-key", "task.prompt", "--label-key", "task.reference",
    "--custom-rm-path", "engine.adapters.slime.custom_rm", "--group-rm", "--num-rollout", "10",
], check=True, env=env)
