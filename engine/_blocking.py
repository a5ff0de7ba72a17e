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
    """A synchronous facade over :class:`Engine`; use it as a context manager::

        with BlockingEngine.from_config("engine.toml") as eng:
            rewards = eng.score(items)

    Its ``score``, ``run`` and ``stats`` take and return what :class:`Engine`'s do, and raise what they
    raise.

    Args:
        config: The engine's configuration; the defaults when None.
        kwargs: As :class:`Engine` takes them (``transport``, ``sleep``).
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(Engine(config, **kwargs))

    @classmethod
    def from_config(cls, path: str | Path, **kwargs: Any) -> Self:
        """A blocking engine configured by a TOML file.

        Args:
            path: The config file.
            kwargs: As :class:`Engine` takes them.

        Returns:
            The engine, not yet open.

        Raises:
            ConfigError: The file is missing, is not TOML, or holds a bad key or value (named).
        """
        return cls(load_config(path), **kwargs)

    @staticmethod
    def connect(
        url: str, *, token: str | None = None, timeout: float | None = REMOTE_TIMEOUT, **kwargs: Any
    ) -> BlockingRemoteEngine:
        """The engine served by ``engine serve`` at ``url``, used as this class is (see ``Engine.connect``).

        Args:
            url: The service's ``http://`` or ``https://`` URL.
            token: The service's bearer token.
            timeout: Seconds one request may take to be answered, 600 by default, ``None`` to wait forever.
            kwargs: As ``Engine.connect`` takes them.

        Returns:
            The client, not yet open.

        Raises:
            ValueError: The URL, token or timeout cannot be used (a token's message never holds it).
        """
        return BlockingRemoteEngine(url, token=token, timeout=timeout, **kwargs)

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration."""
        return self._engine.config

    def load(self, name: str) -> None:
        """Make an environment's verifier ready before the first batch, as :meth:`Engine.load` does.

        Args:
            name: The environment's directory name.

        Raises:
            VerificationError, ValueError, ManifestError, RuntimeError: As :meth:`Engine.load` raises them.
        """
        self._open_portal().call(self._engine.load, name)
