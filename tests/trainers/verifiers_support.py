"""verifiers 0.4.0's own code making and scoring v1 traces, for tests/trainers/test_verifiers.py.

A trace is made as a v1 rollout makes it: the harness's chat request parsed by verifiers' chat dialect,
the turn prepared on the trace's message graph, the model called through verifiers' own ``EvalClient``
(at an OpenAI-compatible model server on 127.0.0.1 that answers fixed completions), and the reply
committed to the graph: what verifiers' interception server does for each model call of a rollout. A
full ``Env`` rollout is not run: its harness programs run under ``uv``, which bootstraps itself from the
network. Then ``Task.score`` runs under the same boundary and failure handling as ``Rollout.close``.
"""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import verifiers.v1 as vf
from servers import Request, Response, Server
from verifiers.v1 import graph
from verifiers.v1.clients.eval import EvalClient
from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.errors import TaskError, boundary
from verifiers.v1.state import state_cls
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import SamplingConfig


class Problem(vf.TaskData):
    """A taskset's task data: an arithmetic question, its answer, and (for the engine) its environment."""

    answer: str = ""
    environment: str | None = None
    mode: str | None = None  # read by the test suite's `faulty` environment


def model_server(reply: Callable[[list[dict[str, Any]]], str]) -> Server:
    """An OpenAI-compatible chat completions API on 127.0.0.1 whose reply is ``reply(messages)``."""

    async def answer(request: Request) -> Response:
        body = request.json()
        return Response.json({
            "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": reply(body["messages"])}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    return Server(answer)


def task_config(toml_text: str) -> vf.TaskConfig:
    """The task config a run's TOML gives (``[env.taskset.task...]``), read by verifiers' own config models."""
    data = tomllib.loads(toml_text)
    return vf.TasksetConfig.model_validate(data["env"]["taskset"]).task


async def rollout(task: vf.Task, client: EvalClient, turns: int = 1) -> Trace:
    """One trace of ``task``: ``turns`` model calls, each recorded as verifiers' interception records it."""
    trace: Trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=AgentInfo(config=vf.AgentConfig()),
    )
    dialect = ChatDialect()
    messages: list[dict[str, Any]] = []
    if task.data.system_prompt:
        messages.append({"role": "system", "content": task.data.system_prompt})
    messages.append({"role": "user", "content": task.data.prompt_text})
    for turn_number in range(turns):
        body = {"model": "tiny", "messages": list(messages)}
        request = dialect.parse_request(body)
        turn = graph.prepare_turn(trace, request.messages, request.tools)
        response = await client.get_response(dialect, body, SamplingConfig(), session_id=trace.id, turn=turn)
        turn.commit(response)
        messages.append({"role": "assistant", "content": response.message.content})
        if turn_number + 1 < turns:
            messages.append({"role": "user", "content": "Are you sure?"})
    trace.stop("agent_completed")
    return trace


async def score(task: vf.Task, trace: Trace) -> Trace:
    """``Task.score`` as ``Rollout.close`` runs it: a failure is recorded on the trace, which then is not ok."""
    failed = False
    try:
        async with boundary(TaskError, "scoring"):
            await task.score(trace, None)
    except Exception as error:  # as Rollout.close: every scoring failure is the trace's
        failed = True
        trace.record_error(error)
    trace.is_completed = True
    trace.ok = not failed
    return trace


async def roll_and_score(tasks: Sequence[vf.Task], base_url: str, turns: int = 1) -> list[Trace]:
    """Every task rolled out, then all their traces scored concurrently on this loop (a group's scoring)."""
    client = EvalClient(EvalClientConfig(base_url=base_url, api_key_var="ENGINE_TEST_NO_KEY"))
    try:
        traces = [await rollout(task, client, turns) for task in tasks]
    finally:
        await client.close()
    return list(await asyncio.gather(*(score(task, trace) for task, trace in zip(tasks, traces, strict=True))))


def reward_of(trace: Trace, name: str = "engine") -> float | None:
    """The reward ``name`` recorded on ``trace`` (None: not scored)."""
    recorded = trace.rewards.get(name)
    return None if recorded is None else recorded.score


def as_json(trace: Trace) -> bytes:
    """The trace's record, as verifiers writes traces.jsonl (it must serialise)."""
    return orjson.dumps(trace.to_record())
