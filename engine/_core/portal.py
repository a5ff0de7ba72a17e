"""A synchronous face over an async engine (``BlockingEngine``, and its client twin ``BlockingEngine.connect``).

One event loop runs in a background thread for the face's whole life; a forked child's copy refuses
calls and closes nothing (docs/design.md, "Forked children").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from engine._core.forks import Owner
from engine._core.report import BatchResult

__all__ = ["Blocking", "LoopThread"]


class LoopThread:
    """An event loop in a daemon thread of its own, reached through its anyio blocking portal; :meth:`stop` ends it.

    Not anyio's ``start_blocking_portal``: a context manager made of a generator stops its loop when
    it is collected, and a forked child collects what its parent opened (at the latest as its
    interpreter ends), where the loop's thread is not: it would wait for it for ever. Nothing of this
    runs when it is collected. A daemon thread (older anyio releases' ``start_blocking_portal`` use a
    pool's thread, not a daemon): the interpreter joins every thread that is not a daemon before it
    runs ``atexit`` hooks, so a loop in one would hang the exit before a hook that ends it ran. The one
    thread running a loop for synchronous callers: ``BlockingEngine``'s, its client twin's, and the adapters'.
    """

    def __init__(self, name: str) -> None:
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self.thread.start()
        self.portal = ready.result()

    @staticmethod
    def _run(ready: concurrent.futures.Future[BlockingPortal]) -> None:
        async def host() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        try:
            anyio.run(host, backend="asyncio")
        except BaseException as exc:
            if ready.done():
                raise
            ready.set_exception(exc)  # the loop never started: the caller waiting for it hears why

    def stop(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Let the calls under way finish (``cancel``: cancel them), stop the loop, and wait up to ``timeout`` s
        (None: as long as it takes) for its thread to end."""
        with contextlib.suppress(RuntimeError):  # stopped already
            self.portal.call(self.portal.stop, cancel)
        self.thread.join(timeout)


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
        self._loop: LoopThread | None = None
        self._opened: AbstractContextManager[Any] | None = None  # the engine, opened on the loop
        self._owner: Owner | None = None  # the process that opened it

    def __enter__(self) -> Self:
        loop = LoopThread(name=f"engine-blocking-{id(self):x}")
        try:
            opened = loop.portal.wrap_async_context_manager(self._engine)
            opened.__enter__()
        except BaseException:
            loop.stop(cancel=True)
            raise
        self._loop, self._opened, self._owner = loop, opened, Owner()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        loop, opened, owner = self._loop, self._opened, self._owner
        self._loop = self._opened = self._owner = None
        if loop is None or opened is None or owner is None:
            return
        if not owner.here:  # a forked child's copy: the loop, and what the engine holds, are the parent's
            return
        try:
            opened.__exit__(exc_type, exc, tb)
        except BaseException:
            loop.stop(cancel=True)
            raise
        loop.stop(cancel=exc_type is not None)

    def _open_portal(self) -> BlockingPortal:
        if self._loop is None or self._owner is None:
            raise RuntimeError(f"the engine is not open: use '{self._opened_as}'")
        self._owner.check("this engine", self._opened_as)
        return self._loop.portal

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
