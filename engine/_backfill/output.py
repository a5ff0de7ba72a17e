"""Writing rewards for ``engine score``: never half-written, checkpointed, resumable after kill -9.

The output holds one record per input row, in input order: ``id``, ``reward`` (a float) and
``verifier``, the provenance object the caller passes (``kind``, ``ref``, ``environment``, a digest
or a rubric version, ...), written as given. Its format follows the output's extension: JSON Lines
(``.jsonl``, ``.ndjson``, ``.json-lines``) or Parquet (``.parquet``).

Files, for an output ``OUT``:

* ``OUT.partial``: the records written so far, as JSON Lines whatever the output's format (for
  Parquet it is a spool, converted at the end);
* ``OUT.state.json``: the last checkpoint (see :class:`Checkpoint`);
* ``OUT.tmp``: for Parquet, the file being built from the spool at the end;
* ``OUT.ids``: a 16-byte hash of each record's ``id``, to count repeated ids at the end (derived
  data: rebuilt from the partial file on resume, so it needs no checkpoint of its own);
* ``OUT.lock``: while a run writes ``OUT``, holding an exclusive ``flock`` and the run's pid. A
  second run for the same output (fresh or ``--resume``) is refused while the first holds it,
  instead of both appending to one partial file; the lock goes with the process, however it ends.

``OUT`` itself appears only when the run is complete, by ``os.replace`` after an fsync, so it is
never half-written; a complete old ``OUT`` is replaced atomically.

**Why finishing survives kill -9.** :meth:`RewardWriter.finish` builds the complete file (for
Parquet, ``OUT.tmp`` from the spool), then saves a last checkpoint marked *finished* with that
file's size and sha256, then renames it into place, then removes the other files, the state file
last. A crash before the marker leaves an ordinary resumable run; after it, a resume that finds
``OUT`` matching the marker only completes the cleanup (``RewardWriter.already_finished``), and
one that does not (the rename never happened) builds ``OUT`` again from the partial file, which is
still there. A state without the marker (written by an older version) whose partial file is gone
is accepted when ``OUT`` is a JSON Lines file matching its checkpoint.

**Why it survives kill -9.** :meth:`RewardWriter.checkpoint` first fsyncs the partial file, then
replaces the state file atomically (temporary file, fsync, ``os.replace``, fsync of the
directory). So the state on disk never claims more than the partial file durably holds, whatever
the moment of the kill. A resume truncates the partial file back to the byte offset the state
records, dropping any records written after the last checkpoint, and checks that what remains
is byte for byte what was checkpointed (its sha256). The caller checkpoints after each chunk, so
at most one chunk is scored again.

**Why the result is identical.** Records are encoded the same way on every run, so the resumed
partial file is byte-identical to an uninterrupted run's, and so is a JSON Lines output. A Parquet
output is built from that same spool at the end in both cases, with the same settings, so it is
byte-identical too (given the same pyarrow).

**Parquet columns.** ``reward`` is float64. ``verifier`` is JSON text: provenance objects differ
by verifier kind (a digest here, a rubric version there), and a struct column would add every
other kind's keys, as nulls, to each record, so it would not round-trip. ``id`` is int64 when
every id is an integer (or null), string when every id is a string (or null), and JSON text
otherwise (mixed or other types). The schema metadata key ``engine.json_columns`` lists the
columns holding JSON text; :func:`read_rewards` decodes them, so every output round-trips.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from itertools import islice
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, BinaryIO, Literal, Self

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from engine._backfill.rows import EMPTY_CHECKSUM, JSONL_SUFFIXES, PARQUET_SUFFIXES, RowReader, open_rows
from engine._errors import OutputError, ResumeError, WriteError

__all__ = [
    "STATE_FORMAT",
    "Checkpoint",
    "Finished",
    "OutputError",
    "ResumeError",
    "RewardRecord",
    "RewardWriter",
    "WriteError",
    "lock_path",
    "open_output",
    "open_run",
    "partial_path",
    "read_rewards",
    "state_path",
]

STATE_FORMAT = "engine-score-state/1"
PARQUET_BATCH_ROWS = 16_384  # records per row group when the spool becomes Parquet (~36 MiB less peak than 65,536)
SPOOL_PARSE_ROWS = 8_192  # records parsed at a time then (measured: peak RSS at 1M rows 261 -> 152 MiB)
HASH_CHUNK = 1 << 20
ID_HASH_BYTES = 16  # blake2b-128 of an id's JSON (sorted keys): two ids share one with probability ~n^2 / 2^129
ID_BUCKET_ROWS = 1 << 14  # hashes sorted at a time when counting repeated ids (~1 MiB as Python bytes)
ID_MAX_BUCKET_BITS = 8  # at most 256 buckets: past 256 * 16,384 rows (4.2M) a bucket grows with the file
ID_SPREAD_ROWS = 1 << 16  # hashes read at a time while spreading them over the buckets (1 MiB)
JSON_COLUMNS_KEY = b"engine.json_columns"
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")

Format = Literal["jsonl", "parquet"]
IdKind = Literal["null", "int", "str", "json"]





def partial_path(output: Path) -> Path:
    """Where the records go until the run is complete."""
    return output.with_name(output.name + ".partial")


def lock_path(output: Path) -> Path:
    """The lock a run writing ``output`` holds."""
    return output.with_name(output.name + ".lock")


@contextlib.contextmanager
def _exclusive(output: Path) -> Iterator[None]:
    """Hold ``OUT.lock`` while the block runs; :class:`OutputError` if another run holds it.

    :class:`WriteError` if the lock cannot be written (a read-only directory, a full disk): the
    run has not started, so no rows are counted as checkpointed in it (a state, if any, is kept).

    The file is removed on exit, while still locked. A run that opened it just before then may
    lock the removed file: it checks, after locking, that the path still names what it locked,
    and starts over if not.
    """
    path = lock_path(output)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileNotFoundError, NotADirectoryError) as exc:  # no such directory: where to write is wrong
            raise OutputError(f"cannot create {path}: {exc}") from exc
        except OSError as exc:  # a read-only or full file system, no permission: the system refused the write
            raise WriteError(path, exc, 0) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"{output} is being written by another run (pid {holder}, holding {path}): "
                "wait for it to finish, or stop it and use --resume"
            ) from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and current.st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # it was removed after we opened it: try again
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full disk when the run starts
            raise WriteError(path, exc, 0) from exc
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def state_path(output: Path) -> Path:
    """Where the last checkpoint of a run writing ``output`` is kept."""
    return output.with_name(output.name + ".state.json")


def _format(path: Path) -> Format:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    supported = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise OutputError(f"{path}: unsupported extension {path.suffix!r} (supported: {supported})")


def _fsync(path: Path) -> None:
    """Make a file's bytes durable, or a directory's renames and unlinks (``path`` is either)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Finished:
    """The complete output a finishing run was about to rename into place: its size and sha256.

    ``repeated_ids`` counts the records whose ``id`` (not null) an earlier record already had,
    ``ids_repeated`` the distinct ids that occur more than once.
    """

    output_bytes: int
    output_checksum: str
    repeated_ids: int
    ids_repeated: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Checkpoint:
    """What the state file records: enough to resume, and to refuse to resume wrongly.

    ``rows_done`` input rows (and as many records) are done; ``input_checksum`` is the input's
    checksum through them (:meth:`engine._backfill.rows.RowReader.checksum`); the partial file's first
    ``output_bytes`` bytes hold their records and have ``output_checksum``. ``meta`` is the
    caller's own JSON object (counters for a summary, ...), handed back on resume. ``finished`` is
    set by the last checkpoint of a run, saved just before its output is renamed into place.
    """

    input: str
    rows_done: int
    input_checksum: str
    output_bytes: int
    output_checksum: str
    meta: Mapping[str, Any] = field(default_factory=dict)
    finished: Finished | None = None

    def to_json(self) -> bytes:
        data = {
            "format": STATE_FORMAT,
            "input": self.input,
            "rows_done": self.rows_done,
            "input_checksum": self.input_checksum,
            "output_bytes": self.output_bytes,
            "output_checksum": self.output_checksum,
            "meta": dict(self.meta),
        }
        if self.finished is not None:
            data["finished"] = self.finished.to_json()
        return orjson.dumps(data, option=orjson.OPT_INDENT_2)

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        """The checkpoint in state file ``path``; ``ResumeError`` if it is missing or unusable."""
        try:
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise ResumeError(f"no interrupted run to resume: {path} does not exist; run without --resume") from None
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ResumeError(f"{path}: unreadable state file ({exc}); delete it to start over") from exc
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt != STATE_FORMAT:
            raise ResumeError(
                f"{path}: not a state file this version can resume (format {fmt!r}, not {STATE_FORMAT!r})"
            )
        types = {"input": str, "rows_done": int, "input_checksum": str, "output_bytes": int, "output_checksum": str}
        for key, kind in types.items():
            if not _valid(key, data.get(key), kind):
                raise ResumeError(
                    f"{path}: unusable state file: field {key!r} is missing or not a {_what(key, kind)}; "
                    "delete it to start over"
                )
        if not isinstance(data.get("meta"), dict):
            raise ResumeError(
                f"{path}: unusable state file: field 'meta' is missing or not an object; delete it to start over"
            )
        finished = data.get("finished")
        if finished is not None:
            kinds = {"output_bytes": int, "output_checksum": str, "repeated_ids": int, "ids_repeated": int}
            if not isinstance(finished, dict) or any(
                not _valid(key, finished.get(key), kind) for key, kind in kinds.items()
            ):
                raise ResumeError(
                    f"{path}: unusable state file: field 'finished' is not a finished run's record; "
                    "delete it to start over"
                )
            finished = Finished(**{key: finished[key] for key in kinds})
        return cls(**{key: data[key] for key in (*types, "meta")}, finished=finished)

    def save(self, path: Path) -> None:
        """Replace state file ``path`` atomically and durably with this checkpoint."""
        payload = self.to_json()  # before touching any file: a meta JSON cannot hold changes nothing
        tmp = _state_tmp(path)
        with tmp.open("wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync(path.parent)


def _valid(key: str, value: Any, kind: type) -> bool:
    """Whether a state file's field holds what this version writes there: counts are whole numbers
    >= 0, checksums ``sha256:`` and 64 hex digits (a hand-edited state must not be half-trusted)."""
    if not isinstance(value, kind) or isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    if isinstance(value, str) and key.endswith("_checksum"):
        return _CHECKSUM.fullmatch(value) is not None
    return True


def _what(key: str, kind: type) -> str:
    if kind is int:
        return "whole number >= 0"
    return "sha256 checksum" if key.endswith("_checksum") else kind.__name__


def _state_tmp(state: Path) -> Path:
    return state.with_name(state.name + ".tmp")


def _finite(reward: float) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"a reward must be a float, got {reward!r} ({type(reward).__name__})")
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, got {reward!r}")
    return value


