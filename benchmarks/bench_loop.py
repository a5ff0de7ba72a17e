"""Issue 13, targets 1-3: the engine never holds its caller's event loop, and kinds do not get in each other's way.

1. **Heartbeat.** A task on the loop that awaits ``Engine.score`` sleeps 10 ms at a time and records
   how long each sleep really took; the worst and the p99 of those gaps, during a batch of each kind
   (a cheap thread plugin, a cheap process plugin, an endpoint, and a mix of the thread plugin and
   the endpoint), beside the same heartbeat with the loop idle for as long (the floor: this
   machine's timer and scheduler). Then the same on a *trainer's* loop running in a thread of its
   own while the main thread scores through ``BlockingEngine``. Target: worst gap <= 25 ms.
2. **Mixed batches.** ``--mix`` exact-match items and ``--mix-calls`` endpoint calls in one batch,
   against the two parts run one after the other; and the endpoint calls' p99 latency in the mix
   against alone. Targets: <= 1.0x, and <= 1.5x.
3. **Abort.** A batch of cheap plugin items led by one ``async def`` plugin item (another
   environment) that sleeps 20 ms, while the cheap chunks run, takes ``perf_counter()`` and
   raises: the time from its failure to ``score`` raising. Target: <= 50 ms.
4. **The users' mix** (issue 24). ``--users`` exact-match items followed by ``--users-calls`` endpoint
   calls, in that order (two environments' rollouts one after the other, as a trainer joins them), in
   one batch with the heartbeat beside it, against its two parts run apart (each with the heartbeat
   too): the batch's time, the endpoint calls' p99 and the heartbeat's worst and p99 gap. Target 2's
   targets, and target 1's 25 ms. Each round is timed and the rounds stop after ``--users-seconds``.

The heap holds a batch's items before each run and the garbage collector is run once then, as a
trainer's heap would have settled: a full collection of freshly built items (~100 ms for 200k) is
the host's, not the engine's, and would land in any run that allocates. Each figure is the median
over ``--repeat`` runs; worst gaps are also given as the max over the runs. "loop CPU" is the most
CPU time the loop's thread used within one gap (the engine's own work on the loop, which other
processes on a busy machine do not inflate; the gaps are wall time).

    .venv/bin/python benchmarks/bench_loop.py [--items N] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
from _common import machine, reward_server, table, write_env
from bench_plugin import EXACT, items_for  # the same exact-match plugin and items as the plugin benchmark

import engine

FAIL = """\
import time
import anyio


async def score(task, trajectory):
    await anyio.sleep(float(task["after"]))
    with open(task["stamp"], "w") as file:  # when it failed, on perf_counter's clock (this process's)
        file.write(repr(time.perf_counter()))
    raise RuntimeError("this item fails on purpose")
"""
TICK = 0.01
T = TypeVar("T")


def users_items(plugin: int, calls: int) -> list[dict[str, Any]]:
    """``plugin`` exact-match items then ``calls`` endpoint items, each environment's built together."""
    return [*items_for("exact", plugin), *items_for("endpoint", calls, start=plugin)]


def mixed_items(plugin: int, calls: int) -> list[dict[str, Any]]:
    """``plugin`` exact-match items with ``calls`` endpoint items spread evenly among them, built in batch order
    (as a trainer builds its batch, rollout by rollout: the heap holds them in the order they are read)."""
    every = (plugin + calls) / calls
    endpoint_at = {int(k * every) for k in range(calls)}
    return [items_for("endpoint" if i in endpoint_at else "exact", 1, start=i)[0] for i in range(plugin + calls)]


