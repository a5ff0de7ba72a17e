"""``engine score``: rewards for a file of stored trajectories, streamed, checkpointed, resumable.

A chunk at a time, each scored as one batch and checkpointed: docs/design.md, Crash-safe finish.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from time import perf_counter
from typing import Any

import httpx
import orjson

from engine._backfill.checkpoint import Checkpoint, hold_lock, state_path
from engine._backfill.input import Row, RowDecoder, RowReader, named_environments, open_rows
from engine._backfill.parquet import verifier_identity
from engine._backfill.rewards import Rewards
from engine._backfill.writer import RewardWriter, discard_unfinished, open_output
from engine._check import check_ready
from engine._columns import Columns
from engine._config import EngineConfig
from engine._core.report import BatchResult, VerifierTotals, add_reports
from engine._core.scheduler import completions
from engine._core.threads import in_thread, wait_future
from engine._engine import Engine
from engine._errors import ManifestError, ResumeError, VerificationError

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "PROGRESS_EVERY",
    "RunSummary",
    "check_named",
    "check_provenances",
    "open_run",
    "score_chunks",
    "score_file",
]

DEFAULT_CHUNK_SIZE = 1024  # rows per batch and per checkpoint: at most this many are scored again on resume
PROGRESS_EVERY = 0.25  # seconds: inside a chunk, progress is told at most this often, as the verifiers' calls return

Progress = Callable[[int], None]  # told how many rows are done: as calls return, and after each chunk
Scored = Callable[[list[Row], BatchResult], None]  # told each chunk and its result, in input order


@dataclass
class RunSummary:
    """What ``score_file`` did: rows in the output (``rows``; ``resumed_at`` of them scored before a resume) and
    per-verifier totals over all of them, the seconds this run took, and the distribution of the output's rewards
    (``rewards``: of fewer rows than ``rows`` only when resuming the state of an older version, which had none).

    ``repeated_ids`` counts the rows whose ``id`` an earlier row already had (null ids aside) and
    ``ids_repeated`` the distinct ids that occur more than once, over the whole output; both are
    None when unknown (a run finished by an older version). ``already_finished``: the run had
    finished before this resume, which only removed what it had left.
    """

    output: Path
    rows: int
    resumed_at: int
    verifiers: dict[str, VerifierTotals]
    repeated_ids: int | None = None
    ids_repeated: int | None = None
    already_finished: bool = False
    elapsed: float = 0.0
    rewards: Rewards = field(default_factory=Rewards)


@contextlib.contextmanager
def open_run(
    input_path: str | Path,
    output: str | Path,
    *,
    resume: bool = False,
    json_columns: Collection[str] = (),
    columns: Columns | None = None,
    restart: bool = False,
) -> Iterator[tuple[RowReader, RewardWriter]]:
    """The rows still to score and the writer of their rewards, checked against each other.

    Fresh: the reader starts at the first row. Resumed: the writer is restored from its state,
    the reader skips the rows already done, and the run is refused (:class:`ResumeError`) if
    those rows differ from the ones the interrupted run read; if the run had already finished
    (``writer.already_finished``), the reader has nothing left to read and the input is not
    opened. Both are closed on exit; the run is complete only once the caller has called
    ``writer.finish()``. The run holds ``OUT.lock`` all along: a second run for the same output
    is refused (:class:`OutputError`) while it does. ``json_columns``: Parquet columns holding JSON
    text; ``columns``: where each field is read from (:func:`engine._backfill.input.open_rows`). ``restart``
    (not with ``resume``): an unfinished run's checkpoint and partial file are discarded, under the lock, first.
    """
    if resume and restart:
        raise ValueError("resume or restart, not both")
    with contextlib.ExitStack() as stack:
        stack.enter_context(hold_lock(Path(output)))
        if restart:
            discard_unfinished(Path(output))
        if resume:
            writer = stack.enter_context(open_output(output, input_path=input_path, resume=True))
            if writer.already_finished:  # only the cleanup is left: the input is neither needed nor read
                rows = RowReader.done(input_path, writer.rows_written)
            else:
                rows = stack.enter_context(
                    open_rows(input_path, start=writer.rows_written, json_columns=json_columns, columns=columns)
                )
                _check_input(writer, rows)
        else:
            rows = stack.enter_context(open_rows(input_path, json_columns=json_columns, columns=columns))
            writer = stack.enter_context(open_output(output, input_path=input_path, resume=False))
        yield rows, writer


def _check_input(writer: RewardWriter, rows: RowReader) -> None:
    """Refuse to resume unless ``rows``, opened at ``start=rows_done``, read what the run already read."""
    checkpoint = writer.last_checkpoint
    done = checkpoint.rows_done
    if rows.rows_read < done:
        raise ResumeError(
            f"the input changed since the run started: {rows.path} now has {rows.rows_read} rows, "
            f"but {done} were already scored; delete {writer.state} to start over"
        )
    if rows.checksum() != checkpoint.input_checksum:
        raise ResumeError(
            f"the input changed since the run started: the first {done} rows of {rows.path} had checksum "
            f"{checkpoint.input_checksum}, now {rows.checksum()}; delete {writer.state} to start over"
        )


async def score_chunks(
    engine: Engine,
    rows: RowReader,
    size: int,
    totals: dict[str, VerifierTotals],
    scored: Scored,
    progress: Progress | None = None,
) -> None:
    """Score ``rows`` ``size`` at a time, adding each result to ``totals``, then telling ``scored``; ``progress``
    is told the rows done inside a chunk as its calls return (at most every :data:`PROGRESS_EVERY` seconds).

    A chunk naming an unknown environment is refused (:class:`InputError`, by its line) before any
    of it is scored. A :class:`VerificationError` is located in the input: its ``index`` counts from
    the input's first row, not the chunk's (``first_index``), and a note names the line (or row).
    """
    while chunk := list(islice(rows, size)):
        rows.decoder.check_environments(chunk, engine)
        first = rows.rows_read - len(chunk)  # the chunk's first row's place in the input (0-based)
        try:
            with _told(progress, first):
                result = await engine.run([row.as_item() for row in chunk], first_index=first)
        except VerificationError as exc:
            if exc.index is not None:  # it names the input's row: say where that row is
                exc.add_note(f"input: {rows.path}, {rows.unit} {chunk[exc.index - first].number}")
            raise
        add_reports(totals, result)
        scored(chunk, result)


def _told(progress: Progress | None, first: int) -> contextlib.AbstractContextManager[object]:
    """The rows done so far, ``first`` and the chunk's items whose calls returned, told to ``progress``."""
    if progress is None:
        return contextlib.nullcontext()
    return completions(lambda items: progress(first + items), PROGRESS_EVERY)


