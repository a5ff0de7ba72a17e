"""What a backfill's input and output share about files: the format an extension names, sha256 checksums, fsync."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

__all__ = [
    "EMPTY_CHECKSUM",
    "HASH_CHUNK",
    "JSONL_SUFFIXES",
    "PARQUET_SUFFIXES",
    "Closing",
    "Format",
    "checksum",
    "file_checksum",
    "file_format",
    "fsync",
    "sibling",
    "unsupported",
]

JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".ndjson", ".json-lines")
PARQUET_SUFFIXES: tuple[str, ...] = (".parquet",)
HASH_CHUNK = 1 << 20  # bytes read at a time to hash a file

Format = Literal["jsonl", "parquet"]


def file_format(path: Path) -> Format | None:
    """The format ``path``'s extension names (in any case); None for another extension (see :func:`unsupported`)."""
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return None


def unsupported(path: Path) -> str:
    """Why ``path`` is refused, for the error of the caller (an input's or an output's)."""
    return f"unsupported extension {path.suffix!r} (supported: {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})"


def checksum(digest: hashlib._Hash) -> str:
    """``sha256:<hex>``, as checkpoints record checksums; ``digest`` is left as it was."""
    return f"sha256:{digest.hexdigest()}"


EMPTY_CHECKSUM = checksum(hashlib.sha256())  # the checksum of nothing: no rows, no bytes


def file_checksum(path: Path) -> str:
    """The checksum of a whole file, read a block at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(HASH_CHUNK):
            digest.update(block)
    return checksum(digest)


def fsync(path: Path) -> None:
    """Make a file's bytes durable, or a directory's renames and unlinks (``path`` is either)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sibling(output: Path, suffix: str) -> Path:
    """The file beside ``output`` a run keeps under ``output``'s name plus ``suffix`` (``.lock``, ``.partial``, ...)."""
    return output.with_name(output.name + suffix)


class Closing:
    """A context manager that closes what it holds on exit (:meth:`close`): a backfill's reader or writer."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
