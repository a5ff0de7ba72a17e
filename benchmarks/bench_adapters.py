"""Issue 15's target: verl's per-sample calls, gathered by the adapter, against one batch and one call per sample.

verl calls ``compute_score`` once per sample, 1,024 concurrent coroutines on one loop. With a plugin
of ~20 us a call, ``engine.adapters.verl.compute_score`` (which gathers them into engine batches)
should reach >= 0.6x the speed of one ``Engine.score`` of the same 1,024 items; one engine call per
sample reaches ~0.05x. With a microsecond plugin no adapter comes close to one batch: asyncio alone
needs milliseconds to run 1,024 gathered coroutines, so that row stands beside asyncio's own floor
(1,024 gathered coroutines that do nothing).

Everything runs on one event loop, each way back to back, ``--repeat`` times: a ratio is the median of
the back-to-back pairs' ratios (this machine's speed drifts between runs), a time the median of its runs.

Issue 23's section (``--verl``, in a venv with verl 0.9.1: ``make trainers TRAINERS=verl`` makes one)
runs verl's own reward loop as verl's trainer does, on a local Ray of 2 CPUs: ``RewardLoopManager``
and its ``RewardLoopWorker`` actors (2, and verl's default 8), fed by verl's ``AgentLoopWorker`` (the
streaming path: one Ray call per finished sample to a random reward worker; one worker, in this
process; generation is the tests' stand-in, ``tests/trainers/verl_support.py``, which answers at once,
so the samples finish together: gathering's best case), or ``RewardLoopManager.compute_rm_score`` (the
batch path: one chunk per worker). It counts the engine
batches the adapter made in the reward workers, and, with ``url=``, the batches a shared ``engine
serve`` made of the workers' requests.

    .venv/bin/python benchmarks/bench_adapters.py [--samples N] [--repeat R]
    .venv-verl/bin/python benchmarks/bench_adapters.py --verl [--samples N] [--repeat R]
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


VERL_MAX_SECONDS = 1800.0  # the verl section stops repeating past this (its Ray workers take minutes to start)


def served_batches(url: str, token: str) -> tuple[float, float]:
    """An ``engine serve``'s engine batches so far, and the requests it answered on ``/v1/score``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=30).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    gathered = sum(v for (name, _), v in samples.items() if name == "engine_gathered_batches_total")
    took = sum(v for (name, _), v in samples.items() if name == "engine_gathered_requests_total")
    requests = sum(v for (name, labels), v in samples.items()
                   if name == "engine_http_requests_total" and ("route", "/v1/score") in labels)
    return gathered + (requests - took), requests  # a request not gathered is a batch of its own


