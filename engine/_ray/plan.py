"""What a Ray backfill will do: its input files, cut into blocks of rows, and the files it leaves in OUTDIR.

How blocks are cut and what OUTDIR holds: docs/design.md, Backfills on Ray (The plan).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from engine._backfill.files import file_format, fsync, unsupported
from engine._backfill.input import RowDecoder
from engine._backfill.input import json_columns as columns_of_json
from engine._backfill.parquet import output_schema
from engine._columns import Columns
from engine._errors import InputError, OutputError, ResumeError

__all__ = [
    "DEFAULT_BLOCK_ROWS",
    "PLAN_FORMAT",
    "Block",
    "InputFile",
    "Plan",
    "committed",
    "load_plan",
    "make_plan",
    "part_name",
    "plan_path",
    "resolve_inputs",
    "save_json",
    "success_path",
    "tmp_dir",
    "whole_parts",
]

DEFAULT_BLOCK_ROWS = 8192  # rows per block: per-block overhead (~ms) stays small; a resume re-scores < one a actor
PLAN_FORMAT = "engine-ray-plan/1"
_PART = re.compile(r"part-(\d{12})-(\d{12})\.parquet")


@dataclass(frozen=True)
class InputFile:
    """One input file as planned: its resolved path, and its size and mtime (a resume refuses a changed input)."""

    path: str
    size: int
    mtime_ns: int
    rows: int


@dataclass(frozen=True)
class Block:
    """Rows ``start`` to ``start + rows`` (0-based, over the whole input) of input file number ``file``.

    ``number`` is the first row's line (JSON Lines) or row (Parquet) in its file, from 1, as errors
    name it. ``offset``: the byte its first line starts at (JSON Lines), or its first row group
    (Parquet, with ``groups`` row groups).
    """

    file: int
    start: int
    rows: int
    number: int
    offset: int
    groups: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.rows


@dataclass(frozen=True)
class Plan:
    """The input files and their blocks, and the columns read as JSON text; equal plans mean an unchanged input."""

    files: tuple[InputFile, ...]
    block_rows: int
    blocks: tuple[Block, ...]
    json_columns: tuple[str, ...] = ()  # --json-columns, sorted: a resume must read the rows alike
    columns: tuple[tuple[str, str], ...] = ()  # the column mapping's sources (none: the default), likewise

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    def to_json(self) -> dict[str, Any]:
        data = {
            "format": PLAN_FORMAT,
            "block_rows": self.block_rows,
            "files": [asdict(f) for f in self.files],
            "blocks": [astuple(block) for block in self.blocks],
        }
        if self.json_columns:  # only then: a plan saved before the option was added reads back equal
            data["json_columns"] = list(self.json_columns)
        if self.columns:
            data["columns"] = dict(self.columns)
        return data

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        """The plan :meth:`to_json` wrote; ``ValueError`` for anything else."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a plan of this version ({PLAN_FORMAT})")
        try:
            files = tuple(InputFile(**f) for f in data["files"])
            blocks = tuple(Block(*b) for b in data["blocks"])
            columns = tuple((str(name), str(source)) for name, source in dict(data.get("columns", {})).items())
            return cls(files, int(data["block_rows"]), blocks, tuple(map(str, data.get("json_columns", ()))), columns)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a plan: {exc}") from None


def plan_path(outdir: Path) -> Path:
    return outdir / "_plan.json"


def success_path(outdir: Path) -> Path:
    """The completion marker: present only when every input row's reward is in a part file."""
    return outdir / "_SUCCESS"


def tmp_dir(outdir: Path) -> Path:
    return outdir / "_tmp"


def part_name(block: Block) -> str:
    """The part file of ``block``, named by its rows: a block scored twice replaces its part, never adds one."""
    return f"part-{block.start:012d}-{block.stop:012d}.parquet"


def committed(outdir: Path) -> set[str]:
    """The files in ``outdir`` named as parts (each was renamed into place whole, unless edited since)."""
    try:
        return {entry.name for entry in os.scandir(outdir) if _PART.fullmatch(entry.name)}
    except FileNotFoundError:
        return set()


def whole_parts(outdir: Path, plan: Plan) -> tuple[set[str], list[str]]:
    """``(the parts of plan's blocks that are whole, the files named as one that are not)``.

    A part is whole when it reads as Parquet with the output's columns and its footer counts its
    block's rows. A file cut short or overwritten since it was committed is not: its block is scored
    again, never counted as done (``_SUCCESS`` over a directory Parquet cannot read).
    """
    present = committed(outdir)
    columns = output_schema("null").names
    whole: set[str] = set()
    broken: list[str] = []
    for block in plan.blocks:
        name = part_name(block)
        if name not in present:
            continue
        try:
            meta = pq.read_metadata(outdir / name)
            ok = meta.num_rows == block.rows and meta.schema.to_arrow_schema().names == columns
        except (OSError, pa.ArrowException):
            ok = False
        if ok:
            whole.add(name)
        else:
            broken.append(name)
    return whole, broken


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(("_", ".")) for part in path.relative_to(root).parts)