class RewardWriter:
    """Writes reward records to ``partial_path(output)`` and checkpoints them; see the module docstring.

    Get one from :func:`open_output` (or :func:`open_run`). As a context manager it closes the
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
        self.format: Format = _format(output)
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
        """Append the record of the next input row. ``verifier`` is written as given."""
        f = self._file()
        record = {"id": row_id, "reward": _finite(reward), "verifier": dict(verifier)}
        try:
            line = orjson.dumps(record) + b"\n"
        except orjson.JSONEncodeError as exc:
            raise TypeError(f"the record of id {row_id!r} cannot be written as JSON: {exc}") from exc
        try:
            f.write(line)
            counted = _id_hash(row_id)
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

        The ids file is derived data: it is rebuilt from the records of that prefix.
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
            data.truncate(checkpoint.output_bytes)
            data.seek(0)
            if self._ids is not None:
                for line in islice(data, checkpoint.rows_done):
                    counted = _id_hash(orjson.loads(line)["id"])
                    if counted is not None:
                        self._ids.write(counted)
            data.seek(checkpoint.output_bytes)
        except OSError as exc:
            raise self._failed(self.partial, exc) from exc

    def _output_checksum(self) -> str:
        return f"sha256:{self._hash.hexdigest()}"

    def check_input(self, rows: RowReader) -> None:
        """Refuse to resume unless ``rows``, opened at ``start=rows_done``, read what the run already read."""
        done = self.last_checkpoint.rows_done
        if rows.rows_read < done:
            raise ResumeError(
                f"the input changed since the run started: {rows.path} now has {rows.rows_read} rows, "
                f"but {done} were already scored; delete {self.state} to start over"
            )
        if rows.rows_read != done:
            raise ValueError(f"the reader must be opened at start={done}, it has read {rows.rows_read} rows")
        if rows.checksum() != self.last_checkpoint.input_checksum:
            raise ResumeError(
                f"the input changed since the run started: the first {done} rows of {rows.path} had checksum "
                f"{self.last_checkpoint.input_checksum}, now {rows.checksum()}; delete {self.state} to start over"
            )

    def finish(self) -> None:
        """Put the complete output in place atomically and remove the other files; see the module docstring.

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
            path = _ids_path(self.output)
            if self._ids is not None:  # its last hashes, or the count below would be short, silently
                self._ids.flush()
            self.close()
            repeated, distinct = _count_repeated(path)
            if self.format == "parquet":
                path = _output_tmp(self.output)
                _spool_to_parquet(self.partial, path)
                _fsync(path)
                source, size, checksum = path, path.stat().st_size, _file_checksum(path)
            else:
                source, size, checksum = self.partial, self._bytes, self._output_checksum()
            finished = Finished(size, checksum, repeated, distinct)
            path = self.state
            replace(self.last_checkpoint, finished=finished).save(self.state)
            self.finished = finished
            path = self.output
            os.replace(source, self.output)
            _fsync(self.output.parent)
            self._clean_up()
        except OSError as exc:
            raise self._failed(path, exc) from exc

    def _clean_up(self) -> None:
        """Remove what a finished run leaves but its output, the state file last (it marks the run unfinished)."""
        for leftover in (self.partial, _ids_path(self.output), _output_tmp(self.output), _state_tmp(self.state)):
            leftover.unlink(missing_ok=True)
        _fsync(self.output.parent)
        self.state.unlink(missing_ok=True)
        _fsync(self.output.parent)

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

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _ids_path(output: Path) -> Path:
    return output.with_name(output.name + ".ids")


