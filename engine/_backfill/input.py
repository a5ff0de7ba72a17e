"""A backfill's input: stored trajectories, read as a stream, validated and checksummed (``engine score``, ``bench``).

What each column may hold, and what a plugin receives from it: the README's **Input**. Memory stays flat (one
line, or one Parquet batch, at a time); :meth:`RowReader.checksum` lets a resume refuse an input that changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol, Self

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine import _json
from engine._backfill.files import EMPTY_CHECKSUM, Closing, checksum, file_format, unsupported
from engine._backfill.parquet import JSON_COLUMNS_KEY
from engine._columns import FIELDS, TASK_KEY, Columns
from engine._errors import InputError, ManifestError

__all__ = [
    "BATCH_ROWS",
    "COUNT_BLOCK",
    "FIELDS",
    "JSON_TEXT_COLUMNS",
    "Environments",
    "Row",
    "RowDecoder",
    "RowReader",
    "count_rows",
    "json_columns",
    "named_environments",
    "open_rows",
    "rows_at",
]

JSON_TEXT_COLUMNS: tuple[str, ...] = ("task", "trajectory")  # what a caller may say a Parquet file holds as JSON text
BATCH_ROWS = 1024  # Parquet rows decoded at once: small enough to keep memory flat, big enough to be fast
NAMES_BATCH_ROWS = 1 << 16  # Parquet rows of the environment column alone read at once, for named_environments
COUNT_BLOCK = 1 << 20  # bytes read at a time to count a JSON Lines file's lines

Unit = Literal["line", "row"]
UNITS: dict[str, Unit] = {"jsonl": "line", "parquet": "row"}  # what a row's number counts, per format
_WIDEST = (-(2**63), 2**64)  # the integers an output can hold (orjson writes them; int64 or JSON text in Parquet)
_MISSING: Any = object()  # what a JSON object lacking a source's key gives (a null is a value)


def json_columns(names: Iterable[str]) -> frozenset[str]:
    """``names`` as the columns a Parquet input holds as JSON text, checked (``--json-columns``).

    Raises:
        ValueError: a name is not one of :data:`JSON_TEXT_COLUMNS`.
    """
    chosen = frozenset(name.strip() for name in names)
    unknown = sorted(chosen - set(JSON_TEXT_COLUMNS))
    if unknown:
        raise ValueError(
            f"JSON text columns can be {' and '.join(JSON_TEXT_COLUMNS)} only, not {', '.join(map(repr, unknown))}"
        )
    return chosen


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


class Environments(Protocol):
    """What rows are checked against: an engine, which knows its environments."""

    def environment(self, name: str) -> object: ...


@dataclass(frozen=True, slots=True)
class _Slot:
    """One field of a row (or one ``task.<key>`` entry) and where it is read from: ``column``, its source's
    first part's place among the columns read (:attr:`Columns.reads`), then ``keys``, the rest of its path."""

    name: str
    source: str
    column: int
    keys: tuple[str, ...]

    def prefix(self, depth: int) -> str:
        """The source's first ``depth`` parts: what the path has reached before its ``depth``-th key."""
        return ".".join(self.source.split(".")[:depth])


