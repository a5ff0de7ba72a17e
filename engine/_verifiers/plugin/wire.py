"""What crosses the pipe between the engine and a plugin's worker process, and the engine's half of encoding it.

The worker's half is ``engine._verifiers.plugin.worker``; the protocol, message by message, is in
docs/design.md, "Plugin executors".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from engine._core.contract import BadItem, MalformedItem
from engine._reasons import describe

__all__ = [
    "NOWHERE",
    "PIECE",
    "PROGRESS_BYTES",
    "Pair",
    "PluginSpec",
    "columns_of",
    "encode",
    "read_argv",
    "worker_argv",
]

Pair = tuple[Mapping[str, Any], Any]  # (task, trajectory): what a chunk is a list of

PIECE = 2048  # items pickled per call of the pickler (~1 ms of GIL held at ~0.5 us an item)

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


def _as_dict(position: int, task: Mapping[str, Any]) -> dict[str, Any]:
    """A task for a worker process: as a plain dict, as threads are handed it (``private_pair``).

    Another kind of mapping (a ``MappingProxyType``, a class of the trainer's ``__main__``) may not
    pickle, or not unpickle in a worker that cannot import its class. Raises :class:`BadItem` if
    it cannot be read.
    """
    if type(task) is dict:
        return task
    try:
        return dict(task.items())
    except Exception as exc:
        raise BadItem(position, f"cannot read the item's task: {describe(exc)}") from exc


def columns_of(items: Sequence[Mapping[str, Any]], environment: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """The tasks and the trajectories of items up to the first of another environment, each task a dict.

    Two lists of what the items hold, not a ``(task, trajectory)`` tuple per item: nothing new per
    item for the collector to track (tuples made by the hundred thousand, alive while a chunk is
    pickled, were promoted to its oldest generation and set off full collections, ~100-200 ms of
    the event loop's time, every few batches). Raises :class:`MalformedItem` at the first item that
    has no task or trajectory, :class:`BadItem` at the first whose task cannot be read as a dict.
    """
    tasks: list[dict[str, Any]] = []
    trajectories: list[Any] = []
    for position, item in enumerate(items):
        try:
            task, trajectory, name = item["task"], item["trajectory"], item["environment"]
        except (KeyError, TypeError):
            raise MalformedItem(position) from None
        if name != environment:
            break
        if type(task) is not dict:
            if not isinstance(task, Mapping):
                raise MalformedItem(position)
            task = _as_dict(position, task)
        tasks.append(task)
        trajectories.append(trajectory)
    return tasks, trajectories


def _shifted(exc: BadItem | MalformedItem, offset: int) -> BadItem | MalformedItem:
    """``exc``, raised for a piece of a chunk, at its position in the chunk (``offset`` is the piece's)."""
    if isinstance(exc, MalformedItem):
        return MalformedItem(exc.position + offset)
    return BadItem((exc.position or 0) + offset, exc.reason)


def encode(items: Sequence[Mapping[str, Any]], environment: str) -> tuple[int, list[bytes]]:
    """How many of ``items`` a chunk holds (up to the first of another environment), and the pickles
    of their tasks and trajectories (:func:`columns_of`), :data:`PIECE` items each: what a chunk sends.

    Runs in a worker's thread, never on the event loop: it reads every item (a view of the batch,
    sliced a piece at a time) and pickles them. Each piece is one call of the C pickler, which holds
    the GIL until it returns; pieces keep that short. Raises as :func:`columns_of` does, positions
    in ``items``, and :class:`BadItem` at the first item that cannot be pickled.
    """
    count = 0
    pieces: list[bytes] = []
    for start in range(0, len(items), PIECE):
        try:
            tasks, trajectories = columns_of(items[start : start + PIECE], environment)
        except (BadItem, MalformedItem) as exc:
            raise _shifted(exc, start) from exc.__cause__
        if not tasks:
            break
        try:
            pieces.append(bytes(ForkingPickler.dumps((tasks, trajectories))))
        except Exception as exc:  # pickling fails before anything is sent: the worker is fine
            position = start + _unpicklable(list(zip(tasks, trajectories, strict=True)))
            raise BadItem(position, f"cannot pass the item to a worker process: {describe(exc)}") from exc
        count += len(tasks)
        if len(tasks) < PIECE:  # the end of the items, or an item of another environment
            break
    return count, pieces


def _unpicklable(pairs: Sequence[Pair]) -> int:
    """The position of the first pair that does not pickle (there is one: the whole chunk did not)."""
    for position, pair in enumerate(pairs):
        try:
            ForkingPickler.dumps(pair)
        except Exception:
            return position
    return 0
