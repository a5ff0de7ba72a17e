"""A backfill's input: stored trajectories, read as a stream, validated and checksummed (``engine score``, ``bench``).

An input file holds one row per rollout with the fields ``id``, ``environment``, ``task`` and
``trajectory``. Two formats are read, chosen by the file's extension:

* JSON Lines (``.jsonl``, ``.ndjson``, ``.json-lines``): one JSON object a line. Blank lines are
  skipped but still counted, so a row's number is its line number in an editor.
* Parquet (``.parquet``): the same four columns, read in batches of :data:`BATCH_ROWS` rows; other
  columns are ignored. A row's number is its 1-based position in the file. Because Parquet tables
  are often written from data frames that hold nested values as text, ``task`` and
  ``trajectory`` may each be nested values (struct, list) or JSON text:

  - a ``task`` that is a string is always decoded as JSON (a task must be an object);
  - a ``trajectory`` that is a string is decoded only if it is JSON text of an array or an object;
    any other string (plain text, ``"42"``) stays the string it is, since a bare string is a
    legitimate trajectory.

  In JSON Lines no such decoding happens: the values are already JSON.

Memory stays flat whatever the file's size: JSON Lines is read one line at a time, Parquet one
batch at a time, and only the current row (or batch) is ever held.

**Checksum.** A resumed run must refuse an input that changed under it, so the reader keeps a
running sha256 of what it has consumed; :meth:`RowReader.checksum` is that digest through the
rows read so far. For JSON Lines it is the sha256 of the file's bytes up to the end of the last
row's line (blank lines before it included, blank lines after it not): reading on to the end of
the file, as the last short chunk does, must not change it, since a resume skipping those rows
stops right after the last one. For Parquet, whose
bytes depend on the writer, it is the sha256 of the rows' values: each row's four values, as read
and before any JSON-text decoding, encoded as one orjson array.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Literal, Self

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from engine._backfill.files import Closing, checksum, file_format, unsupported
from engine._errors import InputError

__all__ = ["BATCH_ROWS", "COUNT_BLOCK", "FIELDS", "Row", "RowReader", "count_rows", "open_rows"]

FIELDS: tuple[str, ...] = ("id", "environment", "task", "trajectory")
BATCH_ROWS = 1024  # Parquet rows decoded at once: small enough to keep memory flat, big enough to be fast
COUNT_BLOCK = 1 << 20  # bytes read at a time to count a JSON Lines file's lines

Unit = Literal["line", "row"]
UNITS: dict[str, Unit] = {"jsonl": "line", "parquet": "row"}  # what a row's number counts, per format


@dataclass(frozen=True, slots=True)
class Row:
    """One validated input row. ``number`` is its line (JSON Lines) or row (Parquet), from 1."""

    number: int
    id: Any
    environment: str
    task: Mapping[str, Any]
    trajectory: Any

    def as_item(self) -> dict[str, Any]:
        """The row as an item for ``Engine.score``."""
        return {"id": self.id, "environment": self.environment, "task": self.task, "trajectory": self.trajectory}


class RowReader(Closing):
    """An iterator of :class:`Row` over one input file; use :func:`open_rows` to get one.

    It is also a context manager that closes the file. ``rows_read`` counts the rows consumed so
    far, skipped ones included; :meth:`checksum` covers exactly those rows.
    """

    _raw: Iterator[tuple[int, Any]]

    def __init__(self, path: Path, *, start: int = 0) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be a whole number >= 0, got {start!r}")
        self._empty(path)
        try:
            self._raw = self._open_jsonl() if self.unit == "line" else self._open_parquet()
            # Skipping happens now, not on the first next(), so checksum() covers the skipped rows
            # as soon as the reader exists: that is what a resume compares against its state.
            for _ in islice(self._raw, start):
                pass
        except BaseException:
            self.close()
            raise

    def _empty(self, path: Path) -> None:
        """Set up a reader of ``path`` that has read nothing and opened nothing."""
        fmt = file_format(path)
        if fmt is None:
            raise InputError(path, unsupported(path))
        self.unit: Unit = UNITS[fmt]
        self.path = path
        self.rows_read = 0
        self._hash = hashlib.sha256()
        self._through_last_row: hashlib._Hash | None = None  # _hash at the last row, while blank lines follow
        self._file: BinaryIO | None = None
        self._parquet: pq.ParquetFile | None = None
        self._raw = iter(())

    @classmethod
    def done(cls, path: str | Path, rows_read: int) -> RowReader:
        """A reader past the last of ``rows_read`` rows that never opens ``path``: nothing is left to read.

        For a run that had already finished: completing its cleanup must not need the input, which
        may have been edited or moved since. Its :meth:`checksum` covers nothing.
        """
        reader = cls.__new__(cls)
        reader._empty(Path(path))
        reader.rows_read = rows_read
        return reader

    def _fail(self, number: int, reason: str) -> InputError:
        return InputError(self.path, reason, unit=self.unit, number=number)

    def _open_jsonl(self) -> Iterator[tuple[int, Any]]:
        try:
            self._file = self.path.open("rb")
        except OSError as exc:
            raise InputError(self.path, f"cannot read: {exc}") from exc
        return self._jsonl(self._file)

    def _jsonl(self, file: BinaryIO) -> Iterator[tuple[int, Any]]:
        """``(line number, raw line)`` per non-blank line, hashing every byte up to it."""
        number = 0
        for line in file:
            number += 1
            if line.isspace():
                if self._through_last_row is None:
                    self._through_last_row = self._hash.copy()
                self._hash.update(line)
                continue
            self._hash.update(line)
            self._through_last_row = None
            self.rows_read += 1
            yield number, line

    def _open_parquet(self) -> Iterator[tuple[int, Any]]:
        try:
            self._parquet = pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(self.path, f"cannot read as Parquet: {exc}") from exc
        names = set(self._parquet.schema_arrow.names)
        missing = [name for name in FIELDS if name not in names]
        if missing:
            raise InputError(self.path, f"missing column(s) {', '.join(map(repr, missing))} (a row needs {FIELDS})")
        return self._parquet_rows(self._parquet)

    def _parquet_rows(self, file: pq.ParquetFile) -> Iterator[tuple[int, Any]]:
        """``(row number, (id, environment, task, trajectory))`` per row, as stored, hashing each."""
        number = 0
        try:
            for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=list(FIELDS)):
                columns = [batch.column(name).to_pylist() for name in FIELDS]
                for values in zip(*columns, strict=True):
                    number += 1
                    try:
                        self._hash.update(orjson.dumps(values))
                    except orjson.JSONEncodeError as exc:
                        raise self._fail(number, f"holds a value JSON cannot represent: {exc}") from exc
                    self.rows_read += 1
                    yield number, values
        except (OSError, pa.ArrowException) as exc:
            raise InputError(self.path, f"cannot read as Parquet after row {number}: {exc}") from exc

    def _decode(self, number: int, raw: Any) -> Row:
        if self.unit == "line":
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise self._fail(number, _invalid_json(raw, number, exc)) from None
            if not isinstance(data, dict):
                raise self._fail(number, f"must be a JSON object, got {type(data).__name__}")
            missing = [name for name in FIELDS if name not in data]
            if missing:
                raise self._fail(number, f"missing field(s) {', '.join(map(repr, missing))} (a row needs {FIELDS})")
            row_id, environment, task, trajectory = (data[name] for name in FIELDS)
            if not isinstance(row_id, str | int | None):  # a float, a list or an object: rare, and checked
                try:
                    orjson.dumps({"id": row_id})  # as the output's record will hold it
                except orjson.JSONEncodeError as exc:  # nested deeper than orjson writes (and _has_float recurses)
                    raise self._fail(number, f"'id' cannot be written to the output as JSON: {exc}") from None
                if _has_float(row_id) and (exact := _rounded(raw, row_id)):
                    what = "an integer id" if isinstance(row_id, float) else "an integer in an id"
                    reason = f"'id' {_id_text(exact[0])}: {what} must fit in 64 bits; write it as a string"
                    raise self._fail(number, reason)
        else:
            row_id, environment, task, trajectory = raw
            if isinstance(task, str):
                try:
                    task = orjson.loads(task)
                except orjson.JSONDecodeError as exc:
                    raise self._fail(number, f"'task' is text but not valid JSON: {exc}") from None
            if isinstance(trajectory, str) and trajectory.lstrip()[:1] in ("[", "{"):
                with contextlib.suppress(orjson.JSONDecodeError):  # text that merely starts with a bracket stays text
                    trajectory = orjson.loads(trajectory)
        if not isinstance(environment, str) or not environment:
            raise self._fail(number, f"'environment' must be an environment's name, got {environment!r}")
        if not isinstance(task, dict):
            raise self._fail(number, f"'task' must be an object, got {type(task).__name__}")
        return Row(number=number, id=row_id, environment=environment, task=task, trajectory=trajectory)

    def checksum(self) -> str:
        """``sha256:<hex>`` of the rows consumed so far (see the module docstring)."""
        done = self._hash if self._through_last_row is None else self._through_last_row
        return checksum(done)

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Row:
        number, raw = next(self._raw)
        return self._decode(number, raw)

    def close(self) -> None:
        """Close the file; the reader yields nothing more."""
        self._raw = iter(())
        if self._file is not None:
            self._file.close()
        if self._parquet is not None:
            self._parquet.close()


def _has_float(value: Any) -> bool:
    """Whether ``value`` is a float or holds one (in a list or an object, at any depth)."""
    if isinstance(value, float):
        return True
    if isinstance(value, list):
        return any(map(_has_float, value))
    if isinstance(value, dict):
        return any(map(_has_float, value.values()))
    return False


def _rounded(line: bytes, row_id: Any) -> tuple[Any] | None:
    """``(the id as written,)`` if orjson rounded an integer in ``row_id``, the row's id as it read it; else None.

    orjson reads integers from -2**63 to 2**64 - 1 exactly and any other as a float: two different
    wider ids (or ids holding one, as a list or an object can) could then be written as one. The
    standard parser keeps every integer exactly, so where the two read the id differently, one was
    rounded; it runs only for ids holding a float, which are rare.
    """
    try:
        exact = json.loads(line).get("id")
    except (ValueError, RecursionError):
        return None
    return None if _same(exact, row_id) else (exact,)


def _same(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are the same, types included (2**64 and its float are equal numbers)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return bool(a == b)


def _id_text(row_id: Any) -> str:
    text = str(row_id)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"


def _invalid_json(line: bytes, number: int, exc: orjson.JSONDecodeError) -> str:
    """Why a line is not JSON; for bytes that are not UTF-8, where (orjson's own message says "surrogates")."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        return (
            f"invalid UTF-8 at byte {bad.start + 1} of line {number} (counted from 1 within the line; "
            f"{bad.reason}: {bad.object[bad.start : bad.end]!r})"
        )
    return f"invalid JSON: {exc}"


def open_rows(path: str | Path, *, start: int = 0) -> RowReader:
    """A :class:`RowReader` over ``path``, after skipping its first ``start`` rows.

    Skipped rows are not validated (a resumed run validated them the first time) but are read
    and hashed, so :meth:`RowReader.checksum` covers them. If the file has fewer than ``start``
    rows, ``rows_read`` says how many it had. Raises :class:`InputError` for an unsupported
    extension or an unreadable file, and on iteration for a bad row.
    """
    return RowReader(Path(path), start=start)


def count_rows(path: Path) -> int | None:
    """The number of rows in an input file, cheaply (for a progress bar's total); None if unknown."""
    fmt = file_format(path)
    try:
        if fmt == "jsonl":
            lines, last = 0, b"\n"
            with path.open("rb") as f:
                while block := f.read(COUNT_BLOCK):
                    lines += block.count(b"\n")
                    last = block[-1:]
            return lines + (last != b"\n")
        if fmt == "parquet":
            return int(pq.ParquetFile(path).metadata.num_rows)
    except (OSError, ValueError):
        pass
    return None
