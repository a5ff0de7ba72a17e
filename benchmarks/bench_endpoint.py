"""Target 3: endpoint calls to a fast local server, the engine against a plain aiohttp client.

Workload: 20,000 POSTs of a small item to a server answering ``{"reward": 1.0}`` (nginx when
installed), 64 in flight. Baseline: slime's approach, an ``aiohttp.ClientSession`` and
``asyncio.gather`` over every item under a semaphore, bodies encoded with orjson as ours are.
Then client CPU per request through the engine at 16, 64, 256 and 1,024 in flight, which should
stay flat (within 1.2x). Also, for the record, other HTTP stacks under httpx at 64 in flight.

    .venv/bin/python benchmarks/bench_endpoint.py [--calls N] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
from _common import Sample, cpu_seconds, machine, median_sample, reward_server, table, write_env

import engine

ITEM = {"environment": "remote", "task": {"prompt": "What is 2 + 2?", "reference": "4"}, "trajectory": "4"}
FLAT_LEVELS = (16, 64, 256, 1024)


async def timed(fn: Callable[[], Awaitable[Any]], count: int) -> Sample:
    cpu, start = cpu_seconds(), asyncio.get_running_loop().time()
    await fn()
    return Sample(asyncio.get_running_loop().time() - start, cpu_seconds() - cpu, count)


async def aiohttp_gather(url: str, calls: int, concurrency: int) -> None:
    body = orjson.dumps({"task": ITEM["task"], "trajectory": ITEM["trajectory"]})
    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> float:
            async with semaphore, session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                return float(orjson.loads(await r.read())["reward"])

        rewards = await asyncio.gather(*(one() for _ in range(calls)))
    assert len(rewards) == calls


def config_for(envs: Path, concurrency: int) -> engine.EngineConfig:
    return engine.EngineConfig(
        environments=envs,
        defaults=engine.Limits(max_concurrency=concurrency),
        max_in_flight=max(concurrency, 64),
    )


async def engine_score(envs: Path, calls: int, concurrency: int, transport: httpx.AsyncBaseTransport | None = None):
    async with engine.Engine(config_for(envs, concurrency), transport=transport) as eng:
        # Warm up first: open the connections and let the allocator and GC reach their steady state.
        await eng.score([ITEM] * max(4 * concurrency, calls // 4))
        rewards = await eng.score([ITEM] * calls)
    assert rewards == [1.0] * calls


async def main(calls: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, reward_server() as (url, server):
        envs = Path(tmp)
        write_env(envs, "remote", "endpoint", url)
        print(f"server: {server}; {machine()}; {calls} calls, median of {repeat}\n")

        engine_runs, baseline_runs = [], []
        for _ in range(repeat):
            engine_runs.append(await timed(lambda: engine_score(envs, calls, 64), calls))
            baseline_runs.append(await timed(lambda: aiohttp_gather(url, calls, 64), calls))
        ours, base = median_sample(engine_runs), median_sample(baseline_runs)
        print(table(
            "Target 3a: 64 in flight",
            ["client", "calls/s", "CPU us/call", "ratio (engine/baseline calls/s)", "target"],
            [
                ["engine", f"{ours.rate:,.0f}", f"{ours.cpu_per_item_us:.0f}", f"{ours.rate / base.rate:.2f}x",
                 ">= 1.0x"],
                ["aiohttp + gather", f"{base.rate:,.0f}", f"{base.cpu_per_item_us:.0f}", "1.00x", ""],
            ],
        ))

        levels = []
        for level in FLAT_LEVELS:
            runs = [await timed(lambda level=level: engine_score(envs, calls, level), calls) for _ in range(repeat)]
            levels.append((level, median_sample(runs)))
        low = levels[0][1].cpu_per_item_us
        print()
        print(table(
            "Target 3b: engine client CPU per call as concurrency grows",
            ["in flight", "calls/s", "CPU us/call", "vs 16 in flight", "target"],
            [[str(level), f"{s.rate:,.0f}", f"{s.cpu_per_item_us:.0f}", f"{s.cpu_per_item_us / low:.2f}x", "<= 1.2x"]
             for level, s in levels],
        ))

        stacks: list[tuple[str, Callable[[], httpx.AsyncBaseTransport]]] = [
            ("httpx stock pool (httpcore)", lambda: httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=64))),
        ]
        try:
            from httpx_aiohttp import AiohttpTransport

            stacks.append(("httpx-aiohttp transport", lambda: AiohttpTransport(
                client=lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)))))
        except ImportError:
            pass
        rows = []
        small = min(calls, 4000)
        for name, make in stacks:
            sample = await timed(lambda make=make: engine_score(envs, small, 64, make()), small)
            rows.append([f"engine over {name}", f"{sample.rate:,.0f}", f"{sample.cpu_per_item_us:.0f}"])
        print()
        print(table(f"For the record: other transports under the engine, 64 in flight, {small} calls, one run",
                    ["client", "calls/s", "CPU us/call"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.repeat))
