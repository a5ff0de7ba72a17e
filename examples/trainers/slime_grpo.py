"""GRPO with slime, rewarded by ``--custom-rm-path engine.adapters.slime.custom_rm`` (group-wise here).

slime is not on PyPI (the registry's ``slime`` is another project): install it from its repository
(THUDM/slime, tested at 624b824, v0.3.1) with its Megatron-LM and SGLang, as its README says, then

    SLIME_DIR=/path/to/slime python examples/trainers/slime_grpo.py

It writes out/slime_prompts.jsonl from examples/rollouts.jsonl, one row per rollout: ``prompt``,
``label`` (the task's reference, or null) and ``metadata`` (the environment and the task's other
fields), read by slime with ``--input-key prompt --label-key label --metadata-key metadata``; the
adapter scores each sample in the environment its metadata names (three of them here), with the
engine of ENGINE_CONFIG (examples/engine.toml unless set). MEGATRON_ARGS are your model's Megatron-LM
arguments (slime's scripts/models/<model>.sh): add them for your model.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1]
PROMPTS = EXAMPLES.parent / "out" / "slime_prompts.jsonl"
MEGATRON_ARGS: list[str] = []  # your model's: slime's scripts/models/<model>.sh


def slime_args(prompts: Path) -> list[str]:
    """slime's own arguments of the launch (what ``tests/trainers/test_slime.py`` parses with slime's parser)."""
    return [
        "--hf-checkpoint", "Qwen/Qwen2.5-0.5B-Instruct",
        "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label", "--metadata-key", "metadata",
        "--custom-rm-path", "engine.adapters.slime.custom_rm", "--group-rm",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-rollout", "10",
    ]


def write_prompts(rollouts: Path, prompts: Path) -> int:
    """One slime row per rollout of ``rollouts``; returns how many."""
    rows = [json.loads(line) for line in rollouts.read_text().splitlines() if line.strip()]
    prompts.parent.mkdir(parents=True, exist_ok=True)
    with prompts.open("w") as out:
        for row in rows:
            task = dict(row["task"])
            prompt, label = task.pop("prompt"), task.pop("reference", None)
            metadata = {"environment": row["environment"], **task}
            out.write(json.dumps({"prompt": prompt, "label": label, "metadata": metadata}) + "\n")
    return len(rows)


def main() -> None:
    if importlib.util.find_spec("slime") is None:
        sys.exit("slime is not installed: install it from its repository (THUDM/slime), not PyPI, then run this again")
    slime_dir = os.environ.get("SLIME_DIR")
    if not slime_dir or not (Path(slime_dir) / "train.py").is_file():
        sys.exit("set SLIME_DIR to a checkout of THUDM/slime (its train.py launches the run)")
    write_prompts(EXAMPLES / "rollouts.jsonl", PROMPTS)
    env = {**os.environ}
    env.setdefault("ENGINE_CONFIG", str(EXAMPLES / "engine.toml"))
    train = Path(slime_dir) / "train.py"
    subprocess.run([sys.executable, str(train), *MEGATRON_ARGS, *slime_args(PROMPTS)], check=True, env=env)


if __name__ == "__main__":
    main()
