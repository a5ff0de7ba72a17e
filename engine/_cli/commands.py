"""The ``engine`` command's commands: each parses its options, calls the engine's keyword-only functions,
and prints what they return (``engine._cli.render``); errors and signals end it as ``engine._cli.lifecycle`` says."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import click
import orjson
from rich.table import Table
from rich.text import Text

from engine._backfill.audit import audit as audit_file
from engine._backfill.audit import diff as diff_outputs
from engine._backfill.bench import DEFAULT_BATCH_SIZE, bench_file, summarise
from engine._backfill.checkpoint import Checkpoint, state_path
from engine._backfill.files import file_format
from engine._backfill.input import JSON_TEXT_COLUMNS, count_rows, json_columns
from engine._backfill.run import DEFAULT_CHUNK_SIZE, score_file
from engine._cache.store import Database, remove
from engine._check import check_environments
from engine._cli.audit import show_agreements
from engine._cli.lifecycle import (
    EXIT_BAD_INPUT,
    EXIT_DISAGREE,
    EXIT_IO,
    EXIT_VERIFICATION,
    Commands,
    fail,
    interrupted,
    outcome,
    run,
)
from engine._cli.render import (
    bench_table,
    failure_details,
    plural,
    rewards_summary,
    session_line,
    show_progress,
    stdout,
    summary_table,
    window_lines,
)
from engine._columns import Columns
from engine._config import load_config
from engine._environments.digest import digest_directory
from engine._environments.manifest import RUBRIC_REF
from engine._errors import CacheError, ResumeError, RubricError, VerificationError, WriteError
from engine._http.headers import token_problem
from engine._ray.plan import DEFAULT_BLOCK_ROWS
from engine._serve import limits as _limits
from engine._verifiers.rubric.registry import RubricRegistry

__all__ = ["cli"]

DEFAULT_CONFIG = "engine.toml"

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


traceback_option = click.option(
    "--traceback",
    "whole_traceback",
    is_flag=True,
    help="When a verifier fails, print the whole traceback of what it raised (a process plugin's as its worker "
    "formatted it), not only the plugin's own frames.",
)


def _columns(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, str] | None:
    try:
        return None if value is None else Columns.parse(value).mapping
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


columns_option = click.option(
    "--columns",
    "columns",
    metavar="FIELD=SOURCE,...",
    default=None,
    callback=_columns,
    help="Where each field of a row is read from, replacing [input.columns]: id, environment, trajectory, and task "
    "or task.KEY entries building it, each from a column or a dotted path into one "
    "(environment=data_source,task.reference=reward_model.ground_truth); a field not named: its own column.",
)


def _refuse_json_columns_for_jsonl(input_path: Path, json_text: frozenset[str]) -> None:
    if json_text and file_format(input_path) == "jsonl":
        fail(EXIT_BAD_INPUT, "--json-columns is for Parquet input: a JSON Lines file's values are JSON already")


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
    cls=Commands,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 done, 1 a verification error aborted the run, 2 bad usage, config or input, "
    "3 the output or its state could not be written (disk full), 4 engine audit or diff: rewards disagree, "
    "70 an internal error (a bug: please report it), "
    "130 interrupted, 143 terminated (SIGTERM).",
)
def cli() -> None:
    """Score rollouts with rubric, plugin and endpoint verifiers: one reward per item, or one error."""


@cli.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Rewards file: .jsonl or .parquet. Written only when complete. With --ray: a directory.")
@config_option
@click.option("--resume", is_flag=True, help="Continue an interrupted or failed run from its last checkpoint.")
@click.option("--restart", is_flag=True,
              help="Start over: discard an unfinished run's checkpoint and partial file for OUTPUT and score every "
              "row (what a resume refused for a verifier that changed needs). Not with --ray.")
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
@traceback_option
@columns_option
def score(input_path: Path, output: Path, config_path: Path, resume: bool, restart: bool, chunk_size: int | None,
          on_ray: bool,
          address: str | None, actors: int | None, url: str | None, token_env: str | None,
          json_text: frozenset[str], whole_traceback: bool, columns: dict[str, str] | None) -> None:
    """Backfill rewards for a file of stored trajectories (JSON Lines or Parquet)."""
    ray_only = {"--address": address, "--actors": actors, "--url": url, "--token-env": token_env}
    if resume and restart:
        fail(EXIT_BAD_INPUT, "--resume and --restart: give one (--restart discards what --resume would continue)")
    if on_ray and restart:
        fail(EXIT_BAD_INPUT, "--restart is not for --ray: write to a new output directory instead")
    if on_ray:
        _score_on_ray(input_path, output, config_path, resume, chunk_size or DEFAULT_BLOCK_ROWS, address, actors, url,
                      token_env, json_text, whole_traceback, columns)
        return
    _refuse_json_columns_for_jsonl(input_path, json_text)
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    if given := [name for name, value in ray_only.items() if value is not None]:
        fail(EXIT_BAD_INPUT, f"{', '.join(given)} go(es) with --ray")
    if output.is_dir():
        fail(EXIT_BAD_INPUT, f"{output} is a directory: the output is a .jsonl or .parquet file (a directory: --ray)")
    try:
        config = load_config(config_path)
        cleanup_only = resume and _only_cleanup_left(output)  # the input is neither needed nor read then
        if not cleanup_only and not input_path.is_file():
            fail(EXIT_BAD_INPUT, f"{input_path}: no such input file")
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(EXIT_IO, f"cannot create {output.parent}: {exc.strerror or exc}")
        with show_progress(None if cleanup_only else count_rows(input_path)) as progress:
            summary = run(
                lambda: score_file(
                    input_path=input_path,
                    output=output,
                    config=config,
                    resume=resume,
                    chunk_size=chunk_size,
                    progress=progress,
                    json_columns=json_text,
                    columns=columns,
                    restart=restart,
                ),
                kept=lambda: _kept(output),
                whole=whole_traceback,
            )
    except KeyboardInterrupt:  # before or after the run itself (run() reports one during it)
        interrupted(f"; {_kept(output)}")
    if summary.already_finished:
        stdout.print(
            f"the run had already finished: {summary.output} was complete; removed what it had left", soft_wrap=True
        )
    stdout.print(summary_table(summary.verifiers, f"all {plural(summary.rows, 'row')}"))
    for line in window_lines(summary.verifiers, config):
        stdout.print(line, soft_wrap=True, markup=False)
    for part in rewards_summary(summary.rewards, summary.rows):
        stdout.print(part, soft_wrap=True, markup=False)
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
    stdout.print(session_line(summary.rows - summary.resumed_at, summary.rows, summary.elapsed), soft_wrap=True)
    resumed = f" (resumed at row {summary.resumed_at:,})" if summary.resumed_at and not summary.already_finished else ""
    stdout.print(f"{plural(summary.rows, 'reward')} written to {summary.output}{resumed}", soft_wrap=True,
                 markup=False)


def _token(variable: str | None) -> str | None:
    """The bearer token ``--token-env`` names (``engine serve``'s, or the one a ``--url`` service asks for)."""
    if variable is None:
        return None
    token = os.environ.get(variable)
    if not token:
        fail(EXIT_BAD_INPUT, f"--token-env {variable}: the variable is not set or empty")
    if problem := token_problem(token):
        fail(EXIT_BAD_INPUT, f"--token-env {variable}: the token {problem}")
    return token


def _score_on_ray(input_path: Path, output: Path, config_path: Path, resume: bool, block_rows: int,
                  address: str | None, actors: int | None, url: str | None, token_env: str | None,
                  json_text: frozenset[str], whole_traceback: bool, columns: dict[str, str] | None) -> None:
    """``engine score --ray``: :func:`engine._ray.run.backfill`, with the single-machine command's errors and exits."""
    from engine._ray.run import DEFAULT_ACTORS, backfill  # Ray itself is imported only once a run starts

    token = _token(token_env)
    config = load_config(config_path) if url is None or config_path.is_file() else None
    kept = f"parts committed so far are kept in {output}: run the same command with --resume to continue"
    try:
        with show_progress(None) as progress:
            summary = backfill(input_path, output, config, resume=resume, actors=actors or DEFAULT_ACTORS, url=url,
                               token=token, address=address, block_rows=block_rows, progress=progress,
                               json_columns=json_text, columns=columns)
    except KeyboardInterrupt:
        interrupted(f"; {kept}")
    except WriteError as exc:
        fail(EXIT_IO, f"{exc}; {kept}")
    except VerificationError as exc:  # said as the single-machine run's is: what is kept, --resume, --traceback
        fail(*(outcome(exc, lambda: f"; {kept}", whole=whole_traceback) or (EXIT_VERIFICATION, str(exc))))
    if summary.already_complete:
        stdout.print(f"{output} is already complete ({plural(summary.rows, 'row')}): nothing to do", soft_wrap=True,
                     markup=False)
        return
    if summary.rescored:
        count = len(summary.rescored)
        shown = ", ".join(summary.rescored[:5]) + (f" and {count - 5:,} more" if count > 5 else "")
        stdout.print(f"re-scored {count:,} part{'s' if count > 1 else ''} that {'were' if count > 1 else 'was'} "
                     f"not whole (cut short or overwritten since committed): {shown}", soft_wrap=True)
    scored = summary.rows - summary.resumed_at
    # the parts committed before this run kept no figures of their verifiers: the table covers this run's rows
    covered = f"all {plural(scored, 'row')}" if scored == summary.rows else f"the {plural(scored, 'row')} of this run"
    stdout.print(summary_table(summary.verifiers, covered))
    for line in window_lines(summary.verifiers, config):
        stdout.print(line, soft_wrap=True, markup=False)
    for part in rewards_summary(summary.rewards, summary.rows):
        stdout.print(part, soft_wrap=True, markup=False)
    stdout.print(session_line(scored, summary.rows, summary.elapsed), soft_wrap=True)
    resumed = f" (resumed at {summary.resumed_at:,} rows committed)" if summary.resumed_at else ""
    stdout.print(f"{plural(summary.rows, 'reward')} written to {output} in {plural(summary.blocks, 'part')}{resumed}",
                 soft_wrap=True, markup=False)


@cli.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False, path_type=Path))
@config_option
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="Passes over the file.")
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH_SIZE, show_default=True,
              help="Rows scored per batch, as a trainer's step would.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
