"""A plugin's worker process: how long from its spawn until it is ready, and what it imports, vs `python -c pass`.

Every worker the engine starts or replaces (after a timeout, a crash, an abort) is a fresh
interpreter that imports the worker's module and the plugin: what that module imports is paid
again each time. Measured, each ``--repeat`` times, alternating, medians:

- ``python -c pass``, spawned until it exits: the interpreter's own start, the baseline;
- ``python -c "import engine._verifiers.plugin.worker"``, spawned until it exits, and the import's
  own time and the modules it adds, measured inside that interpreter;
- a real worker of a trivial plugin (``WorkerPool.warm``), from its spawn until it says it is
  ready (interpreter up, worker module and plugin imported), and the modules it then holds,
  counted by the plugin itself in the worker.

"third-party" counts modules outside the standard library and the engine: those ``site`` loads in
every interpreter (setuptools' ``_distutils_hack``) too, but not the plugin's own (``_engine_env_*``)
or aliases such as ``__main__``.

    .venv/bin/python benchmarks/bench_worker_start.py [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, table, write_env

from engine._environments.digest import snapshot_directory
from engine._verifiers.plugin.in_processes import WorkerPool
from engine._verifiers.plugin.wire import PluginSpec

WORKER_MODULE = "engine._verifiers.plugin.worker"

# The modules an interpreter holds, and how many are neither the standard library's nor the engine's.
COUNT = """
def counts(modules):
    ours = ("engine", "_engine_env_", "__")  # the engine, the plugin, __main__ and the like
    tops = [name.partition(".")[0] for name in modules]
    return len(modules), sum(1 for t in tops if t not in sys.stdlib_module_names and not t.startswith(ours))
"""
# The plugin reports what its worker holds: its reward is a count.
PLUGIN = f"""\
import sys
{COUNT}

def score(task, trajectory):
    return float(counts(list(sys.modules))[task["which"]])
"""
# The worker's module imported in a fresh interpreter: the import's own time, and the modules then held.
IMPORT = f"""
import sys, time
{COUNT}
started = time.perf_counter()
import {WORKER_MODULE}
took = time.perf_counter() - started
sys.stdout.write(" ".join(map(str, [took, *counts(list(sys.modules))])))
"""


def spawned(args: list[str]) -> tuple[float, str]:
    """Seconds from spawning ``python args`` until it exits, and what it wrote."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True, timeout=60)
    return time.perf_counter() - started, done.stdout


async def worker_ready(spec: PluginSpec, sources: dict[str, bytes]) -> tuple[float, int, int]:
    """Seconds from a worker's spawn until it is ready, and the modules (all, third-party) it then holds."""
    pool = WorkerPool(spec, sources, 1, 60.0)
    try:
        started = time.perf_counter()
        await pool.warm()
        took = time.perf_counter() - started
        items = [{"environment": spec.environment, "task": {"which": which}, "trajectory": ""} for which in (0, 1)]
        (modules, third), _ = await pool.call(items)
    finally:
        await pool.aclose()
    return took, int(modules), int(third)


def ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.1f}"


def main(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        envs = Path(tmp)
        write_env(envs, "counting", "plugin", "verify:score", {"verify.py": PLUGIN})
        snapshot = snapshot_directory(envs / "counting")
        spec = PluginSpec(str(envs / "counting"), "counting", "verify:score", snapshot.digest)
        sources = dict(snapshot.sources)
        runs: dict[str, list[float]] = {"pass": [], "import": [], "import alone": [], "ready": []}
        modules, third = spawned(["-c", f"import sys\n{COUNT}\nprint(*counts(list(sys.modules)))"])[1].split()
        counts = {"pass": (int(modules), int(third))}

        def python_pass() -> None:
            runs["pass"].append(spawned(["-c", "pass"])[0])

        def import_worker() -> None:
            took, out = spawned(["-c", IMPORT])
            alone, modules, third = out.split()
            runs["import"].append(took)
            runs["import alone"].append(float(alone))
            counts["import"] = (int(modules), int(third))

        def ready() -> None:
            took, modules, third = asyncio.run(worker_ready(spec, sources))
            runs["ready"].append(took)
            counts["ready"] = (modules, third)

        steps = [python_pass, import_worker, ready]
        for step in steps:  # once each, unmeasured: the page cache, the bytecode caches
            step()
        for value in runs.values():
            value.clear()
        for _ in range(repeat):
            for step in steps:
                step()

    print(f"{machine()}; median of {repeat}\n")
    print(table(
        "A plugin's worker process: start-up",
        ["what", "ms", "import ms", "modules", "third-party"],
        [
            ["python -c pass: spawn to exit (baseline)", ms(runs["pass"]), "-", *counts["pass"]],
            [f"python -c 'import {WORKER_MODULE}': spawn to exit", ms(runs["import"]), ms(runs["import alone"]),
             *counts["import"]],
            ["a worker of a trivial plugin: spawn to ready", ms(runs["ready"]), "-", *counts["ready"]],
        ],
    ))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    main(args.repeat)