class RowDecoder:
    """One input file's rows, checked and decoded as ``engine score`` reads them; its errors name the file and row.

    The reader (:class:`RowReader`) decodes each row it reads with one; the Ray actors, which read their blocks
    themselves, and ``engine.ray``'s datasets use one of their own. A Parquet row is decoded after
    :meth:`use_schema` has said which of its columns are JSON text and which hold structs.

    Args:
        path: The file, named in errors; its extension says its format (it is never opened here).
        listed: Parquet columns holding JSON text besides those the file's metadata names (:func:`json_columns`);
            JSON Lines values are JSON already and are never decoded.
        columns: Where each field is read from (``--columns``); None: the column of its own name.

    Raises:
        InputError: ``path``'s extension is not an input format's.
        ValueError: a name in ``listed`` is not one of :data:`JSON_TEXT_COLUMNS`.
    """

    def __init__(self, path: Path, listed: Collection[str] = (), columns: Columns | None = None) -> None:
        fmt = file_format(path)
        if fmt is None:
            raise InputError(path, unsupported(path))
        self.path = path
        self.unit: Unit = UNITS[fmt]
        self._listed = json_columns(listed)
        self.columns = Columns() if columns is None else columns
        self.reads = self.columns.reads  # the columns (JSON Lines: the keys) a row is read from, in this order
        self._slots = tuple(
            _Slot(name, source, self.reads.index(first), tuple(keys))
            for name, source in self.columns.sources
            for first, *keys in [source.split(".")]
        )
        self.decoded: frozenset[str] = frozenset()  # the fields read as JSON text (Parquet: see use_schema)
        # Parquet, per use_schema: the columns read as JSON text (the file's metadata says so), and per slot:
        # its value decoded from JSON text, its struct type (checked for null fields), and whether its path goes
        # through struct fields (a null there may be a key the row lacks)
        self._json_reads: tuple[int, ...] = ()
        # each field its own column, read as it is (no path, no decoding, no struct to check): the common case,
        # taken without the per-field loop (JSON Lines: unless a row lacks a column)
        self._direct = all(not slot.keys and slot.column == index for index, slot in enumerate(self._slots))
        self._plain = self._direct and self.unit == "line"
        count = len(self._slots)
        self._decode: tuple[bool, ...] = (False,) * count
        self._structs: tuple[pa.DataType | None, ...] = (None,) * count
        self._in_struct: tuple[bool, ...] = (False,) * count

    def use_schema(self, schema: pa.Schema) -> None:
        """Read Parquet rows of ``schema`` from now on: which columns are JSON text, which hold structs.

        A column is JSON text if the schema's metadata (``engine.json_columns``) names it; a field's value is
        JSON text if ``listed`` names the field, or if it is a text ``task`` (a task must be an object: text
        can only be JSON). A source dotted past a column (``reward_model.ground_truth``) reaches into a struct,
        or into a column of JSON text.

        Raises:
            InputError: a column or a struct's field is missing, a source dots into a column that is neither
                a struct nor JSON text, or one listed as JSON text is not text.
        """
        present = set(schema.names)
        missing = [name for name in self.reads if name not in present]
        if missing:
            raise InputError(self.path, f"missing column(s) {self._missing(missing)}; the file has {_names(schema)}")
        in_file = set((schema.metadata or {}).get(JSON_COLUMNS_KEY, b"").decode(errors="replace").split(","))
        for name in self.reads:
            if name in in_file and not _is_text(kind := schema.field(name).type):
                raise InputError(
                    self.path, f"its metadata ({JSON_COLUMNS_KEY.decode()}) lists {name!r} as JSON text, but the "
                    f"column is {kind}"
                )
        if "task" in self._listed and not self.columns.whole_task:
            raise InputError(self.path, "--json-columns lists 'task', but the column mapping builds the task of "
                             "task.<key> entries, each read as stored")
        decode: list[bool] = []
        structs: list[pa.DataType | None] = []
        in_struct: list[bool] = []
        decoded: set[str] = set()
        for slot in self._slots:
            through_json = self.reads[slot.column] in in_file
            kind = schema.field(self.reads[slot.column]).type
            if not through_json:
                kind = self._reach(slot, kind)
            listed = slot.name in self._listed and not through_json
            if listed and not _is_text(kind):
                what = "the column" if slot.source == slot.name else repr(slot.source)
                raise InputError(self.path, f"--json-columns lists {slot.name!r} as JSON text, but {what} is {kind}")
            text = listed or (slot.name == "task" and not through_json and _is_text(kind))
            decode.append(text)
            structs.append(kind if not through_json and not text and _holds_struct(kind) else None)
            in_struct.append(not through_json and bool(slot.keys))
            if text or (through_json and not slot.keys):
                decoded.add(slot.name)
        self._json_reads = tuple(index for index, name in enumerate(self.reads) if name in in_file)
        self._decode, self._structs, self._in_struct = tuple(decode), tuple(structs), tuple(in_struct)
        self._plain = self._direct and not (self._json_reads or any(decode) or any(structs))
        self.decoded = frozenset(decoded)

    def error(self, number: int, reason: str) -> InputError:
        """The error naming row ``number`` of the file."""
        return InputError(self.path, reason, unit=self.unit, number=number)

    def decode(self, number: int, raw: Any) -> Row:
        """Row ``number``, from its line (JSON Lines: bytes) or the values of its columns :attr:`reads` as stored
        (Parquet), each field read from its source, checked.

        Raises:
            InputError: the row is not one (not JSON, a field missing or of the wrong type, an id the output
                cannot hold), naming its line or row.
        """
        if self.unit == "line":
            try:
                data = _json.loads(raw)  # every integer exact: a task's 2**64 + 1 reaches the plugin as it is
            except _json.JSONDecodeError as exc:
                raise self.error(number, _invalid_json(raw, number, exc)) from None
            if not isinstance(data, dict):
                raise self.error(number, f"must be a JSON object, got {type(data).__name__}")
            if self._plain:
                try:
                    plain = [data[name] for name in self.reads]
                except KeyError:
                    pass  # said below, with every source the row lacks
                else:
                    return self._row(number, plain)
            values = [data.get(name, _MISSING) for name in self.reads]
        elif self._plain:
            return self._row(number, list(raw))
        else:
            values = list(raw)
            for index in self._json_reads:
                values[index] = self._json_text(number, self.reads[index], values[index])
        fields: list[Any] = []
        missing: list[_Slot] = []
        for index, slot in enumerate(self._slots):
            value = values[slot.column]
            if value is not _MISSING and slot.keys:
                value = self._follow(number, slot, value)
            if value is _MISSING:
                missing.append(slot)
            elif self.unit == "row":
                fields.append(self._stored(number, index, slot, value))
            else:
                fields.append(value)
        if missing:
            raise self.error(number, f"missing field(s) {self._missing([slot.source for slot in missing])}")
        return self._row(number, fields)

    def _row(self, number: int, fields: list[Any]) -> Row:
        """Row ``number`` of the values of its fields, in the mapping's order, checked."""
        row_id, environment, trajectory = fields[0], fields[1], fields[-1]
        if self.columns.whole_task:
            task = fields[2]
        else:
            entries = zip(self._slots[2:-1], fields[2:-1], strict=True)
            task = {slot.name[len(TASK_KEY):]: value for slot, value in entries}
        if not (row_id is None or isinstance(row_id, str) or (type(row_id) is int and _fits(row_id))):
            self._check_id(number, row_id)
        if not isinstance(environment, str) or not environment:
            raise self.error(number, f"{self._named('environment')} must be an environment's name, got {environment!r}")
        if not isinstance(task, dict):
            raise self.error(number, f"{self._named('task')} must be an object, got {type(task).__name__}")
        return Row(number=number, id=row_id, environment=environment, task=task, trajectory=trajectory)

    def check_environments(self, rows: Iterable[Row], engine: Environments) -> None:
        """Refuse rows naming an environment ``engine`` does not have, by the first one's line, before any is scored.

        Raises:
            InputError: a row names no environment of ``engine``'s.
            ManifestError: an environment's manifest is broken (a config error, reported as such).
        """
        for row in rows:
            try:
                engine.environment(row.environment)
            except ManifestError:
                raise
            except ValueError as exc:
                raise self.error(row.number, str(exc)) from None

    def _named(self, name: str) -> str:
        """Field ``name`` as an error names it: with its source, when the mapping reads it from another."""
        source = self.columns.source_of(name)
        return f"{name!r}" if source in (None, name) else f"{name!r} (read from {source!r})"

    def _missing(self, sources: list[str]) -> str:
        """Sources a file or row lacks, each with the field the mapping reads from it; or what a row needs."""
        if self.columns.is_default:
            return f"{', '.join(map(repr, dict.fromkeys(sources)))} (a row needs {FIELDS})"
        read_as = {source: [slot.name for slot in self._slots if source in (slot.source, self.reads[slot.column])]
                   for source in dict.fromkeys(sources)}
        return ", ".join(repr(source) if names == [source] else f"{source!r} (read as {', '.join(names)})"
                         for source, names in read_as.items())

    def _reach(self, slot: _Slot, kind: pa.DataType) -> pa.DataType:
        """The type ``slot``'s path reaches through struct fields from its column's type ``kind``.

        Raises:
            InputError: a part of the path is not a struct, or has no such field.
        """
        for depth, key in enumerate(slot.keys, 1):
            where = slot.prefix(depth)
            if not pa.types.is_struct(kind):
                raise InputError(self.path, f"{slot.source!r} (read as {slot.name}) cannot be read: {where!r} is "
                                 f"{kind}, not a struct (nor a column the file's {JSON_COLUMNS_KEY.decode()} "
                                 "metadata lists as JSON text)")
            index = kind.get_field_index(key)
            if index < 0:
                fields = ", ".join(repr(field.name) for field in kind)
                raise InputError(self.path, f"missing field {slot.source!r} (read as {slot.name}): {where!r} has "
                                 f"fields {fields}")
            kind = kind.field(index).type
        return kind

    def _follow(self, number: int, slot: _Slot, value: Any) -> Any:
        """The value ``slot``'s path reaches from its column's ``value``; :data:`_MISSING` where an object lacks
        a key (a struct never does: its fields are the schema's)."""
        for depth, key in enumerate(slot.keys, 1):
            if not isinstance(value, dict):
                what = "null" if value is None else f"{_json_type(value)}, not an object"
                raise self.error(number, f"{slot.source!r} (read as {slot.name}) cannot be read: "
                                 f"{slot.prefix(depth)!r} is {what}")
            if key not in value:
                return _MISSING
            value = value[key]
        return value

    def _json_text(self, number: int, name: str, value: Any) -> Any:
        """``value``, JSON text in ``name``, decoded (a null stays null)."""
        if value is None:
            return None
        try:
            return _json.loads(value)
        except _json.JSONDecodeError as exc:
            raise self.error(number, f"{name!r} is text but not valid JSON: {exc}") from None

    def _stored(self, number: int, index: int, slot: _Slot, value: Any) -> Any:
        """The ``value`` Parquet slot ``index`` reached: decoded if it is JSON text, refused if it is a null struct
        field or a struct (at any depth) with one, which may be a key only other rows have."""
        if self._decode[index]:
            return self._json_text(number, slot.source, value)
        where = slot.source if value is None and self._in_struct[index] else None
        kind = self._structs[index]
        if where is None and kind is not None:
            where = _null_field(kind, value, slot.source)
        if where is None:
            return value
        column = self.reads[slot.column]
        if slot.name == "task" and not slot.keys:
            store = "as JSON text"
        elif slot.name == "trajectory" and not slot.keys:
            store = f"as JSON text and pass --json-columns {slot.name}"
        else:
            store = f"as JSON text, listed in the file's {JSON_COLUMNS_KEY.decode()} metadata"
        raise self.error(
            number,
            f"{where} is null in a struct column: Arrow gives a struct every key any row has, null where a row "
            f"has none, so a key this row lacks cannot be told from one holding null; store {column!r} {store}",
        )

    def _check_id(self, number: int, row_id: Any) -> None:
        """Refuse an id the output cannot hold as it is: an integer outside 64 bits (in it, at any depth), or one
        nested deeper than orjson writes."""
        named = self._named("id")
        wide = _wide_integer(row_id)
        if wide is not None:
            what = "an integer id" if wide is row_id else "an integer in an id"  # shown exactly, as it was written
            raise self.error(number, f"{named} {_id_text(row_id)}: {what} must fit in 64 bits; write it as a string")
        try:
            orjson.dumps({"id": row_id})  # as the output's record will hold it
        except orjson.JSONEncodeError as exc:
            raise self.error(number, f"{named} cannot be written to the output as JSON: {exc}") from None