def _verl_way(vs: Any, root: Path, kwargs: dict[str, str], workers: int, samples: int, repeat: int,
              deadline: float, url: str, token: str) -> list[list[Any]]:
    """Both paths with ``workers`` reward workers calling the engine as ``kwargs`` say: a row each, and
    one for generation alone (the streaming row's time includes it)."""
    import ray

    items = vs.numbered(samples)
    want = vs.float32(vs.expected(items))
    config = vs.compose_verl([*vs.settings(root, workers), *vs.engine_reward(**kwargs)])
    manager = vs.RewardLoopManager(config)
    handles = manager.reward_loop_workers
    # verl's AgentLoopWorker, here in this process (each of the trainer's is a Ray actor of its own: starting
    # 8 more processes a setting took minutes on this machine); it sends the same Ray calls
    streaming = vs.AgentLoopWorker(config, None, None, handles)
    batching = vs.AgentLoopWorker(config, None, None, None)

    def generate(worker: Any) -> Any:
        return asyncio.run(worker.generate_sequences(vs.gen_batch(vs.rows(items))))

    assert vs.rewards_of(generate(streaming)) == want  # warm: every worker up
    generated = generate(batching)
    manager.compute_rm_score(generated)
    where = "in process" if "config" in kwargs else "url=, one engine serve"
    rows: list[list[Any]] = []

    def generate_only() -> Any:
        return generate(batching)

    def stream() -> Any:
        return generate(streaming)

    def batch() -> Any:
        return generated.union(manager.compute_rm_score(generated))

    for path, step in (("generation alone (no reward)", generate_only), ("streaming path", stream),
                       ("batch path", batch)):
        counts: list[int] = []
        times: list[float] = []
        served: list[tuple[float, float]] = []
        for _ in range(repeat):
            before, seen = sum(vs.worker_batches(handles)), served_batches(url, token)
            started = time.perf_counter()
            out = step()
            times.append(time.perf_counter() - started)
            if step is not generate_only:
                assert vs.rewards_of(out) == want
            counts.append(sum(vs.worker_batches(handles)) - before)
            after = served_batches(url, token)
            served.append((after[0] - seen[0], after[1] - seen[1]))
            if time.monotonic() > deadline:
                break
        shown = "" if step is generate_only else f"{statistics.median(counts):g} ({', '.join(map(str, counts))})"
        if step is not generate_only and "url" in kwargs:
            shown += (f"; the service: {statistics.median(b for b, _ in served):g} batches "
                      f"of {statistics.median(r for _, r in served):g} requests")
        rows.append([f"{path}, {workers} reward workers, {where}", f"{statistics.median(times) * 1e3:.0f} ms", shown,
                     len(times)])
    for handle in handles:
        ray.kill(handle)
    while True:  # verl names its reward workers: the next manager's need the names back
        try:
            ray.get_actor("reward_loop_worker_0")
        except ValueError:
            return rows
        time.sleep(0.1)


def verl_main(samples: int, repeat: int) -> None:
    """Issue 23: verl's streaming and batch paths as verl's trainer runs them (see the module's docstring)."""
    import os
    import subprocess
    import sys

    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "trainers"), str(tests)]
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: its Ray keeps to 127.0.0.1
    import ray
    import verl_support as vs
    from _common import free_port, wait_for_port
    from cli_support import child_env, engine_command

    deadline = time.monotonic() + VERL_MAX_SECONDS
    token = "bench-token"
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config_file = vs.workspace(root)
        port = free_port()
        command = engine_command("serve", "--config", config_file, "--port", str(port), "--token-env", "SERVE_TOKEN")
        server = subprocess.Popen(command, cwd=root, env=child_env({"SERVE_TOKEN": token}),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_port(port, 60)
            items = [{"environment": "sample", "task": {"reference": s["ground_truth"], "num_turns": 2, "index": n},
                      "trajectory": s["response"]} for n, s in enumerate(vs.numbered(samples))]

            async def one_batch() -> float:
                async with engine.Engine.from_config(config_file) as eng:
                    await eng.score(items)
                    return await timed(lambda: eng.score(items))

            base = statistics.median(asyncio.run(one_batch()) for _ in range(repeat))
            rows.append([f"one Engine.score of {samples:,} (in process, for scale)", f"{base * 1e3:.1f} ms", "1",
                         repeat])
            vs.start_ray()
            for workers in (2, 8):
                for kwargs in ({"config": str(config_file)}, {"url": url, "token": token}):
                    rows += _verl_way(vs, root, kwargs, workers, samples, repeat, deadline, url, token)
        finally:
            ray.shutdown()
            server.terminate()
            server.wait(30)
    print(f"{machine()}; medians of up to {repeat} runs (each run's count in brackets)\n")
    print(table(f"Issue 23: verl's reward loop, {samples:,} samples a step",
                ["way", "time a step", "engine batches a step", "runs"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=None, help="runs of each way (default: 15, --verl: 3)")
    parser.add_argument("--verl", action="store_true", help="issue 23's section: verl's own reward loop")
    args = parser.parse_args()
    if args.verl:
        verl_main(args.samples, args.repeat or 3)
    else:
        main(args.samples, args.repeat or 15)
