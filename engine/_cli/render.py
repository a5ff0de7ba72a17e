"""What the ``engine`` command prints: its two consoles, the progress of a run, a backfill's summary, and the tables
of its figures."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from engine._backfill.rewards import BINS, Rewards
from engine._core.report import VerifierTotals

__all__ = [
    "bench_table",
    "close_progress",
    "plural",
    "rewards_summary",
    "session_line",
    "show_progress",
    "stderr",
    "stdout",
    "summary_table",
]

PLAIN_PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
LOG_WIDTH = 200
HISTOGRAM_BAR = 40  # characters of the longest bar

# Off a terminal (CI, job logs) rich would fold tables to 80 columns; a log line may be long instead.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else LOG_WIDTH)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else LOG_WIDTH)


_bars: list[Progress] = []  # the bar drawn now, if any: closed before an error is said (close_progress)


def close_progress() -> None:
    """Stop the progress bar, if one is drawn, after its last redraw: what is printed next comes below it."""
    while _bars:
        _bars.pop().stop()


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless one: ``1 reward``, ``2,048 rewards``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _start(done: int, total: int | None) -> str:
    """What a run is about to do, said before anything is scored (never "scored 0 rows")."""
    if total is None:
        return f"resuming: {plural(done, 'row')} scored before" if done else "scoring"
    if done:
        return f"resuming at row {done:,}: {total - done:,} of {plural(total, 'row')} to score"
    return f"scoring {plural(total, 'row')}"


@contextlib.contextmanager
def show_progress(total: int | None) -> Iterator[Callable[[int], None]]:
    """A progress callback: a bar with rate and ETA on a terminal, plain periodic lines otherwise.

    It is told the rows done, first before anything is scored (a resume's rows done before), then as they are.
    """
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
            _bars.append(bar)
            task = bar.add_task("score", total=total, rate="")
            started, first = time.monotonic(), None

            def update(done: int) -> None:
                nonlocal first
                first = done if first is None else first
                rate = (done - first) / max(time.monotonic() - started, 1e-9)
                bar.update(task, completed=done, rate=f"{rate:,.0f} rows/s" if done > first else "")

            try:
                yield update
            finally:
                with contextlib.suppress(ValueError):
                    _bars.remove(bar)
        return
    began, last = time.monotonic(), 0.0
    start: int | None = None

    def line(done: int) -> None:
        nonlocal last, start
        now = time.monotonic()
        if start is None:  # the first call: before anything is scored, say what is about to be
            start, last = done, now
            stderr.print(_start(done, total), soft_wrap=True, markup=False)
            return
        if done == start or (now - last < PLAIN_PROGRESS_EVERY and done != total):
            return
        last = now
        rate = (done - start) / max(now - began, 1e-9)
        of = f"/{total}" if total is not None else ""
        eta = f", ETA {(total - done) / rate:,.0f} s" if total is not None and rate > 0 and done < total else ""
        stderr.print(f"scored {done}{of} rows, {rate:,.0f} rows/s{eta}", soft_wrap=True)

    yield line


def summary_table(verifiers: Mapping[str, VerifierTotals], rows: str) -> Table:
    """``engine score``'s figures: a row per verifier, titled by the ``rows`` they cover."""
    table = Table(title=f"per verifier, {rows}", title_justify="left")
    for name in ("kind", "verifier", "items", "mean reward", "p50 ms", "p99 ms", "retries"):
        table.add_column(name, justify="left" if name in ("kind", "verifier") else "right", overflow="fold")
    for key, totals in verifiers.items():
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


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def session_line(scored: int, rows: int, seconds: float) -> str:
    """What this run scored (``scored`` of the output's ``rows``) and how long it took."""
    took = _duration(seconds)
    if scored:
        return f"scored {plural(scored, 'row')} in {took} ({scored / max(seconds, 1e-9):,.0f} rows/s)"
    if rows:
        return f"scored no rows in {took}: all {rows:,} were scored before"
    return f"scored no rows in {took}: the input has none"


def _share(count: int, of: int) -> str:
    return f"{count:,} ({count / of:.1%})"


def rewards_summary(rewards: Rewards, rows: int) -> list[RenderableType]:
    """The distribution of the output's ``rows`` rewards: a line of figures, then a histogram over [0, 1] (left
    out when every reward is exactly 0.0 or 1.0: the line says it all)."""
    count = rewards.count
    if not count:
        return [f"rewards of {plural(rows, 'row')}: none recorded" if rows else "rewards: none (no rows)"]
    if count == rows:
        which = f"all {plural(rows, 'row')}" if rows > 1 else "the 1 row"
    else:  # a resume of a state an older version wrote: the rows it scored had no distribution kept
        which = f"{count:,} of the {plural(rows, 'row')} (those an older version scored before the resume not known)"
    line = (
        f"rewards of {which}: mean {rewards.mean:.4f}, exactly 0.0: {_share(rewards.zeros, count)}, exactly 1.0: "
        f"{_share(rewards.ones, count)}, min {rewards.low:g}, max {rewards.high:g}"
    )
    if rewards.zeros + rewards.ones == count:
        return [line]
    labels = [f"[{k / BINS:.1f}, {(k + 1) / BINS:.1f}{']' if k == BINS - 1 else ')'}" for k in range(BINS)]
    filled = [k for k, n in enumerate(rewards.bins) if n]
    bars = [("< 0", rewards.below)] if rewards.below else []
    if filled:  # the lowest bin with rewards to the highest, those between shown empty (the shape shows its gaps)
        bars += [(labels[k], rewards.bins[k]) for k in range(filled[0], filled[-1] + 1)]
    bars += [("> 1", rewards.above)] if rewards.above else []
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(justify="right")
    table.add_column()
    table.add_column(justify="right")
    most = max(n for _, n in bars)
    for label, n in bars:
        table.add_row(Text(label), Text("█" * max(1 if n else 0, round(HISTOGRAM_BAR * n / most)), style="cyan"),
                      f"{n:,} ({n / count:.0%})")
    return [line, table]


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