class RowReader(Closing):
    """An iterator of :class:`Row` over one input file; use :func:`open_rows` to get one.

    It is also a context manager that closes the file. ``rows_read`` counts the rows consumed so
    far, skipped ones included; :meth:`checksum` covers exactly those rows. ``json_columns``
    (:func:`json_columns`) names Parquet columns holding JSON text besides those the file's
    metadata names; JSON Lines values are JSON already and are never decoded. ``columns`` says where
    each field is read from (:class:`Columns`; None: the column of its own name). Each row is checked
    and decoded by its :class:`RowDecoder` (``decoder``).
    """

    _raw: Iterator[tuple[int, Any]]

    def __init__(self, path: Path, *, start: int = 0, json_columns: Collection[str] = (),
                 columns: Columns | None = None) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be a whole number >= 0, got {start!r}")
        self._empty(path, json_columns, columns)
        if not self.decoder.columns.is_default:  # a resume reading other columns reads other rows
            self._hash.update(b"columns:" + _json.dumps(self.decoder.columns.sources) + b"\n")
        try:
            self._raw = self._open_jsonl() if self.unit == "line" else self._open_parquet()
            # Skipping happens now, not on the first next(), so checksum() covers the skipped rows
            # as soon as the reader exists: that is what a resume compares against its state.
            for _ in islice(self._raw, start):
                pass
        except BaseException:
            self.close()
            raise

    def _empty(self, path: Path, listed: Collection[str], columns: Columns | None = None) -> None:
        """Set up a reader of ``path`` that has read nothing and opened nothing."""
        self.decoder = RowDecoder(path, listed, columns)
        self.unit: Unit = self.decoder.unit
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
        reader._empty(Path(path), ())
        reader.rows_read = rows_read
        return reader

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
        self.decoder.use_schema(self._parquet.schema_arrow)
        if also := ",".join(sorted(self.decoder.decoded - {"task"})):  # a resume decoding otherwise reads other rows
            self._hash.update(f"json_columns:{also}\n".encode())
        return self._parquet_rows(self._parquet)

    def _parquet_rows(self, file: pq.ParquetFile) -> Iterator[tuple[int, Any]]:
        """``(row number, the values of the decoder's columns)`` per row, as stored, hashing each."""
        number = 0
        reads = list(self.decoder.reads)
        try:
            for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=reads):
                columns = [batch.column(name).to_pylist() for name in reads]
                for values in zip(*columns, strict=True):
                    number += 1
                    try:
                        self._hash.update(_json.dumps(values))
                    except TypeError as exc:
                        raise self.decoder.error(number, f"holds a value JSON cannot represent: {exc}") from exc
                    self.rows_read += 1
                    yield number, values
        except (OSError, pa.ArrowException) as exc:
            raise InputError(self.path, f"cannot read as Parquet after row {number}: {exc}") from exc

    def checksum(self) -> str:
        """``sha256:<hex>`` of the rows consumed so far, which a resume compares with its state.

        JSON Lines: the file's bytes up to the end of the last row's line (blank lines before it
        included, after it not: reading on to the end of the file, as the last short chunk does,
        must leave what a resume skipping those rows finds). Parquet, whose bytes depend on the
        writer: each row's values of the columns read, as stored (before any decoding), each as a JSON
        array, after the names of the columns decoded besides ``task``, if any (a resume decoding others
        is refused). Either after the column mapping, unless it is the default (a resume reading other
        columns is refused). No rows: the checksum of nothing, as a run's state starts with.
        """
        if self.rows_read == 0:  # nothing scored yet: what a resume then reads with need not match anything
            return EMPTY_CHECKSUM
        done = self._hash if self._through_last_row is None else self._through_last_row
        return checksum(done)

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Row:
        number, raw = next(self._raw)
        return self.decoder.decode(number, raw)

    def close(self) -> None:
        """Close the file; the reader yields nothing more."""
        self._raw = iter(())
        if self._file is not None:
            self._file.close()
        if self._parquet is not None:
            self._parquet.close()