async def score_file(
    *,
    input_path: Path,
    output: Path,
    config: EngineConfig,
    resume: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    json_columns: Collection[str] = (),
    columns: Mapping[str, str] | None = None,
    restart: bool = False,
) -> RunSummary:
    """Score every row of ``input_path`` into ``output``; see the module docstring.

    Every environment the rows to score name is checked first (:func:`check_named`): one that cannot score
    stops the run before it writes anything. ``columns``: where each field is read from (``--columns``),
    replacing the config's ``[input.columns]``. A resume whose configuration resolves a verifier the checkpointed
    rows name to another provenance is refused (:class:`ResumeError`, naming both); ``restart`` starts over instead,
    discarding an unfinished run's checkpoint.

    Raises ``VerificationError`` when a verifier fails (a note names the input line or row),
    ``UnreadyError`` when an environment the rows name cannot score, ``InputError`` for a bad row,
    ``OutputError``/``ResumeError`` when the output cannot be written or resumed, and ``ConfigError``
    for a bad config or manifest.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    mapping = Columns.chosen(columns, config.input_columns)
    began = perf_counter()
    async with Engine(config, transport=transport) as engine:
        named = await check_named(engine, Path(input_path), _rows_left_after(output) if resume else 0,
                                  source=mapping.source_of("environment") or "environment")
        opened = open_run(input_path, output, resume=resume, json_columns=json_columns, columns=mapping,
                          restart=restart)
        with opened as (rows, writer):
            resumed_at = writer.rows_written
            recorded = _recorded_provenances(writer) if resume else {}
            if resume and not writer.already_finished:
                _check_provenances(engine, recorded, named, writer)
            totals = _previous_totals(writer) if resume else {}
            rewards = _previous_rewards(writer) if resume else Rewards()
            if writer.already_finished:
                writer.finish()
                return _summary(output, resumed_at, resumed_at, totals, rewards, writer, began, already_finished=True)
            if progress is not None:
                progress(resumed_at)

            def scored(chunk: list[Row], result: BatchResult) -> None:
                for position, (row, reward) in enumerate(zip(chunk, result.rewards, strict=True)):
                    provenance = {**result.provenance(position), "environment": row.environment}
                    writer.write(row.id, reward, provenance)
                    _record_provenance(recorded, provenance)
                rewards.add(result.rewards)
                verifiers = {key: total.to_json() for key, total in totals.items()}
                meta = {"verifiers": verifiers, "rewards": rewards.to_json(), PROVENANCES: recorded}
                writer.checkpoint(rows.rows_read, rows.checksum(), meta=meta)
                if progress is not None:
                    progress(rows.rows_read)

            await score_chunks(engine, rows, chunk_size, totals, scored, progress)
            writer.finish()
            return _summary(output, rows.rows_read, resumed_at, totals, rewards, writer, began)


def _rows_left_after(output: Path) -> int | None:
    """The rows a resumed run of ``output`` skips (its checkpoint's); None if it reads none (only its cleanup is
    left), 0 if its state cannot be read (opening the run says why)."""
    try:
        checkpoint = Checkpoint.load(state_path(output))
    except ResumeError:
        return 0
    return None if checkpoint.finished is not None else checkpoint.rows_done


async def check_named(
    engine: Engine, input_path: Path, start: int | None, *, source: str = "environment"
) -> dict[str, int]:
    """Check, before any row is scored, every environment the rows of ``input_path`` after its first ``start``
    name (:func:`engine._check.check_ready`, on the run's own engine: its imports are the run's); None: no row.
    ``source``: where a row's environment is read from (a column mapping's, a dotted path). Returns those
    environments, each with its first row's number (none when ``start`` is None).

    Raises:
        InputError: a row names no environment of ``engine``'s (the first such row, by its line or row).
        ManifestError: an environment's manifest is broken (a config error, as a row reaching it would raise).
        UnreadyError: some of those environments cannot score (each named, with why): no row was scored.
    """
    if start is None:
        return {}
    decoder = RowDecoder(input_path)
    # in a thread of its own: a signal stops the run at once, not once a pass over a large file is done
    names = functools.partial(named_environments, input_path, start=start, source=source)
    named = await wait_future(in_thread(names, "engine-names"))
    for name, number in named.items():
        try:
            engine.environment(name)
        except ManifestError:
            raise  # a config error, reported as such (as the run would when it reached the row)
        except ValueError as exc:
            raise decoder.error(number, str(exc)) from None
    which = "the rows still to score name" if start else "the input names"
    await check_ready(engine, (engine.config.environments / name for name in named), which=which,
                      then=", checked before scoring any row")
    return named


PROVENANCES = "provenances"  # the checkpoint's meta: each environment's provenances so far, for the resume's check


def _record_provenance(recorded: dict[str, list[dict[str, Any]]], provenance: Mapping[str, Any]) -> None:
    """Add a written record's provenance to ``recorded`` (each environment's distinct ones, in order)."""
    seen = recorded.setdefault(str(provenance.get("environment")), [])
    canonical = verifier_identity(provenance)
    if canonical not in seen:
        seen.append(canonical)


def _recorded_provenances(writer: RewardWriter) -> dict[str, list[dict[str, Any]]]:
    """The provenances of a resumed run's checkpointed records: its checkpoint's, or (a state an older version
    wrote) read from the partial file's checkpointed lines, which a JSON Lines spool holds whatever the output."""
    previous = writer.last_checkpoint.meta.get(PROVENANCES)
    recorded: dict[str, list[dict[str, Any]]] = {}
    if isinstance(previous, dict) and all(
        isinstance(value, list) and all(isinstance(p, dict) for p in value) for value in previous.values()
    ):
        for values in previous.values():
            for provenance in values:
                _record_provenance(recorded, provenance)
        return recorded
    if writer.already_finished:
        return recorded
    with writer.partial.open("rb") as f:
        for line in islice(f, writer.last_checkpoint.rows_done):
            _record_provenance(recorded, orjson.loads(line)["verifier"])
    return recorded


