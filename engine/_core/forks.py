"""Which process opened something that only that process can use: a forked child leaves it alone.

``os.fork()`` copies a process's memory but only the thread that called it. A child has its parent's
engines without their threads (a blocking engine's event loop: a call would wait for ever), and the
parent's worker processes, which are not its children (killing them fails the parent's batch in
flight on an innocent item; their pipes are the parent's conversations). Whatever holds such things
notes the process that opened it (:class:`Owner`). In any other process it is refused
(:meth:`Owner.check` raises, saying so) or left alone: closing it, or an exit hook, does nothing of
the parent's.
"""

from __future__ import annotations

import os

__all__ = ["Owner"]


class Owner:
    """The process that opened something: this one, when made."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    @property
    def here(self) -> bool:
        """Whether this is the process that opened it (not a child forked from it since)."""
        return self.pid == os.getpid()

    def check(self, what: str, how: str) -> None:
        """``RuntimeError`` unless this is the process that opened ``what`` (opened in this one as ``how`` says)."""
        pid = os.getpid()
        if pid != self.pid:
            raise RuntimeError(
                f"{what} belongs to another process: it was opened in pid {self.pid}, and this is pid {pid} "
                f"(a child forked from it); open one in this process: '{how}'"
            )
