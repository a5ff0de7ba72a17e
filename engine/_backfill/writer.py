"""Writing rewards for ``engine score``: never half-written, checkpointed, resumable after kill -9.

The output's files, and why a checkpoint and the finish survive a kill: docs/design.md, Crash-safe finish.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

import orjson

from engine._backfill.checkpoint import Checkpoint, Finished, state_path, state_tmp_path
from engine._backfill.files import (
    EMPTY_CHECKSUM,
    HASH_CHUNK,
    Closing,
    Format,
    checksum,
    file_checksum,
    file_format,
    fsync,
    sibling,
    unsupported,
)
from engine._backfill.ids import count_repeated, id_hash, ids_path
from engine._backfill.parquet import read_records, spool_to_parquet, verifier_problem
from engine._errors import OutputError, ResumeError, WriteError

__all__ = [
    "RewardRecord",
    "RewardWriter",
    "discard_unfinished",
    "open_output",
    "output_tmp_path",
    "partial_path",
    "read_rewards",
]


def partial_path(output: Path) -> Path:
    """Where the records go until the run is complete."""
    return sibling(output, ".partial")


def output_tmp_path(output: Path) -> Path:
    """Where a Parquet output is built from the spool before it is renamed into place."""
    return sibling(output, ".tmp")


def _output_format(path: Path) -> Format:
    fmt = file_format(path)
    if fmt is None:
        raise OutputError(f"{path}: {unsupported(path)}")
    return fmt


def _finite(reward: float) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"a reward must be a float, got {reward!r} ({type(reward).__name__})")
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, got {reward!r}")
    return value


class RewardWriter(Closing):
    """Writes reward records to ``partial_path(output)`` and checkpoints them (docs/design.md, Crash-safe finish).

    Get one from :func:`open_output` (or :func:`engine._backfill.run.open_run`). As a context manager it closes the
    files on exit without finishing: unless :meth:`finish` ran, the partial and state files stay
    for ``--resume``. A resumed writer whose run had already finished (it was stopped while
    cleaning up) has ``already_finished`` set: it writes nothing, and :meth:`finish` only completes
    the cleanup. After :meth:`finish`, ``finished`` describes the output and its repeated ids.
    """

    def __init__(
        self, output: Path, input_path: Path, data: BinaryIO | None, checkpoint: Checkpoint, ids: BinaryIO | None
    ) -> None:
        self.output = output
        self.input_path = input_path
        self.format: Format = _output_format(output)
        self.partial = partial_path(output)
        self.state = state_path(output)
        self.last_checkpoint = checkpoint
        self.rows_written = checkpoint.rows_done
        self.already_finished = data is None
        self.finished: Finished | None = checkpoint.finished if data is None else None
        self._data = data
        self._ids = ids
        self._bytes = checkpoint.output_bytes
        self._hash = hashlib.sha256()

    def _file(self) -> BinaryIO:
        if self._data is None:
            done = "had already finished" if self.already_finished else "is closed"
            raise ValueError(f"the writer of {self.output} {done}")
        return self._data

    def _failed(self, path: Path, exc: OSError) -> WriteError:
        return WriteError(path, exc, self.last_checkpoint.rows_done)

    def write(self, row_id: Any, reward: float, verifier: Mapping[str, Any]) -> None:
        """Append the record of the next input row. ``verifier`` is written as given; for a Parquet output it
        must fit the struct column (:func:`engine._backfill.parquet.verifier_problem`), or ``TypeError``."""
        f = self._file()
        record = {"id": row_id, "reward": _finite(reward), "verifier": dict(verifier)}
        if self.format == "parquet" and (problem := verifier_problem(record["verifier"])) is not None:
            raise TypeError(f"the verifier of id {row_id!r} cannot be written to Parquet: {problem}")
        try:
            line = orjson.dumps(record) + b"\n"
        except orjson.JSONEncodeError as exc:
            raise TypeError(f"the record of id {row_id!r} cannot be written as JSON: {exc}") from exc
        try:
            f.write(line)
            counted = id_hash(row_id)
            if counted is not None and self._ids is not None:
                self._ids.write(counted)
        except OSError as exc:
            raise self._failed(self.partial, exc) from exc
        self._hash.update(line)
        self._bytes += len(line)
        self.rows_written += 1

    def checkpoint(self, rows_done: int, input_checksum: str, *, meta: Mapping[str, Any] | None = None) -> None:
        """Make the records written so far durable, then record them as done.

        ``rows_done`` must equal the records written (one per input row) and ``input_checksum``
        be the input's checksum through those rows. A crash after this returns loses nothing
        written before it.
        """
        f = self._file()
        if rows_done != self.rows_written:
            raise ValueError(
                f"checkpoint of {rows_done} rows, but {self.rows_written} records were written (one per input row)"
            )
        checkpoint = Checkpoint(
            input=self.last_checkpoint.input,
            rows_done=rows_done,
            input_checksum=input_checksum,
            output_bytes=self._bytes,
            output_checksum=self._output_checksum(),
            meta=MappingProxyType(dict(meta if meta is not None else self.last_checkpoint.meta)),
        )
        path = self.partial
        try:
            f.flush()
            os.fsync(f.fileno())
            path = self.state
            checkpoint.save(self.state)
        except OSError as exc:
            raise self._failed(path, exc) from exc
        self.last_checkpoint = checkpoint

    def _rewind(self, checkpoint: Checkpoint) -> None:
        """Check the partial file's checkpointed prefix, drop what follows it, and position for appending.

        The ids file is derived data: it is rebuilt from the records of that prefix. For a Parquet output,
        each of those records' ``verifier`` must fit the struct column, or the resume is refused now
        rather than when the run finishes: a partial file left by a version that wrote ``verifier`` as
        JSON text may hold keys the struct has no field for.
        """
        data = self._file()
        size = os.fstat(data.fileno()).st_size
        if size < checkpoint.output_bytes:
            raise ResumeError(
                f"{self.partial} holds {size} bytes but {checkpoint.output_bytes} were checkpointed: it was changed; "
                f"delete {self.state} to start over"
            )
        remaining = checkpoint.output_bytes
        while remaining:
            chunk = data.read(min(remaining, HASH_CHUNK))
            self._hash.update(chunk)
            remaining -= len(chunk)
        if self._output_checksum() != checkpoint.output_checksum:
            raise ResumeError(
                f"{self.partial} no longer holds what was checkpointed (checksum mismatch): it was changed; "
                f"delete {self.state} to start over"
            )
        try:
            data.seek(0)
            parquet = self.format == "parquet"
            # read back only for what needs it: a Parquet output's verifiers, or the ids file's hashes
            reread = checkpoint.rows_done if parquet or self._ids is not None else 0
            for number, line in enumerate(islice(data, reread), 1):
                record = orjson.loads(line)
                if parquet and (problem := verifier_problem(record["verifier"])) is not None:
                    raise ResumeError(
                        f"{self.partial}, line {number}: the interrupted run's record cannot be written to "
                        f"{self.output}'s verifier column: {problem}; delete {self.state} to start over"
                    )
                counted = id_hash(record["id"])
                if counted is not None and self._ids is not None:
                    self._ids.write(counted)
            data.truncate(checkpoint.output_bytes)
            data.seek(checkpoint.output_bytes)
        except OSError as exc:
            raise self._failed(self.partial, exc) from exc

    def _output_checksum(self) -> str:
        return checksum(self._hash)

    def finish(self) -> None:
        """Put the complete output in place atomically and remove the other files (docs/design.md, Crash-safe finish).

        Steps, each safe to crash after: fsync the partial file; count
        repeated ids; for Parquet, convert the spool to ``OUT.tmp`` and fsync it; save the last
        checkpoint, marked finished with the output's size and sha256; rename the output into
        place and fsync the directory; remove the partial, ids and temporary files, fsync the
        directory; remove the state file, fsync the directory.
        """
        if self.already_finished:
            try:
                self._clean_up()
            except OSError as exc:
                raise self._failed(self.state, exc) from exc
            return
        f = self._file()
        path = self.partial
        try:
            f.flush()
            os.fsync(f.fileno())
            path = ids_path(self.output)
            if self._ids is not None:  # its last hashes, or the count below would be short, silently
                self._ids.flush()
            self.close()
            repeated, distinct = count_repeated(path)
            if self.format == "parquet":
                path = output_tmp_path(self.output)
                spool_to_parquet(self.partial, path)
                fsync(path)
                source, size, digest = path, path.stat().st_size, file_checksum(path)
            else:
                source, size, digest = self.partial, self._bytes, self._output_checksum()
            finished = Finished(size, digest, repeated, distinct)
            path = self.state
            replace(self.last_checkpoint, finished=finished).save(self.state)
            self.finished = finished
            path = self.output
            os.replace(source, self.output)
            fsync(self.output.parent)
            self._clean_up()
        except OSError as exc:
            raise self._failed(path, exc) from exc

    def _clean_up(self) -> None:
        """Remove what a finished run leaves but its output, the state file last (it marks the run unfinished)."""
        for leftover in (self.partial, ids_path(self.output), output_tmp_path(self.output), state_tmp_path(self.state)):
            leftover.unlink(missing_ok=True)
        fsync(self.output.parent)
        self.state.unlink(missing_ok=True)
        fsync(self.output.parent)

    def close(self) -> None:
        """Close the partial file, leaving it and the state for ``--resume``."""
        for name in ("_data", "_ids"):
            f: BinaryIO | None = getattr(self, name)
            setattr(self, name, None)
            if f is not None:
                # Only what follows the last checkpoint can still be buffered, and a resume drops
                # it anyway: a write that fails here (disk full) loses nothing, so it is not raised
                # again over the error that stopped the run.
                with contextlib.suppress(OSError):
                    f.close()


def _resolved(path: Path) -> str:
    return str(path.resolve())


def open_output(output: str | Path, *, input_path: str | Path, resume: bool) -> RewardWriter:
    """A writer for ``output``, the rewards of input file ``input_path``.

    A fresh run (``resume=False``) refuses if an interrupted run's state exists for ``output``,
    otherwise starts an empty partial file and a state of 0 rows; an existing complete ``output``
    is replaced only when the new run finishes. A resumed run loads the state, refuses if it is
    missing, was made for another input, or if the partial file no longer holds what it
    checkpointed, and truncates the partial file to the last checkpoint; if the run had already
    finished (``output`` matches its last checkpoint), the writer is ``already_finished``. The
    caller must then check the input against the checkpoint (:func:`engine._backfill.run.open_run`
    does it all).
    """
    output, input_path = Path(output), Path(input_path)
    _output_format(output)
    if _resolved(output) == _resolved(input_path):
        raise OutputError(f"{output}: the output would replace the input; choose another output file")
    return _restore(output, input_path) if resume else _start(output, input_path)


def discard_unfinished(output: Path) -> None:
    """Remove what an unfinished run for ``output`` left (its state, partial and ids files), for a run that starts
    over (``--restart``); the caller holds ``output``'s lock. A complete ``output`` is left: a new run replaces it."""
    for path in (state_path(output), partial_path(output), ids_path(output), state_tmp_path(state_path(output))):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _start(output: Path, input_path: Path) -> RewardWriter:
    state, partial = state_path(output), partial_path(output)
    if state.exists():
        try:
            finished = Checkpoint.load(state).finished is not None
        except ResumeError:
            finished = False
        if finished:
            raise ResumeError(
                f"a run for {output} finished but was stopped while cleaning up ({state} is left): "
                f"use --resume to complete it (nothing is scored again), or delete {state} to start over"
            )
        raise ResumeError(
            f"an interrupted run exists for {output} ({state}): use --resume to continue it, "
            f"or delete {state} to start over"
        )
    checkpoint = Checkpoint(
        input=_resolved(input_path),
        rows_done=0,
        input_checksum=EMPTY_CHECKSUM,
        output_bytes=0,
        output_checksum=EMPTY_CHECKSUM,
    )
    try:
        data: BinaryIO = partial.open("wb")
    except OSError as exc:
        raise OutputError(f"cannot write {partial}: {exc}") from exc
    try:
        ids: BinaryIO = ids_path(output).open("wb")
        os.fsync(data.fileno())
    except OSError as exc:
        data.close()
        raise WriteError(partial, exc, 0) from exc
    writer = RewardWriter(output, input_path, data, checkpoint, ids)
    try:
        checkpoint.save(state)  # from here on, --resume works whenever the run stops
    except BaseException as exc:
        writer.close()
        if isinstance(exc, OSError):
            raise WriteError(state, exc, 0) from exc
        raise
    return writer


