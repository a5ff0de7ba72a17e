"""An environment directory's content digest, the pin that gates plugin imports, and its source snapshot.

What is hashed, what is refused, and why plugins import from the snapshot: docs/design.md, Snapshots.
"""

from __future__ import annotations

import enum
import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine._errors import DigestError

__all__ = [
    "MANIFEST",
    "MAX_BYTES",
    "MAX_PATHS",
    "Pin",
    "Snapshot",
    "digest_directory",
    "open_regular",
    "pin_verdict",
    "snapshot_directory",
]

IGNORED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
IGNORED_SUFFIXES = (".pyc", ".pyo")
SOURCE_SUFFIX = ".py"  # the files a snapshot keeps: the only ones the importer reads
MANIFEST = "manifest.json"  # an environment's manifest, at its root: a snapshot keeps its bytes too
CHUNK = 1 << 20
PAGE = 4096  # the least a read asks for: some /proc files refuse reads that are not whole records
# The walk's bounds. An environment is code and the data it checks with: the largest seen hold a few
# thousand files and a few hundred MiB. 100,000 paths take ~1 s to walk (a link costs a realpath);
# 1 GiB takes a few seconds to read and hash, and a snapshot keeps the .py part of it in memory.
MAX_PATHS = 100_000  # files and directories, counted as the walk reaches them (links followed)
MAX_BYTES = 1 << 30  # bytes hashed, over all files


@dataclass(frozen=True)
class Snapshot:
    """A directory's digest and the bytes its ``.py`` files had when they were hashed.

    ``sources`` maps each source file's relative POSIX path to those bytes; ``manifest`` is the
    bytes of ``manifest.json`` as hashed (``None`` if the directory has none).
    """

    root: Path
    digest: str
    sources: Mapping[str, bytes]
    manifest: bytes | None = None


