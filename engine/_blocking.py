"""``BlockingEngine``: the engine for synchronous trainers.

One event loop runs in a background thread for the engine's whole life (``engine._core.portal``),
so every ``score`` call reuses the same connection pool, threads and imported plugins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from engine._config import EngineConfig, load_config
from engine._core.portal import Blocking
from engine._engine import Engine
from engine._remote.client import TIMEOUT as REMOTE_TIMEOUT
from engine._remote.client import BlockingRemoteEngine

__all__ = ["BlockingEngine"]


class BlockingEngine(Blocking[Engine]):
    """A synchronous facade over :class:`Engine`; use it as a context manager."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(Engine(config, **kwargs))

    @classmethod
    def from_config(cls, path: str | Path, **kwargs: Any) -> Self:
        return cls(load_config(path), **kwargs)

    @staticmethod
    def connect(
        url: str, *, token: str | None = None, timeout: float | None = REMOTE_TIMEOUT, **kwargs: Any
    ) -> BlockingRemoteEngine:
        """The engine served by ``engine serve`` at ``url``, used as this class is (see ``Engine.connect``).

        ``timeout``: seconds one request may take to be answered, 600 by default, ``None`` to wait forever.
        """
        return BlockingRemoteEngine(url, token=token, timeout=timeout, **kwargs)

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    def load(self, name: str) -> None:
        """Like :meth:`Engine.load`: make environment ``name``'s verifier ready before the first batch."""
        self._open_portal().call(self._engine.load, name)
