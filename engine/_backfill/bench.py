"""``engine bench``: how fast each verifier scores a file of stored trajectories; nothing is written.

What it measures, per run or pooled, and its process hint: docs/design.md, engine check and engine bench.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import httpx

from engine._backfill.columns import Columns
from engine._backfill.input import Row, open_rows
from engine._backfill.run import score_chunks
from engine._check import process_hint
from engine._config import EngineConfig
from engine._core.contract import ProcessHint
from engine._core.report import BatchResult, VerifierTotals
from engine._engine import Engine

__all__ = ["DEFAULT_BATCH_SIZE", "BenchRun", "bench_file", "summarise"]

DEFAULT_BATCH_SIZE = 8192  # rows per batch: a large training step's worth
HISTOGRAM_PER_DOUBLING = 2  # buckets of the latency histogram shown per doubling of latency (x1.41 each)


@dataclass
class BenchRun:
    """One pass over the file: its wall time, the time spent scoring, and per-verifier figures.

    ``plugin_environments``: a plugin's environment, per verifier key; ``hints``: worker processes would gain
    it cores (a CPU-bound thread plugin), as of the run's end.
    """

    items: int
    seconds: float  # wall time, reading the file included
    scoring: float  # time inside Engine.run, summed over the batches
    verifiers: dict[str, VerifierTotals]
    plugin_environments: dict[str, str] = field(default_factory=dict)
    hints: dict[str, ProcessHint | None] = field(default_factory=dict)

    def add(self, chunk: list[Row], result: BatchResult) -> None:
        """Count a scored chunk (:func:`score_chunks` has added its figures to ``verifiers``)."""
        self.items += len(chunk)
        self.scoring += result.elapsed
        for report in result.verifiers:
            environment = report.provenance.get("environment") if report.kind == "plugin" else None
            if environment is not None:
                self.plugin_environments[report.key] = environment


async def bench_file(
    *,
    input_path: Path,
    config: EngineConfig,
    repeat: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE,
    transport: httpx.AsyncBaseTransport | None = None,
    json_columns: Collection[str] = (),
    columns: Mapping[str, str] | None = None,
) -> list[BenchRun]:
    """Score ``input_path`` ``repeat`` times on one engine (imports and connections are kept); ``json_columns``: its
    Parquet columns holding JSON text; ``columns``: where each field is read from, replacing the config's
    (:func:`engine._backfill.input.open_rows`)."""
    if repeat < 1 or batch_size < 1:
        raise ValueError(f"repeat and batch_size must be >= 1, got {repeat} and {batch_size}")
    mapping = Columns.chosen(columns, config.input_columns)
    runs: list[BenchRun] = []
    async with Engine(config, transport=transport) as engine:
        for _ in range(repeat):
            run, started = BenchRun(0, 0.0, 0.0, {}), perf_counter()
            with open_rows(input_path, json_columns=json_columns, columns=mapping) as rows:
                await score_chunks(engine, rows, batch_size, run.verifiers, run.add)
            run.seconds = perf_counter() - started
            for key, environment in run.plugin_environments.items():
                run.hints[key] = process_hint(engine, environment)
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
    first = totals[0]
    pooled = VerifierTotals(first.kind, first.ref)
    for t in totals:
        pooled.merge(t)
    steady, waited, busy = pooled.latency, pooled.waited, pooled.busy
    rates = [t.items / t.active if t.active else 0.0 for t in totals]
    hint = [run.hints.get(key) for run in runs if key in run.verifiers][-1]  # as of its last run's end
    return {
        "kind": first.kind,
        "verifier": key if first.kind == "plugin" else first.ref,
        "items": first.items,
        "items_per_s": _spread(rates),
        "active_s": _spread([t.active for t in totals]),
        "latency_ms": {f"p{q}": _ms(steady.percentile(q)) for q in (50, 95, 99)},
        "startup": {"calls": pooled.startup_calls, "seconds": pooled.startup_seconds,
                    "max_ms": pooled.startup_longest * 1e3 if pooled.startup_calls else None},
        "histogram": [
            {"low_ms": low * 1e3, "high_ms": high * 1e3, "items": count}
            for low, high, count in steady.coarse(HISTOGRAM_PER_DOUBLING)
        ],
        "peak_in_flight": pooled.peak_in_flight,
        "retries": pooled.retries,
        "waiting_s": waited,
        "in_verifier_s": busy,
        "waiting_share": waited / (waited + busy) if waited + busy else 0.0,
        "mean_reward": pooled.mean_reward,
        "judge_usage": dict(pooled.spent),
        "process_hint": hint.as_dict() if hint is not None else None,
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
        for totals in run.verifiers.values():
            usage.update(totals.spent)
    return {
        "runs": len(runs),
        "items": runs[0].items,
        "items_per_s": {**_spread(rates), "each": rates, "stdev": statistics.pstdev(rates)},
        "verifiers": [_verifier(key, runs) for key in keys],
        "judge_usage": dict(usage),
    }
