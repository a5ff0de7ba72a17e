"""``engine bench``: how fast each verifier scores a file of stored trajectories; nothing is written.

What it measures, per run or pooled, and its process hint: docs/design.md, engine check and engine bench.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import httpx

from engine._backfill.input import Row, open_rows
from engine._backfill.run import score_chunks
from engine._check import process_hint
from engine._columns import Columns
from engine._config import EngineConfig
from engine._core.contract import ProcessHint
from engine._core.report import BatchResult, VerifierTotals, add_amounts
from engine._engine import Engine

__all__ = ["DEFAULT_BATCH_SIZE", "MIN_SPAN_ITEMS", "MIN_SPAN_S", "BenchRun", "bench_file", "summarise"]

DEFAULT_BATCH_SIZE = 8192  # rows per batch: a large training step's worth
HINT_ITEMS = 64  # a plugin's first rows in the file, whose warm calls its process hint times (in turn)
HISTOGRAM_PER_DOUBLING = 2  # buckets of the latency histogram shown per doubling of latency (x1.41 each)
# A rate over less than this (a run's active span, or its items) is a wave or two, not a sustained one:
# 1,225 items of a cheap plugin in 10 ms read 122,586 items/s.
MIN_SPAN_S = 0.1
MIN_SPAN_ITEMS = 100


@dataclass
class BenchRun:
    """One pass over the file: its wall time, the time spent scoring, and per-verifier figures.

    ``plugin_environments``: a plugin's environment, per verifier key; ``hints``: worker processes would gain
    it cores (a CPU-bound thread plugin), timed after the last run only (:func:`engine._check.process_hint`).
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
    samples: dict[str, list[dict[str, Any]]] = {}  # each plugin environment's first rows, for the process hint

    def sampled(chunk: list[Row], result: BatchResult) -> None:
        """``run.add``, keeping the first run's first rows of each plugin (a pass over a chunk while one wants more)."""
        run.add(chunk, result)
        wanting = {env for env in run.plugin_environments.values() if len(samples.setdefault(env, [])) < HINT_ITEMS}
        for row in chunk:
            if not wanting:
                break
            if row.environment in wanting:
                (sample := samples[row.environment]).append(row.as_item())
                if len(sample) == HINT_ITEMS:
                    wanting.discard(row.environment)

    async with Engine(config, transport=transport) as engine:
        for _ in range(repeat):
            run, started = BenchRun(0, 0.0, 0.0, {}), perf_counter()
            with open_rows(input_path, json_columns=json_columns, columns=mapping) as rows:
                await score_chunks(engine, rows, batch_size, run.verifiers, sampled if not runs else run.add)
            run.seconds = perf_counter() - started
            runs.append(run)
        # as engine check does, on calls of their own, after the runs: none of them is in the figures
        for key, environment in run.plugin_environments.items():
            if sample := samples.get(environment):  # the file's rows of it, unless it changed since the first run
                run.hints[key] = await process_hint(engine, environment, sample)
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
    active = _spread([t.active for t in totals])
    return {
        "kind": first.kind,
        "verifier": key if first.kind == "plugin" else first.ref,
        "items": first.items,  # a run's
        "items_all_runs": pooled.items,
        "items_per_s": _spread(rates),
        "active_s": active,
        "active_s_all_runs": pooled.active,
        # too short a span (or too few items) to take its rate for a sustained one
        "short_span": active["median"] < MIN_SPAN_S or first.items < MIN_SPAN_ITEMS,
        "latency_ms": {f"p{q}": _ms(steady.percentile(q)) for q in (50, 95, 99)},
        "startup": {"calls": pooled.startup_calls, "seconds": pooled.startup_seconds,
                    "max_ms": pooled.startup_longest * 1e3 if pooled.startup_calls else None,
                    # the items of the calls that started it up or waited on that: in no latency
                    "items": pooled.items - sum(steady.counts.values())},
        "histogram": [
            {"low_ms": low * 1e3, "high_ms": high * 1e3, "items": count}
            for low, high, count in steady.coarse(HISTOGRAM_PER_DOUBLING)
        ],
        "peak_in_flight": pooled.peak_in_flight,
        "mean_in_flight": busy / pooled.active if pooled.active else 0.0,  # its calls in the verifier, on average
        "retries": pooled.retries,
        "waiting_s": waited,
        "in_verifier_s": busy,
        "waiting_share": waited / (waited + busy) if waited + busy else 0.0,
        "mean_reward": pooled.mean_reward,
        "judge_usage": dict(pooled.spent),
        "process_hint": hint.as_dict() if hint is not None else None,
    }


def _bottleneck(verifiers: list[dict[str, Any]], scoring: float) -> dict[str, Any] | None:
    """The verifier that bounds the batches: the longest active over all runs (the batches end when it does)."""
    if not verifiers:
        return None
    slowest = max(verifiers, key=lambda v: v["active_s_all_runs"])
    return {"kind": slowest["kind"], "verifier": slowest["verifier"], "active_s": slowest["active_s_all_runs"],
            "share": slowest["active_s_all_runs"] / scoring if scoring else 0.0}


def summarise(runs: list[BenchRun]) -> dict[str, Any]:
    """The benchmark as plain data: each verifier's figures (see the module docstring) and every run's rate.

    Rates are over each run, reported as min, median and max (``each`` lists them); counts, time sums,
    latencies, retries and judge usage are over all runs together (``items`` alone is a run's, the file's);
    ``bottleneck`` names the verifier active longest, its share of the time spent scoring.
    """
    keys = list(dict.fromkeys(key for run in runs for key in run.verifiers))
    rates = [run.items / run.seconds for run in runs]
    usage: dict[str, float] = {}
    for run in runs:
        for totals in run.verifiers.values():
            add_amounts(usage, totals.spent)
    verifiers = [_verifier(key, runs) for key in keys]
    scoring = math.fsum(run.scoring for run in runs)
    return {
        "runs": len(runs),
        "items": runs[0].items,
        "items_all_runs": sum(run.items for run in runs),
        "items_per_s": {**_spread(rates), "each": rates, "stdev": statistics.pstdev(rates)},
        "seconds": _spread([run.seconds for run in runs]),
        "scoring_s_all_runs": scoring,
        "short_span": statistics.median(run.seconds for run in runs) < MIN_SPAN_S,
        "min_span": {"seconds": MIN_SPAN_S, "items": MIN_SPAN_ITEMS},
        "bottleneck": _bottleneck(verifiers, scoring),
        "verifiers": verifiers,
        "judge_usage": dict(usage),
    }
