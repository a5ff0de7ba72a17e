"""What a verifier that reads JSON (an endpoint's answer, a judge's reply) takes for a number, and where."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Words", "is_json_number", "number_field"]


def is_json_number(value: Any) -> bool:
    """True for a number as JSON writes one, once parsed: an int or a finite float, never a boolean.

    ``true`` parses as ``True``, which Python counts as the int 1: a reward or a score of ``true`` is
    refused, not taken for 1. (orjson refuses NaN and numbers too large for a float already.)
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not isinstance(value, float) or math.isfinite(value)


@dataclass(frozen=True)
class Words:
    """How a reader says what is wrong, each a format string: ``{kind}`` (what the JSON is instead of an
    object), ``{shown}`` (an excerpt of what was read) and ``{value}`` (the field's value, as JSON)."""

    not_object: str
    missing: str
    not_number: str


def number_field(
    data: Any, field: str, words: Words, shown: Callable[[], str], value: Callable[[Any], str] | None = None
) -> int | float:
    """``data[field]``, when ``data`` (parsed JSON) is an object holding a JSON number there.

    Else ``ValueError`` in ``words``, ``shown()`` quoting what was read (called only then: an excerpt
    costs time a good answer need not spend). ``value`` gives the field's value as a message may
    quote it (scrubbed, say), for words that quote it.
    """
    if not isinstance(data, dict):
        raise ValueError(words.not_object.format(kind=type(data).__name__, shown=shown()))
    if field not in data:
        raise ValueError(words.missing.format(shown=shown()))
    number = data[field]
    if not is_json_number(number):
        raise ValueError(words.not_number.format(shown=shown(), value=value(number) if value is not None else ""))
    return number  # type: ignore[no-any-return]
