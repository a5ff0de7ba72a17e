"""The command line: a thin layer that parses options, calls keyword-only functions, and reports.

Exit codes (also in ``engine --help``):

* 0 ``EXIT_OK``: done;
* 1 ``EXIT_VERIFICATION``: a verification error aborted the run (``engine check``: a check failed);
* 2 ``EXIT_BAD_INPUT``: bad usage, config, manifest, input, or an output that cannot be resumed;
* 3 ``EXIT_IO``: the output or its state could not be written (disk full, I/O error);
* 70 ``EXIT_INTERNAL``: a bug in the engine: an exception none of its own errors (``engine._errors``),
  reported with its traceback, never as bad input (:func:`_outcome` draws that line);
* 130 ``EXIT_INTERRUPTED``: interrupted (Ctrl-C);
* 143 ``EXIT_TERMINATED``: stopped by SIGTERM.

A backfill stopped by any of these keeps its checkpoint, releases its lock, and says in one
``error:`` line what happened and how to continue (``--resume``). SIGINT and SIGTERM are handled
by :func:`main`, the entry point of the CLI's own process (a run is stopped by cancelling it from
its event loop, see :func:`_on_signal`); the library itself installs no signal handler.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import anyio
import click
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from engine._backfill.bench import DEFAULT_BATCH_SIZE, bench_file, summarise
from engine._backfill.checkpoint import Checkpoint, state_path
from engine._backfill.files import file_format
from engine._backfill.input import JSON_TEXT_COLUMNS, count_rows, json_columns
from engine._backfill.run import DEFAULT_CHUNK_SIZE, RunSummary, score_file
from engine._check import check_environments
from engine._config import load_config
from engine._environments.digest import digest_directory
from engine._environments.manifest import RUBRIC_REF
from engine._errors import EngineError, ResumeError, RubricError, VerificationError, WriteError
from engine._http.headers import token_problem
from engine._ray.plan import DEFAULT_BLOCK_ROWS
from engine._serve import limits as _limits
from engine._verifiers.rubric.registry import RubricRegistry

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_IO",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_VERIFICATION",
    "cli",
    "main",
]

EXIT_OK = 0
EXIT_VERIFICATION = 1
EXIT_BAD_INPUT = 2
EXIT_IO = 3
EXIT_INTERNAL = 70  # EX_SOFTWARE of sysexits.h: an internal software error
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process the signal ended
PLAIN_PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
DEFAULT_CONFIG = "engine.toml"
LOG_WIDTH = 200
# seconds the threads still running when a command is done get to end by themselves (anyio's idle
# workers end as soon as its loop does); a plugin call abandoned at its timeout never will
THREADS_GRACE = 1.0

T = TypeVar("T")

# Off a terminal (CI, job logs) rich would fold tables to 80 columns; a log line may be long instead.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else LOG_WIDTH)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else LOG_WIDTH)

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_CONFIG,
    show_default=True,
    help="The engine's TOML config.",
)


def _json_columns(ctx: click.Context, param: click.Parameter, value: str | None) -> frozenset[str]:
    try:
        return json_columns(value.split(",")) if value else frozenset()
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


json_columns_option = click.option(
    "--json-columns",
    "json_text",
    metavar=",".join(JSON_TEXT_COLUMNS),
    default=None,
    callback=_json_columns,
    help="Parquet input: these columns hold JSON text, decoded for the plugin (as are those the file's "
    "engine.json_columns metadata lists, and a text task); any other text reaches it as text.",
)


def _refuse_json_columns_for_jsonl(input_path: Path, json_text: frozenset[str]) -> None:
    if json_text and file_format(input_path) == "jsonl":
        _fail(EXIT_BAD_INPUT, "--json-columns is for Parquet input: a JSON Lines file's values are JSON already")


def _fail(code: int, message: str) -> NoReturn:
    stderr.print(Text("error: ", style="bold red") + Text(message), soft_wrap=True)
    sys.exit(code)


class _Signals:
    """How this process is stopping: whether SIGINT (Ctrl-C) or SIGTERM was received (:func:`_on_signal`,
    installed by :func:`main` only), which came first, and whether the interrupt was reported
    (:func:`_interrupted`). ``stop`` is set while :func:`_run` runs: it stops the run from its event loop."""

    received = False
    terminated = False
    reported = False
    stop: Callable[[], None] | None = None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Stop on SIGINT or SIGTERM: the run unwinds, keeps its checkpoint and releases its lock; then say which.

    During a run the run's own cancel scope is cancelled, from its event loop: the cancellation
    then goes through anyio's task groups and worker threads as any cancellation does. An
    exception raised here instead would land wherever the main thread happens to be (inside a task
    group, between a thread's result and its caller) and come out as a traceback. Outside a run
    (reading the config, counting rows) plain code runs: KeyboardInterrupt unwinds it. Signals
    after the first change nothing: the process is already stopping.
    """
    if _Signals.received:
        return
    _Signals.received = True
    _Signals.terminated = signum == signal.SIGTERM
    if _Signals.stop is not None:
        _Signals.stop()
        return
    raise KeyboardInterrupt


