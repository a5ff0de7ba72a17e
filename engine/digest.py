"""An environment directory's content digest, the pin that gates plugin imports, and its source snapshot.

``sha256:<hex>`` over every file below the directory, sorted by relative POSIX path; each file
contributes ``<path> NUL <size> NUL <bytes>`` so that no two different trees hash alike. Caches
that Python and the usual tools write next to code are left out, so importing a vetted plugin
does not change its digest.

Symbolic links are followed, as ``import`` follows them: a linked file or directory is hashed by
its content, so editing code behind a link changes the digest. A link back up the tree (a loop)
is not entered twice; a dangling link contributes ``<path> NUL -> <target> NUL``. Anything that is
not a regular file or a directory once links are followed (a FIFO, a socket, a device such as
``/dev/zero``) is refused with :class:`~engine.errors.DigestError` naming it: reading one could
block or never end, and nothing in it could be vetted.

:func:`snapshot_directory` keeps the bytes of the ``.py`` files while it hashes them, read once
each: the importer serves modules from that snapshot, so the code that runs is the code that
was hashed, whatever happens to the files afterwards.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import DigestError

__all__ = ["Snapshot", "digest_directory", "snapshot_directory"]

IGNORED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
IGNORED_SUFFIXES = (".pyc", ".pyo")
SOURCE_SUFFIX = ".py"  # the files a snapshot keeps: the only ones the importer reads
CHUNK = 1 << 20


@dataclass(frozen=True)
class Snapshot:
    """A directory's digest and the bytes its ``.py`` files had when they were hashed.

    ``sources`` maps each source file's relative POSIX path to those bytes.
    """

    root: Path
    digest: str
    sources: Mapping[str, bytes]


def _files(root: Path) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    # the real paths of each directory's ancestors on the walk, to cut loops made of links
    ancestors: dict[str, frozenset[str]] = {os.fspath(root): frozenset()}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        seen = ancestors.pop(dirpath) | {os.path.realpath(dirpath)}
        kept = []
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if name in IGNORED_DIRS or os.path.realpath(child) in seen:
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


def _refuse(full: Path, mode: int) -> DigestError:
    target = f" (a link to {os.path.realpath(full)})" if full.is_symlink() else ""
    return DigestError(
        f"{full}{target} is {_kind(mode)}, not a regular file or directory: an environment may hold only "
        "those (reading it could block or never end, and it cannot be vetted)",
        path=full,
    )


def _open_regular(full: Path) -> int:
    """A descriptor of regular file ``full``, or :class:`DigestError` for anything else.

    Checked before opening (opening a FIFO blocks until a writer comes) and again on what was
    opened, without blocking, in case the file was replaced in between.
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


def snapshot_directory(path: str | Path) -> Snapshot:
    """The digest of directory ``path``, and the bytes of its ``.py`` files as hashed.

    Raises ``NotADirectoryError`` if ``path`` is not a directory, :class:`~engine.errors.DigestError`
    for a file in it that is not a regular file or directory, and ``OSError`` if a file cannot be read.
    """
    root = Path(path)
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a directory")
    h = hashlib.sha256()
    sources: dict[str, bytes] = {}
    for rel, full in _files(root):
        if not full.exists():  # a dangling link: nothing to import there, but where it points counts
            h.update(f"{rel}\0-> {os.readlink(full)}\0".encode())
            continue
        with open(_open_regular(full), "rb") as f:
            if rel.endswith(SOURCE_SUFFIX):  # one read: the bytes hashed are the bytes kept
                data = f.read()
                h.update(f"{rel}\0{len(data)}\0".encode())
                h.update(data)
                sources[rel] = data
                continue
            h.update(f"{rel}\0{os.fstat(f.fileno()).st_size}\0".encode())
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return Snapshot(root, f"sha256:{h.hexdigest()}", sources)


def digest_directory(path: str | Path) -> str:
    """The digest of directory ``path``, written ``sha256:<hex>`` (raises as :func:`snapshot_directory`)."""
    return snapshot_directory(path).digest
