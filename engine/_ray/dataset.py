"""``engine.ray.score_dataset``: a Ray Dataset of rollouts in, the same rows with ``reward`` and ``verifier`` out."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from pathlib import Path

import pyarrow as pa

from engine._backfill.input import RowDecoder
from engine._backfill.parquet import VERIFIER_TYPE
from engine._columns import Columns
from engine._config import EngineConfig
from engine._core.portal import Blocking
from engine._engine import Engine
from engine._errors import EngineError
from engine._ray.actor import Carried

__all__ = ["DATASET_NAME", "RowScorer"]

DATASET_NAME = Path("dataset.parquet")  # how a bad row's errors name the dataset (rows as Parquet's are read)


class RowScorer:
    """A Ray Data callable class: one engine per actor; each batch of rows is one engine batch.

    Rows are read as ``engine score`` reads a Parquet file's (a text ``task``, and the ``json_columns``,
    are JSON text; each field is read from where ``columns`` says); a bad row is an ``InputError`` naming
    its row in the batch. The columns ``reward`` (float64) and ``verifier`` (the single-machine output's
    struct) are added.
    """

    def __init__(self, config: EngineConfig | None, url: str | None, token: str | None,
                 json_columns: Collection[str] = (), columns: Columns | None = None) -> None:
        engine = Engine.connect(url, token=token) if url is not None else Engine(config)
        self._engine = Blocking(engine).__enter__()  # open for the actor's whole life, on a loop of its own
        self._decoder = RowDecoder(DATASET_NAME, json_columns, columns)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._engine.__exit__(None, None, None)

    def __call__(self, batch: pa.Table) -> pa.Table:
        try:
            self._decoder.use_schema(batch.schema)  # each batch's own: Ray may type two blocks differently
            columns = [batch.column(name).to_pylist() for name in self._decoder.reads]
            rows = [self._decoder.decode(n, values) for n, values in enumerate(zip(*columns, strict=True), 1)]
            result = self._engine.run([row.as_item() for row in rows])
        except EngineError as exc:
            raise Carried(exc) from None
        verifiers = [
            {**result.provenance(position), "environment": row.environment} for position, row in enumerate(rows)
        ]
        batch = batch.append_column("reward", pa.array(result.rewards, type=pa.float64()))
        return batch.append_column("verifier", pa.array(verifiers, type=VERIFIER_TYPE))