def _noted() -> None:
    """A run's ``stop`` while its loop is not running yet or no more: the run checks ``received`` itself."""


def _interrupted(after: str = "") -> NoReturn:
    _Signals.reported = True
    if _Signals.terminated:
        _fail(EXIT_TERMINATED, "terminated (SIGTERM)" + after)
    _fail(EXIT_INTERRUPTED, "interrupted (Ctrl-C)" + after)


async def _stoppable(fn: Callable[[], Awaitable[T]], result: list[T]) -> None:
    """Run ``fn`` in a cancel scope that a signal cancels (through ``_Signals.stop``); append what it returns."""
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:

        def stop() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the run is over anyway
                loop.call_soon_threadsafe(scope.cancel)  # safe from a signal handler, and wakes the loop up

        _Signals.stop = stop
        try:
            if _Signals.received:  # a signal came while the loop was starting
                scope.cancel()
            result.append(await fn())
        finally:
            _Signals.stop = _noted


def _run(fn: Callable[[], Awaitable[T]], kept: Callable[[], str] | None = None) -> T:
    """Run ``fn`` on an asyncio loop, turning the engine's errors into messages and exit codes.

    ``kept`` says, after a run stopped by an interrupt or a write error, what it kept and how to go on.
    Once a signal was received, whatever ends the run (cancellation, or an error or exception group
    the cancellation caused) is reported as that signal, in one line.
    """
    result: list[T] = []

    def after() -> str:
        return f"; {kept()}" if kept is not None else ""

    _Signals.stop = _noted
    try:
        try:
            anyio.run(_stoppable, fn, result, backend="asyncio")
        finally:
            _Signals.stop = None
    except BaseException as exc:
        if _Signals.received or isinstance(exc, KeyboardInterrupt):
            _interrupted(after())
        known = _outcome(exc, after)
        if known is None:
            raise  # a bug: the command group reports it (_Commands)
        _fail(*known)
    if _Signals.received or not result:
        _interrupted(after())
    return result[0]


def _outcome(exc: BaseException, after: Callable[[], str] | None = None) -> tuple[int, str] | None:
    """The exit code and ``error:`` message of one of the engine's own errors; None for any other exception.

    Only an error the engine raises on purpose (``engine._errors``) says something about the
    user's input, config, verifiers or disk. The misuse a user's input can cause is turned into
    one of them where the input is read (a bad row: ``InputError``, by its line); a ``ValueError``
    or ``TypeError`` from anywhere else is a bug in the engine and must not read as bad input.
    ``after`` says, for a write error, what the run kept and how to go on.
    """
    if isinstance(exc, VerificationError):
        lines = [str(exc)]
        if exc.__cause__ is not None:
            lines.append(f"cause: {type(exc.__cause__).__name__}: {exc.__cause__}")
        lines += getattr(exc, "__notes__", [])
        return EXIT_VERIFICATION, "\n  ".join(lines)
    if isinstance(exc, WriteError):
        return EXIT_IO, f"{exc}{after() if after is not None else ''}"
    if isinstance(exc, EngineError):
        return EXIT_BAD_INPUT, str(exc)
    return None


