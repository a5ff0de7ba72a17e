"""Target 4 of issue 13: every core for CPU-bound verifiers.

Two CPU-bound plugins, 10,000 items each: a ~1 ms pure-Python plugin (a loop of integer arithmetic)
and math-verify on GSM8K-style answers (``examples/envs/math/verify.py``, the example environment
that uses it). Each is scored three ways, in this process, alternating, ``--repeat`` times:

- the engine, process executor, one worker per core (``"executor": "process"``, ``workers`` unset);
- a serial loop calling the plugin (what a TRL sync reward function does);
- one asyncio task per item, each ``loop.run_in_executor`` on the default thread pool (verl's reward loop);
- for the record, the machine's ceiling at that moment: as many bare processes as cores
  (``concurrent.futures.ProcessPoolExecutor``, started before the timing), each handed an equal
  share of the items in one piece. The machine is shared, and a busy neighbour takes a core from
  every way alike: the engine's ratio to this row is its own loss.

Worker start-up is not timed: the engine is opened, ``engine.load`` starts a worker and a warm-up
batch (``--warm`` items) starts the rest and sizes its chunks, before the first timed batch. The
figures are medians over the repeats; the ratio is each timed run's rate over the serial loop's of
the same round, then the median of those. Target: the engine >= 0.9 x cores x the serial loop. The
last column is the CPU time of this process (not its children) per item: for the engine, its own cost
beside its workers'.

    .venv/bin/python benchmarks/bench_cores.py [--items N] [--repeat R] [--warm W]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from _common import Sample, machine, measure, median_sample, table

import engine
from engine._verifiers.plugin.launcher import default_workers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "envs"
# ~1 ms of pure Python a call here (CPython 3.11): the work is in the task, so every call costs the same
SPIN = """\
def score(task, trajectory):
    total = 0
    for i in range(task["work"]):
        total += i * i % 7
    return 1.0 if total % 2 == int(trajectory) % 2 else 0.0
"""
SPIN_WORK = 25_000


def load(path: Path) -> Callable[..., Any]:
    """The very function the engine calls, imported as a user's own code would import it."""
    spec = importlib.util.spec_from_file_location(f"bench_cores_{path.parent.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn: Callable[..., Any] = module.score
    return fn


def spin_items(count: int) -> list[dict[str, Any]]:
    return [{"environment": "spin", "task": {"work": SPIN_WORK}, "trajectory": str(i % 3)} for i in range(count)]


def gsm8k_items(count: int) -> list[dict[str, Any]]:
    """GSM8K-style items: an integer (sometimes a fraction or a decimal) reference, a worked answer ending in it."""
    items = []
    for i in range(count):
        a, b = 17 + i % 97, 3 + i % 13
        reference = [str(a * b), f"{a}/{b}", f"{a}.{b}"][i % 3]
        said = reference if i % 4 else str(a * b + 1)  # a quarter wrong
        boxed = said if i % 3 != 1 else f"\\frac{{{a}}}{{{b}}}"
        trajectory = (
            f"Natalia sold clips to {a} of her friends, {b} each. So she sold {a} * {b} clips in all. "
            f"The answer is $\\boxed{{{boxed}}}$."
        )
        items.append({"environment": "math", "task": {"prompt": f"Question {i}", "answer": reference},
                      "trajectory": trajectory})
    return items


def write_envs(root: Path) -> None:
    spin = root / "spin"
    spin.mkdir()
    (spin / "verify.py").write_text(SPIN)
    manifest = {"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score", "executor": "process"}}
    (spin / "manifest.json").write_bytes(orjson.dumps(manifest))
    shutil.copytree(EXAMPLES / "math", root / "math")
    path = root / "math" / "manifest.json"
    manifest = orjson.loads(path.read_bytes())
    manifest["verifier"].pop("workers", None)  # one per core, as for the spin plugin
    path.write_bytes(orjson.dumps(manifest))


_fn: Callable[..., Any] | None = None  # the plugin, in a process of the ceiling's pool


def _load_in_child(path: str) -> None:
    global _fn
    _fn = load(Path(path))


def _score_share(pairs: list[tuple[Any, Any]]) -> list[Any]:
    assert _fn is not None
    return [_fn(task, trajectory) for task, trajectory in pairs]


