"""A backfill's checkpoint and lock: ``OUT.state.json``, saved atomically, and ``OUT.lock``, held while a run writes.

Why the state never claims more than the partial file holds: docs/design.md, Crash-safe finish.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from engine._backfill.files import fsync, sibling
from engine._errors import OutputError, ResumeError, WriteError

__all__ = ["STATE_FORMAT", "Checkpoint", "Finished", "hold_lock", "lock_path", "state_path", "state_tmp_path"]

STATE_FORMAT = "engine-score-state/1"
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


def lock_path(output: Path) -> Path:
    """The lock a run writing ``output`` holds."""
    return sibling(output, ".lock")


def state_path(output: Path) -> Path:
    """Where the last checkpoint of a run writing ``output`` is kept."""
    return sibling(output, ".state.json")


def state_tmp_path(state: Path) -> Path:
    """Where a new checkpoint is written before it replaces state file ``state``."""
    return sibling(state, ".tmp")


@contextlib.contextmanager
def hold_lock(output: Path) -> Iterator[None]:
    """Hold ``OUT.lock`` while the block runs; :class:`OutputError` if another run holds it.

    :class:`WriteError` if the lock cannot be written (a read-only directory, a full disk): the
    run has not started, so no rows are counted as checkpointed in it (a state, if any, is kept).

    The file is removed on exit, while still locked. A run that opened it just before then may
    lock the removed file: it checks, after locking, that the path still names what it locked,
    and starts over if not.
    """
    path = lock_path(output)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileNotFoundError, NotADirectoryError) as exc:  # no such directory: where to write is wrong
            raise OutputError(f"cannot create {path}: {exc}") from exc
        except OSError as exc:  # a read-only or full file system, no permission: the system refused the write
            raise WriteError(path, exc, 0) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"{output} is being written by another run (pid {holder}, holding {path}): "
                "wait for it to finish, or stop it and use --resume"
            ) from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and current.st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # it was removed after we opened it: try again
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full disk when the run starts
            raise WriteError(path, exc, 0) from exc
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


@dataclass(frozen=True)
class Finished:
    """The complete output a finishing run was about to rename into place: its size and sha256.

    ``repeated_ids`` counts the records whose ``id`` (not null) an earlier record already had,
    ``ids_repeated`` the distinct ids that occur more than once.
    """

    output_bytes: int
    output_checksum: str
    repeated_ids: int
    ids_repeated: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Checkpoint:
    """What the state file records: enough to resume, and to refuse to resume wrongly.

    ``rows_done`` input rows (and as many records) are done; ``input_checksum`` is the input's
    checksum through them (:meth:`engine._backfill.input.RowReader.checksum`); the partial file's first
    ``output_bytes`` bytes hold their records and have ``output_checksum``. ``meta`` is the
    caller's own JSON object (counters for a summary, ...), handed back on resume. ``finished`` is
    set by the last checkpoint of a run, saved just before its output is renamed into place.
    """

    input: str
    rows_done: int
    input_checksum: str
    output_bytes: int
    output_checksum: str
    meta: Mapping[str, Any] = field(default_factory=dict)
    finished: Finished | None = None

    def to_json(self) -> bytes:
        data = {
            "format": STATE_FORMAT,
            "input": self.input,
            "rows_done": self.rows_done,
            "input_checksum": self.input_checksum,
            "output_bytes": self.output_bytes,
            "output_checksum": self.output_checksum,
            "meta": dict(self.meta),
        }
        if self.finished is not None:
            data["finished"] = self.finished.to_json()
        return orjson.dumps(data, option=orjson.OPT_INDENT_2)

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        """The checkpoint in state file ``path``; ``ResumeError`` if it is missing or unusable."""
        try:
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise ResumeError(f"no interrupted run to resume: {path} does not exist; run without --resume") from None
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ResumeError(f"{path}: unreadable state file ({exc}); delete it to start over") from exc
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt != STATE_FORMAT:
            raise ResumeError(
                f"{path}: not a state file this version can resume (format {fmt!r}, not {STATE_FORMAT!r})"
            )
        types = {"input": str, "rows_done": int, "input_checksum": str, "output_bytes": int, "output_checksum": str}
        for key, kind in types.items():
            if not _valid(key, data.get(key), kind):
                raise ResumeError(
                    f"{path}: unusable state file: field {key!r} is missing or not a {_what(key, kind)}; "
                    "delete it to start over"
                )
        if not isinstance(data.get("meta"), dict):
            raise ResumeError(
                f"{path}: unusable state file: field 'meta' is missing or not an object; delete it to start over"
            )
        finished = data.get("finished")
        if finished is not None:
            kinds = {"output_bytes": int, "output_checksum": str, "repeated_ids": int, "ids_repeated": int}
            if not isinstance(finished, dict) or any(
                not _valid(key, finished.get(key), kind) for key, kind in kinds.items()
            ):
                raise ResumeError(
                    f"{path}: unusable state file: field 'finished' is not a finished run's record; "
                    "delete it to start over"
                )
            finished = Finished(**{key: finished[key] for key in kinds})
        return cls(**{key: data[key] for key in (*types, "meta")}, finished=finished)

    def save(self, path: Path) -> None:
        """Replace state file ``path`` atomically and durably with this checkpoint."""
        payload = self.to_json()  # before touching any file: a meta JSON cannot hold changes nothing
        tmp = state_tmp_path(path)
        with tmp.open("wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync(path.parent)


def _valid(key: str, value: Any, kind: type) -> bool:
    """Whether a state file's field holds what this version writes there: counts are whole numbers
    >= 0, checksums ``sha256:`` and 64 hex digits (a hand-edited state must not be half-trusted)."""
    if not isinstance(value, kind) or isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    if isinstance(value, str) and key.endswith("_checksum"):
        return _CHECKSUM.fullmatch(value) is not None
    return True


def _what(key: str, kind: type) -> str:
    if kind is int:
        return "whole number >= 0"
    return "sha256 checksum" if key.endswith("_checksum") else kind.__name__