def _internal(exc: Exception) -> NoReturn:
    """Report a bug: the traceback, then one ``error:`` line that says it is one; exit 70."""
    sys.stderr.write("".join(traceback.format_exception(exc)))
    sys.stderr.flush()
    _fail(EXIT_INTERNAL, f"internal error (a bug in engine, not in your input): {type(exc).__name__}: {exc}")


class _Commands(click.Group):
    """The ``engine`` command group: an exception none of its commands handled gets its exit code (:func:`_outcome`),
    or, if it is not one of the engine's own errors, is reported as a bug (:func:`_internal`).

    Here rather than in :func:`main`, so that it holds however the group is invoked (``engine``,
    ``python -m engine``, click's test runner).
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors and the like, reported by click
        except Exception as exc:
            known = _outcome(exc)  # one of the engine's own errors, raised outside a run
            if known is None:
                _internal(exc)
            _fail(*known)


def _kept(output: Path) -> str:
    """What a stopped ``engine score`` run left for ``output``, and how to continue it."""
    state = state_path(output)
    if not state.exists():
        if output.exists():
            return f"{output} is complete"
        return "nothing was checkpointed yet: run the same command again"
    try:
        checkpoint = Checkpoint.load(state)
    except ResumeError:
        return f"{state} is kept: run the same command with --resume to continue"
    if checkpoint.finished is not None:
        return f"{output} was complete: run the same command with --resume to finish cleaning up"
    return f"{checkpoint.rows_done:,} rows are checkpointed: run the same command with --resume to continue"


def _only_cleanup_left(output: Path) -> bool:
    """Whether ``output`` looks complete and its state says its run finished: a resume then reads no input.

    A first look only: the resume itself checks the output against the state.
    """
    try:
        return Checkpoint.load(state_path(output)).finished is not None and output.is_file()
    except ResumeError:
        return False


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 done, 1 a verification error aborted the run, 2 bad usage, config or input, "
    "3 the output or its state could not be written (disk full), 70 an internal error (a bug: please report it), "
    "130 interrupted, 143 terminated (SIGTERM).",
)
def cli() -> None:
    """Score rollouts with rubric, plugin and endpoint verifiers: one reward per item, or one error."""


@contextlib.contextmanager
def _progress(total: int | None) -> Iterator[Callable[[int], None]]:
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


def _summary_table(summary: RunSummary) -> Table:
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


@cli.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Rewards file: .jsonl or .parquet. Written only when complete. With --ray: a directory.")
@config_option
@click.option("--resume", is_flag=True, help="Continue an interrupted or failed run from its last checkpoint.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help=f"Rows per batch and per checkpoint (at most this many are scored again on resume) "
              f"[default: {DEFAULT_CHUNK_SIZE}; with --ray, rows per block: {DEFAULT_BLOCK_ROWS}].")
@click.option("--ray", "on_ray", is_flag=True,
              help="Score on Ray Data: INPUT a file, directory or glob; OUTPUT a directory of Parquet parts.")
@click.option("--address", default=None, help="With --ray: the Ray cluster (default: RAY_ADDRESS, else a local Ray).")
@click.option("--actors", type=click.IntRange(min=1), default=None,
              help="With --ray: actors, one engine each; each verifier's limits are split over them [default: 2].")
@click.option("--url", default=None, help="With --ray: every actor scores through this `engine serve` instead.")
@click.option("--token-env", metavar="NAME", default=None, help="With --url: variable holding the service's token.")
@json_columns_option
def score(input_path: Path, output: Path, config_path: Path, resume: bool, chunk_size: int | None, on_ray: bool,
          address: str | None, actors: int | None, url: str | None, token_env: str | None,
          json_text: frozenset[str]) -> None:
    """Backfill rewards for a file of stored trajectories (JSON Lines or Parquet)."""
    ray_only = {"--address": address, "--actors": actors, "--url": url, "--token-env": token_env}
    if on_ray:
        _score_on_ray(input_path, output, config_path, resume, chunk_size or DEFAULT_BLOCK_ROWS, address, actors, url,
                      token_env, json_text)
        return
    _refuse_json_columns_for_jsonl(input_path, json_text)
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    if given := [name for name, value in ray_only.items() if value is not None]:
        _fail(EXIT_BAD_INPUT, f"{', '.join(given)} go(es) with --ray")
    if output.is_dir():
        _fail(EXIT_BAD_INPUT, f"{output} is a directory: the output is a .jsonl or .parquet file (a directory: --ray)")
    try:
        config = load_config(config_path)
        cleanup_only = resume and _only_cleanup_left(output)  # the input is neither needed nor read then
        if not cleanup_only and not input_path.is_file():
            _fail(EXIT_BAD_INPUT, f"{input_path}: no such input file")
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _fail(EXIT_IO, f"cannot create {output.parent}: {exc.strerror or exc}")
        with _progress(None if cleanup_only else count_rows(input_path)) as progress:
            summary = _run(
                lambda: score_file(
                    input_path=input_path,
                    output=output,
                    config=config,
                    resume=resume,
                    chunk_size=chunk_size,
                    progress=progress,
                    json_columns=json_text,
                ),
                kept=lambda: _kept(output),
            )
    except KeyboardInterrupt:  # before or after the run itself (_run reports one during it)
        _interrupted(f"; {_kept(output)}")
    if summary.already_finished:
        stdout.print(
            f"the run had already finished: {summary.output} was complete; removed what it had left", soft_wrap=True
        )
    stdout.print(_summary_table(summary))
    if summary.repeated_ids is None:
        stdout.print("repeated ids: not counted (the run was finished by an older version)")
    elif summary.repeated_ids:
        stdout.print(
            f"repeated ids: {summary.repeated_ids:,} rows have an id an earlier row had "
            f"({summary.ids_repeated:,} distinct ids occur more than once)",
            soft_wrap=True,
        )
    else:
        stdout.print("repeated ids: none")
    resumed = f" (resumed at row {summary.resumed_at:,})" if summary.resumed_at and not summary.already_finished else ""
    stdout.print(f"{summary.rows:,} rewards written to {summary.output}{resumed}", soft_wrap=True)


def _token(variable: str | None) -> str | None:
    """The bearer token ``--token-env`` names (``engine serve``'s, or the one a ``--url`` service asks for)."""
    if variable is None:
        return None
    token = os.environ.get(variable)
    if not token:
        _fail(EXIT_BAD_INPUT, f"--token-env {variable}: the variable is not set or empty")
    if problem := token_problem(token):
        _fail(EXIT_BAD_INPUT, f"--token-env {variable}: the token {problem}")
    return token


def _score_on_ray(input_path: Path, output: Path, config_path: Path, resume: bool, block_rows: int,
                  address: str | None, actors: int | None, url: str | None, token_env: str | None,
                  json_text: frozenset[str]) -> None:
    """``engine score --ray``: :func:`engine._ray.run.backfill`, with the single-machine command's errors and exits."""
    from engine._ray.run import DEFAULT_ACTORS, backfill  # Ray itself is imported only once a run starts

    token = _token(token_env)
    config = load_config(config_path) if url is None or config_path.is_file() else None
    kept = f"parts committed so far are kept in {output}: run the same command with --resume to continue"
    try:
        with _progress(None) as progress:
            summary = backfill(input_path, output, config, resume=resume, actors=actors or DEFAULT_ACTORS, url=url,
                               token=token, address=address, block_rows=block_rows, progress=progress,
                               json_columns=json_text)
    except KeyboardInterrupt:
        _interrupted(f"; {kept}")
    except WriteError as exc:
        _fail(EXIT_IO, f"{exc}; {kept}")
    if summary.already_complete:
        stdout.print(f"{output} is already complete ({summary.rows:,} rows): nothing to do", soft_wrap=True)
        return
    if summary.rescored:
        count = len(summary.rescored)
        shown = ", ".join(summary.rescored[:5]) + (f" and {count - 5:,} more" if count > 5 else "")
        stdout.print(f"re-scored {count:,} part{'s' if count > 1 else ''} that {'were' if count > 1 else 'was'} "
                     f"not whole (cut short or overwritten since committed): {shown}", soft_wrap=True)
    stdout.print(_summary_table(RunSummary(output, summary.rows, summary.resumed_at, summary.verifiers)))
    resumed = f" (resumed at {summary.resumed_at:,} rows committed)" if summary.resumed_at else ""
    stdout.print(f"{summary.rows:,} rewards written to {output} in {summary.blocks:,} parts{resumed}", soft_wrap=True)


@cli.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False, path_type=Path))
@config_option
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="Passes over the file.")
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH_SIZE, show_default=True,
              help="Rows scored per batch, as a trainer's step would.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