def _output_tmp(output: Path) -> Path:
    return output.with_name(output.name + ".tmp")


def _id_hash(row_id: Any) -> bytes | None:
    """The hash an id is counted by; None for an id written as null (None, and NaN or infinity, as orjson writes them).

    Keys are sorted: ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` are one id, as they are one JSON object.
    """
    encoded = orjson.dumps(row_id, option=orjson.OPT_SORT_KEYS)
    if encoded == b"null":
        return None
    return hashlib.blake2b(encoded, digest_size=ID_HASH_BYTES).digest()


def _file_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(HASH_CHUNK):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _count_repeated(ids: Path) -> tuple[int, int]:
    """``(records whose id an earlier one had, distinct ids occurring more than once)`` in ids file ``ids``.

    Memory stays bounded: the hashes are spread by their first byte over up to
    ``2 ** ID_MAX_BUCKET_BITS`` temporary files of ~:data:`ID_BUCKET_ROWS` hashes each (equal hashes
    share a bucket; a file is opened only to append a block's worth, so few descriptors are used),
    and each bucket is sorted on its own. Exact unless two different ids share a 128-bit hash.
    """
    try:
        total = ids.stat().st_size // ID_HASH_BYTES
    except FileNotFoundError:
        return 0, 0
    bits = 0
    while bits < ID_MAX_BUCKET_BITS and total > ID_BUCKET_ROWS << bits:
        bits += 1
    repeated = distinct = 0
    with tempfile.TemporaryDirectory(prefix="engine-ids-") as scratch:  # not beside the output: kill -9 leaves it
        parts = [ids] if bits == 0 else [Path(scratch) / str(n) for n in range(1 << bits)]
        if bits:
            pending = [bytearray() for _ in parts]
            with ids.open("rb") as source:
                while block := source.read(ID_HASH_BYTES * ID_SPREAD_ROWS):
                    shift = 8 - bits
                    for start in range(0, len(block), ID_HASH_BYTES):
                        pending[block[start] >> shift] += block[start : start + ID_HASH_BYTES]
                    for part, hashes in zip(parts, pending, strict=True):
                        if hashes:
                            with part.open("ab") as f:
                                f.write(hashes)
                            hashes.clear()
        for part in parts:
            data = part.read_bytes()
            previous, run = b"", 0
            for value in sorted(data[i : i + ID_HASH_BYTES] for i in range(0, len(data), ID_HASH_BYTES)):
                if value == previous:
                    repeated += 1
                    run += 1
                    distinct += run == 1
                else:
                    previous, run = value, 0
    return repeated, distinct


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
    caller must then check the input with :meth:`RewardWriter.check_input` (:func:`open_run` does
    it all).
    """
    output, input_path = Path(output), Path(input_path)
    _format(output)
    if _resolved(output) == _resolved(input_path):
        raise OutputError(f"{output}: the output would replace the input; choose another output file")
    return _restore(output, input_path) if resume else _start(output, input_path)


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
        ids: BinaryIO = _ids_path(output).open("wb")
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


def _matches(path: Path, size: int, checksum: str) -> bool:
    """Whether ``path`` is a file of ``size`` bytes with sha256 ``checksum``."""
    try:
        return path.stat().st_size == size and _file_checksum(path) == checksum
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
        legacy = _format(output) == "jsonl" and finished is None
        if legacy and _matches(output, checkpoint.output_bytes, checkpoint.output_checksum):
            # left by a version that wrote no finished marker, stopped between the rename and the cleanup
            return RewardWriter(output, input_path, None, checkpoint, None)
        raise ResumeError(
            f"{partial} is missing, so the interrupted run cannot continue; delete {state} to start over"
        ) from None
    except OSError as exc:
        raise OutputError(f"cannot write {partial}: {exc}") from exc
    try:
        ids: BinaryIO = _ids_path(output).open("wb")
    except OSError as exc:
        data.close()
        raise WriteError(_ids_path(output), exc, checkpoint.rows_done) from exc
    writer = RewardWriter(output, input_path, data, checkpoint, ids)
    try:
        writer._rewind(checkpoint)
    except BaseException:
        writer.close()
        raise
    return writer


@contextlib.contextmanager
def open_run(
    input_path: str | Path, output: str | Path, *, resume: bool = False
) -> Iterator[tuple[RowReader, RewardWriter]]:
    """The rows still to score and the writer of their rewards, checked against each other.

    Fresh: the reader starts at the first row. Resumed: the writer is restored from its state,
    the reader skips the rows already done, and the run is refused (:class:`ResumeError`) if
    those rows differ from the ones the interrupted run read; if the run had already finished
    (``writer.already_finished``), the reader has nothing left to read and the input is not
    opened. Both are closed on exit; the run is complete only once the caller has called
    ``writer.finish()``. The run holds ``OUT.lock`` all along: a second run for the same output
    is refused (:class:`OutputError`) while it does.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_exclusive(Path(output)))
        if resume:
            writer = stack.enter_context(open_output(output, input_path=input_path, resume=True))
            if writer.already_finished:  # only the cleanup is left: the input is neither needed nor read
                rows = RowReader.done(input_path, writer.rows_written)
            else:
                rows = stack.enter_context(open_rows(input_path, start=writer.rows_written))
                writer.check_input(rows)
        else:
            rows = stack.enter_context(open_rows(input_path))
            writer = stack.enter_context(open_output(output, input_path=input_path, resume=False))
        yield rows, writer


