"""Leak checks for the fault suite: threads, child processes, pipes and sockets back to where they were.

``no_leaks`` is for synchronous tests (``BlockingEngine``: closing it ends its event loop and the
loop's worker threads); an async test takes a :class:`Snapshot` inside its event loop and calls
:meth:`Snapshot.settled` after its engine has closed.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from polling import wait_until

import engine._verifiers.plugin.launcher

SETTLE_SECONDS = 5.0  # how long abandoned threads and dying processes get to finish


def child_pids() -> set[int]:
    """Every process whose parent is this one (zombies included: a child not yet reaped is a leak)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        if int(stat.rpartition(")")[2].split()[1]) == me:  # the name in parentheses may hold spaces
            found.add(int(entry))
    return found


def channels() -> set[str]:
    """The pipes and sockets this process holds open, as ``pipe:[inode]`` / ``socket:[inode]``."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith(("pipe:", "socket:")):
            found.add(target)
    return found


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited and been reaped (a zombie still has a /proc entry)."""
    return not Path("/proc", str(pid)).exists()


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[threading.Thread]
    children: frozenset[int]
    channels: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        # spawning a process starts multiprocessing's resource tracker, once for the life of this
        # process: it is not a leak of any one test
        multiprocessing.resource_tracker.ensure_running()
        # likewise the pipe that tells workers this process died, made when the first worker starts
        engine._verifiers.plugin.launcher.alive_fd()
        return cls(frozenset(threading.enumerate()), frozenset(child_pids()), frozenset(channels()))

    def leaks(self) -> list[str]:
        found = []
        threads = [t.name for t in threading.enumerate() if t not in self.threads]
        if threads:
            found.append(f"threads {threads}")
        children = child_pids() - self.children
        if children:
            found.append(f"child processes {sorted(children)}")
        opened = channels() - self.channels
        if opened:
            found.append(f"pipes and sockets {sorted(opened)}")
        return found

    def settled(self) -> None:
        """Assert that nothing outlives the test, once abandoned threads and dying processes have ended."""
        wait_until(
            lambda: not self.leaks(),
            SETTLE_SECONDS,
            message=f"left behind after {SETTLE_SECONDS:g} s: {'; '.join(self.leaks())}",
        )


@pytest.fixture
def no_leaks() -> Iterator[Snapshot]:
    snapshot = Snapshot.take()
    yield snapshot
    snapshot.settled()