class Heartbeat:
    """Sleeps ``TICK`` at a time on the loop it runs on, recording each sleep's real length."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.cpu: list[float] = []  # the loop thread's own CPU time during each gap
        self.stop = False

    async def beat(self) -> None:
        while not self.stop:
            started, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(TICK)
            self.gaps.append(time.perf_counter() - started)
            self.cpu.append(time.thread_time() - cpu)

    def figures(self) -> tuple[float, float, float]:
        """(p99, worst, worst loop CPU) in ms."""
        gaps = sorted(self.gaps)
        return gaps[max(0, int(len(gaps) * 0.99) - 1)] * 1e3, gaps[-1] * 1e3, max(self.cpu) * 1e3


async def with_heartbeat(work: Callable[[], Awaitable[Any]]) -> tuple[float, float, float, float]:
    """``work()`` on this loop with a heartbeat beside it: (seconds, p99 gap ms, worst gap ms, worst loop CPU ms)."""
    return (await beside_heartbeat(work))[0]


async def beside_heartbeat(work: Callable[[], Awaitable[T]]) -> tuple[tuple[float, float, float, float], T]:
    """:func:`with_heartbeat`'s figures, and what ``work()`` returned."""
    heart = Heartbeat()
    beating = asyncio.ensure_future(heart.beat())
    await asyncio.sleep(3 * TICK)  # the heartbeat is going
    heart.gaps.clear()
    heart.cpu.clear()
    started = time.perf_counter()
    result = await work()
    elapsed = time.perf_counter() - started
    heart.stop = True
    await beating
    return (elapsed, *heart.figures()), result


def settle() -> None:
    gc.collect()


def row(name: str, runs: list[tuple[float, float, float, float]]) -> list[str]:
    seconds = statistics.median(r[0] for r in runs)
    p99 = statistics.median(r[1] for r in runs)
    worst = statistics.median(r[2] for r in runs)
    worst_max = max(r[2] for r in runs)
    cpu = statistics.median(r[3] for r in runs)
    verdict = "ok" if worst_max <= 25 else "over"
    return [name, f"{seconds:.2f}", f"{p99:.1f}", f"{worst:.1f}", f"{worst_max:.1f}", f"{cpu:.1f}", verdict]


async def heartbeats(config: engine.EngineConfig, url_ok: bool, args: argparse.Namespace) -> list[list[str]]:
    rows = []
    n = args.items
    thread_items = items_for("exact", n)
    process_items = items_for("exact_process", n)
    endpoint_items = items_for("endpoint", args.endpoint_items) if url_ok else []
    mix_items = mixed_items(args.mix, args.mix_calls)
    async with engine.Engine(config) as eng:
        for name in ("exact", "exact_process", "endpoint"):
            await eng.load(name)
        await eng.score(thread_items[:2000])
        await eng.score(process_items[:2000])
        await eng.score(endpoint_items[:256])
        cases: list[tuple[str, list[dict[str, Any]] | None]] = [
            ("idle loop (the floor)", None),
            (f"thread plugin, {n:,} items", thread_items),
            (f"process plugin, {n:,} items", process_items),
            (f"endpoint, {len(endpoint_items):,} calls", endpoint_items),
            (f"mix: {args.mix:,} thread + {args.mix_calls:,} endpoint", mix_items),
        ]
        for name, items in cases:
            runs = []
            for _ in range(args.repeat):
                settle()
                if items is None:
                    runs.append(await with_heartbeat(lambda: asyncio.sleep(1.0)))
                else:
                    runs.append(await with_heartbeat(functools.partial(eng.score, items)))
            rows.append(row(name, runs))
    return rows


def blocking_heartbeat(config: engine.EngineConfig, args: argparse.Namespace) -> list[str]:
    """A trainer's own loop in a thread, heartbeat on it; the main thread scores through ``BlockingEngine``."""
    items = items_for("exact", args.items)
    runs = []
    with engine.BlockingEngine(config) as eng:
        eng.score(items[:2000])
        for _ in range(args.repeat):
            settle()
            heart = Heartbeat()
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_until_complete, args=(heart.beat(),), daemon=True)
            thread.start()
            time.sleep(3 * TICK)
            heart.gaps.clear()
            started = time.perf_counter()
            eng.score(items)
            elapsed = time.perf_counter() - started
            heart.stop = True
            thread.join()
            loop.close()
            runs.append((elapsed, *heart.figures()))
    return row(f"trainer's loop, BlockingEngine thread plugin {args.items:,}", runs)