def _check_provenances(engine: Engine, recorded: Mapping[str, list[dict[str, Any]]], named: Mapping[str, int],
                       writer: RewardWriter) -> None:
    """Refuse a resume that would add rows of an environment under another verifier than its checkpointed rows'
    (a new pin, rubric version or URL): the output would mix two verifiers' rewards under one name in silence."""
    now = {name: {**engine._verifier(name).provenance(), "environment": name} for name in set(recorded) & set(named)}
    check_provenances(recorded, now, where=f"the rows already checkpointed in {writer.partial}",
                      instead="run with --restart to score every row again with the verifier now (the checkpoint "
                              "is discarded)")


def check_provenances(recorded: Mapping[str, list[dict[str, Any]]], now: Mapping[str, Mapping[str, Any]], *,
                      where: str, instead: str) -> None:
    """Refuse (:class:`ResumeError`) to resume when an environment of ``now`` (its provenance now) has rows in
    ``recorded`` (each environment's provenances so far) under another provenance, naming both.

    ``where``: the rows already written (for the message); ``instead``: how to start a new output.
    """
    for name in sorted(set(recorded) & set(now)):
        current = verifier_identity(now[name])
        before = [p for p in recorded[name] if verifier_identity(p) != current]
        if before:
            shown = orjson.dumps(before[-1], option=orjson.OPT_SORT_KEYS).decode()
            raise ResumeError(
                f"environment {name!r} now resolves to another verifier than {where}: they were scored by "
                f"{shown}, the rest would be by {orjson.dumps(current, option=orjson.OPT_SORT_KEYS).decode()}; "
                f"resuming would mix the two in one output: {instead}, or restore the configuration the run "
                "started with and --resume"
            )