def _id_kind(value: Any) -> IdKind:
    if value is None:
        return "null"
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return "int"
    if isinstance(value, str):
        return "str"
    return "json"


def _merge(a: IdKind, b: IdKind) -> IdKind:
    if a == "null" or a == b:
        return b
    if b == "null":
        return a
    return "json"


def _batches(f: BinaryIO) -> Iterator[list[dict[str, Any]]]:
    """The spool's records, parsed, :data:`SPOOL_PARSE_ROWS` at a time (parsed dicts are large; Arrow is not)."""
    while lines := list(islice(f, SPOOL_PARSE_ROWS)):
        yield [orjson.loads(line) for line in lines]


def _spool_to_parquet(spool: Path, target: Path) -> None:
    """Convert the JSON Lines spool to a Parquet file, streaming; two passes, the first picks the ``id`` type.

    Records are parsed a few thousand at a time and kept as Arrow batches until a row group's worth
    is ready: peak memory stays that of one row group in Arrow, whatever the spool's size.
    """
    kind: IdKind = "null"
    with spool.open("rb") as f:
        for batch in _batches(f):
            for record in batch:
                kind = _merge(kind, _id_kind(record["id"]))
    id_type = pa.int64() if kind == "int" else pa.string()
    json_columns = "id,verifier" if kind == "json" else "verifier"
    schema = pa.schema(
        [
            pa.field("id", id_type),
            pa.field("reward", pa.float64(), nullable=False),
            pa.field("verifier", pa.string(), nullable=False),
        ],
        metadata={JSON_COLUMNS_KEY: json_columns.encode()},
    )

    def arrow(batch: list[dict[str, Any]]) -> pa.RecordBatch:
        ids = [r["id"] for r in batch]
        if kind == "json":
            ids = [None if i is None else orjson.dumps(i).decode() for i in ids]
        columns = [
            pa.array(ids, type=id_type),
            pa.array([r["reward"] for r in batch], type=pa.float64()),
            pa.array([orjson.dumps(r["verifier"]).decode() for r in batch], type=pa.string()),
        ]
        return pa.record_batch(columns, schema=schema)

    with spool.open("rb") as f, pq.ParquetWriter(target, schema) as writer:
        group: list[pa.RecordBatch] = []
        for batch in _batches(f):
            group.append(arrow(batch))
            if sum(b.num_rows for b in group) >= PARQUET_BATCH_ROWS:
                writer.write_table(pa.Table.from_batches(group), row_group_size=PARQUET_BATCH_ROWS)
                group = []
        if group:
            writer.write_table(pa.Table.from_batches(group), row_group_size=PARQUET_BATCH_ROWS)


@dataclass(frozen=True, slots=True)
class RewardRecord:
    """One record of an output file."""

    id: Any
    reward: float
    verifier: Mapping[str, Any]


def read_rewards(path: str | Path) -> Iterator[RewardRecord]:
    """The records of a complete output file (JSON Lines or Parquet), streamed, in order."""
    path = Path(path)
    if _format(path) == "jsonl":
        with path.open("rb") as f:
            for line in f:
                if not line.isspace():
                    data = orjson.loads(line)
                    yield RewardRecord(data["id"], data["reward"], data["verifier"])
        return
    with pq.ParquetFile(path) as pf:
        metadata = pf.schema_arrow.metadata or {}
        json_columns = set(metadata.get(JSON_COLUMNS_KEY, b"").decode().split(","))

        def column(batch: pa.RecordBatch, name: str) -> list[Any]:
            values = batch.column(name).to_pylist()
            if name in json_columns:
                return [None if v is None else orjson.loads(v) for v in values]
            return values

        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["id", "reward", "verifier"]):
            for row_id, reward, verifier in zip(
                column(batch, "id"), column(batch, "reward"), column(batch, "verifier"), strict=True
            ):
                yield RewardRecord(row_id, reward, verifier)