def _fits(value: int) -> bool:
    return _WIDEST[0] <= value < _WIDEST[1]


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):  # a data frame's categorical column
        kind = kind.value_type
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind))


def _list_item(kind: pa.DataType) -> pa.DataType | None:
    """The item type of a list type; None for any other type."""
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list, pa.types.is_list_view,
             pa.types.is_large_list_view)
    item: pa.DataType | None = kind.value_type if any(test(kind) for test in lists) else None  # type: ignore[attr-defined]
    return item


def _holds_struct(kind: pa.DataType) -> bool:
    if pa.types.is_struct(kind):
        return True
    item = _list_item(kind)
    return item is not None and _holds_struct(item)


def _null_field(kind: pa.DataType, value: Any, where: str) -> str | None:
    """Where in ``value``, of Arrow type ``kind``, a struct's field is null (``task.a[2].b``); None if nowhere."""
    if value is None:
        return None
    if pa.types.is_struct(kind):
        for field in kind:
            inner = value.get(field.name)
            if inner is None:
                return f"{where}.{field.name}"
            if (found := _null_field(field.type, inner, f"{where}.{field.name}")) is not None:
                return found
        return None
    item = _list_item(kind)
    if item is not None and _holds_struct(item):
        for index, inner in enumerate(value):
            if (found := _null_field(item, inner, f"{where}[{index}]")) is not None:
                return found
    return None


