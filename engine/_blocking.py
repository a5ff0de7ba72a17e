"""``BlockingEngine``: the engine for synchronous trainers.

One event loop runs in a background thread for the engine's whole life (an anyio blocking
portal), so every ``score`` call reuses the same connection pool, threads and imported plugins.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from anyio.from_thread import BlockingPortal, start_blocking_portal

from engine._config import EngineConfig, load_config
from engine._core.report import BatchResult
from engine._engine import Engine

if TYPE_CHECKING:
    from engine._serve.client import BlockingRemoteEngine

__all__ = ["BlockingEngine"]


class BlockingEngine:
    """A synchronous facade over :class:`Engine`; use it as a context manager."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self._engine = Engine(config, **kwargs)
        self._stack: ExitStack | None = None
        self._portal: BlockingPortal | None = None

    @classmethod
    def from_config(cls, path: str | Path, **kwargs: Any) -> Self:
        return cls(load_config(path), **kwargs)

    @staticmethod
    def connect(url: str, *, token: str | None = None, **kwargs: Any) -> BlockingRemoteEngine:
        """The engine served by ``engine serve`` at ``url``, used as this class is (see ``Engine.connect``)."""
        from engine._serve.client import BlockingRemoteEngine

        return BlockingRemoteEngine(url, token=token, **kwargs)

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    def __enter__(self) -> Self:
        with ExitStack() as stack:
            self._portal = stack.enter_context(start_blocking_portal(backend="asyncio"))
            stack.enter_context(self._portal.wrap_async_context_manager(self._engine))
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack, self._portal = self._stack, None, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)

    def _open_portal(self) -> BlockingPortal:
        if self._portal is None:
            raise RuntimeError("the engine is not open: use 'with BlockingEngine(...) as eng'")
        return self._portal

    def score(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> list[float]:
        """Like :meth:`Engine.score`, blocking until the batch is scored or has failed."""
        return self._open_portal().call(functools.partial(self._engine.score, items, first_index=first_index))

    def load(self, name: str) -> None:
        """Like :meth:`Engine.load`: make environment ``name``'s verifier ready before the first batch."""
        self._open_portal().call(self._engine.load, name)

    def run(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> BatchResult:
        """Like :meth:`Engine.run`: the rewards with per-verifier reports, usage and provenance."""
        result: BatchResult = self._open_portal().call(
            functools.partial(self._engine.run, items, first_index=first_index)
        )
        return result

    def stats(self, *, reset: bool = True) -> dict[str, float]:
        """Like :meth:`Engine.stats`: the figures since the last reset (read on the engine's own loop)."""
        stats: dict[str, float] = self._open_portal().call(functools.partial(self._engine.stats, reset=reset))
        return stats