async def mixed(config: engine.EngineConfig, args: argparse.Namespace) -> list[list[str]]:
    mix = mixed_items(args.mix, args.mix_calls)
    plugin = [item for item in mix if item["environment"] == "exact"]  # the same items, in the same order
    calls = [item for item in mix if item["environment"] == "endpoint"]
    ratios, p99_ratios, apart_s, mix_s, p99_alone, p99_mix = [], [], [], [], [], []
    async with engine.Engine(config) as eng:
        await eng.score(plugin[:2000])
        await eng.score(calls[:256])
        for _ in range(args.repeat):
            settle()
            started = time.perf_counter()
            await eng.score(plugin)
            alone = await eng.run(calls)
            apart = time.perf_counter() - started
            settle()
            started = time.perf_counter()
            together = await eng.run(mix)
            both = time.perf_counter() - started
            endpoint_alone = next(r for r in alone.verifiers if r.kind == "endpoint").latency(99)
            endpoint_mix = next(r for r in together.verifiers if r.kind == "endpoint").latency(99)
            apart_s.append(apart)
            mix_s.append(both)
            ratios.append(both / apart)
            p99_alone.append(endpoint_alone * 1e3)
            p99_mix.append(endpoint_mix * 1e3)
            p99_ratios.append(endpoint_mix / endpoint_alone)
    m = statistics.median
    return [
        [
            f"{args.mix:,} exact-match + {args.mix_calls:,} endpoint, one batch",
            f"{m(mix_s):.2f} s",
            "one after the other",
            f"{m(apart_s):.2f} s",
            f"{m(ratios):.2f}x",
            "<= 1.0x",
        ],
        [
            "endpoint p99 in the mix",
            f"{m(p99_mix):.1f} ms",
            "endpoint alone",
            f"{m(p99_alone):.1f} ms",
            f"{m(p99_ratios):.2f}x",
            "<= 1.5x",
        ],
    ]


def endpoint_p99(result: engine.BatchResult) -> float:
    """The endpoint calls' p99 latency in ``result``, in ms."""
    return next(r for r in result.verifiers if r.kind == "endpoint").latency(99) * 1e3


async def users_mix(config: engine.EngineConfig, args: argparse.Namespace) -> tuple[int, list[list[str]]]:
    """Target 4: the users' mix beside the heartbeat, against its parts apart; (rounds run, table rows)."""
    mix = users_items(args.users, args.users_calls)
    plugin, calls = mix[: args.users], mix[args.users :]
    rounds: list[dict[str, float]] = []
    async with engine.Engine(config) as eng:
        await eng.score(plugin[:2000])
        await eng.score(calls[:256])
        deadline = time.monotonic() + args.users_seconds
        while len(rounds) < args.repeat and (not rounds or time.monotonic() < deadline):
            settle()
            (plugin_s, _, _, _), _ = await beside_heartbeat(functools.partial(eng.run, plugin))
            settle()
            (calls_s, calls_p99, calls_worst, _), alone = await beside_heartbeat(functools.partial(eng.run, calls))
            settle()
            (mix_s, mix_p99, mix_worst, _), together = await beside_heartbeat(functools.partial(eng.run, mix))
            rounds.append({
                "mix": mix_s, "apart": plugin_s + calls_s, "p99 mix": endpoint_p99(together),
                "p99 alone": endpoint_p99(alone), "gap worst": mix_worst, "gap p99": mix_p99,
                "alone worst": calls_worst, "alone gap p99": calls_p99, "plugin rate": args.users / plugin_s,
            })
    m = statistics.median

    def med(key: str) -> float:
        return m(r[key] for r in rounds)

    worst_max = max(r["gap worst"] for r in rounds)
    rows = [
        [f"{args.users:,} exact-match then {args.users_calls:,} endpoint, one batch", f"{med('mix'):.2f} s",
         "one after the other", f"{med('apart'):.2f} s", f"{m(r['mix'] / r['apart'] for r in rounds):.2f}x", "<= 1.0x"],
        ["endpoint p99 in the mix", f"{med('p99 mix'):.1f} ms", "endpoint alone", f"{med('p99 alone'):.1f} ms",
         f"{m(r['p99 mix'] / r['p99 alone'] for r in rounds):.2f}x", "<= 1.5x"],
        ["heartbeat worst gap in the mix (max of rounds)", f"{med('gap worst'):.1f} ({worst_max:.1f}) ms",
         "endpoint alone", f"{med('alone worst'):.1f} ms", "ok" if worst_max <= 25 else "over", "<= 25 ms"],
        ["heartbeat p99 gap in the mix", f"{med('gap p99'):.1f} ms", "endpoint alone", f"{med('alone gap p99'):.1f} ms",
         "", ""],
        ["exact-match alone (for the record)", f"{med('plugin rate'):,.0f} items/s", "", "", "", ""],
    ]
    return len(rounds), rows