@click.option("--wide", is_flag=True, help="Every column of the table (the default fits 100 columns).")
@json_columns_option
@traceback_option
@columns_option
def bench(input_path: Path, config_path: Path, repeat: int, batch_size: int, as_json: bool, wide: bool,
          json_text: frozenset[str], whole_traceback: bool, columns: dict[str, str] | None) -> None:
    """Measure each verifier on a file of stored trajectories, writing no rewards."""
    _refuse_json_columns_for_jsonl(input_path, json_text)
    config = load_config(config_path)
    if not input_path.is_file():
        fail(EXIT_BAD_INPUT, f"{input_path}: no such input file")
    runs = run(lambda: bench_file(input_path=input_path, config=config, repeat=repeat, batch_size=batch_size,
                                   json_columns=json_text, columns=columns), whole=whole_traceback)
    summary = summarise(runs)
    if as_json:
        click.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
        return
    bench_table(summary, wide=wide)


tolerance_option = click.option(
    "--tolerance", type=click.FloatRange(min=0), default=0.0, show_default=True,
    help="The largest difference between two rewards that still agrees (0: exactly equal); beyond it, exit 4.")


@cli.command()
@click.argument("output", metavar="OUTPUT", type=click.Path(path_type=Path))
@click.option("--input", "input_path", metavar="INPUT", type=click.Path(dir_okay=False, path_type=Path),
              required=True, help="The input OUTPUT was scored from: each sampled row is found in it by its id.")
