"""Files an environment directory must not hold: a FIFO, a socket, a link to a device.

Reading any of them blocks or never ends (a FIFO's ``open`` waits for a writer; ``/dev/zero`` has no
end), so the digest refuses them by their type, never by opening them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["SPECIAL_KINDS", "make_special"]

SPECIAL_KINDS = ["fifo", "socket", "link-to-dev-zero"]


def make_special(path: Path, kind: str) -> str:
    """Create a special file of ``kind`` at ``path``; returns what the digest calls it."""
    if kind == "fifo":
        os.mkfifo(path)
        return "a named pipe (FIFO)"
    if kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)  # a Unix socket's file, as bind() leaves it
        return "a socket"
    if kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
        return "a character device"
    raise ValueError(f"unknown special file kind {kind!r}")
