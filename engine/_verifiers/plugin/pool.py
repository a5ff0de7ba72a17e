"""Process-isolated plugins: worker processes that each import a plugin once and call it in their main thread.

A plugin whose manifest says ``"executor": "process"`` runs here instead of in the engine's
threads. What that buys: a call that overruns its deadline is killed (Python cannot kill a
thread), a crash (a segfault, ``os._exit``, the OOM killer) fails an item instead of the trainer,
libraries that time themselves out with ``signal.alarm`` (math-verify) work because the plugin
runs in its process's main thread, and CPU-bound plugins use every core instead of one GIL.

Workers are fresh interpreters (``python -c``, see :class:`_Child`), not ``fork``ed (the engine
runs an event loop and threads, which ``fork`` would copy half-way) and not multiprocessing's
``spawn`` either, which re-runs the program's ``__main__`` module in every child: each worker then
paid for the trainer script's module-level imports (a model library: seconds, and hundreds of
MiB), and a script without ``if __name__ == "__main__":`` could not use workers at all. A worker
imports only the engine and the plugin. It

1. says it is up, receives from the engine the snapshot of the environment's sources that the
   engine vetted (``engine._environments.digest``), imports the plugin from it
   (``engine._verifiers.plugin.importer``: never from the disk, so a file changed since the check
   does not run), and says it is ready or why it cannot be;
2. then serves *chunks*: a list of ``(task, trajectory)`` pairs in, one message out: the rewards
   (already checked to be finite floats) and what the calls cost, or the position in the chunk of
   the first item that failed and why. A plugin's exception travels as text (its type, message
   and traceback): it need not be picklable. A chunk the worker cannot unpickle (a class of the
   trainer's ``__main__``) is sent again as items pickled one by one, to name the one that fails.

Before each call the worker writes the item's position and start time to a few bytes shared with
the engine: the engine's deadline is per item, and when a worker overruns it (it is then killed
with SIGKILL) or dies, the engine knows which item it was running. A killed or dead worker is
replaced by a fresh one when next needed.

The engine's side of a round trip is blocking code in a thread that belongs to the worker (pickle
and send the chunk, wait on the pipe and the process's sentinel until the deadline, receive), so a
large chunk is never pickled on the event loop; a round trip costs ~150 us. When the caller is
cancelled (its batch aborted), the worker is killed, which ends that round trip at once.

A worker inherits three descriptors: its end of the pipe, the few bytes of progress (a file
mapped by both), and the read end of a pipe whose write end only the engine's process holds, so
the worker sees end-of-file there, and exits, when that process dies, even in the middle of a
call (a ``kill -9`` of the trainer leaves no orphan).

Each worker leads a process group of its own, which the processes a plugin starts join: killing a
worker kills its group, and once a worker has exited, for whatever reason, what is left of its
group is killed before the worker is reaped (while the unreaped worker holds the group's id, so
the signal cannot reach anyone else). A worker that sees the engine's process die kills its own
group. Only a process that leaves the group on purpose (``setsid``) escapes this.

A worker that is killed (a timeout, an abort, a crash) is reaped, and its thread, pipe and pidfd
released, as soon as it has died, not when the engine closes: a trainer aborts batches for hours.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
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
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from time import monotonic, perf_counter, sleep, thread_time
from typing import Any, TypeVar

from engine._core import meters
from engine._core.contract import BadItem, as_rewards, private_pair
from engine._environments.digest import Snapshot
from engine._reasons import describe
from engine._verifiers.plugin.importer import PluginLoadError, load_callable

__all__ = [
    "STARTUP_TIMEOUT",
    "Cost",
    "PluginError",
    "PluginSpec",
    "WorkerFailure",
    "WorkerPool",
    "default_workers",
    "in_thread",
    "load_plugin",
    "said",
    "wait_future",
]

T = TypeVar("T")
Cost = tuple[float, float]  # (wall seconds, CPU seconds of the calling thread) of some calls
Pair = tuple[Mapping[str, Any], Any]  # (task, trajectory)
_Call = Callable[[Mapping[str, Any], Any], Any]

STARTUP_TIMEOUT = 60.0  # seconds for a worker's interpreter to start, before it imports the plugin
CLOSE_GRACE = 2.0  # seconds an idle worker has to exit once its pipe is closed, before SIGKILL
JOIN_POLL = 0.005  # seconds between looks at a worker that should exit, where there are no pidfds
PROGRESS_BYTES = 16  # [position in the chunk, monotonic start] of the call a worker is running, as doubles

logger = logging.getLogger("engine")


# --- threads whose result outlives whoever waits for it ---


def in_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run ``fn`` in a new daemon thread; its future outlives whoever started it."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """Await ``future``; cancelling the waiter leaves the future (and its thread) running."""
    waiter = asyncio.wrap_future(future)
    waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
    return await asyncio.shield(waiter)


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# --- what crosses the pipe ---


@dataclass(frozen=True)
class PluginSpec:
    """What a worker needs to import a plugin: where, under which name, and the digest it was vetted at."""

    root: str  # the environment directory, absolute
    environment: str
    ref: str
    digest: str


class PluginError(Exception):
    """A plugin's exception in a worker process, as text (chained as the ``VerificationError``'s cause)."""

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name = type_name
        super().__init__(text)


class WorkerFailure(Exception):
    """A chunk (or a worker's start) failed: ``reason``, and ``position``, the item's place in the chunk."""

    def __init__(self, reason: str, position: int = 0, cause: BaseException | None = None) -> None:
        self.reason = reason
        self.position = position
        self.cause = cause
        super().__init__(reason)


def said(exc: BaseException) -> str:
    """What ``describe`` says of a plugin's exception; never raises (its ``__str__`` is the plugin's code)."""
    try:
        return describe(exc)
    except KeyboardInterrupt:
        raise
    except BaseException:  # an exception whose __str__ raises, even SystemExit
        return type(exc).__name__


def _described(exc: BaseException) -> tuple[str, str, str]:
    """(type name, what ``describe`` says, the traceback) of a plugin's exception, as plain strings."""
    return type(exc).__name__, said(exc), "".join(traceback.format_exception(exc))