@config_option
@click.option("--sample", type=click.IntRange(min=1), default=None,
              help="Rows to draw (every row when OUTPUT has fewer) [default: 100].")
@click.option("--fraction", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="A share of OUTPUT's rows to draw instead of --sample (at least one).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the draw: the same seed, the same rows.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Times each sampled row is scored; above 1 the spread of its rewards is the noise floor.")
@tolerance_option
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
@json_columns_option
@traceback_option
@columns_option
def audit(output: Path, input_path: Path, config_path: Path, sample: int | None, fraction: float | None, seed: int,
          repeat: int, tolerance: float, as_json: bool, json_text: frozenset[str], whole_traceback: bool,
          columns: dict[str, str] | None) -> None:
    """Score a seeded sample of a stored output again and compare, per verifier; exit 4 if one disagrees."""
    if sample is not None and fraction is not None:
        fail(EXIT_BAD_INPUT, "--sample and --fraction: give one")
    _refuse_json_columns_for_jsonl(input_path, json_text)
    config = load_config(config_path)
    if not input_path.is_file():
        fail(EXIT_BAD_INPUT, f"{input_path}: no such input file")
    report = run(lambda: audit_file(output, input=input_path, config=config, sample=sample, fraction=fraction,
                                    seed=seed, repeat=repeat, tolerance=tolerance, json_columns=json_text,
                                    columns=columns), whole=whole_traceback)
    show_agreements(report, as_json=as_json)
    if not report.agrees:
        raise SystemExit(EXIT_DISAGREE)


