"""JSON read and written with every integer exact: orjson, and the standard library where orjson would round one."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import orjson

from engine._numpy import is_plain_numpy

__all__ = ["EXACT", "JSONDecodeError", "dumps", "loads", "plain"]

JSONDecodeError = orjson.JSONDecodeError  # what loads raises, whichever parser found the fault
# orjson reads an integer outside [-2**63, 2**64) as a float (rounded) and writes none: such an integer has
# 19 digits at least, so a text without a run of 19 digits is read by orjson alone
_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_WIDE = b"0" * 19


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # as orjson refuses it: no float means a number that large
        raise ValueError(f"{text[:40]} is too large for a float")
    return value


# the standard library's parser: every integer exact, NaN and infinities refused as orjson refuses them
EXACT = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite)


def _wide(data: bytes | str) -> bool:
    """Whether ``data`` has a run of 19 digits: where an integer orjson would round (or refuse) may stand."""
    raw = data.encode() if isinstance(data, str) else data
    return raw.translate(_DIGITS).find(_WIDE) >= 0  # C speed, ~2 ns a byte


def loads(data: bytes | str) -> Any:
    """``data`` parsed as orjson does (refusing NaN and infinities), except that wide integers stay exact.

    Raises:
        JSONDecodeError: ``data`` is not JSON.
    """
    try:
        value = orjson.loads(data)
    except JSONDecodeError:
        if not _wide(data):
            raise
    else:
        if not _wide(data):
            return value
    try:  # orjson rounded an integer, or refused one too wide for a float: the standard parser reads it exactly
        text = data if isinstance(data, str) else data.decode()
        return EXACT.decode(text)
    except (ValueError, RecursionError) as exc:  # not JSON after all, or nested deeper than it goes
        raise JSONDecodeError(f"cannot be read with its integers exact: {exc}", str(data[:100]), 0) from None


def plain(value: Any) -> Any:
    """A ``default`` for :func:`dumps`: what orjson cannot write itself but an in-process engine takes.

    Any mapping as a dict; numpy's scalars and arrays as Python's values, exactly (``tolist``: a float32
    widened to the float it holds, never re-rounded to its shortest text, as orjson's numpy option would).
    Trainers hand over numpy values (verl's ``extra_info``, its ``np.str_`` data sources; ``np.str_`` is a
    ``str``, which orjson writes itself).

    Raises:
        TypeError: ``value`` is none of those.
    """
    if isinstance(value, Mapping):
        return dict(value)
    if is_plain_numpy(value):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """``value`` as orjson writes it, or, where it holds an integer orjson cannot write, as exact JSON.

    Raises:
        TypeError: ``value`` holds something JSON cannot represent (``default`` aside), NaN and infinities too
            (orjson would write them as ``null``: another value).
    """
    try:
        written = orjson.dumps(value, default=default)
    except orjson.JSONEncodeError as exc:
        refused = exc
    else:
        if b"null" in written and _holds_non_finite(value):  # a value with no null needs no look
            raise TypeError("NaN and infinities are not JSON numbers (orjson would write null)")
        return written
    if not _holds_wide_integer(value):
        raise TypeError(str(refused)) from None
    try:  # the standard writer, which writes every integer exactly (and refuses NaN)
        return json.dumps(value, default=default, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()
    except (ValueError, RecursionError) as exc:
        raise TypeError(str(exc)) from None


def _holds_non_finite(value: Any) -> bool:
    if isinstance(value, float):  # numpy's float64 too
        return not math.isfinite(value)
    if isinstance(value, list | tuple):
        return any([_holds_non_finite(part) for part in value])
    if is_plain_numpy(value):  # a float32 or an array, which ``plain`` writes as Python's values
        return _holds_non_finite(value.tolist())
    if isinstance(value, Mapping):
        return any([_holds_non_finite(part) for part in value.values()])
    if isinstance(value, Enum):  # orjson writes an enum as its value
        return _holds_non_finite(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # orjson writes one as its fields
        return any([_holds_non_finite(getattr(value, field.name)) for field in dataclasses.fields(value)])
    return False


def _holds_wide_integer(value: Any) -> bool:
    """Whether ``value`` holds an integer outside orjson's range; ``TypeError`` for a key that is not a string
    (the standard writer would write ``1`` as ``"1"``, a changed value; orjson refuses it)."""
    if type(value) is int:
        return not -(2**63) <= value < 2**64
    if isinstance(value, list | tuple):
        return any([_holds_wide_integer(part) for part in value])
    if isinstance(value, Mapping):  # a dict, or a mapping ``default`` turns into one
        if not all(type(key) is str for key in value):
            raise TypeError("a key of a JSON object must be a string")
        return any([_holds_wide_integer(part) for part in value.values()])
    return False
