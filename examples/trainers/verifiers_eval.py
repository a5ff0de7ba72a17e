"""A verifiers (v1) rollout scored by ``engine.adapters.verifiers:engine_reward``.

    pip install verifiers          # not installed by `make`
    .venv/bin/python examples/trainers/verifiers_eval.py

In an environment's config, plug the reward as ``"engine.adapters.verifiers:engine_reward"``, with
ENGINE_CONFIG (and ENGINE_ENVIRONMENT, or an ``environment`` field in each task) set. This script
scores a few rows of examples/rollouts.jsonl as verifiers would: the awaited reward, task and trace by name.
"""

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

if importlib.util.find_spec("verifiers") is None:
    sys.exit("verifiers is not installed: `pip install verifiers`, then run this again")

EXAMPLES = Path(__file__).resolve().parents[1]
os.environ.setdefault("ENGINE_CONFIG", str(EXAMPLES / "engine.toml"))

from engine.adapters.verifiers import engine_reward  # noqa: E402  (after ENGINE_CONFIG is set)

rows = [json.loads(line) for line in (EXAMPLES / "rollouts.jsonl").read_text().splitlines()[:8]]
rows = [row for row in rows if row["environment"] == "arithmetic"]


async def main() -> None:
    rewards = await asyncio.gather(*(
        engine_reward(task={"environment": row["environment"], **row["task"]}, trace={"completion": row["trajectory"]})
        for row in rows
    ))
    for row, reward in zip(rows, rewards, strict=True):
        print(row["id"], reward)


asyncio.run(main())
