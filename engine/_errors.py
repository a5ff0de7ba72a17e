"""The engine's exceptions: every error it raises on purpose, public or internal, in one tree.

Tree::

    EngineError
    ├── ConfigError            (also a ValueError) a bad config file, key or value
    │   └── ManifestError      an environment's manifest.json is unreadable or invalid
    ├── DigestError            an environment directory holds a file that cannot be hashed (a FIFO, a device)
    ├── VerificationError      a verifier could not produce a reward for an item;
    │   │                      the whole batch aborts with it, never a zero in its place
    │   └── RubricError        a rubric is missing, malformed, or lacks the version asked for
    ├── InputError             (also a ValueError) a backfill's input file is unreadable or holds a bad row
    ├── OutputError            (also a ValueError) a backfill's output cannot go where or how it was asked
    │   └── ResumeError        a backfill cannot start or resume: its state is missing or does not match
    ├── WriteError             the system refused to write a backfill's output or state (disk full, ...)
    └── ServiceError           a scoring service (``engine serve``) could not be reached or failed itself;
                               never a verifier's failure, which crosses the wire as a VerificationError

    Failure                    internal: a failure inside a verifier, with a ``reason`` in words; the
                               engine turns it into the ``VerificationError`` naming the item

Foreign exceptions (httpx, orjson, tenacity, OSError) become reasons in one place, ``engine._reasons``.

Misuse of the Python API (an item that is not a mapping, an unknown environment name) raises
plain ``TypeError``/``ValueError``: those are bugs in the caller, not verifier failures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ConfigError",
    "DigestError",
    "EngineError",
    "Failure",
    "InputError",
    "ManifestError",
    "OutputError",
    "ResumeError",
    "RubricError",
    "ServiceError",
    "VerificationError",
    "WriteError",
]


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """The engine's configuration is unusable; the message names the file and the key."""


class ManifestError(ConfigError):
    """An environment's ``manifest.json`` is unreadable or invalid; names the file and the field."""


class DigestError(EngineError):
    """An environment directory cannot be digested: ``path`` is not a regular file or directory.

    ``reason`` names the file and says why (a FIFO or a link to a device would block or never end).
    """

    def __init__(self, reason: str, *, path: Path) -> None:
        self.reason = reason
        self.path = path
        super().__init__(reason)


def _python(value: Any) -> Any:
    """A numpy scalar as the Python value it holds (exactly), anything else as it is."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        try:
            return value.item()
        except ValueError:  # an array of more than one value: not a scalar, kept as it is
            return value
    return value


class VerificationError(EngineError):
    """A verifier failed to produce a reward.

    ``kind`` and ``ref`` name the verifier, ``environment`` the environment the item came from,
    ``index`` the item's position in the batch and ``item_id`` its ``id`` (when the item had one).
    ``reason`` says what went wrong; the original exception, if any, is chained as ``__cause__``.
    """

    def __init__(
        self,
        kind: str,
        ref: str,
        reason: str,
        *,
        environment: str | None = None,
        index: int | None = None,
        item_id: Any = None,
    ) -> None:
        self.kind = kind
        self.ref = ref
        self.reason = reason
        # a trainer's numpy values named as Python's (verl's np.str_ data sources, its np.int64 ids): equal,
        # and a message reads 'probe', not np.str_('probe')
        self.environment = None if environment is None else str(environment)
        self.index = index
        self.item_id = _python(item_id)
        super().__init__(kind, ref, reason)

    def at_item(self, environment: str, index: int, item_id: Any) -> VerificationError:
        """This error, naming the item it failed on, as a new error: set once, by the scheduler.

        Only an error raised before any item was read needs this (a rubric that cannot be resolved):
        a verifier's own failures are :class:`Failure`, which the scheduler names the item of.
        """
        return VerificationError(
            self.kind, self.ref, self.reason, environment=environment, index=index, item_id=item_id
        )

    def __str__(self) -> str:
        where = ""
        if self.index is not None:
            where = f" on item {self.index}"
            if self.item_id is not None:
                where += f" (id {self.item_id!r})"
        env = f" (environment {self.environment!r})" if self.environment else ""
        return f"{self.kind} verifier {self.ref!r}{env} failed{where}: {self.reason}"


class RubricError(VerificationError):
    """A rubric cannot be used: missing, missing the version asked for, malformed, or a bad scale."""

    def __init__(
        self, ref: str, reason: str, *, environment: str | None = None, index: int | None = None, item_id: Any = None
    ) -> None:
        super().__init__("rubric", ref, reason, environment=environment, index=index, item_id=item_id)

    def at_item(self, environment: str, index: int, item_id: Any) -> RubricError:
        return RubricError(self.ref, self.reason, environment=environment, index=index, item_id=item_id)


class InputError(EngineError, ValueError):
    """The input file is unreadable or holds a bad row.

    ``path`` is the file; ``unit`` and ``number`` locate the row (``"line", 7`` in JSON Lines,
    ``"row", 7`` in Parquet), both ``None`` for a problem with the file as a whole; ``reason``
    says what is wrong.
    """

    def __init__(
        self, path: Path, reason: str, *, unit: Literal["line", "row"] | None = None, number: int | None = None
    ) -> None:
        self.path = path
        self.reason = reason
        self.unit = unit
        self.number = number
        where = f"{path}: {unit} {number}" if number is not None else f"{path}"
        super().__init__(f"{where}: {reason}")


class OutputError(EngineError, ValueError):
    """The output cannot be written where or how it was asked (bad extension, same file as input, ...)."""


class ResumeError(OutputError):
    """A run cannot start or resume: the state is missing or does not match, or the input changed."""


class WriteError(EngineError):
    """The system refused to write the output, its partial file or its state (disk full, I/O error, ...).

    Not a misuse and not a bad input: nothing checkpointed is lost, and ``--resume`` continues once
    the cause is fixed. ``path`` is the file being written, ``rows_done`` the rows checkpointed.
    """

    def __init__(self, path: Path, exc: OSError, rows_done: int) -> None:
        self.path = path
        self.rows_done = rows_done
        super().__init__(f"cannot write {path}: {exc.strerror or exc}")


class ServiceError(EngineError):
    """A scoring service (``Engine.connect``) gave no answer a batch can be read from.

    It could not be reached, stayed saturated (503) past the client's retry budget, refused the
    token, or failed itself (a bug answered as HTTP 500). ``status`` is the HTTP status, if one came.
    Never a verification failure: a verifier's crosses the wire and is raised as ``VerificationError``.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class Failure(Exception):
    """Internal: something failed inside a verifier, and ``reason`` says what, in words.

    What a verifier raises (the contract, ``engine._core.contract``): it knows why, not which item of
    the batch it was. ``position``, if known, is the item's place in the chunk the verifier was
    handed. Never seen by users: the scheduler, which knows the item, turns it into the one
    ``VerificationError`` naming the verifier and the item, chaining this failure's cause.
    """

    # the environment cannot load its verifier (a pin that does not match, a module that does not
    # import): every item of it fails alike, and the scheduler names its first in the batch
    of_environment = False

    def __init__(self, reason: str, *, position: int | None = None) -> None:
        self.reason = reason
        self.position = position
        super().__init__(reason)
