"""The engine's exceptions, public and internal, in one tree (docs/design.md, "Errors and failures").

Every class raised on purpose is here or in the table below it, with what it carries. Misuse of the
Python API is a plain ``TypeError``/``ValueError``; a foreign exception becomes a reason in ``engine._reasons``.
"""

# The other modules' exceptions, each kept for what it carries (each is raised and caught beside its use):
#   engine._core.contract.BadItem        a Failure at a chunk's ``position``; pickles by its arguments
#   engine._core.contract.MalformedItem  a chunk's item with no task or trajectory: the scheduler's TypeError/ValueError
#   engine._http.retry.TransientStatus   a status that asks to try again, with its ``retry_after``
#   engine._http.post.CallTimeout        an httpx timeout for a call's whole deadline, with its ``reason``
#   engine._http.transport.ResponseTooLarge  an httpx transport error for a body past ``max_body``
#   engine._http.transport._Unsolicited  the transport's signal: bytes no request asked for, the connection closes
#   engine._verifiers.plugin.executor.CallFailed  an executor's Failure (position, timed_out, of_environment)
#   engine._verifiers.plugin.worker_client.PluginError  a plugin's exception in a worker: its type's name, what
#                                        describe says, the worker's traceback (its text) and the plugin's own frames
#   engine._verifiers.plugin.worker_client._Overran  the worker client's signal: a deadline passed waiting for it
#   engine._verifiers.plugin.importer.PluginLoadError  a Failure importing a plugin (where the import is retried)
#   engine._verifiers.plugin.thread_calls.Interrupted  a plugin's KeyboardInterrupt in a thread, as its failure
#   engine._serve.body.TooMany           a body's array past the limit, refused before the rest is built (413)
#   engine._serve.app._Refused           a request the service will not score, with its status and kind
#   engine._serve.gather.Gone            a client that hung up: nothing is sent
#   engine._remote.wire._Malformed       what is wrong with a service's answer, in words (a ServiceError next)
#   engine._ray.actor.Carried            an EngineError on its way from a Ray actor, which Ray then does not retry

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from traceback import FrameSummary
from typing import Any, Literal

from engine._numpy import python_scalar

__all__ = [
    "BudgetError",
    "CacheError",
    "ConfigError",
    "DigestError",
    "EngineError",
    "Failure",
    "InputError",
    "ManifestError",
    "OutputError",
    "Overspent",
    "ResumeError",
    "RubricError",
    "ServiceError",
    "UnreadyError",
    "VerificationError",
    "WriteError",
]


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], fields: dict[str, Any]) -> BaseException:
    """An error as it was pickled: its class, its ``args`` and every field (notes too), not its constructor."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


class EngineError(Exception):
    """Base class of every error the engine raises on purpose.

    Each pickles whole (a Ray actor's, a worker's, crossing a process): its class, ``args`` and fields,
    without calling a constructor whose arguments are not its ``args``.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


class ConfigError(EngineError, ValueError):
    """The engine's configuration is unusable; the message names the file and the key.

    Attributes:
        problem: What is wrong, in words (the message without the file and the key).
        key: The key it is wrong in, dotted (``defaults.timeout``, ``refs.'x/y'.max_rate``, ``judge.model``;
            ``Limits.timeout`` for an object built in code), or None.
        field: That key inside its ``table`` (``timeout`` in ``defaults``).
        table: The table the key is in, or None.
        source: The config file, or None.
    """

    def __init__(
        self, problem: str, *, key: str | None = None, table: str | None = None, source: Path | None = None
    ) -> None:
        self.problem = problem
        self.field = key
        self.table = table
        self.key = table if key is None else key if table is None else f"{table}.{key}"
        self.source = source
        where = "".join(f"{part}: " for part in (source, self.key) if part is not None)
        super().__init__(f"{where}{problem}")

    def within(self, table: str, source: Path | None) -> ConfigError:
        """This error, its key inside ``table`` of file ``source`` (a table's values checked as an object's)."""
        return type(self)(self.problem, key=self.field, table=table, source=source)


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