@json_columns_option
def bench(input_path: Path, config_path: Path, repeat: int, batch_size: int, as_json: bool,
          json_text: frozenset[str]) -> None:
    """Measure each verifier on a file of stored trajectories, writing no rewards."""
    _refuse_json_columns_for_jsonl(input_path, json_text)
    config = load_config(config_path)
    if not input_path.is_file():
        _fail(EXIT_BAD_INPUT, f"{input_path}: no such input file")
    runs = _run(lambda: bench_file(input_path=input_path, config=config, repeat=repeat, batch_size=batch_size,
                                   json_columns=json_text))
    summary = summarise(runs)
    if as_json:
        click.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
        return
    _bench_table(summary)


def _number(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _bench_table(summary: dict[str, Any]) -> None:
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


HISTOGRAM_BAR = 40  # characters of the longest bar


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


@cli.command()
@config_option
def check(config_path: Path) -> None:
    """Load every environment and report whether each can score; exit 1 if any cannot."""
    config = load_config(config_path)
    checks = _run(lambda: check_environments(config=config))
    table = Table()
    for name in ("environment", "kind", "ref", "manifest", "digest", "verifier", "ok"):
        table.add_column(name, overflow="fold")
    for row in checks:
        cells = (row.environment, row.kind, row.ref, row.manifest, row.digest, row.verifier)
        mark = Text("yes", style="green") if row.ok else Text("NO", style="bold red")
        table.add_row(*map(Text, cells), mark)
    stdout.print(table)
    for row in checks:
        if row.hint is not None:
            stdout.print(f"hint: {row.environment}: {row.hint.says()}", markup=False, soft_wrap=True)
    pins = [f'{row.environment} = "{row.digest_now}"' for row in checks if row.digest_now]
    if pins:  # whole lines, to copy under [pins] once the code is vetted (the table folds them)
        stdout.print("digests to pin under [pins], after vetting:\n" + "\n".join(pins), markup=False, soft_wrap=True)
    failed = [row.environment for row in checks if not row.ok]
    if failed:
        _fail(EXIT_VERIFICATION, f"{len(failed)} of {len(checks)} environments cannot score: {', '.join(failed)}")
    stdout.print(f"all {len(checks)} environments can score")


@cli.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def digest(directory: Path) -> None:
    """Print an environment directory's digest (the value to pin under [pins])."""
    click.echo(digest_directory(directory))  # a FIFO, a socket or a device in it: a DigestError, bad input


@cli.group(invoke_without_command=True)
@config_option
@click.pass_context
def rubrics(ctx: click.Context, config_path: Path) -> None:
    """List the rubrics and their versions."""
    ctx.obj = config_path  # a subcommand may be given its own --config, where users type it
    if ctx.invoked_subcommand is None:
        registry = RubricRegistry(load_config(config_path).rubrics)
        listing = registry.list()
        if not listing:
            stdout.print(f"no rubrics under {registry.root}")
        for ref, versions in sorted(listing.items()):
            stdout.print(f"{ref}  versions {', '.join(map(str, versions))} (latest {versions[-1]})")


@rubrics.command("show")
@click.argument("ref")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"The engine's TOML config (default: the one given to `rubrics`, else {DEFAULT_CONFIG}).")
@click.pass_obj
def rubrics_show(group_config: Path, ref: str, config_path: Path | None) -> None:
    """Print one rubric: owner/name (the latest version) or owner/name@N."""
    registry = RubricRegistry(load_config(config_path or group_config).rubrics)
    try:
        rubric = registry.resolve(ref)
    except RubricError as exc:
        _fail(EXIT_BAD_INPUT, exc.reason)
    except ValueError as exc:
        if RUBRIC_REF.fullmatch(ref):
            raise  # a well-formed ref: not the user's mistake
        _fail(EXIT_BAD_INPUT, str(exc))  # the user's ref is malformed (resolve says how)
    lo, hi = rubric.scale
    stdout.print(f"# {rubric.ref}  scale [{lo:g}, {hi:g}]  {rubric.digest}", markup=False)
    stdout.print(rubric.text, markup=False)


