"""numpy's values told apart without importing numpy: trainers hand them over, and the engine takes them as Python's."""

from __future__ import annotations

from typing import Any

__all__ = ["is_plain_numpy", "python_scalar"]

# numpy's kinds of values whose tolist() is the value itself: booleans, integers, floats (complex numbers and
# strings too, which orjson then refuses or writes as they are); never dates, durations or records, whose
# tolist() would be another value (an integer for a datetime64 in ns, a string for one in s, fields unnamed)
_PLAIN_KINDS = frozenset("biufcUO")


def is_plain_numpy(value: Any) -> bool:
    """Whether ``value`` is numpy's (a scalar or an array) of a kind whose ``tolist()`` is the value it holds."""
    if type(value).__module__ != "numpy" or not hasattr(value, "tolist"):
        return False
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "kind", None) in _PLAIN_KINDS


def python_scalar(value: Any) -> Any:
    """A numpy scalar of a plain kind as the Python value it holds (exactly); anything else as it is."""
    if is_plain_numpy(value) and getattr(value, "ndim", None) == 0:
        return value.tolist()
    return value
