"""TRL: reward functions for ``GRPOTrainer(reward_funcs=[...])``.

TRL calls a reward function once per step per rank with columns, not rows: ``prompts``,
``completions``, ``completion_ids``, every other dataset column as a list, and ``trainer_state``,
``log_extra``, ``log_metric``. Each row becomes an item: ``environment`` from the row's ``environment``
column, else the constructor's; ``task`` = ``{"prompt": prompt, **the row's other columns}`` (but
``environment`` and ``id``); ``trajectory`` = the completion (text or messages); ``id`` from an ``id``
column if there is one.

``EngineReward`` is synchronous: it runs on the training thread, scoring on the process's background
engine loop. ``AsyncEngineReward`` is awaited on TRL's own event loop, and its engine is bound to that
loop. Both pickle (TRL requires it) as their arguments: the engine is opened again where they land.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import engine
from engine.adapters._runtime import Source, engine_for, in_background

__all__ = ["AsyncEngineReward", "EngineReward"]

logger = logging.getLogger("engine")
ON_ERROR = ("raise", "skip_batch")
# what TRL passes besides the columns: not part of any row
_NOT_COLUMNS = frozenset({"trainer_state", "log_extra", "log_metric"})
# the engine's figures that average across ranks, as log_metric averages them (percentiles do not)
_AVERAGED = ("items", "reward_mean", "errors", "retries", "timeouts", "judge_tokens")


class EngineReward:
    """A TRL reward function scored by the engine: ``list[float]``, or ``None`` for every row of a skipped batch.

    ``config`` is the engine's config file (or an ``EngineConfig``, which does not pickle), ``url`` an
    ``engine serve``'s (with ``token``); neither: ``ENGINE_CONFIG`` or ``ENGINE_URL``. ``environment``
    serves rows without an ``environment`` column. ``on_error="raise"`` (the default) raises the
    ``VerificationError``; ``"skip_batch"`` logs it at ERROR and returns ``None`` for every row, which
    TRL leaves out of the advantage (never zeros). ``name`` is TRL's metric name for it (its
    ``__name__``): the environment's, else ``"engine"``.
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
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, got {on_error!r}")
        if environment is not None and (not isinstance(environment, str) or not environment):
            raise TypeError(f"environment must be a non-empty string, got {environment!r}")
        self._source = Source.of(config, url, token)
        self.environment = environment
        self.on_error = on_error
        self.__name__ = name or environment or "engine"

    def __getstate__(self) -> dict[str, Any]:
        if isinstance(self._source.config, engine.EngineConfig):
            raise TypeError(f"{type(self).__name__} with an EngineConfig object does not pickle: pass its file's path")
        return {
            "source": self._source,
            "environment": self.environment,
            "on_error": self.on_error,
            "name": self.__name__,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._source = state["source"]
        self.environment = state["environment"]
        self.on_error = state["on_error"]
        self.__name__ = state["name"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._source!r}, environment={self.environment!r}, on_error={self.on_error!r})"

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        log_metric = kwargs.get("log_metric")
        rewards, stats = in_background(self._score, self.items(prompts, completions, kwargs), log_metric is not None)
        if log_metric is not None:  # on the training thread, where TRL keeps its metrics
            _log(stats, log_metric)
        return rewards

    def items(
        self, prompts: Sequence[Any], completions: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """The engine items of TRL's columns (see the module's docstring)."""
        count = len(prompts)
        if len(completions) != count:
            raise ValueError(f"{len(completions)} completions for {count} prompts")
        columns = {}
        for key, values in kwargs.items():
            if key in _NOT_COLUMNS or not isinstance(values, list | tuple):
                continue  # not a dataset column (TRL's own context)
            if len(values) != count:
                raise ValueError(f"column {key!r} has {len(values)} values for {count} prompts")
            columns[key] = values
        environments = columns.pop("environment", None)
        ids = columns.pop("id", None)
        if environments is None and self.environment is None:
            raise ValueError(
                "no environment: give EngineReward(environment=...) or the dataset an 'environment' column"
            )
        items = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            item: dict[str, Any] = {
                "environment": environments[row] if environments is not None else self.environment,
                "task": {"prompt": prompt, **{key: values[row] for key, values in columns.items()}},
                "trajectory": completion,
            }
            if ids is not None:
                item["id"] = ids[row]
            items.append(item)
        return items

    async def _score(self, items: list[dict[str, Any]], stats: bool) -> tuple[list[float | None], dict[str, float]]:
        """The rewards of ``items``, and the engine's figures since the last call if ``stats``."""
        eng = await engine_for(self._source)
        rewards: list[float | None]
        try:
            rewards = list(await eng.score(items))
        except engine.VerificationError as exc:
            if self.on_error == "raise":
                raise
            logger.error(
                "reward function %r skipped its batch of %d rows (None for each): %s", self.__name__, len(items), exc
            )
            rewards = [None] * len(items)
        figures = getattr(eng, "stats", None)  # an engine serve's client may keep none
        return rewards, (dict(figures(reset=True)) if stats and figures is not None else {})


class AsyncEngineReward(EngineReward):
    """:class:`EngineReward` awaited on TRL's event loop, its engine bound to that loop (same arguments)."""

    async def __call__(  # type: ignore[override]  # TRL awaits an async __call__
        self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        log_metric = kwargs.get("log_metric")
        rewards, stats = await self._score(self.items(prompts, completions, kwargs), log_metric is not None)
        if log_metric is not None:
            _log(stats, log_metric)
        return rewards


def _log(stats: Mapping[str, float], log_metric: Callable[[str, float], Any]) -> None:
    """The figures that average across ranks, as TRL's ``log_metric`` does; none that is NaN."""
    for key, value in stats.items():
        if key.rsplit("/", 1)[-1] in _AVERAGED and not math.isnan(value):
            log_metric(key, value)