def resolve_inputs(spec: str | Path) -> list[Path]:
    """The input files ``spec`` names: a file, every Parquet and JSON Lines file under a directory (names starting
    with ``_`` or ``.`` skipped, as Parquet readers do), or the files a glob matches; sorted by path."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and file_format(p) and not _hidden(p, path))
        if not files:
            raise InputError(path, "the directory holds no .parquet or JSON Lines file")
        return files
    if path.is_file():
        if file_format(path) is None:
            raise InputError(path, unsupported(path))
        return [path]
    if glob.has_magic(str(spec)):
        files = sorted(Path(p) for p in glob.glob(str(spec), recursive=True) if file_format(Path(p)))
        files = [p for p in files if p.is_file()]
        if not files:
            raise InputError(path, "the glob matches no .parquet or JSON Lines file")
        return files
    raise InputError(path, "no such file or directory")


def _jsonl_blocks(index: int, path: Path, first: int, block_rows: int) -> Iterator[Block]:
    """Blocks of a JSON Lines file: one pass, noting where every ``block_rows``-th row starts."""
    offset = rows = 0
    start_number = start_offset = 0
    count = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.isspace():
                if count == 0:
                    start_number, start_offset = number, offset
                count += 1
                if count == block_rows:
                    yield Block(index, first + rows, count, start_number, start_offset)
                    rows += count
                    count = 0
            offset += len(line)
    if count:
        yield Block(index, first + rows, count, start_number, start_offset)


def _parquet_blocks(
    index: int, path: Path, first: int, block_rows: int, json_columns: tuple[str, ...], columns: Columns
) -> Iterator[Block]:
    """Blocks of a Parquet file: runs of whole row groups of about ``block_rows`` rows (at least one group); its
    columns checked first as an actor will read them (``json_columns``, ``columns``: see :class:`RowDecoder`)."""
    try:
        meta = pq.ParquetFile(path).metadata
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as exc:
        raise InputError(path, f"cannot read as Parquet: {exc}") from exc
    RowDecoder(path, json_columns, columns).use_schema(schema)  # its columns, checked before any block
    rows = group = 0
    while group < meta.num_row_groups:
        start, count = group, 0
        while group < meta.num_row_groups and (count == 0 or count + meta.row_group(group).num_rows <= block_rows):
            count += meta.row_group(group).num_rows
            group += 1
        if count:
            yield Block(index, first + rows, count, rows + 1, start, group - start)
        rows += count


def make_plan(inputs: list[Path], block_rows: int = DEFAULT_BLOCK_ROWS, json_columns: Iterable[str] = (),
              columns: Columns | None = None) -> Plan:
    """Plan the blocks of ``inputs`` (see the module docstring), their Parquet ``json_columns`` read as JSON text,
    each field from where ``columns`` says; ``InputError`` for an unreadable file, ``ValueError`` for a column that
    cannot be JSON text."""
    columns = Columns() if columns is None else columns
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    listed = tuple(sorted(columns_of_json(json_columns)))
    files: list[InputFile] = []
    blocks: list[Block] = []
    first = 0
    for index, path in enumerate(inputs):
        try:
            stat = path.stat()
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc}") from exc
        try:
            if file_format(path) == "jsonl":
                found = list(_jsonl_blocks(index, path, first, block_rows))
            else:
                found = list(_parquet_blocks(index, path, first, block_rows, listed, columns))
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc}") from exc
        rows = sum(b.rows for b in found)
        files.append(InputFile(str(path.resolve()), stat.st_size, stat.st_mtime_ns, rows))
        blocks += found
        first += rows
    return Plan(tuple(files), block_rows, tuple(blocks), listed, () if columns.is_default else columns.sources)


def save_json(path: Path, data: Any) -> None:
    """Write ``path`` atomically and durably (temporary file, fsync, rename, fsync of the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def load_plan(outdir: Path) -> Plan | None:
    """The plan a run for ``outdir`` saved; None if there is none; ``ResumeError`` if it is unusable."""
    path = plan_path(outdir)
    try:
        return Plan.from_json(orjson.loads(path.read_bytes()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ResumeError(f"{path}: unusable plan ({exc}); delete {outdir} to start over") from None


def check_outdir(outdir: Path) -> None:
    """Refuse an OUTDIR that is a file, or a directory holding files no run of ours wrote."""
    if outdir.exists() and not outdir.is_dir():
        raise OutputError(f"{outdir}: the output of --ray is a directory, and this is a file")
