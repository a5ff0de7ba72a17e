"""The one contract every verifier kind resolves to.

A plugin author writes a :data:`VerifyFn` (or its ``async def`` twin); inside the engine every kind is a
:class:`Verifier` of that same shape, so the scheduler never needs to know which kind it is driving.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from gc import is_tracked
from typing import Any, Protocol, overload, runtime_checkable

from engine._errors import Failure
from engine._reasons import a_or_an

__all__ = [
    "ENV_NAME",
    "MAX_INDEX",
    "AsyncVerifyFn",
    "BadItem",
    "Chunker",
    "HintingVerifier",
    "Items",
    "MalformedItem",
    "ProcessHint",
    "Sifted",
    "SiftingVerifier",
    "Verifier",
    "VerifyFn",
    "as_rewards",
    "check_first_index",
    "check_item",
    "check_reward",
    "is_async",
    "item_label",
    "private",
    "private_pair",
    "task_of",
]

# What a plugin author writes: (task, trajectory) -> reward; every kind resolves to this shape.
VerifyFn = Callable[[Mapping[str, Any], Any], float]
AsyncVerifyFn = Callable[[Mapping[str, Any], Any], Awaitable[float]]  # its ``async def`` twin, awaited on the loop


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is an :data:`AsyncVerifyFn`, to be awaited: an ``async def``, or an instance whose
    ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class Verifier(Protocol):
    """A resolved verifier, as the scheduler sees it."""

    @property
    def kind(self) -> str: ...

    @property
    def ref(self) -> str: ...

    @property
    def key(self) -> str:
        """The name its limits are configured under (``engine._config``)."""
        ...

    @property
    def retries(self) -> int:
        """Transient failures retried so far, over the verifier's life."""
        ...

    def provenance(self) -> Mapping[str, Any]:
        """What scores the items: kind, ref, and the environment digest or rubric version."""
        ...

    def spent(self) -> Mapping[str, float]:
        """What its calls have cost so far, by name (judge requests and tokens, and ``spend`` at the judge's prices);
        empty for kinds that spend none.

        A rubric's verifier is built for one batch, so what it spent is that batch's.
        """
        ...

    async def load(self) -> None:
        """Make it ready to call (a plugin imports), or raise :class:`~engine._errors.Failure` saying why not."""
        ...

    async def aclose(self) -> None:
        """Release what it holds (a plugin's worker processes and imports); the engine calls it when it closes."""
        ...

    @property
    def chunker(self) -> Chunker | None:
        """What scores its items several to a call, if anything does (a plugin's verifier: itself); None for a
        verifier called one item at a time (endpoint, rubric), whose batches are grouped before any call."""
        ...

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        """The reward for one item, checked (:func:`check_reward`) before it leaves the verifier.

        Raises :class:`~engine._errors.Failure` saying why in words, or any exception (described by
        ``engine._reasons``): never a ``VerificationError``, which only the scheduler makes, naming
        the item it knows and the verifier does not.
        """
        ...