@cli.command()
@click.argument("a", metavar="A", type=click.Path(path_type=Path))
@click.argument("b", metavar="B", type=click.Path(path_type=Path))
@click.option("--by", type=click.Choice(["id", "position"]), default="id", show_default=True,
              help="Match the records by id (a repeated id by its occurrence), or record by record.")
@tolerance_option
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def diff(a: Path, b: Path, by: str, tolerance: float, as_json: bool) -> None:
    """Compare two outputs of the same input per verifier (B as the new side); exit 4 if one disagrees."""
    report = diff_outputs(a, b, by=by, tolerance=tolerance)
    show_agreements(report, as_json=as_json)
    if not report.agrees:
        raise SystemExit(EXIT_DISAGREE)


@cli.command()
@config_option
@traceback_option
def check(config_path: Path, whole_traceback: bool) -> None:
    """Load every environment and report whether each can score; exit 1 if any cannot."""
    config = load_config(config_path)
    checks = run(lambda: check_environments(config=config), whole=whole_traceback)
    table = Table()
    for name in ("environment", "kind", "ref", "manifest", "digest", "verifier", "ok"):
        table.add_column(name, overflow="fold")
    for row in checks:
        cells = (row.environment, row.kind, row.ref, row.manifest, row.digest, row.verifier)
        mark = Text("yes", style="green") if row.ok else Text("NO", style="bold red")
        table.add_row(*map(Text, cells), mark)
    stdout.print(table)
    for row in checks:  # where each plugin that failed failed, under the table (its cells fold)
        if row.error is not None and (details := failure_details(row.error, whole_traceback)):
            stdout.print(f"{row.environment}: " + "\n  ".join(details), markup=False, soft_wrap=True)
    for row in checks:
        if row.hint is not None:
            stdout.print(f"hint: {row.environment}: {row.hint.says()}", markup=False, soft_wrap=True)
    pins = [f'{row.environment} = "{row.digest_now}"' for row in checks if row.digest_now]
    if pins:  # whole lines, to copy under [pins] once the code is vetted (the table folds them)
        stdout.print("digests to pin under [pins], after vetting:\n" + "\n".join(pins), markup=False, soft_wrap=True)
    failed = [row.environment for row in checks if not row.ok]
    if failed:
        fail(EXIT_VERIFICATION, f"{len(failed)} of {plural(len(checks), 'environment')} cannot score: "
             f"{', '.join(failed)}")
    stdout.print(f"all {plural(len(checks), 'environment')} can score" if len(checks) != 1
                 else "the 1 environment can score")


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
        fail(EXIT_BAD_INPUT, exc.reason)
    except ValueError as exc:
        if RUBRIC_REF.fullmatch(ref):
            raise  # a well-formed ref: not the user's mistake
        fail(EXIT_BAD_INPUT, str(exc))  # the user's ref is malformed (resolve says how)
    lo, hi = rubric.scale
    stdout.print(f"# {rubric.ref}  scale [{lo:g}, {hi:g}]  {rubric.digest}", markup=False)
    stdout.print(rubric.text, markup=False)