def _previous_totals(writer: RewardWriter) -> dict[str, VerifierTotals]:
    """The per-verifier totals a resumed run's checkpoint carries; ``ResumeError`` if they are not what a run
    writes (the state is a file a user can edit)."""
    previous = writer.last_checkpoint.meta.get("verifiers", {})
    try:
        if not isinstance(previous, dict) or not all(isinstance(key, str) for key in previous):
            raise ValueError("not an object of verifiers' totals")
        return {key: VerifierTotals.from_json(value) for key, value in previous.items()}
    except ValueError:
        raise ResumeError(
            f"{writer.state}: unusable state file: field 'meta.verifiers' is not what a run writes; "
            "delete it to start over"
        ) from None


def _previous_rewards(writer: RewardWriter) -> Rewards:
    """The distribution of the rewards a resumed run's checkpoint carries: empty if it has none (a state an older
    version wrote, whose rows the summary then leaves out); ``ResumeError`` if it is not what a run writes."""
    previous = writer.last_checkpoint.meta.get("rewards")
    if previous is None:
        return Rewards()
    try:
        return Rewards.from_json(previous)
    except ValueError as exc:
        raise ResumeError(
            f"{writer.state}: unusable state file: field 'meta.rewards' is {exc}; delete it to start over"
        ) from None


def _summary(
    output: Path,
    rows: int,
    resumed_at: int,
    totals: dict[str, VerifierTotals],
    rewards: Rewards,
    writer: RewardWriter,
    began: float,
    *,
    already_finished: bool = False,
) -> RunSummary:
    finished = writer.finished
    return RunSummary(
        output=output,
        rows=rows,
        resumed_at=resumed_at,
        verifiers=totals,
        repeated_ids=None if finished is None else finished.repeated_ids,
        ids_repeated=None if finished is None else finished.ids_repeated,
        already_finished=already_finished,
        elapsed=perf_counter() - began,
        rewards=rewards,
    )
