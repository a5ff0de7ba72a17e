"""What each Ray actor runs: one engine, opened once, scoring blocks as engine batches and committing each block.

How a block is committed whole, and how each actor's share of the limits is set: docs/design.md, Backfills on Ray.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine import _json
from engine._backfill.files import file_format, fsync
from engine._backfill.input import BATCH_ROWS, Row, RowDecoder
from engine._backfill.parquet import PARQUET_BATCH_ROWS, ids_kind, output_batch, output_schema, verifier_problem
from engine._backfill.rewards import Rewards
from engine._columns import Columns
from engine._config import EngineConfig, Limits
from engine._core.portal import Blocking
from engine._core.report import BatchResult, VerifierTotals, add_reports
from engine._engine import Engine
from engine._errors import EngineError, InputError, VerificationError
from engine._ray.plan import Block, Plan, part_name, tmp_dir
from engine._remote.client import RemoteEngine

__all__ = ["BlockScorer", "Carried", "absolute", "split_limits"]


def split_limits(config: EngineConfig, actors: int) -> EngineConfig:
    """``config`` with every verifier's (and the judge's) ``max_concurrency`` and ``max_rate`` split over ``actors``.

    Each actor gets ``ceil(max_concurrency / actors)`` calls in flight (at least one each: up to
    ``actors - 1`` more than the whole job's limit in total) and ``max_rate / actors`` calls a second.
    """
    if actors < 1:
        raise ValueError(f"actors must be >= 1, got {actors}")

    def split(limits: Limits) -> Limits:
        rate = None if limits.max_rate is None else limits.max_rate / actors
        return replace(limits, max_concurrency=math.ceil(limits.max_concurrency / actors), max_rate=rate)

    judge = config.judge
    if judge is not None:
        rate = None if judge.max_rate is None else judge.max_rate / actors
        judge = replace(judge, max_concurrency=math.ceil(judge.max_concurrency / actors), max_rate=rate)
    refs = {key: split(limits) for key, limits in config.refs.items()}
    return replace(config, defaults=split(config.defaults), refs=refs, judge=judge)


def absolute(config: EngineConfig) -> EngineConfig:
    """``config`` with its directories and files as absolute paths: an actor's working directory is not the driver's."""
    bundle = config.ca_bundle.resolve() if config.ca_bundle is not None else None
    return replace(config, environments=config.environments.resolve(), rubrics=config.rubrics.resolve(),
                   ca_bundle=bundle)


class Carried(Exception):
    """One of the engine's errors on its way from an actor to the driver, whole (an ``EngineError`` pickles
    with its fields and notes), as a type Ray does not retry."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(str(error))
        self.error = error

    def __reduce__(self) -> tuple[Any, ...]:
        return Carried, (self.error,)


def _rows_of(
    path: Path, block: Block, json_columns: Collection[str], columns: Columns
) -> tuple[RowDecoder, list[Row]]:
    """The rows of ``block`` of file ``path``, read and checked as ``engine score`` reads them (``json_columns``
    and ``columns`` too); the decoder names the file in errors."""
    decoder = RowDecoder(path, json_columns, columns)
    rows: list[Row] = []
    if file_format(path) == "jsonl":
        try:
            with path.open("rb") as f:
                f.seek(block.offset)
                for number, line in enumerate(f, block.number):
                    if line.isspace():
                        continue
                    rows.append(decoder.decode(number, line))
                    if len(rows) == block.rows:
                        break
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc}") from exc
    else:
        groups = list(range(block.offset, block.offset + block.groups))
        number = block.number
        try:
            with pq.ParquetFile(path) as file:
                decoder.use_schema(file.schema_arrow)
                reads = list(decoder.reads)
                for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=reads, row_groups=groups):
                    values_of = [batch.column(name).to_pylist() for name in reads]
                    for values in zip(*values_of, strict=True):
                        rows.append(decoder.decode(number, values))
                        number += 1
        except (OSError, pa.ArrowException) as exc:
            raise InputError(path, f"cannot read as Parquet: {exc}") from exc
    if len(rows) != block.rows:
        raise InputError(path, f"has {len(rows)} rows where {block.rows} were planned: it changed during the run")
    return decoder, rows


