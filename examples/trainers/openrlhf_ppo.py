"""PPO with OpenRLHF 0.11.2, rewarded through ``--reward.remote_url`` pointing at the engine's adapter file.

    pip install openrlhf==0.11.2   # not installed by `make`: OpenRLHF pulls a GPU stack, vLLM and Ray
    .venv/bin/python examples/trainers/openrlhf_ppo.py

OpenRLHF reads one top-level column of each prompt row as the prompt (``--data.input_key``) and one as the
label (``--data.label_key``); it does not read nested keys. So this writes the example rollouts' tasks as
prompt rows: ``prompt`` the task's prompt, ``label`` the item (environment, task, id) as a JSON string,
which the adapter scores in its own environment. A string, not an object: the ``datasets`` library would
merge every row's object into one schema, adding the keys of the other rows' tasks as nulls.
The adapter file reads ENGINE_CONFIG (or ENGINE_URL) from the environment of OpenRLHF's Ray actors.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1]
PROMPTS = Path("out/openrlhf-prompts.jsonl")


def write_prompts(rollouts: Path, prompts: Path) -> None:
    """One prompt row per rollout of ``rollouts``: its task's prompt and, as a JSON string, its item."""
    prompts.parent.mkdir(parents=True, exist_ok=True)
    with rollouts.open() as source, prompts.open("w") as out:
        for line in source:
            row = json.loads(line)
            item = {"environment": row["environment"], "task": row["task"], "id": row["id"]}
            out.write(json.dumps({"prompt": row["task"]["prompt"], "label": json.dumps(item)}) + "\n")


def launch_line(adapter: str) -> list[str]:
    """OpenRLHF's command line (its own argument names, checked by tests/trainers/test_openrlhf.py)."""
    return [
        "--actor.model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct",
        "--reward.remote_url", adapter,
        "--data.prompt_dataset", str(PROMPTS), "--data.input_key", "prompt", "--data.label_key", "label",
        "--data.max_samples", "64", "--train.max_epochs", "1", "--ckpt.output_dir", "out/openrlhf-ppo",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
    ]


def main() -> None:
    if importlib.util.find_spec("openrlhf") is None:
        sys.exit("OpenRLHF is not installed: `pip install openrlhf==0.11.2`, then run this again")
    adapter = subprocess.run([sys.executable, "-m", "engine", "adapters", "openrlhf-path"], check=True,
                             capture_output=True, text=True).stdout.strip()
    write_prompts(EXAMPLES / "rollouts.jsonl", PROMPTS)
    env = {**os.environ, "ENGINE_CONFIG": str(EXAMPLES / "engine.toml")}
    subprocess.run([sys.executable, "-m", "openrlhf.cli.train_ppo_ray", *launch_line(adapter)], check=True, env=env)


if __name__ == "__main__":
    main()