def _wide_integer(value: Any) -> int | None:
    """The first integer in ``value`` (itself, or in a list or an object at any depth) an output cannot hold."""
    if type(value) is int:
        return None if _fits(value) else value
    parts = value if isinstance(value, list) else value.values() if isinstance(value, dict) else ()
    for part in parts:
        if (found := _wide_integer(part)) is not None:
            return found
    return None


def _names(schema: pa.Schema) -> str:
    """A schema's column names, for an error: the first twenty."""
    names = schema.names
    shown = ", ".join(map(repr, names[:20]))
    return f"columns {shown}" + (f" and {len(names) - 20} more" if len(names) > 20 else "")


def _json_type(value: Any) -> str:
    """What JSON calls ``value``'s type."""
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "an array"}
    return kinds.get(type(value), type(value).__name__)


def _id_text(row_id: Any) -> str:
    text = str(row_id)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"


def _invalid_json(line: bytes, number: int, exc: _json.JSONDecodeError) -> str:
    """Why a line is not JSON; for bytes that are not UTF-8, where (orjson's own message says "surrogates")."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        return (
            f"invalid UTF-8 at byte {bad.start + 1} of line {number} (counted from 1 within the line; "
            f"{bad.reason}: {bad.object[bad.start : bad.end]!r})"
        )
    return f"invalid JSON: {exc}"


def open_rows(
    path: str | Path, *, start: int = 0, json_columns: Collection[str] = (), columns: Columns | None = None
) -> RowReader:
    """A :class:`RowReader` over ``path``, after skipping its first ``start`` rows.

    Skipped rows are not validated (a resumed run validated them the first time) but are read
    and hashed, so :meth:`RowReader.checksum` covers them. If the file has fewer than ``start``
    rows, ``rows_read`` says how many it had. Raises :class:`InputError` for an unsupported
    extension or an unreadable file, and on iteration for a bad row. ``json_columns``: see
    :class:`RowReader` (``ValueError`` for a name that is not one of :data:`JSON_TEXT_COLUMNS`); ``columns``:
    where each field is read from (:class:`Columns`).
    """
    return RowReader(Path(path), start=start, json_columns=json_columns, columns=columns)


def rows_at(
    path: Path, positions: Collection[int], *, json_columns: Collection[str] = (), columns: Columns | None = None
) -> Iterator[tuple[int, Row]]:
    """``(position, row)`` of the rows of ``path`` at ``positions`` (counted from 1), in order, decoded and checked
    as :class:`RowReader` does; the others are neither decoded nor hashed (a JSON Lines line is only split off, a
    Parquet batch without one is never converted). For ``engine audit``, whose sample is a small share of its input.

    Raises:
        InputError: the file cannot be read, or a row at one of ``positions`` is not one.
    """
    decoder = RowDecoder(path, json_columns, columns)
    wanted = frozenset(positions)
    last = max(wanted, default=0)
    if decoder.unit == "line":
        try:
            with path.open("rb") as file:
                position = 0
                for number, line in enumerate(file, 1):
                    if line.isspace():
                        continue
                    position += 1
                    if position in wanted:
                        yield position, decoder.decode(number, line)
                        if position == last:
                            return
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc}") from exc
        return
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(path, f"cannot read as Parquet: {exc}") from exc
    with parquet:
        decoder.use_schema(parquet.schema_arrow)
        reads = list(decoder.reads)
        before = 0  # rows before the batch
        try:
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=reads):
                here = sorted(p for p in wanted if before < p <= before + batch.num_rows)
                if here:
                    taken = batch.take(pa.array([p - before - 1 for p in here]))
                    values = zip(*(taken.column(name).to_pylist() for name in reads), strict=True)
                    for position, raw in zip(here, values, strict=True):
                        yield position, decoder.decode(position, raw)
                before += batch.num_rows
                if before >= last:
                    return
        except (OSError, pa.ArrowException) as exc:
            raise InputError(path, f"cannot read as Parquet after row {before}: {exc}") from exc


def named_environments(path: Path, *, start: int = 0, source: str = "environment") -> dict[str, int]:
    """The environments the rows of ``path`` after its first ``start`` name, each with the number of the first row
    that does (its line, or row, as :class:`RowDecoder` numbers them), in the order they first appear. ``source``:
    where a row's environment is (a column mapping's: a column, or a dotted path into a struct or an object).

    A first pass, cheaper than the run's: a Parquet file's environment column alone, a JSON Lines file's lines
    parsed but nothing decoded or checked (measured on 100,000 rows, a cheap plugin's run: Parquet ~0.3% of it,
    JSON Lines 3% with short rows, 11% with 2 KB trajectories). A row that is not one, or names no environment,
    is skipped: the run reports it where it reads it.

    Raises:
        InputError: the file cannot be read, or its extension is not an input format's.
    """
    fmt = file_format(path)
    if fmt is None:
        raise InputError(path, unsupported(path))
    named: dict[str, int] = {}
    if fmt == "jsonl":
        _named_in_lines(path, start, named, source.split("."))
    else:
        _named_in_parquet(path, start, named, source.split("."))
    return named


def _named_in_lines(path: Path, start: int, named: dict[str, int], keys: list[str]) -> None:
    rows = 0
    try:
        with path.open("rb") as file:
            for number, line in enumerate(file, 1):
                if line.isspace():
                    continue
                rows += 1
                if rows <= start:
                    continue
                try:
                    data = orjson.loads(line)  # an integer too wide for orjson: the run's exact parser reads it
                except orjson.JSONDecodeError:
                    try:
                        data = _json.loads(line)
                    except _json.JSONDecodeError:
                        continue
                name = data
                for key in keys:
                    name = name.get(key) if type(name) is dict else None
                if type(name) is str and name not in named:
                    named[name] = number
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc}") from exc


def _named_in_parquet(path: Path, start: int, named: dict[str, int], keys: list[str]) -> None:
    number = 0  # rows before the batch
    try:
        with pq.ParquetFile(path) as file:
            if keys[0] not in file.schema_arrow.names:
                return  # the run refuses the file, naming every missing column
            for batch in file.iter_batches(batch_size=NAMES_BATCH_ROWS, columns=[keys[0]]):
                column = batch.column(0)
                for key in keys[1:]:  # a struct's field; anything else (JSON text) the run reads where it reaches it
                    if not pa.types.is_struct(column.type) or column.type.get_field_index(key) < 0:
                        return
                    column = pc.struct_field(column, key)
                skip = min(max(start - number, 0), len(column))
                part = column.slice(skip)
                if pa.types.is_dictionary(part.type):  # a data frame's categorical column
                    part = part.cast(part.type.value_type)
                if _is_text(part.type):
                    new = [name for name in pc.unique(part).to_pylist() if name is not None and name not in named]
                    first = {name: number + skip + pc.index(part, name).as_py() + 1 for name in new}
                    named.update(sorted(first.items(), key=lambda pair: pair[1]))
                number += len(column)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(path, f"cannot read as Parquet: {exc}") from exc


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
