"""What the ``engine`` command prints: its two consoles, the progress of a run, a backfill's summary, and the tables
of its figures."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TextIO

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from engine._backfill.rewards import BINS, Rewards
from engine._config import EngineConfig
from engine._core.report import VerifierTotals
from engine._errors import VerificationError
from engine._verifiers.plugin.worker_client import PluginError

__all__ = [
    "bench_table",
    "cause_line",
    "close_progress",
    "failure_details",
    "plural",
    "rewards_summary",
    "session_line",
    "show_progress",
    "stderr",
    "stdout",
    "summary_table",
    "window_lines",
]

PLAIN_PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
LOG_WIDTH = 200
HISTOGRAM_BAR = 40  # characters of the longest bar


def _width(stream: TextIO) -> int | None:
    """Off a terminal (CI, job logs) rich would fold tables to 80 columns; a log line may be long instead,
    unless ``COLUMNS`` says how wide (None: rich reads the terminal's width, or ``COLUMNS``)."""
    return None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else LOG_WIDTH


stdout = Console(highlight=False, width=_width(sys.stdout))
stderr = Console(stderr=True, highlight=False, width=_width(sys.stderr))


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


def summary_table(verifiers: Mapping[str, VerifierTotals], rows: str) -> Table:
    """``engine score``'s figures: a row per verifier, titled by the ``rows`` they cover."""
    table = Table(title=f"per verifier, {rows}", title_justify="left")
    # a judge's columns only when one spent: a run without rubrics reads as it always did
    tokens = any("total_tokens" in totals.spent for totals in verifiers.values())
    spend = any("spend" in totals.spent for totals in verifiers.values())
    names = ("kind", "verifier", "items", "mean reward", "p50 ms", "p99 ms", "retries")
    for name in (*names, *(["judge tokens"] if tokens else []), *(["spend"] if spend else [])):
        table.add_column(name, justify="left" if name in ("kind", "verifier") else "right", overflow="fold")
    for key, totals in verifiers.items():
        judged = [f"{totals.spent.get('total_tokens', 0):,.0f}"] if tokens else []
        judged += [f"{totals.spent.get('spend', 0):.6g}"] if spend else []
        table.add_row(
            Text(totals.kind),
            Text(key if totals.kind == "plugin" else totals.ref),  # a plugin's ref alone is ambiguous
            f"{totals.items:,}",
            f"{totals.mean_reward:.4f}",
            f"{totals.latency.percentile(50) * 1e3:.2f}",
            f"{totals.latency.percentile(99) * 1e3:.2f}",
            f"{totals.retries:,}",
            *judged,
        )
    return table


def window_lines(verifiers: Mapping[str, VerifierTotals], config: EngineConfig | None) -> list[str]:
    """A line per verifier whose adaptive window ended below its ceiling (``max_concurrency``): a quota's 429s
    shrank it, and how far."""
    lines = []
    for key, totals in verifiers.items():
        if totals.window is None or config is None:
            continue
        judge = config.judge
        ceiling = (judge.max_concurrency if judge is not None else None) if totals.kind == "rubric" else (
            config.limits_for(key).max_concurrency)
        if ceiling is not None and totals.window < ceiling:
            whose = f"the judge of {totals.ref}" if totals.kind == "rubric" else totals.ref
            lines.append(f"window: {whose} ended at {totals.window:,} of max_concurrency {ceiling:,} "
                         "(429s or 503s with Retry-After shrank it)")
    return lines


def _seconds(seconds: float | None) -> str:
    """A duration in the unit that reads best (us, ms, s), three figures at most: ``-`` for none."""
    if seconds is None or math.isnan(seconds):
        return "-"
    for scale, unit in ((1e6, "us"), (1e3, "ms")):
        if seconds * scale < 1000:
            return f"{_figures(seconds * scale)} {unit}"
    return f"{_figures(seconds)} s" if seconds < 1000 else f"{seconds:,.0f} s"


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


def _figures(value: float) -> str:
    return format(value, ".2f" if value < 10 else ".1f" if value < 100 else ".0f")


def _ms(ms: float | None) -> str:
    return _seconds(None if ms is None else ms / 1e3)


def _rate(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 100 else _figures(rate)


def _named(v: dict[str, Any]) -> str:
    return f"{v['kind']} {v['verifier']}"


# (header, cell) of each column; --wide shows them all, the default those named in NARROW
_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("kind", lambda v: v["kind"]),
    ("verifier", lambda v: v["verifier"]),
    ("items", lambda v: f"{v['items_all_runs']:,}"),
    ("items/s", lambda v: _rate(v["items_per_s"]["median"]) + ("*" if v["short_span"] else "")),
    ("min-max", lambda v: f"{_rate(v['items_per_s']['min'])}-{_rate(v['items_per_s']['max'])}"),
    ("active", lambda v: _seconds(v["active_s_all_runs"])),
    ("start-up", lambda v: f"{_ms(v['startup']['max_ms'])} ({v['startup']['calls']:,} calls)"
                           if v["startup"]["calls"] else "-"),
    ("p50", lambda v: _ms(v["latency_ms"]["p50"])),
    ("p95", lambda v: _ms(v["latency_ms"]["p95"])),
    ("p99", lambda v: _ms(v["latency_ms"]["p99"])),
    ("peak in flight", lambda v: f"{v['peak_in_flight']:,}"),
    ("mean in flight", lambda v: f"{v['mean_in_flight']:.1f}"),
    ("queued", lambda v: f"{v['waiting_share']:.0%}"),
    ("retries", lambda v: f"{v['retries']:,}"),
)
NARROW = ("kind", "verifier", "items", "items/s", "active", "p50", "p99")  # fits 100 columns


def bench_table(summary: dict[str, Any], *, wide: bool = False) -> None:
    """``engine bench``'s figures: what they count, a table of the verifiers (``wide``: every column), the
    bottleneck, warnings and hints, each one's latency histogram and judge usage, the runs' rates."""
    runs, verifiers = summary["runs"], summary["verifiers"]
    over = "the one run" if runs == 1 else f"all {runs} runs"
    floor = summary["min_span"]
    stdout.print(
        f"{runs} run{'s' if runs > 1 else ''} of {summary['items']:,} items. Items, active time, start-up, retries "
        f"and the histograms count {over}; items/s is the median run's, over the verifier's active time (first "
        "call's start to last call's end, per batch); latency is per item, calls that waited on start-up apart"
        + ("" if wide else " (--wide: every column)") + ".",
        markup=False,
    )
    table = Table()
    shown = [column for column in _COLUMNS if wide or column[0] in NARROW]
    for name, _ in shown:  # a header may wrap between its words, never inside one; a long URL folds in its cell
        justify: Literal["left", "right"] = "left" if name in ("kind", "verifier") else "right"
        table.add_column(name, justify=justify, overflow="fold", min_width=max(map(len, name.split())))
    for v in verifiers:
        table.add_row(*(Text(cell(v)) for _, cell in shown))
    if wide:  # at its own width, however narrow the terminal: folded to fit, its figures would break mid-number
        table.width = stdout.measure(table, options=stdout.options.update(max_width=10_000)).maximum
        stdout.print(table, crop=False)
    else:
        stdout.print(table)
    if (slowest := summary["bottleneck"]) is not None:
        stdout.print(_bottleneck_line(slowest, verifiers, summary["scoring_s_all_runs"]), markup=False)
    for v in verifiers:
        if v["short_span"]:
            stdout.print(
                f"* {_named(v)}: too short to measure a rate: active {_seconds(v['active_s']['median'])} over "
                f"{v['items']:,} items a run, under {_seconds(floor['seconds'])} or {floor['items']:,} items; "
                "bench a larger file",
                markup=False,
            )
    for v in verifiers:
        if (hint := v["process_hint"]) is not None:
            stdout.print(f"hint: {_named(v)}: {hint['says']}", markup=False)
    for v in verifiers:
        stdout.print(_histogram_title(v, over), markup=False)
        stdout.print(_histogram(v["histogram"]))
        usage = v["judge_usage"]
        if usage:
            stdout.print(
                f"judge usage of {v['verifier']} ({over}): {usage['requests']:,} requests ({usage['retries']:,} "
                f"retries), {usage['prompt_tokens']:,} prompt + {usage['completion_tokens']:,} completion = "
                f"{usage['total_tokens']:,} tokens",
                markup=False,
            )
    rate = summary["items_per_s"]
    each = ", ".join(f"{r:,.0f}" for r in rate["each"])
    short = (f"; * runs of {_seconds(summary['seconds']['median'])} are too short to measure a rate"
             if summary["short_span"] else "")
    stdout.print(
        f"overall {rate['median']:,.0f} items/s{'*' if short else ''}, median of {runs} run(s) (min "
        f"{rate['min']:,.0f}, max {rate['max']:,.0f}; reading the file included){short}; runs: {each}",
    )


def _bottleneck_line(slowest: dict[str, Any], verifiers: list[dict[str, Any]], scoring: float) -> str:
    """Which verifier bounds the batches (the one active longest: they end when it does), and how its calls
    spent their time: queued for a limit, or in the verifier."""
    v = next(v for v in verifiers if (v["kind"], v["verifier"]) == (slowest["kind"], slowest["verifier"]))
    others = sorted((o for o in verifiers if o is not v), key=lambda o: o["active_s_all_runs"], reverse=True)
    nxt = f"; the next, {_named(others[0])}, {_seconds(others[0]['active_s_all_runs'])}" if others else "; the only one"
    if v["waiting_share"] >= 0.5:  # most of its calls' time queued: a limit bounds it, not the verifier
        why = (f"its calls spent {v['waiting_share']:.0%} of their time queued for a limit (its max_concurrency "
               "or max_rate, the engine's cap, the judge's, a worker pool's)")
    else:
        why = (f"its calls spent {1 - v['waiting_share']:.0%} of their time in the verifier, "
               f"{v['mean_in_flight']:.1f} at once on average (at most {v['peak_in_flight']:,})")
    return (f"bottleneck: {_named(v)}: active longest, {_seconds(slowest['active_s'])} of the "
            f"{_seconds(scoring)} spent scoring ({slowest['share']:.0%}){nxt}; {why}")


def _histogram_title(v: dict[str, Any], over: str) -> str:
    startup = v["startup"]
    counted = sum(bucket["items"] for bucket in v["histogram"])
    said = f"latency per item, {_named(v)}: {counted:,} of {v['items_all_runs']:,} items ({over})"
    if startup["calls"]:
        said += (f"; {startup['items']:,} items in the {startup['calls']:,} calls that waited on start-up "
                 f"(the longest {_ms(startup['max_ms'])}) are start-up's")
    return said + ":"


def _histogram(buckets: list[dict[str, Any]]) -> Table:
    """A latency histogram: a row per non-empty log-scaled bucket, a bar for its share (its shape: a tail,
    two modes; a gap shows in the ranges)."""
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    most = max((bucket["items"] for bucket in buckets), default=0)
    total = sum(bucket["items"] for bucket in buckets)
    for bucket in buckets:
        if not (count := bucket["items"]):
            continue
        bar = "█" * max(1, round(HISTOGRAM_BAR * count / most))
        table.add_row(_range(bucket["low_ms"], bucket["high_ms"]), Text(bar, style="cyan"),
                      f"{count:,} ({count / total:.0%})")
    if not total:
        table.add_row("none after start-up", "", "")
    return table


def _range(low_ms: float, high_ms: float) -> str:
    """A bucket's bounds, ``1.41-2.00 ms``: the unit once when both read in it."""
    low, high = _ms(low_ms).split(), _ms(high_ms).split()
    return f"{low[0]}-{high[0]} {high[1]}" if low[1] == high[1] else f"{low[0]} {low[1]}-{high[0]} {high[1]}"