def _identity(path: str) -> tuple[int, int] | None:
    """The directory ``path`` is (links followed), as (device, inode); ``None`` if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _files(root: Path, max_paths: int) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    # the directories each directory's ancestors on the walk are, to cut loops made of links (by
    # device and inode: one stat, where a realpath costs a call per component of a deep path)
    ancestors: dict[str, frozenset[tuple[int, int] | None]] = {os.fspath(root): frozenset()}
    count = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        count += len(dirnames) + len(filenames)
        if count > max_paths:
            raise DigestError(
                f"{root} holds more than {max_paths} files (links followed): more than an environment holds "
                "(do links reach the same directories by many paths?); it is refused, not walked to the end",
                path=root,
            )
        seen = ancestors.pop(dirpath) | {_identity(dirpath)}
        kept = []
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if name in IGNORED_DIRS or _identity(child) in seen:
                continue
            ancestors[child] = seen
            kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            full = Path(dirpath, name)
            found.append((full.relative_to(root).as_posix(), full))
    found.sort()
    return found


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def _shown(full: Path) -> str:
    """``full``, and where it leads if it is a link."""
    return f"{full} (a link to {os.path.realpath(full)})" if full.is_symlink() else f"{full}"


def _refuse(full: Path, mode: int) -> DigestError:
    return DigestError(
        f"{_shown(full)} is {_kind(mode)}, not a regular file or directory: an environment may hold only "
        "those (reading it could block or never end, and it cannot be vetted)",
        path=full,
    )


def open_regular(full: Path) -> int:
    """A descriptor of regular file ``full``, or :class:`DigestError` for anything else.

    Checked before opening (opening a FIFO blocks until a writer comes) and again on what was
    opened, without blocking, in case the file was replaced in between. ``OSError`` if it cannot
    be opened (``FileNotFoundError`` if it does not exist).
    """
    mode = os.stat(full).st_mode
    if not stat.S_ISREG(mode):
        raise _refuse(full, mode)
    fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(full, mode)
    return fd


def _read(f: BinaryIO, full: Path, size: int, h: hashlib._Hash, keep: bool) -> bytes | None:
    """Hash ``size`` and the bytes of regular file ``full``, open as ``f``, into ``h``; its bytes if ``keep``.

    Stops as soon as it has read more than its size (as ``fstat`` gave it): a file that reads more is
    not a plain file (``/proc/self/pagemap`` has size 0 and reads ~256 GiB), or it grew while hashed.
    """
    h.update(b"%d\0" % size)
    chunks: list[bytes] = []
    got = 0
    while chunk := f.read(min(CHUNK, max(size + 1 - got, PAGE))):
        got += len(chunk)
        if got > size:
            raise DigestError(
                f"{_shown(full)} reads more bytes than its size ({size}): it is not a plain file (a /proc or /sys "
                "file) or it grew while it was hashed, and it cannot be vetted",
                path=full,
            )
        h.update(chunk)
        if keep:
            chunks.append(chunk)
    if got < size:
        raise DigestError(f"{full} read {got} bytes, not its size ({size}): it changed while it was hashed", path=full)
    return b"".join(chunks) if keep else None


def snapshot_directory(
    path: str | Path, *, max_paths: int = MAX_PATHS, max_bytes: int = MAX_BYTES
) -> Snapshot:
    """The digest of directory ``path``, and the bytes of its ``.py`` files (and manifest) as hashed.

    Raises ``NotADirectoryError`` if ``path`` is not a directory, :class:`~engine._errors.DigestError`
    for a file in it that is not a regular file or directory, cannot be read, or does not read as its
    size, and for a walk past ``max_paths`` files and directories or ``max_bytes`` bytes.
    """
    root = Path(path)
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a directory")
    h = hashlib.sha256()
    sources: dict[str, bytes] = {}
    manifest = None
    left = max_bytes
    for rel, full in _files(root, max_paths):
        name = os.fsencode(rel)  # the name's own bytes, UTF-8 or not
        if not full.exists():  # a dangling link: nothing to import there, but where it points counts
            h.update(name + b"\0-> " + os.fsencode(os.readlink(full)) + b"\0")
            continue
        try:
            with open(open_regular(full), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                left -= size
                if left < 0:
                    raise DigestError(
                        f"{root} holds more than {max_bytes} bytes (links followed, at {full}): more than an "
                        "environment holds; it is refused, not read to the end",
                        path=full,
                    )
                h.update(name + b"\0")
                keep = rel.endswith(SOURCE_SUFFIX) or rel == MANIFEST  # one read: the bytes hashed are the bytes kept
                data = _read(f, full, size, h, keep)
        except OSError as exc:  # gone since the walk saw it (an editor's swap file), unreadable (EIO, EACCES)
            reason = f"{_shown(full)} cannot be read ({exc.strerror or exc}), so it cannot be vetted"
            raise DigestError(reason, path=full) from exc
        if rel == MANIFEST:
            manifest = data
        elif data is not None:
            sources[rel] = data
    return Snapshot(root, f"sha256:{h.hexdigest()}", sources, manifest)


class Pin(enum.Enum):
    """What a pin says of a directory's digest (:func:`pin_verdict`)."""

    MATCHES = "matches"  # pinned, at this digest: it may be trusted
    CHANGED = "changed"  # pinned, at another digest: it changed after it was vetted
    MISSING = "missing"  # not pinned, and a pin is required
    NOT_NEEDED = "not needed"  # not pinned, and none is required


def pin_verdict(digest: str, pin: str | None, *, required: bool) -> Pin:
    """What ``pin`` says of a directory whose digest is ``digest``; ``required``: whether it must have one.

    The one rule both the plugin verifier (before it imports anything) and ``engine check`` apply.
    """
    if pin is not None:
        return Pin.MATCHES if digest == pin else Pin.CHANGED
    return Pin.MISSING if required else Pin.NOT_NEEDED


def digest_directory(path: str | Path) -> str:
    """The content digest of an environment directory, the value its pin must hold.

    Args:
        path: The directory. Links in it are followed; caches (``__pycache__``, ``*.pyc``) are left out.

    Returns:
        ``sha256:<hex>`` over every file's relative path, size and bytes, sorted by path
        (docs/design.md, Snapshots).

    Raises:
        NotADirectoryError: ``path`` is not a directory.
        DigestError: A file in it is not a regular file or directory, cannot be read, or does not read as
            its size, or the walk passes ``MAX_PATHS`` files and directories or ``MAX_BYTES`` bytes.
    """
    return snapshot_directory(path).digest