@cli.command()
@config_option
@click.option("--host", default=_limits.DEFAULT_HOST, show_default=True,
              help="Address to listen on; one that is not loopback needs --token-env.")
@click.option("--port", type=click.IntRange(0, 65535), default=_limits.DEFAULT_PORT, show_default=True)
@click.option("--token-env", metavar="NAME", default=None,
              help="Environment variable holding the bearer token every request must carry.")
@click.option("--environment", metavar="NAME", default=None,
              help="The environment /get_reward scores a label that is not an item in (its reference).")
@click.option("--max-items", type=click.IntRange(min=1), default=_limits.MAX_ITEMS, show_default=True,
              help="Items in one request; more is refused (413).")
@click.option("--max-bytes", type=click.IntRange(min=1), default=_limits.MAX_BYTES, show_default=True,
              help="Bytes of one request body; more is refused (413).")
@click.option("--max-queued", type=click.IntRange(min=1), default=_limits.MAX_QUEUED, show_default=True,
              help="Items admitted across requests; a batch that does not fit gets 503 with Retry-After.")
@click.option("--graceful-timeout", type=click.FloatRange(min=0), default=_limits.GRACEFUL_TIMEOUT,
              show_default=True, help="Seconds in-flight batches get to finish after SIGTERM.")
@click.option("--gather-items", type=click.IntRange(0, _limits.MAX_GATHERED), default=_limits.GATHER_ITEMS,
              show_default=True, help="Requests of at most this many plugin items share engine batches (0: none).")
