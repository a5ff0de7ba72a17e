"""The loop executor: an ``async def`` plugin awaited on the engine's event loop, one item a call."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from engine._core.contract import BadItem, as_rewards
from engine._verifiers.plugin.executor import CallFailed, Executor, must_pass, own_pair
from engine._verifiers.plugin.importer import safely_described

__all__ = ["LoopExecutor"]


class LoopExecutor(Executor):
    """Awaits ``fn`` on the loop; its value's code (``__float__``) runs there too, as the plugin's own does."""

    def __init__(self, fn: Callable[..., Any], timeout: float) -> None:
        self._fn = fn
        self._timeout = timeout

    def chunk_size(self, share: int) -> int:
        return 1  # a chunk would be one await after another: nothing is saved

    async def call(self, task: Mapping[str, Any], trajectory: Any, deadline: float) -> float:
        task, trajectory = own_pair(task, trajectory)
        with anyio.CancelScope(deadline=deadline):
            try:
                return as_rewards([await self._fn(task, trajectory)])[0]
            except BadItem as exc:  # its value is not a reward
                raise CallFailed(exc.reason) from exc.__cause__
            except BaseException as exc:  # a plugin's sys.exit(), or any BaseException, must not end the trainer
                if must_pass(exc):
                    raise
                raise CallFailed(f"raised {safely_described(exc)}") from exc
        raise CallFailed(f"timed out after {self._timeout:g} s", timed_out=True)

    async def call_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        raise AssertionError("unreachable: an async plugin's chunks are of one item (chunk_size)")
