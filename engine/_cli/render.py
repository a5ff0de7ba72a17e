"""What the ``engine`` command prints: its two consoles, the progress of a run, and the tables of its figures."""

from __future__ import annotations

import contextlib
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from engine._backfill.run import RunSummary
from engine._errors import VerificationError
from engine._verifiers.plugin.worker_client import PluginError

__all__ = ["bench_table", "cause_line", "failure_details", "show_progress", "stderr", "stdout", "summary_table"]

PLAIN_PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
LOG_WIDTH = 200
HISTOGRAM_BAR = 40  # characters of the longest bar

# Off a terminal (CI, job logs) rich would fold tables to 80 columns; a log line may be long instead.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else LOG_WIDTH)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else LOG_WIDTH)


@contextlib.contextmanager
def show_progress(total: int | None) -> Iterator[Callable[[int], None]]:
    """A progress callback: a bar with rate and ETA on a terminal, plain periodic lines otherwise."""
    if stderr.is_terminal:
        columns = (
            TextColumn("scoring"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=stderr) as bar:
            task = bar.add_task("score", total=total, rate="")
            started, first = time.monotonic(), None

            def update(done: int) -> None:
                nonlocal first
                first = done if first is None else first
                rate = (done - first) / max(time.monotonic() - started, 1e-9)
                bar.update(task, completed=done, rate=f"{rate:,.0f} rows/s" if done > first else "")

            yield update
        return
    began, last = time.monotonic(), 0.0
    start: int | None = None

    def line(done: int) -> None:
        nonlocal last, start
        start = done if start is None else start
        now = time.monotonic()
        if now - last < PLAIN_PROGRESS_EVERY and done != total:
            return
        last = now
        rate = (done - start) / max(now - began, 1e-9)
        of = f"/{total}" if total is not None else ""
        if done == start:  # nothing scored yet in this run: there is no rate to show
            stderr.print(f"scored {done}{of} rows", soft_wrap=True)
            return
        eta = f", ETA {(total - done) / rate:,.0f} s" if total is not None and rate > 0 and done < total else ""
        stderr.print(f"scored {done}{of} rows, {rate:,.0f} rows/s{eta}", soft_wrap=True)

    yield line


def cause_line(cause: BaseException) -> str:
    """What a verification error's cause was, in one line: a worker's plugin exception as the plugin's own type."""
    if isinstance(cause, PluginError):
        return cause.described
    try:
        text = str(cause)
    except Exception:  # a plugin's exception: its __str__ is the plugin's code
        text = "(its message cannot be read)"
    return f"{type(cause).__name__}: {text}"


def failure_details(exc: VerificationError, whole: bool) -> list[str]:
    """Where a verifier failed, as lines under its error: the plugin's own frames (file, line and source, innermost
    last), or with ``whole`` (``--traceback``) the whole traceback of what it raised (a worker's as it sent it)."""
    cause = exc.__cause__
    if whole and cause is not None:
        text = cause.worker_traceback if isinstance(cause, PluginError) else "".join(traceback.format_exception(cause))
        return ["the whole traceback of what it raised:", *(f"  {line}" for line in text.rstrip("\n").splitlines())]
    if not exc.plugin_frames:
        return []
    frames = traceback.StackSummary.from_list(list(exc.plugin_frames)).format()  # indented as in a traceback
    return [
        "in the plugin's own code, innermost last (--traceback prints the whole traceback):",
        *"".join(frames).rstrip("\n").splitlines(),
    ]


def summary_table(summary: RunSummary) -> Table:
    """``engine score``'s figures: a row per verifier."""
    table = Table(title="per verifier", title_justify="left")
    for name in ("kind", "verifier", "items", "mean reward", "p50 ms", "p99 ms", "retries"):
        table.add_column(name, justify="left" if name in ("kind", "verifier") else "right", overflow="fold")
    for key, totals in summary.verifiers.items():
        table.add_row(
            Text(totals.kind),
            Text(key if totals.kind == "plugin" else totals.ref),  # a plugin's ref alone is ambiguous
            f"{totals.items:,}",
            f"{totals.mean_reward:.4f}",
            f"{totals.latency.percentile(50) * 1e3:.2f}",
            f"{totals.latency.percentile(99) * 1e3:.2f}",
            f"{totals.retries:,}",
        )
    return table


def _number(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def bench_table(summary: dict[str, Any]) -> None:
    """``engine bench``'s figures: a table of the verifiers, each one's latency histogram, judge usage, the runs."""
    runs = summary["runs"]
    table = Table(
        title=f"{summary['items']:,} items a run, {runs} run(s): items/s over each verifier's active time "
        "(median, min-max over runs); latency per item less start-up; start-up, waiting and in verifier summed "
        "over calls",
        title_justify="left",
    )
    columns = ("kind", "verifier", "items", "items/s", "min-max", "active s", "start-up (summed)", "p50 ms", "p95 ms",
               "p99 ms", "peak in flight", "retries", "waiting (summed)", "in verifier (summed)")
    for name in columns:
        table.add_column(name, justify="left" if name in ("kind", "verifier") else "right", overflow="fold")
    for v in summary["verifiers"]:
        latency, rate, startup = v["latency_ms"], v["items_per_s"], v["startup"]
        table.add_row(
            Text(v["kind"]), Text(v["verifier"]), f"{v['items']:,}", f"{rate['median']:,.0f}",
            f"{rate['min']:,.0f}-{rate['max']:,.0f}", f"{v['active_s']['median']:.2f}",
            f"{startup['seconds']:.2f} s ({startup['calls']} calls)",
            _number(latency["p50"]), _number(latency["p95"]), _number(latency["p99"]), str(v["peak_in_flight"]),
            str(v["retries"]), f"{v['waiting_s']:.2f} s ({v['waiting_share']:.0%})", f"{v['in_verifier_s']:.2f} s",
        )
    stdout.print(table)
    for v in summary["verifiers"]:
        if (hint := v["process_hint"]) is not None:
            stdout.print(f"hint: {v['kind']} {v['verifier']}: {hint['says']}", soft_wrap=True, markup=False)
    for v in summary["verifiers"]:
        stdout.print(f"latency per item after start-up, {v['kind']} {v['verifier']}:", soft_wrap=True, markup=False)
        stdout.print(_histogram(v["histogram"]))
        usage = v["judge_usage"]
        if usage:
            stdout.print(
                f"judge usage of {v['verifier']} (all runs): {usage['requests']:,} requests ({usage['retries']:,} "
                f"retries), {usage['prompt_tokens']:,} prompt + {usage['completion_tokens']:,} completion = "
                f"{usage['total_tokens']:,} tokens",
                soft_wrap=True, markup=False,
            )
    rate = summary["items_per_s"]
    each = ", ".join(f"{r:,.0f}" for r in rate["each"])
    stdout.print(
        f"overall {rate['median']:,.0f} items/s, median of {runs} run(s) (min {rate['min']:,.0f}, max "
        f"{rate['max']:,.0f}; reading the file included); runs: {each}",
        soft_wrap=True,
    )


def _histogram(buckets: list[dict[str, Any]]) -> Table:
    """A latency histogram: one row per log-scaled bucket, a bar for its share (its shape: a tail, two modes)."""
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(justify="right")
    table.add_column()
    table.add_column(justify="right")
    most = max((bucket["items"] for bucket in buckets), default=0)
    total = sum(bucket["items"] for bucket in buckets)
    for bucket in buckets:
        count = bucket["items"]
        bar = "█" * max(1 if count else 0, round(HISTOGRAM_BAR * count / most)) if most else ""
        table.add_row(
            f"{bucket['low_ms']:.3g}-{bucket['high_ms']:.3g} ms", Text(bar, style="cyan"),
            f"{count:,} ({count / total:.0%})",
        )
    return table
