"""What the engine and a plugin's worker process say to each other: the one place both sides agree on.

The engine (``engine._verifiers.plugin.pool``) starts a worker (``engine._verifiers.plugin.worker``)
as ``python -c``, handing it three descriptors and the plugin's :class:`PluginSpec` on its command
line (:func:`worker_argv`, :func:`read_argv`):

- its end of a socket pair, spoken over with ``multiprocessing.connection.Connection`` (pickles,
  each framed by its length);
- a file of :data:`PROGRESS_BYTES` that both map: ``[position in the chunk, monotonic start]`` of
  the call the worker is running, written by the worker before each call, read by the engine when
  the worker overruns its deadline or dies, to name the item;
- the read end of a pipe whose write end only the engine's process holds: end-of-file there means
  that process died, and the worker exits.

Then, on the socket pair, engine ``->`` worker and back:

1. ``("started",)`` once the interpreter runs; the engine sends the sources it vetted (a dict,
   relative path -> bytes), which the worker imports the plugin from; the worker answers
   ``("ready",)`` or ``("failed", reason, (type name, what it says, traceback) or None)``.
2. Then chunks: a list of pickles, each of ``(tasks, trajectories)``, two lists of some of the
   chunk's items, in order (pickled a piece at a time so the engine's pickler never holds its GIL
   long; columns, not a tuple per item, so the engine makes nothing per item to collect). The answer
   is ``("done", rewards, (wall, cpu))``, the rewards already finite floats; ``("raised", position,
   type name, what it says, traceback)``: a plugin's exception, as text (it need not be picklable);
   ``("bad", position, reason)``: an item that cannot be copied, or a value that is not a reward; or
   ``("unpicklable", reason)``: a chunk the worker cannot unpickle (a class of the trainer's
   ``__main__``), after which the engine sends ``("probe", [each pair pickled alone])`` and the
   worker answers ``("bad", position, reason)`` naming the first that does not unpickle, or
   ``("bad", -1, ...)`` if each does.
3. The engine closing its end means: exit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NOWHERE", "PROGRESS_BYTES", "Cost", "Pair", "PluginSpec", "read_argv", "worker_argv"]

Pair = tuple[Mapping[str, Any], Any]  # (task, trajectory): what a chunk is a list of

Cost = tuple[float, float]  # (wall seconds, CPU seconds of the calling thread) of some calls, as a chunk's answer says

PROGRESS_BYTES = 16  # [position in the chunk, monotonic start] of the call a worker is running, as doubles
NOWHERE = -1  # progress[0] while a worker reads a chunk: it calls nothing yet, so no item is to blame


@dataclass(frozen=True)
class PluginSpec:
    """What a worker needs to import a plugin: where, under which name, and the digest it was vetted at."""

    root: str  # the environment directory, absolute
    environment: str
    ref: str
    digest: str


def worker_argv(fds: Sequence[int], spec: PluginSpec) -> list[str]:
    """A worker's arguments: its descriptors (pipe, progress, engine alive), then its spec's fields."""
    return [*map(str, fds), spec.root, spec.environment, spec.ref, spec.digest]


def read_argv(argv: Sequence[str]) -> tuple[tuple[int, int, int], PluginSpec]:
    """The descriptors and the spec :func:`worker_argv` wrote (``argv`` without the program's name)."""
    conn, progress, alive, root, environment, ref, digest = argv
    return (int(conn), int(progress), int(alive)), PluginSpec(root, environment, ref, digest)