def _verifiers(rows: list[Row], result: BatchResult) -> list[Mapping[str, Any]]:
    """Each row's ``verifier`` record, as ``engine score`` writes it, checked once per verifier and environment."""
    made: dict[tuple[int, str], Mapping[str, Any]] = {}
    verifiers: list[Mapping[str, Any]] = []
    cached = result.cached
    for position, (row, verifier_of) in enumerate(zip(rows, result.verifier_of, strict=True)):
        if cached and position in cached:  # its own: the time of the judge call its verdict came from
            verifiers.append({**result.provenance(position), "environment": row.environment})
            continue
        verifier = made.get((verifier_of, row.environment))
        if verifier is None:
            verifier = {**result.provenance(position), "environment": row.environment}
            problem = verifier_problem(verifier)
            if problem is not None:
                raise TypeError(f"the verifier of id {row.id!r} cannot be written to Parquet: {problem}")
            made[verifier_of, row.environment] = verifier
        verifiers.append(verifier)
    return verifiers


def _table(rows: list[Row], result: BatchResult) -> pa.Table:
    """The records of a scored block, with the single-machine Parquet output's schema for their ids (each one the
    reader checked the output can hold)."""
    ids = [row.id for row in rows]
    schema = output_schema(ids_kind(ids))
    rewards = [float(reward) for reward in result.rewards]
    return pa.Table.from_batches([output_batch(schema, ids, rewards, _verifiers(rows, result))])


def commit(outdir: Path, block: Block, rows: list[Row], result: BatchResult) -> None:
    """Write ``block``'s part file whole: a temporary file, fsync, rename into place, fsync the directory."""
    scratch = tmp_dir(outdir)
    scratch.mkdir(exist_ok=True)
    table = _table(rows, result)
    target = scratch / f"{part_name(block)}.{uuid.uuid4().hex}"  # two attempts at one block never share a file
    try:
        pq.write_table(table, target, row_group_size=PARQUET_BATCH_ROWS)
        fsync(target)
        os.replace(target, outdir / part_name(block))
        fsync(outdir)
    finally:
        target.unlink(missing_ok=True)


class BlockScorer:
    """A Ray Data callable class: each actor makes one, so each actor opens one engine, for its whole life.

    Called with a batch of block descriptions (one, as the driver asks: its file's path and the
    :class:`Block` fields), it scores and commits each and returns, per block, its first row, its
    rows, and its verifiers' totals and its rewards' distribution as JSON. An engine error (a
    verification error, a bad row) is raised as :class:`Carried`: Ray does not retry it.
    """

    def __init__(self, outdir: str, config: EngineConfig | None, url: str | None, token: str | None,
                 json_columns: Collection[str] = (), columns: Columns | None = None) -> None:
        # small arguments: Ray keeps large ones in its object store, and a restarted actor needs them again
        self._outdir = Path(outdir)
        self._json_columns = tuple(json_columns)
        self._columns = Columns() if columns is None else columns
        self._local: Engine | None = None
        engine: Engine | RemoteEngine
        if url is not None:
            engine = Engine.connect(url, token=token)
        else:
            engine = self._local = Engine(config)
        self._engine = Blocking(engine).__enter__()  # open for the actor's whole life, on a loop of its own

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._engine.__exit__(None, None, None)

    def score_block(self, path: Path, block: Block) -> dict[str, Any]:
        """Score ``block`` of input file ``path`` and commit its part; its totals per verifier, and its rewards'
        distribution (under ``"rewards"``)."""
        try:
            decoder, rows = _rows_of(path, block, self._json_columns, self._columns)
            if self._local is not None:
                decoder.check_environments(rows, self._local)
            try:
                result = self._engine.run([row.as_item() for row in rows], first_index=block.start)
            except VerificationError as exc:
                if exc.index is not None and block.start <= exc.index < block.stop:
                    exc.add_note(f"input: {decoder.path}, {decoder.unit} {rows[exc.index - block.start].number}")
                raise
            commit(self._outdir, block, rows, result)
        except EngineError as exc:
            raise Carried(exc) from None
        totals: dict[str, VerifierTotals] = {}
        add_reports(totals, result)
        rewards = Rewards()
        rewards.add(result.rewards)
        return {"verifiers": {key: total.to_json() for key, total in totals.items()}, "rewards": rewards.to_json()}

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        starts, counts, totals = [], [], []
        for encoded in batch["block"]:
            path, fields = _json.loads(encoded)
            block = Block(*fields)
            totals.append(_json.dumps(self.score_block(Path(path), block)).decode())
            starts.append(block.start)
            counts.append(block.rows)
        return {"start": starts, "rows": counts, "totals": totals}


def blocks_to_do(plan: Plan, done: set[str]) -> Iterator[tuple[str, Block]]:
    """The blocks of ``plan`` whose part file is not in ``done``, each with its file's path."""
    return ((plan.files[block.file].path, block) for block in plan.blocks if part_name(block) not in done)