class Chunker(Protocol):
    """What scores a verifier's items several to a call (a sync plugin's: one thread hop, or round trip, a chunk)."""

    def chunk_size(self, share: int) -> int:
        """How many items its next call takes: more than 1 for a :meth:`verify_chunk` of up to that many (fewer
        at a lane's end, even one), 1 for one item's ``Verifier.verify`` (its first calls, before any is measured).

        ``share`` is the lane's items left per worker: a chunk larger than that leaves workers idle
        while the last chunks run, so a verifier whose chunks run in parallel stays within it.
        """
        ...

    async def verify_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The rewards of whole items (mappings with ``environment``, ``task``, ``trajectory``), in order.

        It scores only items of its own environment: at the first of another it stops, and returns
        the rewards of the items before it (the engine had guessed the batch was all one
        environment's, and groups the rest).

        A failure raises :class:`~engine._errors.Failure` whose ``position`` is the failing item's
        place in ``items``, or :class:`MalformedItem` for an item without a task or trajectory.
        """
        ...


@dataclass
class Sifted:
    """A lane's items sifted before any call (a rubric's): those to call, those whose reward the cache holds, and
    those identical to an earlier item of the batch (each with that item's index, whose reward it shares)."""

    call: list[int]
    hits: list[int] = field(default_factory=list)
    hit_rewards: list[float] = field(default_factory=list)
    hit_times: list[float] = field(default_factory=list)  # unix time of the judge call each hit's verdict came from
    copies: list[int] = field(default_factory=list)
    originals: list[int] = field(default_factory=list)


@runtime_checkable
class SiftingVerifier(Verifier, Protocol):
    """A verifier whose identical items are scored once a batch and whose verdicts may be kept (a rubric's)."""

    async def sift(self, items: Sequence[Mapping[str, Any]], indices: Sequence[int], first: int) -> Sifted | None:
        """``indices`` of ``items`` sifted (:class:`Sifted`); None if it calls every item. ``first``: the batch's
        first item's place, which ``task_of`` errors name items by.

        Raises :class:`~engine._errors.Failure` for an item that cannot be put to it (``position``: its in ``indices``).
        """
        ...

    def finish(self) -> None:
        """The batch is over, scored or aborted: keep what its calls returned (written behind, not waited for)."""
        ...

    @property
    def shared(self) -> int:
        """Items of the batch given the reward of another batch's call in flight for an identical one."""
        ...


@dataclass(frozen=True)
class ProcessHint:
    """A thread-executor plugin measured CPU-bound on warm calls: their cost, and what worker processes would gain.

    The engine does not switch executors by itself: worker processes change what a plugin may share
    (no module state across items, tasks that pickle), so it says so instead (``engine bench``, ``engine check``).
    """

    call_seconds: float  # a warm call's wall time (less waiting for a CPU), calls made one at a time in one thread
    cpu_share: float  # of a call's wall time, on a CPU (holding the GIL, for Python code)
    cores: int
    calls: int  # the warm calls measured
    gain: float  # the items/s worker processes would give, as a multiple of one thread's (the estimate hinted on)

    def says(self) -> str:
        return (
            f"CPU-bound ({self.call_seconds * 1e3:.3g} ms a call over {self.calls} warm calls, {self.cpu_share:.0%} "
            f"of it on a CPU, one call at a time under the GIL; up to ~{self.gain:.1f}x the items/s in processes): "
            f'"executor": "process" in its manifest\'s verifier would use {self.cores} cores'
        )

    def as_dict(self) -> dict[str, Any]:
        return {"call_ms": self.call_seconds * 1e3, "cpu_share": self.cpu_share, "cores": self.cores,
                "calls": self.calls, "gain": self.gain, "says": self.says()}


@runtime_checkable
class HintingVerifier(Verifier, Protocol):
    """A verifier that can time warm calls of some items and say that another executor would serve it better."""

    async def process_hint(self, items: Sequence[Mapping[str, Any]]) -> ProcessHint | None:
        """Worker processes would gain it cores, as warm calls of ``items`` (its environment's) measured; or None.

        Raises :class:`~engine._errors.Failure` if a call fails (``position``: the item's in ``items``).
        """
        ...


class Items(Sequence[Mapping[str, Any]]):
    """The items of a batch at ``positions``, read only where they are used.

    A chunk is handed to the thread that scores it as this view, not as a copy made on the event
    loop: copying touches every item from the loop's CPU, and the thread then reads them from the
    other CPU's cache (measured: ~0.2 us an item, a fifth of a cheap plugin's cost). The thread
    slices what it needs, a step at a time.
    """

    __slots__ = ("_batch", "_positions")

    def __init__(self, batch: Sequence[Mapping[str, Any]], positions: Sequence[int]) -> None:
        self._batch = batch
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> Mapping[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Mapping[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
        picked = self._positions[index]
        if isinstance(picked, int):
            return self._batch[picked]
        if isinstance(picked, range) and picked.step == 1:  # contiguous: one slice of the batch
            return self._batch[picked.start : picked.stop]
        return list(map(self._batch.__getitem__, picked))

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return iter(self[:])


class MalformedItem(Exception):
    """The item at ``position`` of a chunk has no task or trajectory (the engine says which)."""

    def __init__(self, position: int) -> None:
        self.position = position
        super().__init__(position)


# an environment's name: a directory's, with no path separator, no leading dot, at most NAME_MAX (255)
# bytes, as Linux allows
ENV_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


MAX_INDEX = 2**63 - 1  # the last place an item can have: what int64 holds (Parquet, numpy, every JSON reader)


def check_first_index(first_index: Any, count: int) -> None:
    """``ValueError`` unless ``first_index`` is a whole number >= 0 that leaves every one of ``count`` items a
    place an int64 holds (a place past it could not be written into an error's ``index``)."""
    if type(first_index) is not int or first_index < 0:
        raise ValueError(f"first_index must be a whole number >= 0, got {first_index!r}")
    if first_index + max(count, 1) - 1 > MAX_INDEX:
        raise ValueError(f"first_index {first_index} leaves items of this batch of {count} past place {MAX_INDEX} "
                         "(2**63 - 1), the last an index can hold")


def item_label(index: int, item: Mapping[str, Any]) -> str:
    """How a message names an item: its position, and its ``id`` if it has one."""
    item_id = item.get("id")
    return f"item {index}" if item_id is None else f"item {index} (id {item_id!r})"


def check_item(index: int, item: Any) -> str:
    """The item's environment name; ``TypeError``/``ValueError`` naming the item if it is malformed.

    (Its task and trajectory are checked where they are read, by :func:`task_of` or a plugin's
    chunk runner: looking at every item once more here would cost a cheap plugin's batch a fifth
    of its speed.)
    """
    if not isinstance(item, Mapping):
        raise TypeError(f"item {index} is {a_or_an(type(item).__name__)}, not a mapping")
    if "environment" not in item:
        raise ValueError(
            f"{item_label(index, item)} has no 'environment' (an item needs 'environment', 'task', 'trajectory')"
        )
    name = item["environment"]
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        raise ValueError(
            f"{item_label(index, item)}: 'environment' must be an environment's directory name, got {name!r}"
        )
    return name


def task_of(index: int, item: Mapping[str, Any]) -> tuple[Mapping[str, Any], Any]:
    """An item's ``(task, trajectory)``; ``ValueError``/``TypeError`` naming item ``index`` if malformed."""
    try:
        task, trajectory = item["task"], item["trajectory"]
    except KeyError as exc:
        raise ValueError(
            f"item {index} has no {exc.args[0]!r} (an item needs 'environment', 'task', 'trajectory')"
        ) from None
    if type(task) is not dict and not isinstance(task, Mapping):
        raise TypeError(f"item {index}: 'task' is {a_or_an(type(task).__name__)}, not a mapping")
    return task, trajectory


class BadItem(Failure):
    """The item at ``position`` of a chunk cannot be scored, or its value is not a reward: ``reason`` says why."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(reason)
        self.position = position
        self.args = (position, reason)  # what unpickling calls the class with


# Values of these types cannot change: a call is handed them as they are.
_IMMUTABLE = frozenset({str, int, float, bool, type(None), bytes, complex})


def private(value: Any) -> Any:
    """A copy of ``value`` that shares nothing mutable with it: what one plugin call may change freely.

    Immutable values are shared as they are. A dict with no container in it (one the garbage
    collector does not track: its values are strings, numbers, None...) is copied flat, a list of
    immutable values too; deeper values are copied as deep as they go, ``copy.deepcopy`` for types
    other than dict, list and tuple. The one thing shared: a mutable value that is not a container
    (a ``bytearray``, a numpy array) inside an untracked dict. Raises what ``copy.deepcopy`` raises
    for a value it cannot copy.
    """
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict:
        if not is_tracked(value):
            return value.copy()
        return {key: private(item) for key, item in value.items()}
    if kind is list:
        if _IMMUTABLE.issuperset(map(type, value)):
            return value.copy()
        return [private(item) for item in value]
    if kind is tuple:
        return value if _IMMUTABLE.issuperset(map(type, value)) else tuple(private(item) for item in value)
    return copy.deepcopy(value)


def private_pair(position: int, task: Any, trajectory: Any) -> tuple[dict[str, Any], Any]:
    """The task (as a dict) and the trajectory one call is handed: ``private`` copies of the item's.

    Raises :class:`MalformedItem` if the task is not a mapping, :class:`BadItem` if a value
    cannot be copied (``position`` is the item's place in its chunk).
    """
    if type(task) is not dict and not isinstance(task, Mapping):
        raise MalformedItem(position)
    try:
        mine = private(task) if type(task) is dict else {key: private(value) for key, value in task.items()}
        return mine, private(trajectory)
    except Exception as exc:
        raise BadItem(position, f"cannot copy the item for the plugin: {type(exc).__name__}: {exc}") from exc


_PLAIN = frozenset({float, int, bool})  # what C converts exactly, running none of a plugin's code


def as_rewards(values: Sequence[Any], before: Callable[[int], None] | None = None) -> list[float]:
    """``values`` as rewards (:func:`check_reward` on each); :class:`BadItem` at the first that is not one.

    Fast when every value is a plain float, int or bool, which is what a chunk of calls returns:
    two passes in C (their types, then a sum that is finite only if every value is), and a third
    only for ints and bools. Anything else (a numpy scalar, a ``Decimal``, a subclass of float
    whose ``__float__`` says otherwise) is checked one value at a time, to name a bad one; that
    runs the plugin's code (``__float__``, ``__repr__``), and whatever it raises but
    ``KeyboardInterrupt`` fails its value. ``before(position)``, if given, is called before each
    value is checked there (a worker process records which item it is at).
    """
    try:
        kinds = set(map(type, values))
        if kinds <= _PLAIN and math.isfinite(math.fsum(values)):
            if kinds == {float}:
                return values if type(values) is list else list(values)
            return list(map(float, values))
    except KeyboardInterrupt:
        raise
    except BaseException:  # NaN, inf, too large, a sum that overflows, a metaclass's __hash__: said below
        pass
    rewards = []
    for position, value in enumerate(values):  # the slow path: check each, to name a bad one
        if before is not None:
            before(position)
        try:
            rewards.append(check_reward(value))
        except (TypeError, ValueError) as exc:
            raise BadItem(position, str(exc)) from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the value's own code raised while it was checked
            shown = a_or_an(_type_name(value))
            raise BadItem(position, f"returned {shown}, whose checking raised {_shown(exc)}") from exc
    return rewards


def _type_name(value: Any) -> str:
    """``type(value).__name__``, or a stand-in if even that raises (a metaclass may make it a property)."""
    try:
        return str(type(value).__name__)
    except KeyboardInterrupt:
        raise
    except BaseException:
        return "value of an unnamed type"


def _shown(value: Any) -> str:
    """``repr(value)``, short, for a message; never raises (a plugin's object may have a broken ``__repr__``).

    Anything its ``__repr__`` raises, ``SystemExit`` too, is swallowed here, except ``KeyboardInterrupt``.
    """
    try:
        text = repr(value)
    except KeyboardInterrupt:
        raise
    except BaseException:
        return f"{a_or_an(_type_name(value))} (whose repr() raises)"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_real(kind: type) -> bool:
    """Whether values of ``kind`` are real numbers: ``numbers.Real`` (int, float, bool, ``Fraction``, numpy's
    ints and floats), ``Decimal``, or numpy's bool (found by name: the engine does not import numpy)."""
    if issubclass(kind, (str, bytes, bytearray)):  # a str subclass with a __float__ is still text
        return False
    if issubclass(kind, (numbers.Real, Decimal)):
        return True
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def check_reward(value: Any) -> float:
    """``value`` as a reward: a real number (int, float, bool, a numpy scalar, ``Decimal``, ``Fraction``).

    Refused, with a ``TypeError``/``ValueError`` whose message shows the value: anything else (a
    string, even "42", which ``float()`` would read, bytes, complex, a numpy string or 0-d array,
    None), NaN and the infinities, a number too large for a float, and a value whose ``__float__``
    raises anything but ``KeyboardInterrupt`` (``SystemExit`` too: it is the plugin's, and must not
    end the trainer). The value's own code runs here (``__float__``, ``__index__``, ``__repr__``):
    callers treat whatever else escapes as the plugin's failure.
    """
    if type(value) is float:
        reward = value
    else:
        kind = type(value)
        if not _is_real(kind):
            raise TypeError(f"returned {_shown(value)} ({_type_name(value)}), which is not a real number")
        try:
            reward = float(value)
        except OverflowError:
            raise ValueError(f"returned {_shown(value)}, which is too large for a float") from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            shown = f"{_shown(value)} ({_type_name(value)})"
            raise ValueError(f"returned {shown}, whose float() raised {_shown(exc)}") from None
    if not math.isfinite(reward):
        raise ValueError(f"returned {_shown(value)}, which is not a finite number")
    return reward
