"""A synchronous face over an async engine (``BlockingEngine``, and its client twin ``BlockingEngine.connect``).

One event loop runs in a background thread for the face's whole life (an anyio blocking portal),
so every call reuses what the engine holds: its connections, threads and imported plugins.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager, ExitStack
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from engine._core.report import BatchResult

__all__ = ["Blocking"]


class _Scores(AbstractAsyncContextManager[Any], Protocol):
    """What an async engine (in process, or a service's client) offers the face."""

    async def score(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> list[float]: ...

    async def run(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> BatchResult: ...

    def stats(self, *, reset: bool = True) -> dict[str, float]: ...


E = TypeVar("E", bound=_Scores)


class Blocking(Generic[E]):
    """``engine``'s calls, blocking until each is done, on a loop of the face's own; use it as a context manager."""

    _opened_as = "with BlockingEngine(...) as eng"  # how a caller opens it: said when it is used closed

    def __init__(self, engine: E) -> None:
        self._engine = engine
        self._stack: ExitStack | None = None
        self._portal: BlockingPortal | None = None

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
            raise RuntimeError(f"the engine is not open: use '{self._opened_as}'")
        return self._portal

    def score(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> list[float]:
        """Like the engine's ``score``, blocking until the batch is scored or has failed."""
        return self._open_portal().call(functools.partial(self._engine.score, items, first_index=first_index))

    def run(self, items: Iterable[Mapping[str, Any]], *, first_index: int = 0) -> BatchResult:
        """Like the engine's ``run``: the rewards with per-verifier reports, usage and provenance."""
        result: BatchResult = self._open_portal().call(
            functools.partial(self._engine.run, items, first_index=first_index)
        )
        return result

    def stats(self, *, reset: bool = True) -> dict[str, float]:
        """Like the engine's ``stats``: the figures since the last reset (read on the engine's own loop)."""
        stats: dict[str, float] = self._open_portal().call(functools.partial(self._engine.stats, reset=reset))
        return stats
