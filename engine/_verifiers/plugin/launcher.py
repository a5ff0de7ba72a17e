"""Starting a plugin's worker process: a fresh interpreter leading its own process group, killed as a group, reaped.

Also the pipe that tells workers this process died, and the kill of those still running at exit. The
design is in docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from time import monotonic, sleep

from engine._core.forks import Owner
from engine._verifiers.plugin.wire import PluginSpec, worker_argv

__all__ = ["Child", "default_workers"]

JOIN_POLL = 0.005  # seconds between looks at a worker that should exit, where there are no pidfds


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


def alive_fd() -> int:
    """The read end of a pipe whose write end this process holds until it dies: each worker is handed it
    (see ``engine._verifiers.plugin.worker``). Neither end is inherited otherwise. Made once, when the
    first worker starts (importing the engine opens nothing), and kept for the life of the process."""
    global _alive_pipe
    with _alive_lock:
        if _alive_pipe is None:
            _alive_pipe = os.pipe()
        return _alive_pipe[0]


_live: set[Child] = set()  # every child started and not yet closed, killed at interpreter exit if still running


@atexit.register
def _kill_live_children() -> None:
    for child in list(_live):
        child.kill()  # a no-op in a forked child: its parent's workers are the parent's


class Child:
    """A worker's process: ``python -c`` running ``engine._verifiers.plugin.worker``, handed ``fds`` (argv says which).

    Its ``sentinel`` is a pidfd (readable once the process has exited) where the platform has them,
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
        _live.add(self)
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
        """Its exit code (negative: the signal that ended it), or None while it runs (or before it starts);
        once it has exited, its group is killed, then it is reaped."""
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
        """Release its pidfd; nothing kills it at exit from now on (it has been reaped, or never started)."""
        _live.discard(self)
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None