def load_plugin(snapshot: Snapshot, environment: str, ref: str) -> Callable[..., Any]:
    """:func:`~engine._verifiers.plugin.importer.load_callable`, and whatever else the plugin's code raises on its
    import or while its callable is looked up (a ``BaseException`` of its own, such as pytest's ``Skipped``
    or ``func_timeout``'s ``FunctionTimedOut``) a :class:`PluginLoadError` too, the cause chained.

    Only ``KeyboardInterrupt`` passes: it is the user's, not the plugin's.
    """
    try:
        return load_callable(snapshot, environment, ref)
    except (PluginLoadError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise PluginLoadError(f"cannot load {ref!r}: {said(exc)}") from exc


# --- the worker process ---


def _watch_parent(alive: int) -> None:
    """Exit once the engine's process dies (``alive`` reads end-of-file), even in the middle of a call."""

    def watch() -> None:
        while os.read(alive, 1):  # nothing is ever written: it returns b"" when the writer is gone
            pass
        if os.getpgrp() == os.getpid():  # it leads its group (see _Child): what the plugin started goes too
            os.killpg(0, signal.SIGKILL)
        os._exit(70)

    threading.Thread(target=watch, name="engine-worker-watchdog", daemon=True).start()


def _caller(fn: Callable[..., Any]) -> _Call:
    """``fn`` as a plain call: an ``async def`` plugin runs on an event loop of the worker's own."""
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        return fn
    loop = asyncio.new_event_loop()
    return lambda task, trajectory: loop.run_until_complete(fn(task, trajectory))


def _serve_chunk(call: _Call, pairs: Sequence[Pair], progress: memoryview[float]) -> tuple[Any, ...]:
    """Call the plugin on each pair; the reply to send back.

    Each call is handed its own copy of its task and trajectory (``private_pair``), as in the
    engine's threads: unpickled together, the items of a chunk that shared a task share it here too.
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
        return ("bad", exc.position, exc.reason)
    except BaseException as exc:  # SystemExit and the like fail the item, not the worker
        return ("raised", position, *_described(exc))
    cost = (perf_counter() - started, thread_time() - cpu)
    try:
        return ("done", as_rewards(out, at), cost)
    except BadItem as exc:
        return ("bad", exc.position, exc.reason)
    except BaseException as exc:  # KeyboardInterrupt from a value's code (SIGINT is ignored here: it is the plugin's)
        return ("raised", int(progress[0]), *_described(exc))


def _first_unpicklable(pickles: Sequence[bytes], progress: memoryview[float]) -> tuple[Any, ...]:
    """The reply to a probe: the position of the first item, pickled alone, that does not unpickle here."""
    for position, data in enumerate(pickles):
        progress[0] = position
        try:
            ForkingPickler.loads(data)
        except BaseException as exc:  # whatever unpickling the trainer's objects raises, even SystemExit
            return ("bad", position, f"the worker process cannot unpickle the item: {said(exc)}")
    return ("bad", -1, "every item unpickles alone")


def _child_main() -> None:
    """A worker process's entry point (see :class:`_Child`): argv holds its descriptors and its plugin's spec."""
    conn_fd, progress_fd, alive_fd = (int(arg) for arg in sys.argv[1:4])
    spec = PluginSpec(**json.loads(sys.argv[4]))
    _watch_parent(alive_fd)
    with mmap.mmap(progress_fd, PROGRESS_BYTES) as memory:
        os.close(progress_fd)
        progress = memoryview(memory).cast("d")
        try:
            _worker_main(Connection(conn_fd), progress, spec)
        finally:
            progress.release()


def _worker_main(conn: Connection, progress: memoryview[float], spec: PluginSpec) -> None:
    """A worker process's whole life: check, import, then serve chunks until the pipe closes."""
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
        conn.send(("failed", exc.reason, _described(cause) if cause is not None else None))
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
        except BaseException as exc:  # pickled by the engine, but not unpicklable here (a class of its __main__)
            conn.send(("unpicklable", said(exc)))  # the engine then asks which item it was (a probe)
            continue
        if type(message) is tuple:  # a probe: ("probe", each item of the chunk that failed, pickled alone)
            conn.send(_first_unpicklable(message[1], progress))
        else:
            conn.send(_serve_chunk(call, message, progress))


# --- the engine's side ---


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


NOWHERE = -1  # progress[0] while a worker reads a chunk: it calls nothing yet, so no item is to blame


def _at(reason: str, position: int) -> WorkerFailure:
    """A failure at ``position`` (from a worker's progress), or saying which item it was is not known."""
    if position < 0:
        return WorkerFailure(f"{reason}, while reading its chunk, before any call (which item is not known)", 0)
    return WorkerFailure(reason, position)


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
        worker.kill()


_alive_pipe: tuple[int, int] | None = None
_alive_lock = threading.Lock()


def _alive_fd() -> int:
    """The read end of a pipe whose write end this process holds until it dies: each worker is handed it
    (see _watch_parent). Neither end is inherited otherwise. Made once, when the first worker starts
    (importing the engine opens nothing), and kept for the life of the process."""
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
    """A worker's process: ``python -c`` running :func:`_child_main`, handed ``fds`` (argv says which).

    The little of ``multiprocessing.Process`` the worker uses, over ``subprocess.Popen``; its
    ``sentinel`` is a pidfd (readable once the process has exited) where the platform has them,
    else None and its pipe's end-of-file says it died. The process leads a new session, so a
    process group of its own: :meth:`kill` kills the group, and :meth:`poll` and :meth:`join`
    kill what is left of the group once the process has exited, before they reap it.
    """

    def __init__(self, fds: Sequence[int], spec: PluginSpec) -> None:
        self._fds = tuple(fds)
        self._spec = json.dumps(dataclasses.asdict(spec))
        self._popen: subprocess.Popen[bytes] | None = None
        self.sentinel: int | None = None
        self.pid: int | None = None

    def start(self) -> None:
        # sys.path as the engine's: the worker imports the engine (and the plugin's libraries) as it does
        code = (
            f"import sys; sys.path[:] = {sys.path!r}; "
            "from engine._verifiers.plugin.pool import _child_main; _child_main()"
        )
        self._popen = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, self._fds), self._spec],
            pass_fds=self._fds,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, which whatever the plugin starts joins
        )
        self.pid = self._popen.pid
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or an old kernel
            self.sentinel = os.pidfd_open(self.pid)

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
        signal cannot reach a group that reused the number.
        """
        if self._popen is not None and self._popen.returncode is None:
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

    def _give_up(self, reason: str) -> WorkerFailure:
        """Kill and close it (it overran a deadline, or its pipe broke), and say why."""
        position = int(self._progress[0])
        self.kill()
        self.close()
        return _at(reason, position)

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
                raise self._give_up(f"timed out after {timeout:g} s importing the module") from None
            if message[0] == "failed":
                _, reason, error = message
                self.close(grace=CLOSE_GRACE)
                raise WorkerFailure(reason, 0, PluginError(error[0], error[2]) if error is not None else None)
        except WorkerFailure:
            raise
        except Exception as exc:  # the process cannot be started (no memory, no pids left, ...)
            raise self._give_up(f"its worker process failed: {describe(exc)}") from exc

    def call(self, pairs: Sequence[Pair], timeout: float) -> tuple[list[float], Cost]:
        """Score ``pairs``: each call within ``timeout`` s, or the worker is killed and the item fails."""
        try:
            progress = self._progress
            progress[0], progress[1] = NOWHERE if len(pairs) > 1 else 0, monotonic()
            try:
                self.conn.send(pairs)
            except (BrokenPipeError, ConnectionResetError):
                pass  # it died while idle, or while reading the chunk: the wait below says how
            except Exception as exc:  # pickling fails before anything is sent: the worker is fine
                raise WorkerFailure(
                    f"cannot pass the item to a worker process: {describe(exc)}", _unpicklable(pairs)
                ) from exc
            try:
                reply = self._receive(lambda: progress[1] + timeout)
            except _Overran:
                raise self._give_up(f"timed out after {timeout:g} s") from None
            if reply[0] == "unpicklable":
                reply = self._probe(pairs, reply[1], timeout)
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
            raise self._give_up(f"timed out after {timeout:g} s unpickling the items one by one") from None
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
        await self._in_thread(worker, functools.partial(worker.start, self.timeout))
        return worker

    def _give_back(self, worker: _Worker) -> None:
        # A killed worker stays busy until its thread has closed it: nobody else may touch its pipe.
        if worker.usable and not self._closed:
            worker.busy = False
            self._idle.append(worker)

    async def call(self, pairs: Sequence[Pair]) -> tuple[list[float], Cost]:
        """The rewards of ``pairs`` and what the calls cost, from one worker in one round trip."""
        async with self._slots:
            worker = await self._take()
            try:
                return await self._in_thread(worker, functools.partial(worker.call, pairs, self.timeout))
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
