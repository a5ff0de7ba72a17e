"""The Parquet output: built at the end from the JSON Lines spool (``OUT.partial``), streaming, and read back.

Its columns and how every output round-trips: docs/design.md, Crash-safe finish (Parquet columns).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "PARQUET_BATCH_ROWS",
    "VERIFIER_TYPE",
    "ids_kind",
    "output_batch",
    "output_schema",
    "read_records",
    "records_at",
    "spool_to_parquet",
    "verifier_problem",
]

PARQUET_BATCH_ROWS = 16_384  # records per row group when the spool becomes Parquet (~36 MiB less peak than 65,536)
SPOOL_PARSE_ROWS = 8_192  # records parsed at a time then (measured: peak RSS at 1M rows 261 -> 152 MiB)
JSON_COLUMNS_KEY = b"engine.json_columns"

# The provenance every verifier kind gives (engine._core.report.BatchResult.provenance, plus the
# environment engine score adds), as one struct: a new field may be added, none renamed or retyped.
VERIFIER_TYPE = pa.struct(
    [
        pa.field("kind", pa.string()),  # plugin, endpoint or rubric
        pa.field("ref", pa.string()),  # module:callable, the URL, owner/name@N
        pa.field("environment", pa.string()),
        pa.field("digest", pa.string()),  # plugin: the environment's sha256; rubric: its file's; endpoint: null
        pa.field("version", pa.int64()),  # rubric: its version; others: null
        pa.field("prompt", pa.int64()),  # rubric: the judge prompt's version (PROMPT_VERSION); others: null
        pa.field("model", pa.string()),  # rubric: the judge's model; others: null
        pa.field("judge", pa.struct([  # rubric: the judge's call parameters; others: null
            pa.field("model", pa.string()),
            pa.field("base_url", pa.string()),
            pa.field("temperature", pa.float64()),
            pa.field("max_tokens", pa.int64()),
            pa.field("response_format", pa.bool_()),
        ])),
        pa.field("cached", pa.float64()),  # rubric, served from the verdict cache: its judge call's unix time
    ]
)


def _python_type(kind: pa.DataType) -> type:
    if pa.types.is_integer(kind):
        return int
    if pa.types.is_floating(kind):
        return float
    return dict if pa.types.is_struct(kind) else str


_FIELD_TYPES: dict[str, type] = {field.name: _python_type(field.type) for field in VERIFIER_TYPE}

def verifier_identity(provenance: Mapping[str, Any]) -> dict[str, Any]:
    """What says which verifier scored a record, as compared (a resume's check, an audit): its provenance less the
    null fields (a Parquet output's struct holds every kind's) and ``cached`` (when its verdict was judged, not by
    what: a cache's hit and a call are the same verifier's)."""
    return {key: value for key, value in provenance.items() if value is not None and key != "cached"}


IdKind = Literal["null", "int", "str", "json"]


def verifier_problem(verifier: Mapping[str, Any]) -> str | None:
    """Why ``verifier`` cannot be written to the struct column :data:`VERIFIER_TYPE` as it is; None if it can.

    Checked when a record is written, because Arrow would drop a key the struct has no field for
    without a word, and a value of another type would fail only when the run finishes.
    """
    for key, value in verifier.items():
        kind = _FIELD_TYPES.get(key)
        if kind is None:
            return f"it has a key {key!r}, and the verifier column has fields {', '.join(_FIELD_TYPES)} only"
        if value is None:
            continue
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
                return f"its {key!r} must be a 64-bit integer or null, got {value!r}"
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                return f"its {key!r} must be a number or null, got {value!r}"
        elif kind is dict:
            if not isinstance(value, Mapping):  # the judge's parameters, as the rubric verifier gives them
                return f"its {key!r} must be an object or null, got {value!r}"
        elif not isinstance(value, str):
            return f"its {key!r} must be a string or null, got {value!r}"
    return None


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


def ids_kind(ids: Iterable[Any]) -> IdKind:
    """What the ``id`` column of records with these ids holds (docs/design.md, Crash-safe finish: Parquet columns)."""
    kind: IdKind = "null"
    for row_id in ids:
        kind = _merge(kind, _id_kind(row_id))
    return kind


def output_schema(kind: IdKind) -> pa.Schema:
    """The output's schema when its ids are of ``kind`` (:func:`ids_kind`), whether one file or parts."""
    id_type = pa.int64() if kind == "int" else pa.string()
    json_columns = "id" if kind == "json" else ""
    return pa.schema(
        [
            pa.field("id", id_type),
            pa.field("reward", pa.float64(), nullable=False),
            pa.field("verifier", VERIFIER_TYPE, nullable=False),
        ],
        metadata={JSON_COLUMNS_KEY: json_columns.encode()},
    )


def output_batch(schema: pa.Schema, ids: list[Any], rewards: list[float], verifiers: list[Any]) -> pa.RecordBatch:
    """Records as a batch of :func:`output_schema`'s ``schema`` (ids written as JSON text where it says so)."""
    if (schema.metadata or {}).get(JSON_COLUMNS_KEY) == b"id":
        ids = [None if i is None else orjson.dumps(i).decode() for i in ids]
    columns = [
        pa.array(ids, type=schema.field("id").type),
        pa.array(rewards, type=pa.float64()),
        pa.array(verifiers, type=VERIFIER_TYPE),
    ]
    return pa.record_batch(columns, schema=schema)


def spool_to_parquet(spool: Path, target: Path) -> None:
    """Convert the JSON Lines spool to a Parquet file, streaming; two passes, the first picks the ``id`` type.

    Records are parsed a few thousand at a time and kept as Arrow batches until a row group's worth
    is ready: peak memory stays that of one row group in Arrow, whatever the spool's size. The
    first pass also checks every verifier again (:func:`verifier_problem`): the writer and a resume
    check them, so a record that fails here is a bug, raised rather than written with a field lost.
    """
    kind: IdKind = "null"
    with spool.open("rb") as f:
        for number, batch in enumerate(_batches(f)):
            for offset, record in enumerate(batch):
                kind = _merge(kind, _id_kind(record["id"]))
                problem = verifier_problem(record["verifier"])
                if problem is not None:
                    line = number * SPOOL_PARSE_ROWS + offset + 1
                    raise ValueError(f"{spool}, line {line}: the verifier cannot be written to Parquet: {problem}")
    schema = output_schema(kind)

    def arrow(batch: list[dict[str, Any]]) -> pa.RecordBatch:
        return output_batch(schema, [r["id"] for r in batch], [r["reward"] for r in batch],
                            [r["verifier"] for r in batch])

    with spool.open("rb") as f, pq.ParquetWriter(target, schema) as writer:
        group: list[pa.RecordBatch] = []
        for batch in _batches(f):
            group.append(arrow(batch))
            if sum(b.num_rows for b in group) >= PARQUET_BATCH_ROWS:
                writer.write_table(pa.Table.from_batches(group), row_group_size=PARQUET_BATCH_ROWS)
                group = []
        if group:
            writer.write_table(pa.Table.from_batches(group), row_group_size=PARQUET_BATCH_ROWS)


def _values(batch: pa.RecordBatch, name: str, json_columns: Collection[str]) -> list[Any]:
    """A column of an output's batch as :func:`read_records` gives it (JSON text decoded, a struct's nulls left out)."""
    values = batch.column(name).to_pylist()
    if name in json_columns:
        return [None if v is None else orjson.loads(v) for v in values]
    if pa.types.is_struct(batch.schema.field(name).type):
        return [None if v is None else {k: x for k, x in v.items() if x is not None} for v in values]
    return values


def _json_columns(pf: pq.ParquetFile) -> set[str]:
    metadata = pf.schema_arrow.metadata or {}
    return set(metadata.get(JSON_COLUMNS_KEY, b"").decode().split(","))


def read_records(path: Path) -> Iterator[tuple[Any, float, Any]]:
    """``(id, reward, verifier)`` of each record of a Parquet output, streamed, in order.

    ``verifier`` is a dict of the struct's non-null fields, or, in a file written before the
    struct, the JSON text's object.
    """
    with pq.ParquetFile(path) as pf:
        listed = _json_columns(pf)
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["id", "reward", "verifier"]):
            yield from zip(*(_values(batch, name, listed) for name in ("id", "reward", "verifier")), strict=True)


def records_at(path: Path, positions: Collection[int]) -> Iterator[tuple[int, Any, float, Any]]:
    """``(position, id, reward, verifier)`` of the records of a Parquet output at ``positions`` (from 1), in order,
    as :func:`read_records` gives them; a batch holding none of them is never converted to Python."""
    wanted = sorted(set(positions))
    with pq.ParquetFile(path) as pf:
        listed = _json_columns(pf)
        before, at = 0, 0  # rows before the batch; the first wanted position not yet given
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["id", "reward", "verifier"]):
            if at == len(wanted):
                return
            end = at
            while end < len(wanted) and wanted[end] <= before + batch.num_rows:
                end += 1
            if end > at:
                here = wanted[at:end]
                taken = batch.take(pa.array([p - before - 1 for p in here]))
                columns = (_values(taken, name, listed) for name in ("id", "reward", "verifier"))
                yield from zip(here, *columns, strict=True)
                at = end
            before += batch.num_rows
