"""``engine audit`` and ``engine diff``: stored rewards scored again, or two outputs, compared per verifier.

An audit counts the output's records (a Parquet footer, a JSON Lines file's lines: nothing decoded), draws positions,
decodes the records at them alone, and reads the input once, decoding only the rows at those positions (an output
holds one record per input row, in its order; each one's id is checked): its memory follows the sample, not the files
(docs/audit.md). A record whose id is not at its row is found by id in a second pass over the input.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from engine._backfill.files import file_format, unsupported
from engine._backfill.input import Row, Unit, open_rows, rows_at
from engine._backfill.parquet import read_records, records_at, verifier_identity
from engine._check import check_ready
from engine._columns import Columns
from engine._config import EngineConfig
from engine._core.report import BatchResult
from engine._engine import Engine
from engine._errors import InputError, ManifestError, OutputError, VerificationError

__all__ = [
    "AUDIT_CHUNK",
    "DEFAULT_SAMPLE",
    "Agreement",
    "AuditReport",
    "Confusion",
    "DiffReport",
    "audit",
    "count_records",
    "diff",
    "same_provenance",
    "stored_records",
]

DEFAULT_SAMPLE = 100  # rows an audit draws when neither a count nor a fraction is given
AUDIT_CHUNK = 1024  # sampled items scored as one engine batch
_PART = re.compile(r"part-(\d+)-(\d+)\.parquet")


@dataclass(frozen=True)
class Confusion:
    """Binary rewards (every stored and new reward 0 or 1): how many rows went from ``stored`` to ``new``."""

    one_one: int = 0
    one_zero: int = 0
    zero_one: int = 0
    zero_zero: int = 0

    def to_json(self) -> dict[str, int]:
        return {"1->1": self.one_one, "1->0": self.one_zero, "0->1": self.zero_one, "0->0": self.zero_zero}


@dataclass(frozen=True)
class Agreement:
    """One verifier's figures (one environment's): its rows compared where the provenance is the same.

    Attributes:
        environment: The environment; ``kind`` and ``ref`` its verifier now (``engine diff``: in the first output).
        rows: Rows of this verifier in the sample (diff: matched in both outputs).
        provenance_changed: Rows whose recorded provenance differs from the other side's: not compared.
        stored_provenance: The first differing provenance recorded (None when none differ).
        current_provenance: The provenance on the other side (now, or the second output's).
        compared: Rows compared (same provenance); ``equal`` of them have the same reward.
        mean_abs_diff: Mean absolute difference over the compared rows (NaN when none); ``max_abs_diff`` the largest.
        confusion: Counts of stored -> new for binary rewards; None when some reward is not 0 or 1.
        repeat: Times each item was scored (``--repeat``); ``noise_mean``/``noise_max``: the mean and the largest
            spread (max - min) of an item's rewards over them, ``noisy`` the items whose spread is not 0
            (NaN, NaN, 0 with ``repeat`` 1).
    """

    environment: str
    kind: str
    ref: str
    rows: int
    provenance_changed: int
    stored_provenance: Mapping[str, Any] | None
    current_provenance: Mapping[str, Any] | None
    compared: int
    equal: int
    mean_abs_diff: float
    max_abs_diff: float
    confusion: Confusion | None
    repeat: int = 1
    noise_mean: float = math.nan
    noise_max: float = math.nan
    noisy: int = 0

    @property
    def agreement(self) -> float:
        """The share of compared rows whose rewards are equal (NaN when none was compared)."""
        return self.equal / self.compared if self.compared else math.nan

    def agrees(self, tolerance: float) -> bool:
        """Whether every compared row's rewards differ by at most ``tolerance`` (true when none was compared)."""
        return self.compared == 0 or self.max_abs_diff <= tolerance

    def to_json(self) -> dict[str, Any]:
        def number(value: float) -> float | None:
            return None if math.isnan(value) else value

        return {
            "environment": self.environment, "kind": self.kind, "ref": self.ref, "rows": self.rows,
            "provenance_changed": self.provenance_changed,
            "stored_provenance": None if self.stored_provenance is None else dict(self.stored_provenance),
            "current_provenance": None if self.current_provenance is None else dict(self.current_provenance),
            "compared": self.compared, "equal": self.equal, "agreement": number(self.agreement),
            "mean_abs_diff": number(self.mean_abs_diff), "max_abs_diff": number(self.max_abs_diff),
            "confusion": None if self.confusion is None else self.confusion.to_json(),
            "repeat": self.repeat, "noise_mean": number(self.noise_mean), "noise_max": number(self.noise_max),
            "noisy": self.noisy,
        }


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found: the output's ``rows``, the ``sampled`` ones (``seed``), and per verifier figures.

    ``agrees`` is whether every verifier agrees within ``tolerance``: ``engine audit`` exits 0 then, else 4.
    """

    output: str
    input: str
    rows: int
    sampled: int
    seed: int
    tolerance: float
    verifiers: tuple[Agreement, ...]

    @property
    def agrees(self) -> bool:
        return all(v.agrees(self.tolerance) for v in self.verifiers)

    def to_json(self) -> dict[str, Any]:
        return {"output": self.output, "input": self.input, "rows": self.rows, "sampled": self.sampled,
                "seed": self.seed, "tolerance": self.tolerance, "agrees": self.agrees,
                "verifiers": [v.to_json() for v in self.verifiers]}


@dataclass(frozen=True)
class DiffReport:
    """What :func:`diff` found: rows of ``a`` and ``b``, those matched (by id, or position), and per verifier figures.

    ``only_a``/``only_b``: rows of one output with no match in the other (never compared).
    """

    a: str
    b: str
    rows_a: int
    rows_b: int
    matched: int
    only_a: int
    only_b: int
    tolerance: float
    verifiers: tuple[Agreement, ...]

    @property
    def agrees(self) -> bool:
        return all(v.agrees(self.tolerance) for v in self.verifiers)

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "rows_a": self.rows_a, "rows_b": self.rows_b, "matched": self.matched,
                "only_a": self.only_a, "only_b": self.only_b, "tolerance": self.tolerance, "agrees": self.agrees,
                "verifiers": [v.to_json() for v in self.verifiers]}


def same_provenance(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two provenances name the same verifier: every recorded field equal (null and absent alike, and
    ``cached`` left out)."""
    return verifier_identity(a) == verifier_identity(b)


def _id_key(row_id: Any) -> bytes:
    """An id as a dict key: its JSON (ids are any JSON value; 1 and "1" differ)."""
    return orjson.dumps(row_id, option=orjson.OPT_SORT_KEYS)


def _parts(path: Path) -> list[Path]:
    """A complete ``--ray`` output directory's parts, in row order; :class:`OutputError` if it is not one."""
    if not (path / "_SUCCESS").exists():
        raise OutputError(f"{path} is not a complete --ray output (no _SUCCESS): finish its run first")
    parts = sorted((int(m.group(1)), entry) for entry in path.iterdir() if (m := _PART.fullmatch(entry.name)))
    return [part for _, part in parts]


def _output_files(path: Path) -> list[Path]:
    """The Parquet files of an output in row order (one, or a ``--ray`` directory's parts); [] for JSON Lines."""
    if path.is_dir():
        return _parts(path)
    fmt = file_format(path)
    if fmt is None:
        raise OutputError(f"{path}: {unsupported(path)}")
    if not path.is_file():
        raise OutputError(f"{path}: no such output")
    return [path] if fmt == "parquet" else []


def _parquet_rows(path: Path) -> int:
    """The records of a Parquet output file, from its footer."""
    try:
        with pq.ParquetFile(path) as pf:
            return int(pf.metadata.num_rows)
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(f"{path}: cannot read as Parquet: {exc}") from exc


def count_records(path: Path) -> int:
    """The records of a complete output, decoding none: Parquet footers, or a JSON Lines file's non-blank lines.

    Raises:
        OutputError: not an output (see :func:`stored_records`).
    """
    files = _output_files(path)
    if files or path.is_dir():
        return sum(_parquet_rows(file) for file in files)
    with path.open("rb") as f:
        return sum(1 for line in f if not line.isspace())


def _records_at(path: Path, chosen: Collection[int]) -> Iterator[tuple[int, Any, float, Mapping[str, Any]]]:
    """``(number, id, reward, verifier)`` of the records numbered ``chosen`` (from 1) alone, in order, the others
    neither decoded nor checked; as :func:`stored_records` raises."""
    files = _output_files(path)
    if not files and not path.is_dir():
        wanted, last = frozenset(chosen), max(chosen, default=0)
        number = 0
        with path.open("rb") as f:
            for line_number, line in enumerate(f, 1):
                if line.isspace():
                    continue
                number += 1
                if number in wanted:
                    yield (number, *_record(path, line_number, line))
                    if number == last:
                        return
        return
    before = 0  # records in the parts before this one
    for file in files:
        rows = _parquet_rows(file)
        here = [n - before for n in chosen if before < n <= before + rows]
        if here:
            try:
                for position, row_id, reward, verifier in records_at(file, here):
                    yield before + position, row_id, reward, verifier
            except (OSError, pa.ArrowException) as exc:
                raise OutputError(f"{file}: cannot read as Parquet: {exc}") from exc
        before += rows


def stored_records(path: Path) -> Iterator[tuple[int, Any, float, Mapping[str, Any]]]:
    """``(number, id, reward, verifier)`` of each record of a complete output, streamed: a JSON Lines or Parquet
    file, or a ``--ray`` output directory (its parts in row order); ``number`` counts records from 1.

    Raises:
        OutputError: not an output (an extension of neither format, a directory without ``_SUCCESS``).
        InputError: a record that is not one (a truncated or edited line), named by its line.
    """
    if path.is_dir():
        number = 0
        for part in _parts(path):
            for row_id, reward, verifier in read_records(part):
                number += 1
                yield number, row_id, reward, verifier
        return
    fmt = file_format(path)
    if fmt is None:
        raise OutputError(f"{path}: {unsupported(path)}")
    if not path.is_file():
        raise OutputError(f"{path}: no such output")
    if fmt == "parquet":
        for number, (row_id, reward, verifier) in enumerate(read_records(path), 1):
            yield number, row_id, reward, verifier
        return
    number = 0
    with path.open("rb") as f:
        for line_number, line in enumerate(f, 1):
            if line.isspace():
                continue
            number += 1
            yield (number, *_record(path, line_number, line))


def _record(path: Path, number: int, line: bytes) -> tuple[Any, float, Mapping[str, Any]]:
    """One JSON Lines record, checked: what ``engine score`` writes, or :class:`InputError` naming the line."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise InputError(path, f"not a record of an engine score output (invalid JSON: {exc})", unit="line",
                         number=number) from None
    if (not isinstance(data, dict) or "id" not in data or not isinstance(data.get("verifier"), dict)
            or not isinstance(data.get("reward"), int | float) or isinstance(data.get("reward"), bool)):
        raise InputError(path, "not a record of an engine score output (id, reward, verifier)", unit="line",
                         number=number)
    return data["id"], float(data["reward"]), data["verifier"]


@dataclass
class _Group:
    """One environment's rows as they are compared (built into an :class:`Agreement`)."""

    environment: str
    kind: str = "?"
    ref: str = "?"
    rows: int = 0
    changed: int = 0
    stored: Mapping[str, Any] | None = None
    current: Mapping[str, Any] | None = None
    diffs: list[float] = field(default_factory=list)
    pairs: Counter[tuple[float, float]] = field(default_factory=Counter)
    spreads: list[float] = field(default_factory=list)

    def add(self, stored: float, stored_provenance: Mapping[str, Any], new: float,
            new_provenance: Mapping[str, Any]) -> None:
        self.rows += 1
        self.kind, self.ref = str(new_provenance.get("kind", "?")), str(new_provenance.get("ref", "?"))
        if self.current is None:
            self.current = verifier_identity(new_provenance)
        if not same_provenance(stored_provenance, new_provenance):
            self.changed += 1
            if self.stored is None:
                self.stored, self.current = verifier_identity(stored_provenance), verifier_identity(new_provenance)
            return
        self.diffs.append(abs(stored - new))
        self.pairs[(stored, new)] += 1

    def agreement(self, repeat: int) -> Agreement:
        diffs = self.diffs
        binary = bool(diffs) and all(a in (0.0, 1.0) and b in (0.0, 1.0) for a, b in self.pairs)
        confusion = Confusion(self.pairs[(1.0, 1.0)], self.pairs[(1.0, 0.0)], self.pairs[(0.0, 1.0)],
                              self.pairs[(0.0, 0.0)]) if binary else None
        spreads = self.spreads
        return Agreement(
            environment=self.environment, kind=self.kind, ref=self.ref, rows=self.rows,
            provenance_changed=self.changed, stored_provenance=self.stored, current_provenance=self.current,
            compared=len(diffs), equal=sum(1 for d in diffs if d == 0.0),
            mean_abs_diff=sum(diffs) / len(diffs) if diffs else math.nan,
            max_abs_diff=max(diffs) if diffs else math.nan, confusion=confusion, repeat=repeat,
            noise_mean=sum(spreads) / len(spreads) if spreads else math.nan,
            noise_max=max(spreads) if spreads else math.nan, noisy=sum(1 for s in spreads if s > 0),
        )


@dataclass(frozen=True)
class _Sampled:
    """One sampled output record (``number`` counts from 1), waiting for its input row."""

    number: int
    key: bytes  # its id's (_id_key)
    reward: float
    verifier: Mapping[str, Any]


def _sample_size(rows: int, sample: int | None, fraction: float | None) -> int:
    if sample is not None and fraction is not None:
        raise ValueError("give sample or fraction, not both")
    if sample is not None:
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise ValueError(f"sample must be a whole number >= 1, got {sample!r}")
        return min(sample, rows)
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
        return min(rows, max(1, math.ceil(rows * fraction))) if rows else 0
    return min(DEFAULT_SAMPLE, rows)


def _draw(output: Path, count: int, rows: int, seed: int) -> dict[int, _Sampled]:
    """The sampled records, by number: ``count`` of ``rows`` drawn with ``seed``, the others never decoded."""
    chosen = sorted(random.Random(seed).sample(range(1, rows + 1), count))
    return {number: _Sampled(number, _id_key(row_id), reward, verifier)
            for number, row_id, reward, verifier in _records_at(output, chosen)}


def _find_inputs(input_path: Path, picked: Mapping[int, _Sampled], output: Path,
                 json_columns: Collection[str], columns: Columns | None) -> list[tuple[Row, _Sampled]]:
    """The input rows of the sampled records, in the output's order.

    Record N was scored from the input's row N (one record per row, in order): only those rows are decoded, and
    each must have its record's id. A record whose id is elsewhere (an output filtered or reordered since) is found
    by id in a second pass, if the input holds that id once; :class:`InputError` if it holds it never or more
    than once (which of them the record was scored from cannot be told).
    """
    found: dict[int, tuple[Row, _Sampled]] = {}
    for position, row in rows_at(input_path, picked, json_columns=json_columns, columns=columns):
        record = picked[position]
        if _id_key(row.id) == record.key:
            found[position] = (row, record)
    strays = {number: record for number, record in picked.items() if number not in found}
    if strays:
        keys = {record.key for record in strays.values()}
        seen: Counter[bytes] = Counter()
        first: dict[bytes, Row] = {}
        with open_rows(input_path, json_columns=json_columns, columns=columns) as rows:
            for row in rows:
                if (key := _id_key(row.id)) in keys:
                    seen[key] += 1
                    first.setdefault(key, row)
        for number, record in sorted(strays.items()):
            times = seen[record.key]
            if times == 0:
                raise InputError(output, f"id {record.key.decode()} is not in {input_path} (the output's record "
                                 f"{number}): audit an output against the input it was scored from")
            if times > 1:
                raise InputError(output, f"id {record.key.decode()} is in {input_path} {times} times, none at its "
                                 f"row {number} (the output's record {number}): which row it was scored from cannot "
                                 "be told; audit an output against the input it was scored from, in its order")
            found[number] = (first[record.key], record)
    return [found[number] for number in sorted(found)]


async def _rescore(engine: Engine, items: list[dict[str, Any]], *, first_index: int, fresh: bool) -> BatchResult:
    """Score ``items`` again (``fresh``: a repeat of the noise floor): the audit's engine has no verdict cache, so
    every call reaches its verifier."""
    del fresh  # each repeat is its own batch: no dedup across them either (none is in flight beside another)
    return await engine.run(items, first_index=first_index)


async def audit(
    output: str | Path,
    *,
    input: str | Path,  # the command's --input
    config: EngineConfig | None = None,
    sample: int | None = None,
    fraction: float | None = None,
    seed: int = 0,
    repeat: int = 1,
    tolerance: float = 0.0,
    json_columns: Collection[str] = (),
    columns: Mapping[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> AuditReport:
    """Score a seeded sample of a stored output's rows again and compare them, per verifier, with what it holds.

    Args:
        output: An ``engine score`` output: JSON Lines, Parquet, or a ``--ray`` output directory.
        input: The input it was scored from: record N's row is its row N (its id checked), or found by id.
        config: The configuration to score with now (the defaults when None).
        sample: Rows to draw (all when the output has fewer); ``fraction``: a share of the rows instead
            (at least one); neither: 100.
        seed: Seeds the draw: the same seed, the same rows.
        repeat: Times each sampled item is scored; above 1 the spread of its rewards is the noise floor.
        tolerance: The largest difference still agreeing (``AuditReport.agrees``).
        json_columns: Parquet input columns holding JSON text; ``columns``: where each field is read from.
        transport: Replaces the engine's HTTP transport (tests).

    Returns:
        The figures, per environment's verifier.

    Raises:
        ValueError: A bad ``sample``, ``fraction``, ``repeat`` or ``tolerance``.
        OutputError: ``output`` is not a complete output; InputError: a bad record, a bad input row, or a
            record whose id the input lacks.
        VerificationError: A verifier failed on a sampled item (named, with its input line or row).
        UnreadyError: An environment the sample names cannot score now.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a whole number >= 1, got {repeat!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    output, input_path = Path(output), Path(input)
    # an audit re-verifies: a verdict the cache holds would only compare a stored reward with itself
    config = dataclasses.replace(config, cache=None) if config is not None else EngineConfig()
    rows = count_records(output)
    count = _sample_size(rows, sample, fraction)
    picked = _draw(output, count, rows, seed)
    mapping = Columns.chosen(columns, config.input_columns)
    found = _find_inputs(input_path, picked, output, json_columns, mapping)
    groups: dict[str, _Group] = {}
    async with Engine(config, transport=transport) as engine:
        if found:
            names = {row.environment: row for row, _ in reversed(found)}  # each with its first row
            unit: Unit = "row" if file_format(input_path) == "parquet" else "line"
            for name, row in names.items():
                try:
                    engine.environment(name)
                except ManifestError:
                    raise  # a config error, as a run reports it
                except ValueError as exc:
                    raise InputError(input_path, str(exc), unit=unit, number=row.number) from None
            await check_ready(engine, (config.environments / name for name in names),
                              which="the sampled rows name", then=", checked before scoring any")
        for start in range(0, len(found), AUDIT_CHUNK):
            chunk = found[start : start + AUDIT_CHUNK]
            items = [row.as_item() for row, _ in chunk]
            runs = [await _scored(engine, items, chunk, input_path, start, fresh=k > 0) for k in range(repeat)]
            first = runs[0]
            for position, (row, record) in enumerate(chunk):
                provenance = {**first.provenance(position), "environment": row.environment}
                group = groups.setdefault(row.environment, _Group(row.environment))
                group.add(record.reward, record.verifier, first.rewards[position], provenance)
                if repeat > 1:
                    again = [r.rewards[position] for r in runs
                             if same_provenance(r.provenance(position), first.provenance(position))]
                    group.spreads.append(max(again) - min(again))
    return AuditReport(output=str(output), input=str(input_path), rows=rows, sampled=len(found), seed=seed,
                       tolerance=float(tolerance),
                       verifiers=tuple(groups[name].agreement(repeat) for name in sorted(groups)))


async def _scored(engine: Engine, items: list[dict[str, Any]], chunk: list[tuple[Row, _Sampled]], input_path: Path,
                  start: int, *, fresh: bool) -> BatchResult:
    try:
        return await _rescore(engine, items, first_index=start, fresh=fresh)
    except VerificationError as exc:
        if exc.index is not None:
            row, record = chunk[exc.index - start]
            unit: Unit = "row" if file_format(input_path) == "parquet" else "line"
            exc.add_note(f"input: {input_path}, {unit} {row.number} (the output's record {record.number})")
        raise


def diff(a: str | Path, b: str | Path, *, by: str = "id", tolerance: float = 0.0) -> DiffReport:
    """Compare two outputs of the same input, per verifier: the figures of :func:`audit`, ``b`` as the new side.

    Args:
        a: An ``engine score`` output (JSON Lines, Parquet or a ``--ray`` directory).
        b: Another, of the same input.
        by: ``"id"``: records matched by id (a repeated id by its occurrence); ``"position"``: record by record.
        tolerance: The largest difference still agreeing.

    Returns:
        The figures; rows of one output the other lacks are counted, never compared.

    Raises:
        ValueError: ``by`` is neither, or a bad ``tolerance``.
        OutputError, InputError: As :func:`audit` raises them for an output.
    """
    if by not in ("id", "position"):
        raise ValueError(f"by must be 'id' or 'position', got {by!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    a, b = Path(a), Path(b)
    groups: dict[str, _Group] = {}
    interned: dict[bytes, Mapping[str, Any]] = {}

    def compare(ra: float, va: Mapping[str, Any], rb: float, vb: Mapping[str, Any]) -> None:
        name = str(va.get("environment", "?"))
        groups.setdefault(name, _Group(name)).add(ra, va, rb, vb)

    rows_a = rows_b = matched = 0
    if by == "position":
        records_b = stored_records(b)
        for _, _, ra, va in stored_records(a):
            rows_a += 1
            if (next_b := next(records_b, None)) is None:
                continue
            rows_b += 1
            matched += 1
            compare(ra, va, next_b[2], next_b[3])
        rows_b += sum(1 for _ in records_b)
    else:
        held: dict[tuple[bytes, int], tuple[float, Mapping[str, Any]]] = {}
        seen: Counter[bytes] = Counter()
        for _, row_id, reward, verifier in stored_records(a):
            rows_a += 1
            key = _id_key(row_id)
            seen[key] += 1
            text = orjson.dumps(verifier, option=orjson.OPT_SORT_KEYS)  # one dict per distinct provenance
            held[(key, seen[key])] = (reward, interned.setdefault(text, verifier))
        seen.clear()
        for _, row_id, reward, verifier in stored_records(b):
            rows_b += 1
            key = _id_key(row_id)
            seen[key] += 1
            if (other := held.pop((key, seen[key]), None)) is not None:
                matched += 1
                compare(other[0], other[1], reward, verifier)
    return DiffReport(a=str(a), b=str(b), rows_a=rows_a, rows_b=rows_b, matched=matched, only_a=rows_a - matched,
                      only_b=rows_b - matched, tolerance=float(tolerance),
                      verifiers=tuple(groups[name].agreement(1) for name in sorted(groups)))