class VerificationError(EngineError):
    """A verifier failed to produce a reward; the original exception, if any, is chained as ``__cause__``.

    Attributes:
        kind: The verifier's kind (``plugin``, ``endpoint``, ``rubric``).
        ref: The verifier's ref, as its manifest names it.
        key: The name its limits and figures go by (``Engine.stats``' keys): a plugin's
            ``environment/module:callable``, a rubric's ``owner/name``, an endpoint's URL; ``ref`` if not given.
        reason: What went wrong, in words.
        environment: The environment of the item it failed on, or None.
        index: That item's position in the batch, or None.
        item_id: That item's ``id``, or None.
        timed_out: The verifier ran out of its time (the engine's finding, never a plugin's words).
        cannot_load: The environment cannot load its verifier (a pin that does not match, a module that
            does not import, a rubric that cannot be resolved): none of its items can be scored.
        plugin_frames: Where in a plugin's own code it failed: the frames of what it raised that are in its
            environment's files (``traceback.FrameSummary``: ``filename``, ``lineno``, ``name``, ``line``),
            innermost last, at most 5; empty for other verifiers and failures that raised nothing. The reason
            ends with the innermost (``(at helper.py:12, in parse)``), and only the reason crosses
            ``engine serve``'s wire.
    """

    def __init__(
        self,
        kind: str,
        ref: str,
        reason: str,
        *,
        key: str | None = None,
        environment: str | None = None,
        index: int | None = None,
        item_id: Any = None,
        timed_out: bool = False,
        cannot_load: bool = False,
        plugin_frames: Sequence[FrameSummary] = (),
    ) -> None:
        self.kind = kind
        self.ref = ref
        self.key = ref if key is None else key
        self.reason = reason
        # a trainer's numpy values named as Python's (verl's np.str_ data sources, its np.int64 ids): equal,
        # and a message reads 'probe', not np.str_('probe')
        self.environment = None if environment is None else str(environment)
        self.index = index
        self.item_id = python_scalar(item_id)
        self.timed_out = timed_out
        self.cannot_load = cannot_load
        self.plugin_frames = tuple(plugin_frames)
        super().__init__(kind, ref, reason)

    def at_item(self, environment: str, index: int, item_id: Any) -> VerificationError:
        """This error, naming the item it failed on, as a new error: set once, by the scheduler.

        Only an error raised before any item was read needs this (a rubric that cannot be resolved):
        a verifier's own failures are :class:`Failure`, which the scheduler names the item of.
        """
        fields = {name: value for name, value in self.__dict__.items() if name != "__notes__"}  # notes: this one's
        error = _rebuilt(type(self), self.args, fields)
        assert isinstance(error, VerificationError)  # of this one's class
        error.environment, error.index, error.item_id = str(environment), index, python_scalar(item_id)
        return error

    def __str__(self) -> str:
        where = ""
        if self.index is not None:
            where = f" on item {self.index}"
            if self.item_id is not None:
                where += f" (id {self.item_id!r})"
        env = f" (environment {self.environment!r})" if self.environment else ""
        return f"{self.kind} verifier {self.ref!r}{env} failed{where}: {self.reason}"


class RubricError(VerificationError):
    """A rubric cannot be used: missing, missing the version asked for, malformed, or a bad scale.

    Its fields are a :class:`VerificationError`'s (``kind`` is ``rubric``); every item of its environments fails
    alike, so ``cannot_load`` is true unless told otherwise.
    """

    def __init__(self, ref: str, reason: str, **fields: Any) -> None:
        super().__init__("rubric", ref, reason, **{"cannot_load": True, **fields})


class BudgetError(VerificationError):
    """A judge's budget is spent: the reply that crossed it failed its item, and no request is sent for it again
    while the engine is open (every later batch of the rubrics it covers fails at once). Never a zero.

    Its fields are a :class:`VerificationError`'s (``kind`` is ``rubric``, ``key`` the rubric's ``owner/name``), and:

    Attributes:
        budget: Whose budget: ``"judge"`` (``[judge]``'s, over every rubric) or the rubric's ``owner/name``
            (its ``[refs."owner/name"]``).
        measure: What it counts: ``"tokens"`` (``token_budget``) or ``"spend"`` (``spend_budget``, in the
            currency of the judge's prices).
        limit: The budget, as configured.
        spent: What the engine had spent of it when this item failed (tokens, or money).
    """

    def __init__(
        self, kind: str, ref: str, reason: str, *, budget: str, measure: str, limit: float, spent: float,
        **fields: Any,
    ) -> None:
        super().__init__(kind, ref, reason, **fields)
        self.budget = budget
        self.measure = measure
        self.limit = limit
        self.spent = spent


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


