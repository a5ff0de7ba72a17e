"""JSON read and written with every integer exact: orjson, and the standard library where orjson would round one."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import orjson

__all__ = ["JSONDecodeError", "dumps", "loads"]

JSONDecodeError = orjson.JSONDecodeError  # what loads raises, whichever parser found the fault
# orjson reads an integer outside [-2**63, 2**64) as a float (rounded) and writes none: such an integer has
# 19 digits at least, so a text without a run of 19 digits is read by orjson alone
_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_WIDE = b"0" * 19


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(data: bytes | str) -> Any:
    """``data`` parsed as orjson does (refusing NaN and infinities), except that wide integers stay exact.

    Raises:
        JSONDecodeError: ``data`` is not JSON.
    """
    value = orjson.loads(data)
    raw = data.encode() if isinstance(data, str) else data
    if raw.translate(_DIGITS).find(_WIDE) < 0:  # C speed, ~2 ns a byte: no integer orjson could have rounded
        return value
    text = data if isinstance(data, str) else data.decode()  # orjson has read it: valid UTF-8, valid JSON
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # nested deeper than the standard parser goes
        raise JSONDecodeError(f"cannot be read with its integers exact: {exc}", text, 0) from None


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """``value`` as orjson writes it, or, where it holds an integer orjson cannot write, as exact JSON.

    Raises:
        TypeError: ``value`` holds something JSON cannot represent (``default`` aside).
    """
    try:
        return orjson.dumps(value, default=default)
    except orjson.JSONEncodeError as exc:
        refused = exc
    if not _holds_wide_integer(value):
        raise TypeError(str(refused)) from None
    try:  # the standard writer, which writes every integer exactly (and refuses NaN, as orjson does)
        return json.dumps(value, default=default, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()
    except (ValueError, RecursionError) as exc:
        raise TypeError(str(exc)) from None


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
