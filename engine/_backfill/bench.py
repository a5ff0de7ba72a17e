"""``engine bench``: how fast each verifier scores a file of stored trajectories; nothing is written.

The file is read and scored batch by batch, as a trainer would (``--batch-size`` rows at a time),
``--repeat`` times over. For each verifier: items/s, latency percentiles, the most calls in
flight at once, retries, and how its time split between waiting for a limit and the verifier
itself. The file is read and scored as ``engine score`` reads it (:func:`engine._backfill.run.score_chunks`):
a bad row or a verification error aborts the benchmark, naming the row: a fast zero is not a result.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import httpx

from engine._backfill.input import Row, open_rows
from engine._backfill.run import score_chunks
from engine._config import EngineConfig
from engine._core.report import BatchResult, VerifierTotals
from engine._engine import Engine

__all__ = ["DEFAULT_BATCH_SIZE", "BenchRun", "bench_file", "summarise"]

DEFAULT_BATCH_SIZE = 8192  # rows per batch: a large training step's worth


@dataclass
class BenchRun:
    """One pass over the file: its wall time, the time spent scoring, and per-verifier totals."""

    items: int
    seconds: float  # wall time, reading the file included
    scoring: float  # time inside Engine.run, summed over the batches
    verifiers: dict[str, VerifierTotals]

    def add(self, chunk: list[Row], result: BatchResult) -> None:
        """Count a scored chunk (:func:`score_chunks` has added its figures to ``verifiers``)."""
        self.items += len(chunk)
        self.scoring += result.elapsed


async def bench_file(
    *,
    input_path: Path,
    config: EngineConfig,
    repeat: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[BenchRun]:
    """Score ``input_path`` ``repeat`` times on one engine (imports and connections are kept)."""
    if repeat < 1 or batch_size < 1:
        raise ValueError(f"repeat and batch_size must be >= 1, got {repeat} and {batch_size}")
    runs = []
    async with Engine(config, transport=transport) as engine:
        for _ in range(repeat):
            run, started = BenchRun(0, 0.0, 0.0, {}), perf_counter()
            with open_rows(input_path) as rows:
                await score_chunks(engine, rows, batch_size, run.verifiers, run.add)
            run.seconds = perf_counter() - started
            runs.append(run)
    return runs


def summarise(runs: list[BenchRun]) -> dict[str, Any]:
    """The benchmark as plain data: the median run's figures per verifier, and every run's rate."""
    median = sorted(runs, key=lambda run: run.items / run.seconds)[len(runs) // 2]
    verifiers = []
    for key, t in median.verifiers.items():
        spent = t.waited + t.busy
        verifiers.append(
            {
                "kind": t.kind,
                "verifier": key if t.kind == "plugin" else t.ref,
                "items": t.items,
                "items_per_s": t.items / median.scoring if median.scoring else 0.0,
                "latency_ms": {f"p{q}": t.latency.percentile(q) * 1e3 for q in (50, 95, 99)},
                "peak_in_flight": t.peak_in_flight,
                "retries": t.retries,
                "waiting_s": t.waited,
                "in_verifier_s": t.busy,
                "waiting_share": t.waited / spent if spent else 0.0,
                "mean_reward": t.mean_reward,
            }
        )
    return {
        "runs": len(runs),
        "items": median.items,
        "items_per_s": {
            "median": median.items / median.seconds,
            "each": [run.items / run.seconds for run in runs],
            "stdev": statistics.pstdev(run.items / run.seconds for run in runs),
        },
        "verifiers": verifiers,
    }
