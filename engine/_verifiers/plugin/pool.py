"""Process-isolated plugins, the engine's side: worker processes that each import a plugin once and call it.

A plugin whose manifest says ``"executor": "process"`` runs in worker processes instead of the
engine's threads. What that buys: a call that overruns its deadline is killed (Python cannot kill a
thread), a crash (a segfault, ``os._exit``, the OOM killer) fails an item instead of the trainer,
libraries that time themselves out with ``signal.alarm`` (math-verify) work because the plugin
runs in its process's main thread, and CPU-bound plugins use every core instead of one GIL.

This module starts, talks to, kills and reaps them; the worker's own side is
``engine._verifiers.plugin.worker``, and what the two say to each other ``engine._verifiers.plugin.wire``.

Workers are fresh interpreters (``python -c``, see :class:`_Child`), not ``fork``ed (the engine
runs an event loop and threads, which ``fork`` would copy half-way) and not multiprocessing's
``spawn`` either, which re-runs the program's ``__main__`` module in every child: each worker then
paid for the trainer script's module-level imports (a model library: seconds, and hundreds of
MiB), and a script without ``if __name__ == "__main__":`` could not use workers at all. A worker
imports only its own module (which imports none of the engine's event loop or HTTP stack) and the
plugin, from the snapshot of the environment's sources the engine vetted: never from the disk, so
a file changed since the check does not run. It is sent *chunks*, the tasks and trajectories of
some items, one round trip each; a chunk the worker cannot unpickle (a class of the trainer's
``__main__``) is sent again as items pickled one by one, to name the one that fails.

The engine's deadline is per item: when a worker overruns it (it is then killed with SIGKILL) or
dies, the few bytes of progress it shares with the engine say which item it was running. A killed
or dead worker is replaced by a fresh one when next needed.

The engine's side of a round trip is blocking code in a thread that belongs to the worker: read
the chunk's items (a view of the batch, :func:`encode`) and pickle their tasks and trajectories,
send, wait on the pipe and the process's sentinel until the deadline, receive and unpickle the
rewards. Nothing of a chunk's size runs on the event loop (measured before: 64 lanes building
their pairs there held it ~200 ms at the start of each 200k-item batch), and the items are
pickled :data:`PIECE` at a time, so no single call of the C pickler holds the GIL from the loop for
long. A round trip costs ~150 us. When the caller is cancelled (its batch aborted), the worker is
killed, which ends that round trip at once.

A worker inherits three descriptors: its end of the pipe, the few bytes of progress (a file
mapped by both), and the read end of a pipe whose write end only the engine's process holds, so
the worker sees end-of-file there, and exits, when that process dies, even in the middle of a
call (a ``kill -9`` of the trainer leaves no orphan).

Each worker leads a process group of its own, which the processes a plugin starts join: killing a
worker kills its group, and once a worker has exited, for whatever reason, what is left of its
group is killed before the worker is reaped (while the unreaped worker holds the group's id, so
the signal cannot reach anyone else). A worker that sees the engine's process die kills its own
group. Only a process that leaves the group on purpose (``setsid``) escapes this.

Workers belong to the process that started them. A child forked from it (a trainer's ``os.fork``,
multiprocessing's fork start method) inherits their objects, and the exit hook that kills the workers
still running: there nothing kills them (the parent's batch in flight would fail on an innocent item),
and the child holds no copy of the pipe that tells them their process died (see ``engine._core.forks``).

A worker that is killed (a timeout, an abort, a crash) is reaped, and its thread, pipe and pidfd
released, as soon as it has died, not when the engine closes: a trainer aborts batches for hours.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import mmap
import multiprocessing.connection
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from time import monotonic, sleep
from typing import Any, TypeVar

from engine._core import meters
from engine._core.contract import BadItem, MalformedItem
from engine._core.forks import Owner
from engine._core.threads import in_thread, wait_future
from engine._errors import Failure
from engine._reasons import describe
from engine._verifiers.plugin.wire import NOWHERE, PROGRESS_BYTES, Cost, Pair, PluginSpec, worker_argv

__all__ = [
    "STARTUP_TIMEOUT",
    "PluginError",
    "WorkerFailure",
    "WorkerPool",
    "as_dict",
    "default_workers",
    "encode",
]

T = TypeVar("T")

STARTUP_TIMEOUT = 60.0  # seconds for a worker's interpreter to start, before it imports the plugin
CLOSE_GRACE = 2.0  # seconds an idle worker has to exit once its pipe is closed, before SIGKILL
JOIN_POLL = 0.005  # seconds between looks at a worker that should exit, where there are no pidfds
PIECE = 2048  # items pickled per call of the pickler (~1 ms of GIL held at ~0.5 us an item)

logger = logging.getLogger("engine")


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class PluginError(Exception):
    """A plugin's exception in a worker process, as text (chained as the ``VerificationError``'s cause)."""

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name = type_name
        super().__init__(text)


class WorkerFailure(Failure):
    """A chunk (or a worker's start) failed: ``reason``, and ``position``, the item's place in the chunk."""

    def __init__(
        self, reason: str, position: int = 0, cause: BaseException | None = None, *, timed_out: bool = False
    ) -> None:
        super().__init__(reason, timed_out=timed_out)
        self.position = position
        self.cause = cause


def as_dict(position: int, task: Mapping[str, Any]) -> dict[str, Any]:
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
            task = as_dict(position, task)
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
    in ``items``, and :class:`WorkerFailure` at the first item that cannot be pickled.
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
            raise WorkerFailure(f"cannot pass the item to a worker process: {describe(exc)}", position) from exc
        count += len(tasks)
        if len(tasks) < PIECE:  # the end of the items, or an item of another environment
            break
    return count, pieces


# --- the worker processes ---


def _unpicklable(pairs: Sequence[Pair]) -> int:
    """The position of the first pair that does not pickle (there is one: the whole chunk did not)."""
    for position, pair in enumerate(pairs):
        try:
            ForkingPickler.dumps(pair)
        except Exception:
            return position
    return 0


class _Overran(Exception):
    """A deadline passed while waiting for a worker's message."""


def _at(reason: str, position: int, *, timed_out: bool = False) -> WorkerFailure:
    """A failure at ``position`` (from a worker's progress), or saying which item it was is not known."""
    if position < 0:
        return WorkerFailure(f"{reason}, while reading its chunk, before any call (which item is not known)", 0,
                             timed_out=timed_out)
    return WorkerFailure(reason, position, timed_out=timed_out)


def _how_it_ended(pid: int, code: int | None, doing: str = "") -> str:
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


_live: set[_Worker] = set()  # every worker not yet closed, killed at interpreter exit if still running


@atexit.register
def _kill_live_workers() -> None:
    for worker in list(_live):
        if worker.process.ours:  # a forked child's exit leaves its parent's workers alone
            worker.kill()


_alive_pipe: tuple[int, int] | None = None
_alive_lock = threading.Lock()


def _forget_alive_pipe() -> None:
    """In a forked child: close its copy of the parent's pipe (while a child holds the write end, the parent's
    workers would outlive the parent's death); a worker the child starts gets a pipe of the child's own."""
    global _alive_pipe, _alive_lock
    _alive_lock = threading.Lock()  # another thread of the parent may have held it as the process forked
    if _alive_pipe is not None:
        for fd in _alive_pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        _alive_pipe = None


os.register_at_fork(after_in_child=_forget_alive_pipe)


def _alive_fd() -> int:
    """The read end of a pipe whose write end this process holds until it dies: each worker is handed it
    (see ``engine._verifiers.plugin.worker``). Neither end is inherited otherwise. Made once, when the
    first worker starts (importing the engine opens nothing), and kept for the life of the process."""
    global _alive_pipe
    with _alive_lock:
        if _alive_pipe is None:
            _alive_pipe = os.pipe()
        return _alive_pipe[0]


def _progress_file() -> int:
    """A descriptor of an unnamed file of ``PROGRESS_BYTES`` zero bytes, to map in both processes."""
    fd, path = tempfile.mkstemp(prefix="engine-progress-")
    os.unlink(path)
    os.ftruncate(fd, PROGRESS_BYTES)
    return fd


class _Child:
    """A worker's process: ``python -c`` running ``engine._verifiers.plugin.worker``, handed ``fds`` (argv says which).

    The little of ``multiprocessing.Process`` the worker uses, over ``subprocess.Popen``; its
    ``sentinel`` is a pidfd (readable once the process has exited) where the platform has them,
    else None and its pipe's end-of-file says it died. The process leads a new session, so a
    process group of its own: :meth:`kill` kills the group, and :meth:`poll` and :meth:`join`
    kill what is left of the group once the process has exited, before they reap it. Only the
    process that made it kills it (:attr:`ours`): in a child forked since, it is the parent's.
    """

    def __init__(self, fds: Sequence[int], spec: PluginSpec) -> None:
        self._owner = Owner()  # the process that starts it (its worker's thread runs there)
        self._fds = tuple(fds)
        self._argv = worker_argv(self._fds, spec)
        self._popen: subprocess.Popen[bytes] | None = None
        self.sentinel: int | None = None
        self.pid: int | None = None

    def start(self) -> None:
        # sys.path as the engine's: the worker imports the engine (and the plugin's libraries) as it does
        code = f"import sys; sys.path[:] = {sys.path!r}; from engine._verifiers.plugin.worker import main; main()"
        self._popen = subprocess.Popen(
            [sys.executable, "-c", code, *self._argv],
            pass_fds=self._fds,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, which whatever the plugin starts joins
        )
        self.pid = self._popen.pid
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or an old kernel
            self.sentinel = os.pidfd_open(self.pid)

    @property
    def ours(self) -> bool:
        """Whether this process made it (and not a parent this process was forked from)."""
        return self._owner.here

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: the signal that ended it (as ``multiprocessing`` says it)."""
        return self.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self.poll() is None

    def _exited(self, popen: subprocess.Popen[bytes]) -> bool:
        """Whether it has exited, without reaping it."""
        if popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped meanwhile, by another thread
            return True

    def poll(self) -> int | None:
        """Its exit code, or None while it runs; once it has exited, its group is killed, then it is reaped."""
        popen = self._popen
        if popen is None:
            return None
        if popen.returncode is None:
            if not self._exited(popen):  # one system call, as Popen.poll() makes: this runs before each call
                return None
            self.kill()  # what the plugin started and left behind
        return popen.poll()

    def kill(self) -> None:
        """SIGKILL its process group, it and whatever the plugin started (from any thread).

        Not once it is reaped: until then its process, even exited, holds the group's id, so the
        signal cannot reach a group that reused the number. Nor from a child forked since: it is
        the parent's worker (and the parent's to reap).
        """
        if self._popen is not None and self._popen.returncode is None and self.ours:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` s (None: as long as it takes) for it to exit; if it has, reap it (as :meth:`poll`)."""
        popen = self._popen
        if popen is None:
            return
        if self.sentinel is not None:
            multiprocessing.connection.wait([self.sentinel], timeout)  # readable once it exited; reaps nothing
        elif timeout is None:
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOWAIT)
        else:  # no pidfd: look until it has exited or the time is up
            deadline = monotonic() + timeout
            while not self._exited(popen) and monotonic() < deadline:
                sleep(JOIN_POLL)
        self.poll()

    def close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


