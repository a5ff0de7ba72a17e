"""Where an input row keeps each of its fields: the column mapping of ``--columns`` and ``[input.columns]``, checked.

Pure data (the config reads it without pyarrow); :class:`engine._backfill.input.RowDecoder` follows it, in
``engine score``, ``engine bench`` and on Ray alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine._keys import unknown_key

__all__ = ["FIELDS", "TASK_KEY", "Columns"]

FIELDS: tuple[str, ...] = ("id", "environment", "task", "trajectory")
TASK_KEY = "task."  # a mapping's ``task.<key>`` entry: one key of a task built from several sources
_KNOWN = (*FIELDS, f"{TASK_KEY}<key>")  # what a mapping's keys may be (task.<key>: one key of a task built of several)

Fail = Callable[[str, str], Exception]  # the error naming a mapping's key, and what is wrong with it


def _value_error(key: str, problem: str) -> Exception:
    return ValueError(f"{key}: {problem}")


@dataclass(frozen=True, slots=True)
class Columns:
    """Where each field of a row is read from: ``sources`` pairs each field (``id``, ``environment``, ``task`` or
    its ``task.<key>`` entries, ``trajectory``) with a source path, dotted into struct columns or JSON objects
    (``reward_model.ground_truth``). Build one with :meth:`of` or :meth:`parse`; ``Columns()`` reads each field
    from the column of its own name."""

    sources: tuple[tuple[str, str], ...] = tuple((name, name) for name in FIELDS)

    @classmethod
    def of(cls, mapping: Mapping[str, Any] | None, fail: Fail = _value_error) -> Columns:
        """The columns ``mapping`` names (a field it leaves out: the column of its name); ``task`` may be a table
        of its keys (TOML's ``task.prompt = "prompt"``).

        Raises:
            Exception: ``fail(key, problem)`` (default: ``ValueError``) for an unknown field, a source that is
                not a dotted path, or both ``task`` and ``task.<key>`` entries.
        """
        if mapping is None:
            return cls()
        if not isinstance(mapping, Mapping):
            raise fail("columns", f"must be a table of field = source column, got {type(mapping).__name__}")
        flat: dict[str, Any] = {}
        for key, source in mapping.items():
            if key == "task" and isinstance(source, Mapping):  # [input.columns.task], or TOML's dotted keys
                flat.update({f"{TASK_KEY}{inner}": value for inner, value in source.items()})
            else:
                flat[key] = source
        chosen: dict[str, str] = {}
        for key, source in flat.items():
            if not isinstance(key, str) or not (key in FIELDS or _task_key(key)):
                raise fail(str(key), unknown_key(str(key), _KNOWN))
            if not isinstance(source, str) or not all(part.strip() for part in source.split(".")):
                raise fail(key, f"must be a source column, dotted into a struct or object (a.b), got {source!r}")
            chosen[key] = source
        keys = sorted(key for key in chosen if key.startswith(TASK_KEY))
        if keys and "task" in chosen:
            raise fail("task", f"the task is either one column or built of task.<key> entries, not both ({keys[0]})")
        order = ["id", "environment", *(keys or ["task"]), "trajectory"]
        return cls(tuple((name, chosen.get(name, name)) for name in order))

    @classmethod
    def parse(cls, text: str) -> Columns:
        """The mapping ``--columns`` gives: ``field=source`` pairs, comma-separated.

        Raises:
            ValueError: a pair is not ``field=source``, names a field twice, or :meth:`of` refuses it.
        """
        mapping: dict[str, str] = {}
        for pair in text.split(","):
            if not pair.strip():
                continue
            key, sep, source = (part.strip() for part in pair.partition("="))
            if not sep or not key:
                raise ValueError(f"{pair.strip()!r} is not field=source (e.g. environment=data_source)")
            if key in mapping:
                raise ValueError(f"{key}: named twice")
            mapping[key] = source
        return cls.of(mapping)

    @classmethod
    def chosen(cls, given: Mapping[str, Any] | None, configured: Mapping[str, str]) -> Columns:
        """The mapping a run reads with: ``given`` (``--columns``, an argument) replaces the config's whole.

        Raises:
            ValueError: ``given`` is refused (:meth:`of`).
        """
        return cls.of(configured if given is None else given)

    @property
    def is_default(self) -> bool:
        """Whether each field is read from the column of its own name."""
        return self == Columns()

    @property
    def whole_task(self) -> bool:
        """Whether the task is one source (not built of ``task.<key>`` entries)."""
        return any(name == "task" for name, _ in self.sources)

    @property
    def reads(self) -> tuple[str, ...]:
        """The top-level columns (or a JSON object's keys) the sources start from, once each, in order."""
        return tuple(dict.fromkeys(source.split(".", 1)[0] for _, source in self.sources))

    @property
    def mapping(self) -> dict[str, str]:
        """Each field and its source, as :meth:`of` takes them."""
        return dict(self.sources)

    @property
    def spec(self) -> str:
        """The mapping as ``--columns`` takes it (a resume compares it; errors quote it)."""
        return ",".join(f"{name}={source}" for name, source in self.sources)

    def source_of(self, name: str) -> str | None:
        """Where field (or ``task.<key>`` entry) ``name`` is read from, if the mapping reads it at all."""
        return self.mapping.get(name)


def _task_key(key: str) -> bool:
    rest = key[len(TASK_KEY):]
    return key.startswith(TASK_KEY) and bool(rest.strip()) and "." not in rest