@click.option("--head-timeout", type=click.FloatRange(min=0, min_open=True), default=_limits.HEAD_TIMEOUT,
              show_default=True, help="Seconds a connection has to send a request's line and headers.")
@click.option("--keep-alive", type=click.IntRange(min=1), default=_limits.KEEP_ALIVE, show_default=True,
              help="Seconds an idle kept-alive connection stays open.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=_limits.BODY_TIMEOUT,
              show_default=True, help="Seconds a request has to send its whole body (408 after).")
@click.option("--max-connections", type=click.IntRange(min=1), default=None,
              help="Connections open at most; past it, one waiting for a head (or idle) is closed.  "
                   f"[default: the open-file limit less {_limits.FILES_KEPT}]")
def serve(config_path: Path, host: str, port: int, token_env: str | None, environment: str | None, max_items: int,
          max_bytes: int, max_queued: int, graceful_timeout: float, gather_items: int, head_timeout: float,
          keep_alive: int, body_timeout: float, max_connections: int | None) -> None:
    """Serve one engine over HTTP to every process of a training job (POST /v1/score, /get_reward)."""
    from engine._serve.server import serve as run_service  # uvicorn: imported by this command only

    token = _token(token_env)
    try:
        settings = _limits.ServeConfig(host=host, port=port, token=token, environment=environment,
                                       max_items=max_items, max_bytes=max_bytes, max_queued=max_queued,
                                       graceful_timeout=graceful_timeout, gather_items=gather_items,
                                       head_timeout=head_timeout, keep_alive=keep_alive, body_timeout=body_timeout,
                                       max_connections=max_connections)
    except ValueError as exc:
        _fail(EXIT_BAD_INPUT, str(exc))
    config = load_config(config_path)
    # the service's log, on stderr: each failed batch at ERROR (the scheduler's "batch aborted" line, which a
    # trainer's user looks for beside its own traceback), and a bug answering a request (answered 500)
    logging.getLogger("engine").addHandler(logging.StreamHandler())
    stopped_by = _run(lambda: run_service(config, settings))
    if signal.SIGINT in stopped_by:
        _interrupted()