_REAP = "reap"  # queued to a worker's thread by kill(): close it once the current job is over


class _Worker:
    """One worker process, the engine's end of its pipe, and the thread that talks to it.

    ``start`` and ``call`` block: they are submitted to the worker's own thread, which runs them
    one at a time and owns the pipe while one runs (a thread per worker, not one per call: starting
    a thread costs more than the round trip). ``kill`` may be called from any thread at any time;
    the running job then sees the process die and closes it, which also ends the thread.

    ``sources`` is the snapshot of the environment's sources the engine vetted: the worker imports
    the plugin from it.
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
        self.process = _Child((self._child_end, self._progress_fd, _alive_fd()), spec)
        self.busy = False  # taken by a caller (set and cleared on the event loop)
        self.killed = False
        self.closed = False
        self.exitcode: int | None = None
        self.done = threading.Event()  # no job is running or queued: the pipe is free
        self.done.set()
        self._lock = threading.Lock()  # close() runs once
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | str | None]
        self._jobs = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._serve, name=f"engine-worker-io-{spec.environment}-{number}", daemon=True
        )
        self.thread.start()

    def _serve(self) -> None:
        """The worker's thread: run its jobs in order until it is closed."""
        while (job := self._jobs.get()) is not None:
            if isinstance(job, str):  # _REAP: it was killed (a no-op if the job it interrupted has closed it)
                self.close()
                continue
            fn, future = job
            if not future.set_running_or_notify_cancel():  # nobody wants it any more
                self.done.set()
                continue
            try:
                result = fn()
            except BaseException as exc:
                self.done.set()  # before the caller hears of it: it may submit the next job at once
                future.set_exception(exc)
            else:
                self.done.set()
                future.set_result(result)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` (one of its blocking methods) in its thread."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.done.clear()
        self._jobs.put((fn, future))
        return future

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
        self._jobs.put(_REAP)

    def close(self, grace: float = 0.0) -> int | None:
        """Close the pipe (an idle worker then exits), wait up to ``grace`` s, kill it if it runs, reap it.

        Never while a job uses the pipe, except from that job. Its thread ends after the current job.
        """
        with self._lock:
            if not self.closed:
                self.conn.close()
                self._close_child_ends()
                if self.pid is not None:  # started
                    self.process.join(grace)
                    if self.process.exitcode is None:
                        self.process.kill()
                        self.process.join()
                    self.exitcode = self.process.exitcode
                    self.process.close()
                self._progress.release()
                self._memory.close()
                self.closed = True
                _live.discard(self)
                self._jobs.put(None)
        return self.exitcode

    def _close_child_ends(self) -> None:
        """Close our copies of what the child inherited: then its death closes the pipe."""
        if self._child_end is not None:
            os.close(self._child_end)
            self._child_end = None
        if self._progress_fd is not None:
            os.close(self._progress_fd)  # the mapping stays
            self._progress_fd = None

    def _receive(self, deadline: Callable[[], float], doing: str = "") -> Any:
        """The next message; ``_Overran`` once ``deadline()`` passes, ``WorkerFailure`` if the process died."""
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
        raise _at(_how_it_ended(self.pid or 0, self.close(grace=1.0), doing), position)

    def _give_up(self, reason: str, *, timed_out: bool = False) -> WorkerFailure:
        """Kill and close it (it overran a deadline, or its pipe broke), and say why."""
        position = int(self._progress[0])
        self.kill()
        self.close()
        return _at(reason, position, timed_out=timed_out)

    def start(self, timeout: float) -> None:
        """Start the process and wait until it has imported the plugin (``timeout`` bounds the import)."""
        try:
            _live.add(self)
            self.process.start()
            if self.killed:  # killed while it was being started
                self.process.kill()
            self._close_child_ends()
            up_by = monotonic() + STARTUP_TIMEOUT
            try:
                self._receive(lambda: up_by, " while starting")
            except _Overran:
                raise self._give_up(f"its worker process did not start within {STARTUP_TIMEOUT:g} s") from None
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
                raise WorkerFailure(reason, 0, PluginError(error[0], error[2]) if error is not None else None)
        except WorkerFailure:
            raise
        except Exception as exc:  # the process cannot be started (no memory, no pids left, ...)
            raise self._give_up(f"its worker process failed: {describe(exc)}") from exc

    def call(self, items: Sequence[Mapping[str, Any]], timeout: float) -> tuple[list[float], Cost]:
        """Score ``items`` up to the first of another environment: each call within ``timeout`` s, or the
        worker is killed and the item fails. Fewer rewards than items: the next is another environment's.

        Raises :class:`MalformedItem` or :class:`BadItem` for an item that cannot be read (before anything
        is sent: the worker is fine).
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
        except WorkerFailure:
            raise
        except Exception as exc:  # the pipe failed in a way a dead worker does not explain
            raise self._give_up(f"its worker process failed: {describe(exc)}") from exc
        if reply[0] == "done":
            return reply[1], reply[2]
        if reply[0] == "raised":
            _, position, type_name, what, text = reply
            raise WorkerFailure(f"raised {what}", position, PluginError(type_name, text))
        _, position, reason = reply
        raise WorkerFailure(reason, position)

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
            )
        return reply


class WorkerPool:
    """Up to ``size`` worker processes of one plugin, started when first needed and replaced when lost.

    Each caller holds one worker for one chunk. ``call`` raises :class:`WorkerFailure` for every
    way a chunk can fail, with the failing item's position in the chunk.
    """

    def __init__(self, spec: PluginSpec, sources: Mapping[str, bytes], size: int, timeout: float) -> None:
        self.spec = spec
        self.sources = sources  # what every worker imports: the snapshot the engine vetted
        self.size = size
        self.timeout = timeout
        self._slots = meters.slots(size)  # a caller holding one has a worker, or room to start one
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()  # not yet closed
        self._numbers = itertools.count()
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """The process ids of its workers that are not closed yet (started or starting)."""
        return sorted(w.pid for w in self._workers if not w.closed and w.pid is not None)

    async def _in_thread(self, worker: _Worker, fn: Callable[[], T]) -> T:
        """``fn`` (a blocking method of ``worker``) in its thread; cancelling the caller kills the worker."""
        try:
            return await wait_future(worker.submit(fn))
        except BaseException as exc:
            if not isinstance(exc, Exception):  # cancelled: the call is abandoned, so is its worker
                worker.kill()
            raise

    async def _take(self) -> _Worker:
        """An idle worker, or a new one once it has imported the plugin (the caller holds a slot)."""
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        while self._idle:
            worker = self._idle.pop()
            if worker.alive():
                worker.busy = True
                return worker
            code = worker.close()
            logger.warning(
                "plugin %r of environment %r: %s; starting another",
                self.spec.ref,
                self.spec.environment,
                _how_it_ended(worker.pid or 0, code, " while idle").removeprefix("its "),
            )
            self._workers.discard(worker)
        self._workers = {w for w in self._workers if not w.closed}
        worker = _Worker(self.spec, self.sources, next(self._numbers))
        worker.busy = True
        self._workers.add(worker)
        try:
            with meters.starting():  # its spawn until it has imported the plugin: start-up, not verifying
                await self._in_thread(worker, functools.partial(worker.start, self.timeout))
        except WorkerFailure as exc:  # it could not import the plugin: the environment's failure, not an item's
            exc.of_environment = True
            raise
        return worker

    def _give_back(self, worker: _Worker) -> None:
        # A killed worker stays busy until its thread has closed it: nobody else may touch its pipe.
        if worker.usable and not self._closed:
            worker.busy = False
            self._idle.append(worker)

    async def call(self, items: Sequence[Mapping[str, Any]]) -> tuple[list[float], Cost]:
        """The rewards of ``items`` (up to the first of another environment) and what the calls cost, from
        one worker in one round trip. The items are read in the worker's thread (``_Worker.call``): what the
        event loop does here is the same for one item as for a chunk of 100,000.

        Queued for a free worker is waiting (``meters.waiting``), as for any limit: not time in the plugin.
        """
        async with meters.held(self._slots):
            worker = await self._take()
            try:
                return await self._in_thread(worker, functools.partial(worker.call, items, self.timeout))
            finally:
                self._give_back(worker)

    async def warm(self) -> None:
        """Start a worker if none runs: the plugin imports (or the reason it does not is raised)."""
        async with self._slots:
            self._give_back(await self._take())

    async def aclose(self) -> None:
        """Stop every worker: idle ones exit when their pipe closes, busy ones are killed; all are reaped."""
        self._closed = True
        workers, self._workers, self._idle = list(self._workers), set(), []
        for worker in workers:
            if worker.busy:
                worker.kill()
            elif not worker.closed:
                worker.conn.close()  # no job uses it: the worker reads EOF and exits (all at once)

        def finish() -> None:
            for worker in workers:
                worker.done.wait(CLOSE_GRACE)  # a killed worker's job ends as soon as it sees it die
                worker.close(grace=CLOSE_GRACE)
                worker.thread.join(CLOSE_GRACE)

        await wait_future(in_thread(finish, f"engine-worker-close-{self.spec.environment}"))
