"""What every plugin executor offers the verifier, and how it says that a call failed."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from engine._core.contract import BadItem, ProcessHint, private_pair
from engine._errors import Failure

__all__ = ["MAX_CHUNK", "CallFailed", "Cost", "Executor", "must_pass", "own_pair"]

Cost = tuple[float, float]  # (wall seconds, CPU seconds of the calling thread) of some calls, measured where they ran
MAX_CHUNK = 1 << 18  # items: bounds what one chunk holds (its values and rewards, ~2 MiB of pointers each)


class CallFailed(Failure):
    """A plugin's call failed, as its executor saw it; its cause, if any, is chained.

    ``position`` is the failing item's place in its chunk, if known; ``timed_out``, whether it overran
    the call timeout; ``of_environment``, whether the plugin cannot load (every item of it fails alike).
    ``PluginVerifier`` makes the ``Failure`` the scheduler sees from it, in one place.
    """

    def __init__(
        self, reason: str, position: int | None = None, *, timed_out: bool = False, of_environment: bool = False
    ) -> None:
        super().__init__(reason, position=position)
        self.timed_out = timed_out
        self.of_environment = of_environment


class Executor(Protocol):
    """One way of running a loaded plugin's calls: on the event loop, in threads, or in worker processes.

    Executors subclass it for the defaults of what only some of them have (worker processes, a hint).
    """

    def chunk_size(self, share: int) -> int:
        """Items per call (``Verifier.chunk_size``): 1 until its calls are measured, and always for some."""
        ...

    async def call(self, task: Mapping[str, Any], trajectory: Any, deadline: float) -> float:
        """The reward of one item, by ``deadline`` (``anyio.current_time()``'s clock); raises :class:`CallFailed`.

        A worker process keeps a deadline of its own per item, from when the call reaches it.
        """
        ...

    async def call_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The rewards of ``items`` up to the first of another environment (``Chunker.verify_chunk``).

        Raises :class:`CallFailed` with the failing item's position, or ``MalformedItem``.
        """
        ...

    async def process_hint(self, items: Sequence[Mapping[str, Any]]) -> ProcessHint | None:
        """Worker processes would gain it cores, as warm calls of ``items`` measured; or None (no call made).

        Raises :class:`CallFailed` if a call fails, its ``position`` the item's in ``items``.
        """
        return None

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of its worker processes, if it has any."""
        return []

    async def warm(self) -> None:
        """Be ready to call at once (a worker process started); raises :class:`CallFailed` if it cannot be."""
        return None

    async def aclose(self) -> None:
        """Release its threads or processes; a call still running in a thread ends on its own."""
        return None


def own_pair(task: Mapping[str, Any], trajectory: Any) -> tuple[dict[str, Any], Any]:
    """The task and trajectory one call in this process is handed (``private_pair``); :class:`CallFailed` if they
    cannot be copied."""
    try:
        return private_pair(0, task, trajectory)
    except BadItem as exc:
        raise CallFailed(exc.reason) from exc.__cause__


def must_pass(exc: BaseException) -> bool:
    """Whether ``exc``, raised where a plugin's code ran, is not the plugin's failure but must pass: a
    ``KeyboardInterrupt`` a signal may have raised, or the event loop cancelling this task (a timeout, an
    abort). A ``CancelledError`` the plugin raised itself, while nothing cancels the task, is its failure."""
    if isinstance(exc, KeyboardInterrupt):
        return _may_be_a_signal()
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() > 0
    return False


def _may_be_a_signal() -> bool:
    """Whether a ``KeyboardInterrupt`` on this thread may be Ctrl-C's: on the main thread, while SIGINT's handler
    raises one (Python's own, or asyncio's runner's on a second Ctrl-C). Under any other (``engine serve``'s,
    the CLI's during a run: they stop the loop instead) it can only be the plugin's own, as in a thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGINT)
    handler = getattr(handler, "func", handler)  # the runner installs a functools.partial of its method
    return handler is signal.default_int_handler or isinstance(getattr(handler, "__self__", None), asyncio.Runner)
