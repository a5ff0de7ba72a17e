"""What a verifier that reads JSON (an endpoint's answer, a judge's reply) takes for a number."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_json_number"]


def is_json_number(value: Any) -> bool:
    """True for a number as JSON writes one, once parsed: an int or a finite float, never a boolean.

    ``true`` parses as ``True``, which Python counts as the int 1: a reward or a score of ``true`` is
    refused, not taken for 1. (orjson refuses NaN and numbers too large for a float already.)
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not isinstance(value, float) or math.isfinite(value)