@cli.group()
def adapters() -> None:
    """Trainer adapters (engine.adapters): the files a trainer loads by their path."""


@adapters.command("openrlhf-path")
def adapters_openrlhf_path() -> None:
    """Print the path of OpenRLHF's adapter file, the value of --reward.remote_url."""
    click.echo(Path(__file__).resolve().parent / "adapters" / "openrlhf.py")


def main() -> None:
    """Entry point of the ``engine`` command: the process is the CLI's, so it handles SIGTERM (as Ctrl-C)."""
    try:
        _main()
    except SystemExit as exc:
        if _Signals.reported:
            # Interrupted, and said so: exit with our code now. A KeyboardInterrupt that went through
            # code compiled from a string (a dataclass or namedtuple being created, as imports do)
            # makes CPython end ``python -m engine`` by SIGINT whatever SystemExit says, so SIGTERM
            # would look like Ctrl-C. The run has already unwound (files closed, lock released).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.code if isinstance(exc.code, int) else EXIT_INTERRUPTED)
        if not _threads_left_running():
            raise
        # Done, and said so, but a plugin call abandoned at its timeout still runs in one of anyio's
        # worker threads, which are not daemons: the interpreter would wait for it at exit, for ever.
        # The exit handlers run (worker processes are killed), then the process ends with its code.
        code = _exit_status(exc.code)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _threads_left_running() -> bool:
    """Whether a thread the interpreter would wait for at exit is still running, after a short grace."""
    deadline = time.monotonic() + THREADS_GRACE
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:  # Ctrl-C while waiting for them: they are not worth waiting for
        return True
    return any(t is not threading.current_thread() and not t.daemon and t.is_alive() for t in threading.enumerate())


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` would end the process with: None is 0, anything but an int is printed and 1."""
    if code is None or isinstance(code, int):
        return code or EXIT_OK
    sys.stderr.write(f"{code}\n")
    return 1


def _main() -> None:
    try:
        signal.signal(signal.SIGTERM, _on_signal)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored: a background job, left so
            signal.signal(signal.SIGINT, _on_signal)
        # The CLI reports an abort itself, on stderr with its exit code; without a handler of its own
        # the engine logger's ERROR record would reach Python's last-resort handler and say it twice.
        logging.getLogger("engine").addHandler(logging.NullHandler())
        try:
            # Not standalone: click would report Ctrl-C as "Aborted!" with exit 1; it is ours to report.
            code = cli.main(prog_name="engine", standalone_mode=False)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            _interrupted()
        sys.exit(code if isinstance(code, int) else EXIT_OK)
    except KeyboardInterrupt:
        _interrupted()
