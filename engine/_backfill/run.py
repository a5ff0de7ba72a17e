"""``engine score``: rewards for a file of stored trajectories, streamed, checkpointed, resumable.

The input is read a chunk at a time (memory stays flat however large the file), each chunk is
scored as one batch, its records are written, and a checkpoint is taken (``engine._backfill.output``). A
crash, Ctrl-C or kill -9 loses at most the chunk in flight; ``--resume`` continues from the last
checkpoint and produces the file an uninterrupted run would have. A verification error stops the
run with the chunk before it checkpointed: fix the verifier, then ``--resume``.

The run's summary (per verifier: items, mean reward, latency percentiles, retries) is carried in
the checkpoints, so a resumed run reports on the whole file; so is the count of repeated ids, taken
over the whole output when the run finishes (``engine._backfill.output``). A resume of a run that was
stopped after its output was complete, while cleaning up, only completes the cleanup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import httpx
import pyarrow.parquet as pq

from engine._backfill.output import RewardWriter, open_run
from engine._backfill.rows import JSONL_SUFFIXES, Row, RowReader
from engine._config import EngineConfig
from engine._core.report import VerifierTotals, add_reports
from engine._engine import Engine
from engine._errors import InputError, ManifestError, ResumeError, VerificationError

__all__ = ["DEFAULT_CHUNK_SIZE", "RunSummary", "count_rows", "refuse_unknown_environments", "score_file"]

DEFAULT_CHUNK_SIZE = 1024  # rows per batch and per checkpoint: at most this many are scored again on resume
COUNT_BLOCK = 1 << 20

Progress = Callable[[int], None]  # told how many rows are done, after each chunk


@dataclass
class RunSummary:
    """What ``score_file`` did: rows scored (this run and before a resume) and per-verifier totals.

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


def count_rows(path: Path) -> int | None:
    """The number of rows in an input file, cheaply (for a progress bar's total); None if unknown."""
    try:
        if path.suffix.lower() in JSONL_SUFFIXES:
            lines, last = 0, b"\n"
            with path.open("rb") as f:
                while block := f.read(COUNT_BLOCK):
                    lines += block.count(b"\n")
                    last = block[-1:]
            return lines + (last != b"\n")
        return int(pq.ParquetFile(path).metadata.num_rows)
    except (OSError, ValueError):
        return None


def refuse_unknown_environments(engine: Engine, rows: RowReader, chunk: list[Row]) -> None:
    """Refuse a chunk naming an unknown environment, by its line, before any of it is scored."""
    for row in chunk:
        try:
            engine.environment(row.environment)
        except ManifestError:
            raise  # a broken manifest is a config error, reported as such
        except ValueError as exc:
            raise InputError(rows.path, str(exc), unit=rows.unit, number=row.number) from None


async def score_file(
    *,
    input_path: Path,
    output: Path,
    config: EngineConfig,
    resume: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunSummary:
    """Score every row of ``input_path`` into ``output``; see the module docstring.

    Raises ``VerificationError`` when a verifier fails (a note names the input line or row),
    ``InputError`` for a bad row, ``OutputError``/``ResumeError`` when the output cannot be
    written or resumed, and ``ConfigError`` for a bad config or manifest.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    async with Engine(config, transport=transport) as engine:
        with open_run(input_path, output, resume=resume) as (rows, writer):
            resumed_at = writer.rows_written
            totals = _previous_totals(writer) if resume else {}
            if writer.already_finished:
                writer.finish()
                return _summary(output, resumed_at, resumed_at, totals, writer, already_finished=True)
            if progress is not None:
                progress(resumed_at)
            while chunk := list(islice(rows, chunk_size)):
                refuse_unknown_environments(engine, rows, chunk)
                first = rows.rows_read - len(chunk)  # the chunk's first row's place in the input (0-based)
                try:
                    result = await engine.run([row.as_item() for row in chunk], first_index=first)
                except VerificationError as exc:
                    if exc.index is not None:  # it names the input's row: say where that row is
                        exc.add_note(f"input: {rows.path}, {rows.unit} {chunk[exc.index - first].number}")
                    raise
                for position, (row, reward) in enumerate(zip(chunk, result.rewards, strict=True)):
                    writer.write(row.id, reward, {**result.provenance(position), "environment": row.environment})
                add_reports(totals, result)
                meta = {"verifiers": {key: total.to_json() for key, total in totals.items()}}
                writer.checkpoint(rows.rows_read, rows.checksum(), meta=meta)
                if progress is not None:
                    progress(rows.rows_read)
            writer.finish()
            return _summary(output, rows.rows_read, resumed_at, totals, writer)


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


def _summary(
    output: Path,
    rows: int,
    resumed_at: int,
    totals: dict[str, VerifierTotals],
    writer: RewardWriter,
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
    )
