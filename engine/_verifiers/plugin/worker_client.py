"""The engine's end of one worker process: start it, send it a chunk, wait for its answer by the deadline, kill it.

Its blocking work runs on a kept thread of its own, never on the event loop. The design is in
docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from time import monotonic
from typing import Any, TypeVar

from engine._core.threads import KeptThread
from engine._reasons import describe
from engine._verifiers.plugin.executor import CallFailed, Cost
from engine._verifiers.plugin.launcher import Child, alive_fd
from engine._verifiers.plugin.wire import NOWHERE, PROGRESS_BYTES, Pair, PluginSpec, columns_of, encode

__all__ = ["CLOSE_GRACE", "STARTUP_TIMEOUT", "PluginError", "WorkerClient", "how_it_ended"]

T = TypeVar("T")

STARTUP_TIMEOUT = 60.0  # seconds for a worker's interpreter to start, before it imports the plugin
CLOSE_GRACE = 2.0  # seconds an idle worker has to exit once its pipe is closed, before SIGKILL


class PluginError(Exception):
    """A plugin's exception in a worker process, as the worker saw it (chained as the ``VerificationError``'s cause).

    Its text is the traceback the worker formatted, whole (what a trainer's log of the error shows);
    ``type_name`` and ``described`` are its type's name and what ``describe`` said of it, ``frames`` the
    plugin's own frames of it (``engine._verifiers.plugin.frames``).
    """

    def __init__(
        self, type_name: str, described: str, text: str, frames: Sequence[traceback.FrameSummary] = ()
    ) -> None:
        self.type_name = type_name
        self.described = described
        self.frames = tuple(frames)
        super().__init__(text)

    @property
    def worker_traceback(self) -> str:
        """The traceback as the worker formatted it."""
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:  # its arguments are not its args
        return type(self), (self.type_name, self.described, self.worker_traceback, self.frames)


class _Overran(Exception):
    """A deadline passed while waiting for a worker's message."""


def _failed_at(reason: str, position: int, *, timed_out: bool = False) -> CallFailed:
    """A failure at ``position`` (from a worker's progress), or saying which item it was is not known."""
    if position < 0:
        reason = f"{reason}, while reading its chunk, before any call (which item is not known)"
    return CallFailed(reason, max(position, 0), timed_out=timed_out)


def how_it_ended(pid: int, code: int | None, doing: str = "") -> str:
    """Why a worker is gone, from its exit code; ``doing`` (" importing the module") says when."""
    if code is None:
        return f"its worker process (pid {pid}) stopped answering{doing}"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        hint = " (kill -9, or the kernel's out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"its worker process (pid {pid}) died{doing}: killed by signal {name}{hint}"
    return f"its worker process (pid {pid}) died{doing}: it exited with code {code}"


def _progress_file() -> int:
    """A descriptor of an unnamed file of ``PROGRESS_BYTES`` zero bytes, to map in both processes."""
    fd, path = tempfile.mkstemp(prefix="engine-progress-")
    os.unlink(path)
    os.ftruncate(fd, PROGRESS_BYTES)
    return fd


class WorkerClient:
    """One worker process, the engine's end of its pipe, and the kept thread that talks to it.

    ``start`` and ``call`` block: they are submitted to its thread (:meth:`submit`), which runs them
    one at a time and owns the pipe while one runs (a thread per worker, not one per call: starting
    a thread costs more than the round trip). ``kill`` may be called from any thread at any time;
    the running job then sees the process die and closes it, and the thread closes it after the job
    in any case. ``sources`` is the snapshot of the environment's sources the engine vetted: the
    worker imports the plugin from it.
    """

    def __init__(self, spec: PluginSpec, sources: Mapping[str, bytes], number: int) -> None:
        self.spec = spec
        self.sources = sources
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        self._child_end: int | None = theirs.detach()
        # [position in the chunk, monotonic start] of the current call, in a file both map
        self._progress_fd: int | None = _progress_file()
        self._memory = mmap.mmap(self._progress_fd, PROGRESS_BYTES)
        self._progress = memoryview(self._memory).cast("d")
        self.process = Child((self._child_end, self._progress_fd, alive_fd()), spec)
        self.busy = False  # taken by a caller (set and cleared on the event loop)
        self.killed = False
        self.closed = False
        self._exit_code: int | None = None
        self._lock = threading.Lock()  # close() runs once
        self.thread = KeptThread(f"engine-worker-io-{spec.environment}-{number}")

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` (one of its blocking methods) in its thread, after the jobs before it."""
        return self.thread.submit(fn)

    @property
    def pid(self) -> int | None:
        """Its process's id, once started."""
        return self.process.pid

    @property
    def usable(self) -> bool:
        return not (self.killed or self.closed)

    def alive(self) -> bool:
        """Whether its process is running (reaps it if it is not)."""
        return not self.closed and self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL its process, if it has one and it runs; from any thread.

        Its thread then closes it (reaps it, releases its pipe, pidfd and mapping, and ends) once the
        current job, if any, is over: also when no job was running to see it die (an abort that
        came just as a call returned), so a killed worker never waits for the engine's close.
        """
        self.killed = True
        with contextlib.suppress(ValueError, AttributeError):  # closed, or never started
            self.process.kill()
        if not self.closed:
            self.submit(self.close)

    def close(self, grace: float = 0.0) -> int | None:
        """Close the pipe (an idle worker then exits), wait up to ``grace`` s, kill it if it runs, reap it;
        its exit code.

        Never while a job uses the pipe, except from that job. Its thread ends after the current job.
        """
        with self._lock:
            if not self.closed:
                self.conn.close()
                self._close_child_ends()
                if self.pid is not None:  # started
                    self.process.join(grace)
                    if self.process.poll() is None:
                        self.process.kill()
                        self.process.join()
                    self._exit_code = self.process.poll()
                self.process.close()
                self._progress.release()
                self._memory.close()
                self.closed = True
                self.thread.close()
        return self._exit_code

    def _close_child_ends(self) -> None:
        """Close our copies of what the child inherited: then its death closes the pipe."""
        if self._child_end is not None:
            os.close(self._child_end)
            self._child_end = None
        if self._progress_fd is not None:
            os.close(self._progress_fd)  # the mapping stays
            self._progress_fd = None

    def _receive(self, deadline: Callable[[], float], doing: str = "") -> Any:
        """The next message; ``_Overran`` once ``deadline()`` passes, ``CallFailed`` if the process died."""
        conn, sentinel = self.conn, self.process.sentinel
        waitables: list[Any] = [conn] if sentinel is None else [conn, sentinel]
        while True:
            remaining = deadline() - monotonic()
            if remaining <= 0:
                raise _Overran
            ready = multiprocessing.connection.wait(waitables, remaining)
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, ConnectionResetError):  # it died (reset: before reading what we sent)
                    break
            elif ready:  # the sentinel: it exited
                break
        position = int(self._progress[0])
        raise _failed_at(how_it_ended(self.pid or 0, self.close(grace=1.0), doing), position)

    def _give_up(self, reason: str, *, timed_out: bool = False) -> CallFailed:
        """Kill and close it (it overran a deadline, or its pipe broke), and say why."""
        position = int(self._progress[0])
        self.kill()
        self.close()
        return _failed_at(reason, position, timed_out=timed_out)

    def start(self, timeout: float) -> None:
        """Start the process and wait until it has imported the plugin (``timeout`` bounds the import)."""
        try:
            self.process.start()
            if self.killed:  # killed while it was being started
                self.process.kill()
            self._close_child_ends()
            up_by = monotonic() + STARTUP_TIMEOUT
            try:
                self._receive(lambda: up_by, " while starting")
            except _Overran:
                reason = f"its worker process did not start within {STARTUP_TIMEOUT:g} s"
                raise self._give_up(reason, timed_out=True) from None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died: the wait below says how
                self.conn.send(dict(self.sources))
            imported_by = monotonic() + timeout
            try:
                message = self._receive(lambda: imported_by, " importing the module")
            except _Overran:
                raise self._give_up(f"timed out after {timeout:g} s importing the module", timed_out=True) from None
            if message[0] == "failed":
                _, reason, error = message
                self.close(grace=CLOSE_GRACE)
                cause = PluginError(*error) if error is not None else None
                raise CallFailed(reason, 0) from cause
        except CallFailed:
            raise
        except Exception as exc:  # the process cannot be started (no memory, no pids left, ...)
            raise self._give_up(f"its worker process failed: {describe(exc)}") from exc

    def call(self, items: Sequence[Mapping[str, Any]], timeout: float) -> tuple[list[float], Cost]:
        """Score ``items`` up to the first of another environment: each call within ``timeout`` s, or the
        worker is killed and the item fails. Fewer rewards than items: the next is another environment's.

        Raises :class:`MalformedItem` or :class:`BadItem` for an item that cannot be read or pickled (before
        anything is sent: the worker is fine).
        """
        count, pieces = encode(items, self.spec.environment)
        if not count:
            return [], (0.0, 0.0)
        try:
            progress = self._progress
            progress[0], progress[1] = NOWHERE if count > 1 else 0, monotonic()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died: the wait below says how
                self.conn.send(pieces)
            try:
                reply = self._receive(lambda: progress[1] + timeout)
            except _Overran:
                raise self._give_up(f"timed out after {timeout:g} s", timed_out=True) from None
            if reply[0] == "unpicklable":  # a failure path: the items are read again, to pickle one by one
                tasks, trajectories = columns_of(items[:count], self.spec.environment)
                reply = self._probe(list(zip(tasks, trajectories, strict=True)), reply[1], timeout)
        except CallFailed:
            raise
        except Exception as exc:  # the pipe failed in a way a dead worker does not explain
            raise self._give_up(f"its worker process failed: {describe(exc)}") from exc
        if reply[0] == "done":
            return reply[1], reply[2]
        if reply[0] == "raised":
            _, position, type_name, what, text, frames = reply
            raise CallFailed(f"raised {what}", position) from PluginError(type_name, what, text, frames)
        _, position, reason, error = reply  # "bad", and what raised, if anything did
        raise CallFailed(reason, position) from (PluginError(*error) if error is not None else None)

    def _probe(self, pairs: Sequence[Pair], reason: str, timeout: float) -> tuple[Any, ...]:
        """The reply naming the item of a chunk the worker could not unpickle (``reason`` says why).

        Pickled together, the chunk says only that one of its items does not unpickle there (its
        class lives in the trainer's ``__main__``, say): each item is sent again pickled alone, and
        the worker unpickles them one by one, calling nothing, until one fails. A failure path only.
        """
        pickles = [bytes(ForkingPickler.dumps(pair)) for pair in pairs]  # they pickled together: each does
        progress = self._progress
        progress[0], progress[1] = NOWHERE, monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died: the wait below says how
            self.conn.send(("probe", pickles))
        try:
            reply: tuple[Any, ...] = self._receive(lambda: progress[1] + timeout)
        except _Overran:
            reason = f"timed out after {timeout:g} s unpickling the items one by one"
            raise self._give_up(reason, timed_out=True) from None
        if reply[0] == "bad" and reply[1] < 0:
            return (
                "bad",
                0,
                f"the worker process cannot unpickle the items: {reason}; each item alone unpickles there, "
                "so which of them is not known",
                None,
            )
        return reply

