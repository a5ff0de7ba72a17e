"""An environment directory's content digest, the pin that gates plugin imports.

``sha256:<hex>`` over every file below the directory, sorted by relative POSIX path; each file
contributes ``<path> NUL <size> NUL <bytes>`` so that no two different trees hash alike. Caches
that Python and the usual tools write next to code are left out, so importing a vetted plugin
does not change its digest.

Symbolic links are followed, as ``import`` follows them: a linked file or directory is hashed by
its content, so editing code behind a link changes the digest. A link back up the tree (a loop)
is not entered twice; a dangling link contributes ``<path> NUL -> <target> NUL``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["digest_directory"]

IGNORED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
IGNORED_SUFFIXES = (".pyc", ".pyo")
CHUNK = 1 << 20


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


def digest_directory(path: str | Path) -> str:
    """The digest of directory ``path``, written ``sha256:<hex>``."""
    root = Path(path)
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a directory")
    h = hashlib.sha256()
    for rel, full in _files(root):
        if not full.exists():  # a dangling link: nothing to import there, but where it points counts
            h.update(f"{rel}\0-> {os.readlink(full)}\0".encode())
            continue
        h.update(f"{rel}\0{full.stat().st_size}\0".encode())
        with full.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return f"sha256:{h.hexdigest()}"
