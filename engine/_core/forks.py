"""Which process opened something that only that process can use: a forked child leaves it alone.

Why a child must neither use nor close its parent's engines and workers: docs/design.md, Forked children.
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
