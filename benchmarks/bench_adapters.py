"""Issue 15's target: verl's per-sample calls, gathered by the adapter, against one batch and one call per sample.

verl calls ``compute_score`` once per sample, 1,024 concurrent coroutines on one loop. With a plugin
of ~20 us a call, ``engine.adapters.verl.compute_score`` (which gathers them into engine batches)
should reach >= 0.6x the speed of one ``Engine.score`` of the same 1,024 items; one engine call per
sample reaches ~0.05x. With a microsecond plugin no adapter comes close to one batch: asyncio alone
needs milliseconds to run 1,024 gathered coroutines, so that row stands beside asyncio's own floor
(1,024 gathered coroutines that do nothing).

Everything runs on one event loop, each way back to back, ``--repeat`` times: a ratio is the median of
the back-to-back pairs' ratios (this machine's speed drifts between runs), a time the median of its runs.

    .venv/bin/python benchmarks/bench_adapters.py [--samples N] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import machine, table, write_env

import engine
from engine.adapters import close_engines
from engine.adapters._runtime import coalescer, source_of
from engine.adapters.verl import compute_score

SPIN = """\
import time


def score(task, trajectory):
    until = time.perf_counter() + 20e-6  # ~20 us of Python work, holding the GIL, as a real check would
    while time.perf_counter() < until:
        pass
    return 1.0 if trajectory == task["reference"] else 0.0
"""
TRIVIAL = """\
def score(task, trajectory):
    return 1.0 if trajectory == task["reference"] else 0.0
"""
MAX_SECONDS = 120.0  # the whole benchmark stops repeating past this


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def noop() -> None:
    pass


async def run(config_path: Path, name: str, samples: int, repeat: int, deadline: float) -> dict[str, Any]:
    """Seconds per way (medians) and ratios to one batch, for environment ``name``'s plugin."""
    items = [
        {"environment": name, "task": {"reference": str(i % 7)}, "trajectory": str(i % 5)} for i in range(samples)
    ]
    expected = [1.0 if i % 7 == i % 5 else 0.0 for i in range(samples)]
    async with engine.Engine.from_config(config_path) as eng:

        async def batch() -> None:
            assert await eng.score(items) == expected

        async def adapter() -> None:
            calls = [
                compute_score(name, item["trajectory"], item["task"]["reference"], config=str(config_path))
                for item in items
            ]
            assert await asyncio.gather(*calls) == expected

        async def per_sample() -> None:
            rewards = await asyncio.gather(*(eng.score([item]) for item in items))
            assert [reward for [reward] in rewards] == expected

        async def floor() -> None:
            await asyncio.gather(*(noop() for _ in range(samples)))

        ways = {"batch": batch, "adapter": adapter, "per_sample": per_sample, "floor": floor}
        for fn in ways.values():
            await fn()  # warm: imports, threads, the adapter's engine
        before = coalescer(source_of(str(config_path), None, None)).batches
        runs: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(repeat):
            for way, fn in ways.items():
                runs[way].append(await timed(fn))
            if time.monotonic() > deadline:
                break
        batches = (coalescer(source_of(str(config_path), None, None)).batches - before) / len(runs["adapter"])
    ratio = {
        way: statistics.median(b / x for b, x in zip(runs["batch"], runs[way], strict=True))
        for way in ("adapter", "per_sample")
    }
    return {"seconds": {way: statistics.median(times) for way, times in runs.items()}, "ratio": ratio,
            "batches": batches, "repeats": len(runs["batch"])}


def main(samples: int, repeat: int) -> None:
    deadline = time.monotonic() + MAX_SECONDS
    with tempfile.TemporaryDirectory() as tmp:
        envs = Path(tmp) / "envs"
        write_env(envs, "spin", "plugin", "verify:score", {"verify.py": SPIN})
        write_env(envs, "trivial", "plugin", "verify:score", {"verify.py": TRIVIAL})
        config = Path(tmp) / "engine.toml"
        config.write_text(f'environments = "{envs}"\nallow_unpinned = true\n')
        spin = asyncio.run(run(config, "spin", samples, repeat, deadline))
        trivial = asyncio.run(run(config, "trivial", samples, repeat, deadline))
        close_engines()

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ms"

    rows = []
    for label, result, target in (("~20 us plugin", spin, ">= 0.6x"), ("~1 us plugin", trivial, "(for the record)")):
        s, r = result["seconds"], result["ratio"]
        rows.append([f"{label}: one Engine.score of {samples:,}", ms(s["batch"]), "1.00x", "", ""])
        rows.append([f"{label}: verl adapter, {samples:,} concurrent calls", ms(s["adapter"]), f"{r['adapter']:.2f}x",
                     f"{result['batches']:.1f}", target])
        rows.append([f"{label}: one engine call per sample", ms(s["per_sample"]), f"{r['per_sample']:.2f}x", "", ""])
    rows.append([f"asyncio's floor: {samples:,} gathered no-op coroutines", ms(spin["seconds"]["floor"]), "", "", ""])
    print(f"{machine()}; medians of {spin['repeats']} and {trivial['repeats']} runs\n")
    print(table("Issue 15: verl's per-sample calls on one loop",
                ["way", "time", "speed vs one batch", "engine batches per step", "target"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    main(args.samples, args.repeat)