async def aborts(config: engine.EngineConfig, envs: Path, args: argparse.Namespace) -> list[str]:
    cheap = items_for("exact", args.items)
    stamp = envs.parent / "failed-at"
    failing = {"environment": "fail", "task": {"prompt": "x", "after": "0.02", "stamp": str(stamp)}, "trajectory": ""}
    batch = [failing, *cheap]  # two lanes from the start: the failure lands while the cheap chunks run
    latencies = []
    async with engine.Engine(config) as eng:
        await eng.score(cheap[:2000])
        await eng.load("fail")
        for _ in range(args.repeat):
            settle()
            try:
                await eng.score(batch)
            except engine.VerificationError:
                raised = time.perf_counter()
            else:
                raise AssertionError("the batch should have failed")
            latencies.append((raised - float(stamp.read_text())) * 1e3)
    return [
        f"cheap chunks running, {args.items:,} items",
        f"{statistics.median(latencies):.1f} ms",
        f"{max(latencies):.1f} ms",
        "<= 50 ms",
    ]


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, reward_server() as (url, server):
        envs = Path(tmp) / "envs"
        write_env(envs, "exact", "plugin", "verify:score", {"verify.py": EXACT})
        write_env(envs, "exact_process", "plugin", "verify:score", {"verify.py": EXACT})
        manifest = envs / "exact_process" / "manifest.json"
        manifest.write_text(manifest.read_text().replace('"ref"', '"executor":"process","ref"'))
        write_env(envs, "fail", "plugin", "fail_verify:score", {"fail_verify.py": FAIL})
        write_env(envs, "endpoint", "endpoint", url)
        config = engine.EngineConfig(
            environments=envs, allow_unpinned=True, threads=64, defaults=engine.Limits(max_concurrency=64)
        )
        loop_rows = anyio.run(heartbeats, config, True, args) if "heartbeat" in args.only else []
        if "heartbeat" in args.only:
            loop_rows.append(blocking_heartbeat(config, args))
        mix_rows = anyio.run(mixed, config, args) if "mix" in args.only else []
        abort_row = anyio.run(aborts, config, envs, args) if "abort" in args.only else None
        users = anyio.run(users_mix, config, args) if "users" in args.only else None
    print(f"{machine()}; median of {args.repeat}; endpoint server: {server}\n")
    if loop_rows:
        print(
            table(
                "Target 1: a 10 ms heartbeat's gaps on the loop that awaits the engine",
                ["workload", "s", "p99 ms", "worst ms", "worst (max) ms", "loop CPU ms", "<= 25 ms"],
                loop_rows,
            )
        )
        print()
    if mix_rows:
        print(
            table(
                "Target 2: mixed batches",
                ["workload", "engine", "baseline", "baseline figure", "ratio", "target"],
                mix_rows,
            )
        )
        print()
    if abort_row:
        print(table("Target 3: failure to score raising", ["case", "median", "max", "target"], [abort_row]))
        print()
    if users:
        rounds, users_rows = users
        print(
            table(
                f"Target 4: the users' mix, beside the heartbeat (median of {rounds} rounds)",
                ["workload", "engine", "baseline", "baseline figure", "ratio", "target"],
                users_rows,
            )
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--endpoint-items", type=int, default=200_000)
    parser.add_argument("--mix", type=int, default=300_000)
    parser.add_argument("--mix-calls", type=int, default=4_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--users", type=int, default=300_000)
    parser.add_argument("--users-calls", type=int, default=4_000)
    parser.add_argument("--users-seconds", type=float, default=300.0, help="no round of target 4 starts after this")
    parser.add_argument("--only", default="heartbeat,mix,abort,users")
    main(parser.parse_args())
