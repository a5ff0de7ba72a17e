"""Scoring on Ray Data: ``score_dataset`` for a Dataset in hand, ``backfill`` for files (``engine score --ray``).

Needs the ``ray`` extra; Ray is imported when one of these runs, never by ``import engine``. Actors, limits and
exactly-once commits: docs/design.md, Backfills on Ray.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from engine._backfill.input import json_columns as columns_of_json
from engine._columns import Columns
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
    columns: Mapping[str, str] | None = None,
    **ray_remote_args: Any,
) -> ray.data.Dataset:
    """Score a Ray Dataset of rollouts on a pool of actors, each holding one engine.

    Args:
        dataset: Rows with columns ``id``, ``environment``, ``task``, ``trajectory`` (or those ``columns``
            names), and any others (kept as they are).
        config: The engine's config, its limits split over the actors (``ceil(max_concurrency / N)``,
            ``max_rate / N``); None only with ``url``.
        actors: How many actors score, each with its own engine.
        url: An ``engine serve`` every actor scores through instead, whose engine holds the limits whole.
        token: That service's bearer token.
        actor_cpus: CPUs Ray reserves for each actor.
        batch_size: Rows per engine batch.
        json_columns: Columns (``task``, ``trajectory``) holding JSON text, as ``engine score
            --json-columns`` says of a file's (a text ``task`` is decoded anyway).
        columns: Where each field is read from, as ``engine score --columns`` says (``{"environment":
            "data_source", "task.reference": "reward_model.ground_truth"}``); None: the config's
            ``[input.columns]``, if any.
        ray_remote_args: Passed to ``map_batches``.

    Returns:
        The same rows with ``reward`` (float64) and ``verifier`` (the single-machine output's struct)
        columns added, scored lazily, when the dataset is consumed. The dataset's
        ``raise_original_map_exception`` is set, so that an engine error is not flattened to text: it
        reaches the consumer inside Ray's wrapping, where :func:`engine_error` finds it. A bad row's
        ``InputError`` names its row within its batch.

    Raises:
        ValueError: ``actors`` is below 1; neither ``config`` nor ``url`` is given; a ``json_columns``
            name is neither ``task`` nor ``trajectory``; ``columns`` is not a column mapping; or the
            dataset's Ray Data options break the guarantees (``max_errored_blocks`` above 0 drops rows;
            ``actor_task_retry_on_errors`` retries verification errors).
    """
    import ray.data

    from engine._ray.actor import absolute, split_limits
    from engine._ray.dataset import RowScorer

    if actors < 1:
        raise ValueError(f"actors must be >= 1, got {actors}")
    if config is None and url is None:
        raise ValueError("a config is needed unless every actor scores through an engine serve (url)")
    listed = sorted(columns_of_json(json_columns))  # ValueError now, not in an actor
    mapping = Columns.chosen(columns, config.input_columns if config is not None else {})
    check_data_options(dataset.context)  # the dataset's own copy of the driver's DataContext
    per_actor = None if config is None else absolute(split_limits(config, actors) if url is None else config)
    return dataset.map_batches(
        RowScorer,
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=actor_cpus,
        fn_constructor_kwargs={"config": per_actor, "url": url, "token": token, "json_columns": listed,
                               "columns": mapping},
        **ray_remote_args,
    )