def ceiling(pool: concurrent.futures.ProcessPoolExecutor, cores: int, items: list[dict[str, Any]]) -> list[Any]:
    """The items in ``cores`` equal shares, one to each bare process, in one round trip each."""
    pairs = [(i["task"], i["trajectory"]) for i in items]
    size = -(-len(pairs) // cores)
    shares = pool.map(_score_share, [pairs[k : k + size] for k in range(0, len(pairs), size)])
    return [reward for share in shares for reward in share]


def thread_pool(fn: Callable[..., Any], items: list[dict[str, Any]]) -> list[Any]:
    """verl's reward loop: one asyncio task per item, each run_in_executor on the default thread pool."""

    async def run() -> list[Any]:
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(None, fn, i["task"], i["trajectory"]) for i in items))

    return asyncio.run(run())


def row(eng: engine.BlockingEngine, fn: Callable[..., Any], path: Path, label: str, items: list[dict[str, Any]],
        repeat: int, warm: int) -> list[list[str]]:
    count, name, cores = len(items), items[0]["environment"], default_workers()
    expected = [fn(i["task"], i["trajectory"]) for i in items[:warm]]
    eng.load(name)
    assert eng.score(items[:warm]) == expected  # every worker started, chunks sized: start-up is not timed
    runs: dict[str, list[Sample]] = {"engine": [], "serial": [], "threads": [], "ceiling": []}
    results: dict[str, list[Any]] = {}

    def timed(key: str, call: Callable[[], list[Any]]) -> None:
        out: list[Any] = []
        runs[key].append(measure(lambda: out.extend(call()), count))
        if key in results:
            assert out == results[key], key
        results[key] = out

    with concurrent.futures.ProcessPoolExecutor(cores, initializer=_load_in_child, initargs=(str(path),)) as pool:
        ceiling(pool, cores, items[: cores * 4])  # its processes started: start-up is not timed here either
        for _ in range(repeat):
            timed("serial", lambda: [fn(i["task"], i["trajectory"]) for i in items])
            timed("engine", lambda: eng.score(items))
            timed("threads", lambda: thread_pool(fn, items))
            timed("ceiling", lambda: ceiling(pool, cores, items))
    assert results["engine"] == results["serial"] == results["threads"] == results["ceiling"]
    serial = median_sample(runs["serial"])
    rows = []
    for key, way in [("engine", f"engine, process executor, {cores} workers"), ("serial", "serial loop (TRL)"),
                     ("threads", "task per item, run_in_executor (verl)"),
                     ("ceiling", f"{cores} bare processes, a share each (ceiling)")]:
        sample = median_sample(runs[key])
        ratio = statistics.median(x.rate / s.rate for x, s in zip(runs[key], runs["serial"], strict=True))
        target = f">= {0.9 * cores:.1f}x" if key == "engine" else ""
        rows.append([f"{label}: {way}", f"{sample.rate:,.0f}", f"{sample.seconds:.2f}", f"{ratio:.2f}x", target,
                     f"{sample.cpu_per_item_us:,.0f}"])
    rows.append([f"{label}: one call, serial", f"{1e3 / serial.rate:.3f} ms", "", "", "", ""])
    return rows


def main(count: int, repeat: int, warm: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_envs(root)
        config = engine.EngineConfig(environments=root, allow_unpinned=True,
                                     defaults=engine.Limits(max_concurrency=64, timeout=60.0))
        rows = []
        with engine.BlockingEngine(config) as eng:
            for name, label, items in [("spin", "~1 ms pure Python", spin_items(count)),
                                       ("math", "math-verify, GSM8K-style", gsm8k_items(count))]:
                path = root / name / "verify.py"
                rows += row(eng, load(path), path, label, items, repeat, warm)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{machine()}; {affinity} usable; {count:,} items; median of {repeat}; start-up excluded (load + "
          f"{warm} items)\n")
    header = ["workload", "items/s", "seconds", "vs serial", "target", "this process's CPU/item, us"]
    print(table("Target 4: CPU-bound plugins", header, rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm", type=int, default=500)
    args = parser.parse_args()
    main(args.items, args.repeat, args.warm)