@cli.group()
def cache() -> None:
    """The judge's verdict cache ([cache] in the config): what it holds, and clearing it."""


def _cache_database(config_path: Path) -> Database:
    """The config's cache file, opened; exit 2 if the config has no [cache] (``CacheError`` if it is not one)."""
    config = load_config(config_path)
    if config.cache is None:
        fail(EXIT_BAD_INPUT, f"{config_path}: has no [cache] table, so no verdicts are kept (add [cache] path = ...)")
    return Database(config.cache.path, busy_timeout=config.cache.busy_timeout)


@cache.command("stats")
@config_option
def cache_stats(config_path: Path) -> None:
    """Entries, bytes, and per verifier key the entries and the hits served from them."""
    database = _cache_database(config_path)
    try:
        stats = database.stats()
    finally:
        database.close()
    stdout.print(f"{stats.path}: {plural(stats.entries, 'verdict')}, {stats.bytes:,} bytes", markup=False)
    for key, (entries, hits) in stats.verifiers.items():
        stdout.print(f"  {key}  {plural(entries, 'verdict')}, {plural(hits, 'hit')}", markup=False)


@cache.command("clear")
@config_option
@click.option("--verifier", "verifier_key", metavar="KEY", default=None,
              help="Only this verifier's verdicts (a rubric's owner/name) [default: every verdict].")
def cache_clear(config_path: Path, verifier_key: str | None) -> None:
    """Delete the cache's verdicts (all, or one verifier's); a cache of another schema version is made anew."""
    config = load_config(config_path)
    try:
        database = _cache_database(config_path)
    except CacheError as exc:
        # a file the engine did not make may be someone's data: never deleted; one verifier's verdicts cannot
        # be told apart in a cache of another version
        if not exc.ours or verifier_key is not None:
            raise
        assert config.cache is not None  # _cache_database refused a config without one
        remove(config.cache.path)
        database = _cache_database(config_path)
        stdout.print(f"{config.cache.path}: was a verdict cache of another version ({exc.reason}): made anew",
                     markup=False)
        database.close()
        return
    try:
        deleted = database.clear(verifier_key)
    finally:
        database.close()
    which = "" if verifier_key is None else f" of {verifier_key}"
    stdout.print(f"{database.path}: {plural(deleted, 'verdict')}{which} deleted", markup=False)


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
    from engine._serve.server import log_to_stderr  # uvicorn: imported by this command only
    from engine._serve.server import serve as run_service

    token = _token(token_env)
    try:
        settings = _limits.ServeConfig(host=host, port=port, token=token, environment=environment,
                                       max_items=max_items, max_bytes=max_bytes, max_queued=max_queued,
                                       graceful_timeout=graceful_timeout, gather_items=gather_items,
                                       head_timeout=head_timeout, keep_alive=keep_alive, body_timeout=body_timeout,
                                       max_connections=max_connections)
    except ValueError as exc:
        fail(EXIT_BAD_INPUT, str(exc))
    config = load_config(config_path)
    log_to_stderr()
    stopped_by = run(lambda: run_service(config, settings))
    if signal.SIGINT in stopped_by:
        interrupted()


@cli.group()
def adapters() -> None:
    """Trainer adapters (engine.adapters): the files a trainer loads by their path."""


@adapters.command("openrlhf-path")
def adapters_openrlhf_path() -> None:
    """Print the path of OpenRLHF's adapter file, the value of --reward.remote_url."""
    click.echo(Path(__file__).resolve().parents[1] / "adapters" / "openrlhf.py")
