"""A sync plugin's calls as they run in a thread: one call, a chunk, and the count of those abandoned there.

Everything a call does to its items (reading, copying, turning values into rewards) happens in its
thread, and it measures what it cost there. Python cannot stop a thread: a call whose caller gave up
on it is counted as abandoned until it returns, and a chunk checks between steps that it is still wanted.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from gc import is_tracked
from time import perf_counter, thread_time
from typing import Any, TypeVar

from engine._core.contract import MalformedItem, as_rewards, private_pair
from engine._verifiers.plugin.executor import Cost
from engine._verifiers.plugin.turns import Turns

__all__ = ["Abandoned", "Interrupted", "ThreadCall", "queued_seconds", "run_chunk", "run_chunk_unqueued", "timed"]

T = TypeVar("T")


def timed(fn: Callable[..., Any], task: Mapping[str, Any], trajectory: Any) -> tuple[float, Cost]:
    """The reward ``fn(task, trajectory)`` returns, and what it cost, measured in its thread (no hop, no queue).

    The value becomes a reward here, in the call's thread and within its timeout, as a chunk's do:
    its ``__float__`` is the plugin's code, which must not run on the event loop. A value that is
    not a reward raises :class:`BadItem`.
    """
    started, cpu = perf_counter(), thread_time()
    reward = as_rewards([fn(task, trajectory)])[0]
    return reward, (perf_counter() - started, thread_time() - cpu)


def run_chunk(
    fn: Callable[..., Any],
    items: Sequence[Mapping[str, Any]],
    out: list[Any],
    environment: str,
    step: int,
    wanted: Callable[[], bool],
    converting: list[int],
    turns: Turns | None = None,
) -> tuple[list[float], Cost]:
    """Call ``fn`` on each item into ``out`` (runs in a thread); the rewards, and what they cost.

    Everything a chunk does to its items happens here, in one thread (see ``engine._core.contract.Items``): it slices
    them ``step`` at a time, and between steps stops if its caller no longer waits (an abort, a
    timeout), so an abandoned chunk ends within a step. It stops early, returning fewer rewards,
    at an item of another environment than ``environment`` (the batch was not all one
    environment's). On an exception, ``len(out)`` is the position of the item that raised;
    :class:`BadItem` names an item that cannot be copied, or a value that is not a reward. Once
    every call has returned, ``converting[0]`` is the position of the value being made a reward
    one at a time (its ``__float__`` is the plugin's code, which may overrun the timeout).
    With ``turns``, it takes turns with the event loop between steps; the time it waits for them
    is not in the cost it returns (that sizes its verifier's chunks).
    """
    append = out.append
    at = functools.partial(converting.__setitem__, 0)
    copy, tracked = dict.copy, is_tracked
    started, cpu = perf_counter(), thread_time()
    waited = 0.0  # for turns
    step_wall, step_cpu = started, cpu
    for start in range(0, len(items), step):
        if turns is not None and start:
            wall, used = perf_counter(), thread_time()
            waited += turns.between((wall - step_wall) - (used - step_cpu))
            step_wall, step_cpu = perf_counter(), thread_time()
        if not wanted():
            raise RuntimeError("abandoned")  # nobody waits for this
        for item in items[start : start + step]:
            try:
                task, trajectory, name = item["task"], item["trajectory"], item["environment"]
            except (KeyError, TypeError):
                raise MalformedItem(len(out)) from None
            if name != environment:
                return as_rewards(out, at), (perf_counter() - started - waited, thread_time() - cpu)
            # each call is handed a task and a trajectory of its own: private_pair, inlined for a text
            # and a task with no container in it (a dict the garbage collector does not track)
            if type(task) is dict and type(trajectory) is str and not tracked(task):
                task = copy(task)
            else:
                task, trajectory = private_pair(len(out), task, trajectory)
            append(fn(task, trajectory))
    return as_rewards(out, at), (perf_counter() - started - waited, thread_time() - cpu)


def queued_seconds() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux's schedstat), or 0.0 where not kept."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def run_chunk_unqueued(*args: Any) -> tuple[list[float], Cost]:
    """:func:`run_chunk` (same arguments), less from its wall time what its thread waited for a CPU meanwhile.

    On a machine loaded past its cores a CPU-bound call waits for its turn on one: that is the machine's
    load, not the call waiting (on I/O, a sleep), and processes on free cores would not wait it.
    """
    before = queued_seconds()
    rewards, (wall, cpu) = run_chunk(*args)
    return rewards, (max(wall - (queued_seconds() - before), cpu), cpu)


class Abandoned:
    """A verifier's thread calls whose caller gave up (a timeout, an abort) while they still run."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()  # guards count and every call's state

    def call(self) -> ThreadCall:
        return ThreadCall(self)


class Interrupted(Exception):
    """A ``KeyboardInterrupt`` a plugin's code raised in a thread: the plugin's failure, never a Ctrl-C
    (Python delivers signals to the main thread only), carried to the loop as one."""

    def __init__(self, raised: KeyboardInterrupt) -> None:
        self.raised = raised
        super().__init__(raised)


class ThreadCall:
    """One call in a thread: counted as abandoned from when its caller gives up until it returns."""

    __slots__ = ("_abandoned", "_state")

    def __init__(self, abandoned: Abandoned) -> None:
        self._abandoned = abandoned
        self._state = "pending"  # -> running -> done; "given up" before or while running

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread; skipped if its caller already gave up on it."""
        lock = self._abandoned.lock
        with lock:
            if self._state == "given up":
                raise RuntimeError("abandoned before it started")  # nobody waits for this
            self._state = "running"
        try:
            return fn(*args)
        except KeyboardInterrupt as exc:
            raise Interrupted(exc) from exc
        finally:
            with lock:
                if self._state == "abandoned":
                    self._abandoned.count -= 1
                self._state = "done"

    def wanted(self) -> bool:
        """Whether its caller still waits for it (read without the lock: a stale answer costs one step)."""
        return self._state == "running"

    def give_up(self) -> None:
        """Its caller stops waiting (no-op once it is done)."""
        with self._abandoned.lock:
            if self._state == "running":
                self._state = "abandoned"
                self._abandoned.count += 1
            elif self._state == "pending":
                self._state = "given up"