def _matches(path: Path, size: int, digest: str) -> bool:
    """Whether ``path`` is a file of ``size`` bytes with checksum ``digest``."""
    try:
        return path.stat().st_size == size and file_checksum(path) == digest
    except FileNotFoundError:
        return False


def _restore(output: Path, input_path: Path) -> RewardWriter:
    state, partial = state_path(output), partial_path(output)
    checkpoint = Checkpoint.load(state)
    if checkpoint.input != _resolved(input_path):
        raise ResumeError(
            f"the interrupted run of {output} read {checkpoint.input}, not {_resolved(input_path)}; "
            f"resume with that input, or delete {state} to start over"
        )
    finished = checkpoint.finished
    if finished is not None and _matches(output, finished.output_bytes, finished.output_checksum):
        return RewardWriter(output, input_path, None, checkpoint, None)  # stopped while cleaning up
    try:
        data: BinaryIO = partial.open("r+b")
    except FileNotFoundError:
        legacy = _output_format(output) == "jsonl" and finished is None
        if legacy and _matches(output, checkpoint.output_bytes, checkpoint.output_checksum):
            # left by a version that wrote no finished marker, stopped between the rename and the cleanup
            return RewardWriter(output, input_path, None, checkpoint, None)
        raise ResumeError(
            f"{partial} is missing, so the interrupted run cannot continue; delete {state} to start over"
        ) from None
    except OSError as exc:
        raise OutputError(f"cannot write {partial}: {exc}") from exc
    try:
        ids: BinaryIO = ids_path(output).open("wb")
    except OSError as exc:
        data.close()
        raise WriteError(ids_path(output), exc, checkpoint.rows_done) from exc
    writer = RewardWriter(output, input_path, data, checkpoint, ids)
    try:
        writer._rewind(checkpoint)
    except BaseException:
        writer.close()
        raise
    return writer


