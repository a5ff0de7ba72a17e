"""TRL: reward functions for ``GRPOTrainer(reward_funcs=[...])``.

How TRL calls them, with columns and its own context, and how each row finds its environment:
docs/design.md, Trainer adapters.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import engine
from engine.adapters._runtime import ENV_ENVIRONMENT, Source, engine_for, in_background

__all__ = ["AsyncEngineReward", "EngineReward"]

logger = logging.getLogger("engine")
ON_ERROR = ("raise", "skip_batch")
# What TRL 1.16.0 passes besides the dataset's columns (GRPOTrainer._calculate_rewards): its own
# context, never part of a row. `environments` holds environment_factory's instances, which are
# neither a task's data nor JSON.
TRL_CONTEXT = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})
# the verifier kinds that retry (an endpoint's transient failures, the judge's requests): a plugin never does
_RETRYING = frozenset({"endpoint", "rubric"})


@dataclass(frozen=True)
class Figure:
    """One figure for TRL's ``log_metric``: logged ``weight`` times, so that TRL's average over every value
    logged on every rank (sum over count) is the mean over items, each rank weighted by its items."""

    name: str
    value: float
    weight: int


class EngineReward:
    """A TRL reward function scored by the engine: ``list[float]``, or ``None`` for every row of a skipped batch.

    Args:
        config: The engine's config file (or an ``EngineConfig``, which does not pickle). With neither it
            nor ``url``: ``ENGINE_CONFIG``, or ``ENGINE_URL`` with ``ENGINE_TOKEN``.
        url: An ``engine serve``'s URL (with ``token``).
        environment: Every row's environment, whatever its environment column says. Without it: the
            row's environment column, else ``ENGINE_ENVIRONMENT`` (read here, when it is built).
        on_error: ``"raise"`` (the default) raises the ``VerificationError``; ``"skip_batch"`` logs it at
            ERROR and returns ``None`` for every row (TRL then zeroes those rows' advantage, or, beside
            another reward function, trains them on that one alone). Only a verification failure is
            skipped: a service that cannot be reached or refuses the token, and misuse, are raised.
        token: The ``engine serve``'s bearer token.
        name: TRL's metric name for it (its ``__name__``): the environment's, else ``"engine"``.
        environment_column: The column naming each row's environment (``None``: every row is
            ``environment``'s).

    Raises:
        ValueError: No engine configured, a config file that is missing or does not parse, an
            environment the config has no directory for, or arguments that cannot be used; also when
            neither an environment nor an environment column could name one (``environment_column=None``).
        TypeError: Arguments of the wrong type.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | engine.EngineConfig | None = None,
        *,
        url: str | None = None,
        environment: str | None = None,
        on_error: Literal["raise", "skip_batch"] = "raise",
        token: str | None = None,
        name: str | None = None,
        environment_column: str | None = "environment",
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, got {on_error!r}")
        if environment is not None and (not isinstance(environment, str) or not environment):
            raise TypeError(f"environment must be a non-empty string, got {environment!r}")
        if environment_column is not None and (not isinstance(environment_column, str) or not environment_column):
            raise TypeError(f"environment_column must be a non-empty string or None, got {environment_column!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name must be a non-empty string, got {name!r}")
        if environment_column in TRL_CONTEXT or environment_column in ("prompts", "completions", "completion_ids"):
            raise ValueError(f"environment_column {environment_column!r} is one of TRL's own arguments, not a column")
        # environment= is every row's: two rewards built for two environments never both read one column
        self.fixed = environment is not None
        environment = environment or os.environ.get(ENV_ENVIRONMENT) or None
        if environment is None and environment_column is None:
            raise ValueError(
                f"no environment: give EngineReward(environment=...), set {ENV_ENVIRONMENT}, "
                "or name an environment column"
            )
        self._source = Source.of(config, url, token)
        _check_source(self._source, environment)
        self.environment = environment
        self.environment_column = environment_column
        self.on_error = on_error
        self.__name__ = name or environment or "engine"

    def __getstate__(self) -> dict[str, Any]:
        if isinstance(self._source.config, engine.EngineConfig):
            raise TypeError(f"{type(self).__name__} with an EngineConfig object does not pickle: pass its file's path")
        return {
            "source": self._source,
            "environment": self.environment,
            "fixed": self.fixed,
            "environment_column": self.environment_column,
            "on_error": self.on_error,
            "name": self.__name__,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._source = state["source"]
        self.environment = state["environment"]
        self.fixed = state.get("fixed", False)
        self.environment_column = state.get("environment_column", "environment")
        self.on_error = state["on_error"]
        self.__name__ = state["name"]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._source!r}, environment={self.environment!r}, "
            f"environment_column={self.environment_column!r}, on_error={self.on_error!r})"
        )

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        """Score one generation batch, as TRL calls a reward function, on the process's background engine loop.

        Args:
            prompts: Each row's prompt.
            completions: Each row's completion (text or messages): the item's trajectory.
            completion_ids: TRL's token ids; unused.
            kwargs: The dataset's other columns, each a list, and TRL's own context (``trainer_state``,
                ``log_extra``, ``log_metric``, ``environments``); figures go to ``log_metric``.

        Returns:
            One reward per row, in order; under ``on_error="skip_batch"``, ``None`` for every row of a
            batch that failed verification.

        Raises:
            engine.VerificationError: A row failed verification (under ``on_error="raise"``).
            ValueError: Columns of other lengths than the prompts, or a row no environment names.
        """
        rewards, figures = in_background(self._score, self.items(prompts, completions, kwargs))
        _log(figures, kwargs.get("log_metric"))  # on the training thread, where TRL keeps its metrics
        return rewards

    def items(
        self, prompts: Sequence[Any], completions: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """The engine items of TRL's columns: one per row.

        ``environment`` = the reward's own ``environment=`` (every row's), else the row's environment
        column, else ``ENGINE_ENVIRONMENT``; ``task`` = ``{"prompt": prompt, **the row's other columns}``
        (but the environment column and ``id``; TRL's own context is never a column); ``trajectory`` =
        the completion (text or messages); ``id`` from an ``id`` column if there is one.

        Raises:
            ValueError: Columns of other lengths than the prompts, or a row no environment names.
        """
        count = len(prompts)
        if len(completions) != count:
            raise ValueError(f"{len(completions)} completions for {count} prompts")
        columns = {}
        for key, values in kwargs.items():
            if key in TRL_CONTEXT or not isinstance(values, list | tuple):
                continue  # TRL's own context, not a dataset column
            if len(values) != count:
                raise ValueError(f"column {key!r} has {len(values)} values for {count} prompts")
            columns[key] = values
        environments = columns.pop(self.environment_column, None) if self.environment_column is not None else None
        ids = columns.pop("id", None)
        items = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            environment = None if self.fixed or environments is None else environments[row]
            if environment is None:
                environment = self.environment
                if environment is None:
                    raise ValueError(
                        f"no environment for row {row}: its {self.environment_column!r} column is missing or None, "
                        f"and neither EngineReward(environment=...) nor {ENV_ENVIRONMENT} names one"
                    )
            item: dict[str, Any] = {
                "environment": environment,
                "task": {"prompt": prompt, **{key: values[row] for key, values in columns.items()}},
                "trajectory": completion,
            }
            if ids is not None:
                item["id"] = ids[row]
            items.append(item)
        return items

    async def _score(self, items: list[dict[str, Any]]) -> tuple[list[float | None], list[Figure]]:
        """The rewards of ``items``, and the figures to log for them."""
        eng = await engine_for(self._source)
        try:
            result = await eng.run(items)
        except engine.VerificationError as exc:
            if self.on_error == "raise":
                raise
            logger.error(
                "reward function %r skipped its batch of %d rows (None for each): %s", self.__name__, len(items), exc
            )
            return [None] * len(items), [Figure(f"engine/{self.__name__}/skip_rate", 1.0, 1)]
        rewards: list[float | None] = list(result.rewards)
        if len(rewards) != len(items):  # never hand TRL rewards paired with the wrong rows
            raise RuntimeError(f"the engine returned {len(rewards)} rewards for {len(items)} items")
        return rewards, _figures(result, self.__name__ if self.on_error == "skip_batch" else None)


class AsyncEngineReward(EngineReward):
    """:class:`EngineReward` awaited on TRL's event loop, its engine bound to that loop (same arguments)."""

    async def __call__(  # type: ignore[override]  # TRL awaits an async __call__
        self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        rewards, figures = await self._score(self.items(prompts, completions, kwargs))
        _log(figures, kwargs.get("log_metric"))
        return rewards


def _check_source(source: Source, environment: str | None) -> None:
    """Configuration errors now, not after the first generation: the config file read (it must exist and
    parse), and ``environment`` looked up in it. An ``engine serve``'s environments are its own: they are
    known at the first step."""
    config = source.config
    if config is None:
        return
    if not isinstance(config, engine.EngineConfig):
        config = engine.load_config(config)
    if environment is not None:
        engine.Engine(config).environment(environment)  # reads the manifest only: nothing is opened


def _figures(result: engine.BatchResult, skipping: str | None) -> list[Figure]:
    """The figures of a scored batch that mean the same averaged over ranks: per-item means, weighted by items.

    ``reward_mean`` per verifier; ``retries_per_item`` for the kinds that retry; ``judge_tokens_per_item``
    for rubrics; and, under ``skip_batch``, the reward function's ``skip_rate`` (0.0 here).
    """
    figures = []
    for report in result.verifiers:
        if report.items <= 0:
            continue
        prefix, weight = f"engine/{report.key}/", report.items
        figures.append(Figure(prefix + "reward_mean", report.reward_sum / weight, weight))
        if report.kind in _RETRYING:
            figures.append(Figure(prefix + "retries_per_item", report.retries / weight, weight))
        if report.kind == "rubric":
            tokens = report.spent.get("total_tokens", 0)
            figures.append(Figure(prefix + "judge_tokens_per_item", tokens / weight, weight))
    if skipping is not None:
        figures.append(Figure(f"engine/{skipping}/skip_rate", 0.0, 1))
    return figures


def _log(figures: Sequence[Figure], log_metric: Callable[[str, float], Any] | None) -> None:
    """Each figure ``weight`` times: TRL averages every value logged in a step over every rank."""
    if log_metric is None:
        return
    for figure in figures:
        for _ in range(figure.weight):
            log_metric(figure.name, figure.value)
