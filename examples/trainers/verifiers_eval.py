"""verifiers (v1) traces scored by ``engine.adapters.verifiers:engine_reward`` through verifiers' own ``Task.score``.

    .venv-verifiers/bin/python examples/trainers/verifiers_eval.py --base-url http://127.0.0.1:8000/v1

(``make trainers TRAINERS=verifiers`` builds that venv: verifiers==0.4.0 beside the engine.)

It asks an OpenAI-compatible model (``--base-url``, ``--model``) the first arithmetic questions of
examples/rollouts.jsonl through verifiers' own client, records each reply on a v1 ``Trace`` as
verifiers' interception server records a model call, and scores the traces with ``Task.score``, the
reward plugged by the task config a run's TOML gives (``[env.taskset.task.rewards.engine]``). The
engine is examples/engine.toml unless ENGINE_CONFIG (or ENGINE_URL) says otherwise. Each line printed:
the row's id, ``ok`` or ``failed``, the trace's reward (or its error).
"""

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

if importlib.util.find_spec("verifiers") is None:
    sys.exit("verifiers is not installed: `pip install verifiers==0.4.0`, then run this again")

import verifiers.v1 as vf
from verifiers.v1 import graph
from verifiers.v1.clients.eval import EvalClient
from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.errors import TaskError, boundary
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import SamplingConfig

EXAMPLES = Path(__file__).resolve().parents[1]
if not os.environ.get("ENGINE_URL"):
    os.environ.setdefault("ENGINE_CONFIG", str(EXAMPLES / "engine.toml"))

# What a run's TOML says, under [env.taskset.task]: the engine's reward plugged by its import path
TASK_CONFIG = vf.TaskConfig.model_validate({"rewards": {"engine": {"fn": "engine.adapters.verifiers:engine_reward"}}})


class Arithmetic(vf.TaskData):
    answer: str  # the adapter sends it as the item's "reference"
    environment: str = "arithmetic"  # the engine environment that scores it


async def trace_of(task: vf.Task, client: EvalClient, model: str) -> Trace:
    """One model call, recorded on a v1 trace as verifiers' interception server records it."""
    trace: Trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()),
    )
    dialect = ChatDialect()
    body = {"model": model, "messages": [{"role": "user", "content": task.data.prompt_text}]}
    request = dialect.parse_request(body)
    turn = graph.prepare_turn(trace, request.messages, request.tools)
    turn.commit(await client.get_response(dialect, body, SamplingConfig(), session_id=trace.id, turn=turn))
    trace.stop("agent_completed")
    return trace


async def score(task: vf.Task, trace: Trace) -> Trace:
    """``Task.score`` as a rollout's close runs it: an error is recorded on the trace, which fails."""
    try:
        async with boundary(TaskError, "scoring"):
            await task.score(trace, None)
        trace.ok = True
    except Exception as error:  # a failed verification fails this trace, never scores it
        trace.record_error(error)
    return trace


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="an OpenAI-compatible API")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--rows", type=int, default=6)
    args = parser.parse_args()
    rows = [json.loads(line) for line in (EXAMPLES / "rollouts.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row["environment"] == "arithmetic"][: args.rows]
    tasks = [vf.Task(Arithmetic(idx=n, id=row["id"], prompt=row["task"]["prompt"], answer=row["task"]["reference"]),
                     config=TASK_CONFIG) for n, row in enumerate(rows)]
    client = EvalClient(EvalClientConfig(base_url=args.base_url, api_key_var="OPENAI_API_KEY"))
    try:
        traces = [await trace_of(task, client, args.model) for task in tasks]
    finally:
        await client.close()
    scored = await asyncio.gather(*(score(task, trace) for task, trace in zip(tasks, traces, strict=True)))
    for task, trace in zip(tasks, scored, strict=True):
        outcome = trace.rewards["engine"].score if trace.ok else trace.errors[-1].message  # type: ignore[union-attr]
        print(task.data.id, "ok" if trace.ok else "failed", outcome)


asyncio.run(main())
