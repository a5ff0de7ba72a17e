"""``engine bench``: how fast each verifier scores a file of stored trajectories; nothing is written.

What it measures, per run or pooled, and its process hint: docs/design.md, engine check and engine bench.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import httpx

from engine._backfill.input import Row, open_rows
from engine._backfill.run import score_chunks
from engine._check import process_hint
from engine._config import EngineConfig
from engine._core.contract import ProcessHint
from engine._core.report import BatchResult, LatencyHistogram, VerifierTotals
from engine._engine import Engine

__all__ = ["DEFAULT_BATCH_SIZE", "BenchRun", "Measured", "bench_file", "summarise"]

DEFAULT_BATCH_SIZE = 8192  # rows per batch: a large training step's worth
HISTOGRAM_PER_DOUBLING = 2  # buckets of the latency histogram shown per doubling of latency (x1.41 each)


@dataclass
class Measured:
    """One verifier's figures over a run that only a benchmark keeps (its run's ``VerifierTotals`` has the rest).

    ``active``: its active spans added up (its latencies, less their start-up, are in the run's
    ``VerifierTotals``); ``startup``: the seconds each call that started it up spent so (``meters.starting``);
    ``spent``: what its calls cost (a judge's requests and tokens); ``plugin_environment``: a plugin's environment (None
    for other kinds); ``hint``: worker processes would gain it cores (a CPU-bound thread plugin), as of the run's end.
    """

    active: float = 0.0
    startup: list[float] = field(default_factory=list)
    spent: Counter[str] = field(default_factory=Counter)
    plugin_environment: str | None = None
    hint: ProcessHint | None = None


@dataclass
class BenchRun:
    """One pass over the file: its wall time, the time spent scoring, and per-verifier figures."""

    items: int
    seconds: float  # wall time, reading the file included
    scoring: float  # time inside Engine.run, summed over the batches
    verifiers: dict[str, VerifierTotals]
    measured: dict[str, Measured] = field(default_factory=dict)

    def add(self, chunk: list[Row], result: BatchResult) -> None:
        """Count a scored chunk (:func:`score_chunks` has added its figures to ``verifiers``)."""
        self.items += len(chunk)
        self.scoring += result.elapsed
        for report in result.verifiers:
            measured = self.measured.setdefault(report.key, Measured())
            measured.active += report.active
            measured.startup += report.startup
            measured.spent.update(report.spent)
            if report.kind == "plugin":
                measured.plugin_environment = report.provenance.get("environment")


async def bench_file(
    *,
    input_path: Path,
    config: EngineConfig,
    repeat: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE,
    transport: httpx.AsyncBaseTransport | None = None,
    json_columns: Collection[str] = (),
) -> list[BenchRun]:
    """Score ``input_path`` ``repeat`` times on one engine (imports and connections are kept); ``json_columns``: its
    Parquet columns holding JSON text (:func:`engine._backfill.input.open_rows`)."""
    if repeat < 1 or batch_size < 1:
        raise ValueError(f"repeat and batch_size must be >= 1, got {repeat} and {batch_size}")
    runs: list[BenchRun] = []
    async with Engine(config, transport=transport) as engine:
        for _ in range(repeat):
            run, started = BenchRun(0, 0.0, 0.0, {}), perf_counter()
            with open_rows(input_path, json_columns=json_columns) as rows:
                await score_chunks(engine, rows, batch_size, run.verifiers, run.add)
            run.seconds = perf_counter() - started
            for measured in run.measured.values():
                if measured.plugin_environment is not None:
                    measured.hint = process_hint(engine, measured.plugin_environment)
            runs.append(run)
    return runs


def _spread(values: list[float]) -> dict[str, float]:
    """min, median (the mean of the middle two for an even count) and max."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else seconds * 1e3


def _verifier(key: str, runs: list[BenchRun]) -> dict[str, Any]:
    """One verifier's figures: per run (items, rate, active span) and pooled over the runs (the rest)."""
    totals = [run.verifiers[key] for run in runs if key in run.verifiers]
    measured = [run.measured[key] for run in runs if key in run.measured]
    first = totals[0]
    counts: Counter[int] = Counter()
    for t in totals:
        counts.update(t.latency.counts)
    steady = LatencyHistogram(counts)
    startup = [seconds for m in measured for seconds in m.startup]
    waited, busy = sum(t.waited for t in totals), sum(t.busy for t in totals)
    spent: Counter[str] = Counter()
    for m in measured:
        spent.update(m.spent)
    items = sum(t.items for t in totals)
    rates = [t.items / m.active if m.active else 0.0 for t, m in zip(totals, measured, strict=True)]
    return {
        "kind": first.kind,
        "verifier": key if first.kind == "plugin" else first.ref,
        "items": first.items,
        "items_per_s": _spread(rates),
        "active_s": _spread([m.active for m in measured]),
        "latency_ms": {f"p{q}": _ms(steady.percentile(q)) for q in (50, 95, 99)},
        "startup": {"calls": len(startup), "seconds": sum(startup), "max_ms": max(startup) * 1e3 if startup else None},
        "histogram": [
            {"low_ms": low * 1e3, "high_ms": high * 1e3, "items": count}
            for low, high, count in steady.coarse(HISTOGRAM_PER_DOUBLING)
        ],
        "peak_in_flight": max(t.peak_in_flight for t in totals),
        "retries": sum(t.retries for t in totals),
        "waiting_s": waited,
        "in_verifier_s": busy,
        "waiting_share": waited / (waited + busy) if waited + busy else 0.0,
        "mean_reward": sum(t.reward_sum for t in totals) / items if items else math.nan,
        "judge_usage": dict(spent),
        "process_hint": measured[-1].hint.as_dict() if measured and measured[-1].hint is not None else None,
    }


def summarise(runs: list[BenchRun]) -> dict[str, Any]:
    """The benchmark as plain data: each verifier's figures (see the module docstring) and every run's rate.

    Rates are over each run, reported as min, median and max (``each`` lists them); time sums,
    latencies, retries and judge usage are over all runs together.
    """
    keys = list(dict.fromkeys(key for run in runs for key in run.verifiers))
    rates = [run.items / run.seconds for run in runs]
    usage: Counter[str] = Counter()
    for run in runs:
        for measured in run.measured.values():
            usage.update(measured.spent)
    return {
        "runs": len(runs),
        "items": runs[0].items,
        "items_per_s": {**_spread(rates), "each": rates, "stdev": statistics.pstdev(rates)},
        "verifiers": [_verifier(key, runs) for key in keys],
        "judge_usage": dict(usage),
    }