class CacheError(EngineError):
    """The verdict cache's file (``[cache] path``) is not a cache the engine can use: raised when the engine
    opens, before any judge call.

    ``path`` is the file; ``reason`` says what is wrong (not SQLite, another program's tables, a schema
    of another version). ``ours`` is True only for a cache this engine made (another schema version):
    ``engine cache clear`` makes that one anew, and refuses to delete any other file, which may be someone's data.
    """

    def __init__(self, path: Path, reason: str, *, ours: bool = False) -> None:
        self.path = path
        self.reason = reason
        self.ours = ours
        mend = ("'engine cache clear' makes it anew (the verdicts in it are lost)" if ours else
                "if it is the cache, delete it; else point [cache] path at another file")
        super().__init__(f"{path}: not a verdict cache the engine can use: {reason}; {mend}")


class ServiceError(EngineError):
    """A scoring service (``Engine.connect``) gave no answer a batch can be read from.

    It could not be reached, stayed saturated (503) past the client's retry budget, refused the
    token, or failed itself (a bug answered as HTTP 500). ``status`` is the HTTP status, if one came.
    Never a verification failure: a verifier's crosses the wire and is raised as ``VerificationError``.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class UnreadyError(Exception):
    """Internal: environments checked before a command's run starts cannot score, so it does not start (``engine
    score``'s input's, ``engine serve``'s); no API raises it, and the command ends with the verification exit
    code, as ``engine check`` does. Not an ``EngineError`` (each of those is public): it never leaves a command.

    ``broken`` pairs each such environment's name with why, in name order; ``checked`` counts those checked.
    """

    def __init__(self, broken: list[tuple[str, str]], *, checked: int, which: str, then: str) -> None:
        self.broken = broken
        self.checked = checked
        lines = "".join(f"\n  {name}: {why}" for name, why in broken)
        environments = "environment" if checked == 1 else "environments"
        super().__init__(f"{len(broken)} of {checked} {environments} {which} cannot score{then}:{lines}")


class Failure(Exception):
    """Internal: something failed inside a verifier, and ``reason`` says what, in words.

    What a verifier raises (the contract, ``engine._core.contract``): it knows why, not which item of
    the batch it was. ``position``, if known, is the item's place in the chunk the verifier was
    handed; ``timed_out``, that the call ran out of its time; ``of_environment``, that the environment
    cannot load its verifier (a pin that does not match, a module that does not import): every item
    of it fails alike, and the scheduler names its first in the batch; ``frames``, where in a plugin's own
    code it failed (``VerificationError.plugin_frames``). Never seen by users: the
    scheduler, which knows the item, turns it into the one ``VerificationError`` naming the verifier
    and the item, these fields with it, chaining this failure's cause.
    """

    def __init__(
        self,
        reason: str,
        *,
        position: int | None = None,
        timed_out: bool = False,
        of_environment: bool = False,
        frames: Sequence[FrameSummary] = (),
    ) -> None:
        self.reason = reason
        self.position = position
        self.timed_out = timed_out
        self.of_environment = of_environment
        self.frames = tuple(frames)
        super().__init__(reason)


class Overspent(Failure):
    """Internal: a judge's budget is spent (what a :class:`BudgetError` says, before the scheduler names the
    item); ``budget``, ``measure``, ``limit`` and ``spent`` are its fields."""

    def __init__(self, reason: str, *, budget: str, measure: str, limit: float, spent: float) -> None:
        super().__init__(reason)
        self.budget = budget
        self.measure = measure
        self.limit = limit
        self.spent = spent

    def fields(self) -> dict[str, Any]:
        """The fields a :class:`BudgetError` takes from it."""
        return {"budget": self.budget, "measure": self.measure, "limit": self.limit, "spent": self.spent}