@dataclass(frozen=True, slots=True)
class RewardRecord:
    """One record of an output file: one input row's reward.

    Attributes:
        id: The row's ``id``, as read (None when it had none).
        reward: The reward, a finite float.
        verifier: The provenance: ``kind``, ``ref``, ``environment``, and the environment's digest or the
            rubric's version and digest (a Parquet output's null fields left out).
    """

    id: Any
    reward: float
    verifier: Mapping[str, Any]


def read_rewards(path: str | Path) -> Iterator[RewardRecord]:
    """The records of a complete ``engine score`` output file, streamed, in order.

    Args:
        path: The output: JSON Lines (``.jsonl``, ``.ndjson``, ``.json-lines``) or Parquet (``.parquet``).
            A Parquet ``verifier`` holds the struct's non-null fields (a kind's own); a Parquet file
            written before the struct column, with ``verifier`` as JSON text, reads the same way.

    Returns:
        An iterator of the records, one per input row, read as it is consumed.

    Raises:
        OutputError: The extension names neither format (raised, as the others, once iteration starts).
        OSError: The file cannot be opened or read.
    """
    path = Path(path)
    if _output_format(path) == "jsonl":
        with path.open("rb") as f:
            for line in f:
                if not line.isspace():
                    data = orjson.loads(line)
                    yield RewardRecord(data["id"], data["reward"], data["verifier"])
        return
    for row_id, reward, verifier in read_records(path):
        yield RewardRecord(row_id, reward, verifier)
