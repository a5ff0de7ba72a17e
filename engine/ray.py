"""Scoring on Ray Data: ``score_dataset`` for a Dataset in hand, ``backfill`` for files (``engine score --ray``).

Needs the ``ray`` extra (``pip install 'engine[ray]'``). Ray is imported when one of these runs,
never by ``import engine``. Each Ray actor holds one engine, opened once and reused for every batch
it scores; a verification error fails the job (Ray Data's ``max_errored_blocks`` stays 0: no row is
ever dropped), an actor that dies (OOM, a segfaulting plugin) is restarted and its batch retried.

Limits: each verifier's ``max_concurrency`` and ``max_rate`` are for the whole job, so by default
each of N actors gets ``ceil(max_concurrency / N)`` and ``max_rate / N``; with ``url``, every actor
scores through one ``engine serve``, whose own engine holds them whole.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from engine._backfill.input import json_columns as columns_of_json
from engine._config import EngineConfig
from engine._ray.plan import DEFAULT_BLOCK_ROWS
from engine._ray.run import DEFAULT_ACTOR_CPUS, DEFAULT_ACTORS, RaySummary, backfill, check_data_options, engine_error

if TYPE_CHECKING:
    import ray.data

__all__ = [
    "DEFAULT_ACTORS",
    "DEFAULT_ACTOR_CPUS",
    "DEFAULT_BLOCK_ROWS",
    "RaySummary",
    "backfill",
    "engine_error",
    "score_dataset",
]


def score_dataset(
    dataset: ray.data.Dataset,
    config: EngineConfig | None,
    *,
    actors: int = DEFAULT_ACTORS,
    url: str | None = None,
    token: str | None = None,
    actor_cpus: float = DEFAULT_ACTOR_CPUS,
    batch_size: int = DEFAULT_BLOCK_ROWS,
    json_columns: Collection[str] = (),
    **ray_remote_args: Any,
) -> ray.data.Dataset:
    """``dataset`` (columns ``id``, ``environment``, ``task``, ``trajectory``, and any others) with ``reward`` and
    ``verifier`` columns added, scored lazily by ``actors`` actors, ``batch_size`` rows per engine batch.

    ``ValueError`` if the dataset's Ray Data options break the guarantees (``max_errored_blocks``
    above 0 drops rows; ``actor_task_retry_on_errors`` retries verification errors); its
    ``raise_original_map_exception`` is set, so that the engine's error is not flattened to text. An engine
    error reaches the consumer of the dataset inside Ray's wrapping; :func:`engine_error` finds it
    there. A bad row's ``InputError`` names its row within its batch. ``json_columns`` (``task``,
    ``trajectory``) hold JSON text, as ``engine score --json-columns`` says of a file's (a text
    ``task`` is decoded anyway; ``ValueError`` for another name). ``ray_remote_args`` go to ``map_batches``.
    """
    import ray.data

    from engine._ray.actor import absolute, split_limits
    from engine._ray.dataset import RowScorer

    if actors < 1:
        raise ValueError(f"actors must be >= 1, got {actors}")
    if config is None and url is None:
        raise ValueError("a config is needed unless every actor scores through an engine serve (url)")
    listed = sorted(columns_of_json(json_columns))  # ValueError now, not in an actor
    check_data_options(dataset.context)  # the dataset's own copy of the driver's DataContext
    per_actor = None if config is None else absolute(split_limits(config, actors) if url is None else config)
    return dataset.map_batches(
        RowScorer,
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=actor_cpus,
        fn_constructor_kwargs={"config": per_actor, "url": url, "token": token, "json_columns": listed},
        **ray_remote_args,
    )
