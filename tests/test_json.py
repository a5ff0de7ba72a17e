"""engine._json: orjson's loads and dumps, with every integer kept exact where orjson would round or refuse it."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import numpy as np
import orjson
import pytest

from engine import _json

WIDE = [2**64 + 1, -(2**63) - 1, 10**39 + 7]  # beyond orjson's exact range on both sides, and a 40-digit one


@pytest.mark.parametrize("number", WIDE)
def test_loads_keeps_an_integer_wider_than_64_bits_exact(number: int) -> None:
    text = f'{{"reference": {number}, "nested": [1, {{"deep": {number}}}], "text": "{number}"}}'
    assert isinstance(orjson.loads(text)["reference"], float)  # what the engine read before: a rounded float

    for data in (text, text.encode()):
        value = _json.loads(data)
        assert value == {"reference": number, "nested": [1, {"deep": number}], "text": str(number)}
        assert type(value["reference"]) is int and type(value["nested"][1]["deep"]) is int


def test_loads_leaves_floats_and_64_bit_integers_as_orjson_reads_them() -> None:
    text = b'[0.1, 1e300, -2.5e-10, 1.0, 18446744073709551615, -9223372036854775808, 1234567890123456789.5]'
    assert _json.loads(text) == orjson.loads(text)
    assert [type(v) for v in _json.loads(text)] == [float, float, float, float, int, int, float]
    wide_and_float = b'[18446744073709551616, 0.1, 3.0]'  # the standard parser's path: floats still floats
    assert _json.loads(wide_and_float) == [2**64, 0.1, 3.0]
    assert [type(v) for v in _json.loads(wide_and_float)] == [int, float, float]


@pytest.mark.parametrize("text", ["NaN", "[NaN]", "Infinity", "[-Infinity]", "[1e999]", "[18446744073709551616, NaN]"])
def test_loads_refuses_nan_and_infinities(text: str) -> None:
    with pytest.raises(_json.JSONDecodeError):
        _json.loads(text)


def test_loads_refuses_what_is_not_json_with_orjsons_error() -> None:
    for text in (b"{", b'{"a": 18446744073709551616', b"\xff"):
        with pytest.raises(_json.JSONDecodeError):
            _json.loads(text)
    assert _json.JSONDecodeError is orjson.JSONDecodeError


def test_dumps_writes_wide_integers_exactly_and_anything_else_as_orjson_does() -> None:
    for number in WIDE:
        assert _json.dumps({"reference": number, "list": [number, 0.5]}) == (
            f'{{"reference":{number},"list":[{number},0.5]}}'.encode()
        )
        assert _json.loads(_json.dumps([number])) == [number]
    plain = {"a": [1, 2.5, "é", None, True], "b": 2**64 - 1}
    assert _json.dumps(plain) == orjson.dumps(plain)


def test_dumps_refuses_keys_that_are_not_strings_and_values_json_cannot_hold() -> None:
    with pytest.raises(TypeError, match="key"):
        _json.dumps({1: 2**64})  # the standard writer would write "1", a changed key
    with pytest.raises(TypeError):
        _json.dumps({1: "x"})
    for bad in ([2**64, math.nan], [2**64, object()], {"a": 2**64, "b": {1, 2}}):
        with pytest.raises(TypeError):
            _json.dumps(bad)


@pytest.mark.parametrize("value", [
    np.datetime64("2020-01-01T00:00:00.000000001"),  # tolist(): an integer of nanoseconds
    np.datetime64("2020-01-01T00:00:01"),  # tolist(): a datetime, which orjson would write as a string
    np.timedelta64(5, "ns"),
    np.zeros(1, dtype=[("a", "i4")])[0],  # a record: tolist() would drop its field names
], ids=["datetime64-ns", "datetime64-s", "timedelta64", "record"])
def test_numpy_values_that_tolist_would_change_are_refused(value: Any) -> None:
    with pytest.raises(TypeError):
        _json.dumps({"v": value}, default=_json.plain)


@dataclasses.dataclass
class Point:
    x: Any


class Constant(enum.Enum):
    NAN = float("nan")


@pytest.mark.parametrize("value", [Point(np.float32("nan")), Point(math.nan), Constant.NAN],
                         ids=["dataclass-float32", "dataclass", "enum"])
def test_a_nan_orjson_would_write_as_null_inside_a_dataclass_or_an_enum_is_refused(value: Any) -> None:
    with pytest.raises(TypeError, match="NaN"):
        _json.dumps({"v": value}, default=_json.plain)
