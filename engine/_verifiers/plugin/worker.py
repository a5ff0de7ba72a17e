"""A plugin's worker process: import the plugin once, from the sources the engine vetted, then call it on chunks.

It runs in a fresh interpreter, and imports only what a worker uses (no event loop, none of the engine's
third-party dependencies): every worker started or replaced pays for it. docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from time import monotonic, perf_counter, thread_time
from typing import Any

from engine._core.contract import BadItem, as_rewards, is_async, private_pair
from engine._environments.digest import Snapshot
from engine._verifiers.plugin.frames import own_frames
from engine._verifiers.plugin.importer import PluginLoadError, load_plugin, safely_described
from engine._verifiers.plugin.wire import PROGRESS_BYTES, Pair, PluginSpec, read_argv

__all__ = ["main"]

_Call = Callable[[Mapping[str, Any], Any], Any]


def _described(exc: BaseException, root: str) -> tuple[str, str, str, tuple[traceback.FrameSummary, ...]]:
    """(type name, what ``describe`` says, the traceback, the plugin's own frames under ``root``) of a plugin's
    exception: plain strings and frames, which pickle whatever the exception held."""
    text = "".join(traceback.format_exception(exc))
    return type(exc).__name__, safely_described(exc), text, own_frames(exc, root)


def _watch_parent(alive: int) -> None:
    """Exit once the engine's process dies (``alive`` reads end-of-file), even in the middle of a call."""

    def watch() -> None:
        while os.read(alive, 1):  # nothing is ever written: it returns b"" when the writer is gone
            pass
        if os.getpgrp() == os.getpid():  # it leads its group (launcher.Child): what the plugin started goes too
            os.killpg(0, signal.SIGKILL)
        os._exit(70)

    threading.Thread(target=watch, name="engine-worker-watchdog", daemon=True).start()


def _caller(fn: Callable[..., Any]) -> _Call:
    """``fn`` as a plain call: an ``async def`` plugin runs on an event loop of the worker's own."""
    if not is_async(fn):
        return fn
    import asyncio  # only for an async plugin: every worker pays for what this module imports

    loop = asyncio.new_event_loop()
    return lambda task, trajectory: loop.run_until_complete(fn(task, trajectory))


def _serve_chunk(call: _Call, pairs: Sequence[Pair], progress: memoryview[float], root: str) -> tuple[Any, ...]:
    """Call the plugin (of environment directory ``root``) on each pair; the reply to send back.

    Each call is handed its own copy of its task and trajectory (``private_pair``), as in the
    engine's threads: unpickled together, the items of a piece that shared a task share it here too.
    A value that is not a plain float, int or bool is turned into a reward with its item's position
    and start time in ``progress`` (its ``__float__`` is the plugin's code: it may hang, or end the
    process), so the engine's deadline and a death there name that item.
    """
    out: list[Any] = []
    append = out.append

    def at(position: int) -> None:  # the item now in the plugin's hands, and since when
        progress[0] = position
        progress[1] = monotonic()

    started, cpu = perf_counter(), thread_time()
    position = 0
    try:
        for position, (task, trajectory) in enumerate(pairs):
            at(position)
            append(call(*private_pair(position, task, trajectory)))
    except BadItem as exc:  # the item cannot be copied
        return _bad(exc, root)
    except BaseException as exc:  # SystemExit and the like fail the item, not the worker
        return ("raised", position, *_described(exc, root))
    cost = (perf_counter() - started, thread_time() - cpu)
    try:
        return ("done", as_rewards(out, at), cost)
    except BadItem as exc:
        return _bad(exc, root)
    except BaseException as exc:  # KeyboardInterrupt from a value's code (SIGINT is ignored here: it is the plugin's)
        return ("raised", int(progress[0]), *_described(exc, root))


def _bad(exc: BadItem, root: str) -> tuple[Any, ...]:
    """The reply for an item that cannot be copied or a value that is not a reward, with what raised, if anything
    did (a value's ``__float__``: the plugin's code), described as a plugin's exception is."""
    cause = exc.__cause__
    return ("bad", exc.position, exc.reason, _described(cause, root) if cause is not None else None)


def _first_unpicklable(pickles: Sequence[bytes], progress: memoryview[float]) -> tuple[Any, ...]:
    """The reply to a probe: the position of the first item, pickled alone, that does not unpickle here."""
    for position, data in enumerate(pickles):
        progress[0] = position
        try:
            ForkingPickler.loads(data)
        except BaseException as exc:  # whatever unpickling the trainer's objects raises, even SystemExit
            return ("bad", position, f"the worker process cannot unpickle the item: {safely_described(exc)}", None)
    return ("bad", -1, "every item unpickles alone", None)


def main() -> None:
    """A worker process's entry point: argv holds its descriptors and its plugin's spec (``wire.worker_argv``)."""
    (conn_fd, progress_fd, alive_fd), spec = read_argv(sys.argv[1:])
    _watch_parent(alive_fd)
    with mmap.mmap(progress_fd, PROGRESS_BYTES) as memory:
        os.close(progress_fd)
        progress = memoryview(memory).cast("d")
        try:
            _serve(Connection(conn_fd), progress, spec)
        finally:
            progress.release()


def _serve(conn: Connection, progress: memoryview[float], spec: PluginSpec) -> None:
    """A worker process's whole life: import, then serve chunks until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; the engine stops us
    conn.send(("started",))
    try:
        sources = conn.recv()  # the sources the engine hashed and vetted at spec.digest: never re-read from disk
    except EOFError:  # the engine gave up on this worker
        return
    try:
        fn = load_plugin(Snapshot(Path(spec.root), spec.digest, sources), spec.environment, spec.ref)
    except PluginLoadError as exc:
        cause = exc.__cause__
        conn.send(("failed", exc.reason, _described(cause, spec.root) if cause is not None else None))
        return
    call = _caller(fn)
    conn.send(("ready",))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # the engine closed the pool
            return
        try:
            message = ForkingPickler.loads(data)
            if type(message) is list:  # a chunk: its tasks and trajectories, pickled a piece at a time
                pairs: list[Pair] = []
                for piece in message:
                    tasks, trajectories = ForkingPickler.loads(piece)
                    pairs += zip(tasks, trajectories, strict=True)
        except BaseException as exc:  # pickled by the engine, but not unpicklable here (a class of its __main__)
            conn.send(("unpicklable", safely_described(exc)))  # the engine then asks which item it was (a probe)
            continue
        if type(message) is tuple:  # a probe: ("probe", each item of the chunk that failed, pickled alone)
            conn.send(_first_unpicklable(message[1], progress))
        else:
            conn.send(_serve_chunk(call, pairs, progress, spec.root))
