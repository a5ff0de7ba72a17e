"""A request's JSON body parsed without building more items than are admitted, nor holding the loop meanwhile."""

from __future__ import annotations

import re
import time
from typing import Any

import anyio

from engine import _json

__all__ = ["SMALL", "TooMany", "parse", "parse_small"]

SMALL = 1 << 20  # bytes of a body orjson parses whole: ~10 ms at most, even of empty items
SLICE = 0.005  # seconds a larger body is parsed for before the loop gets a turn
_SPACE = re.compile(r"[ \t\n\r]*")


class TooMany(Exception):
    """A top-level array of the body holds more than ``limit`` values: refused before the rest is built."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(limit)


def parse_small(body: bytes) -> Any:
    """A body of at most :data:`SMALL` bytes as JSON, parsed whole (integers exact): its arrays are the caller's
    to count. ``ValueError`` if it is not JSON."""
    try:
        return _json.loads(body)
    except _json.JSONDecodeError as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None


async def parse(body: bytes, max_items: int) -> Any:
    """``body`` as JSON (integers exact), parsed a value of its top-level arrays at a time, each array (at its top
    level, or in its top-level object) holding at most ``max_items`` values; :func:`parse_small` for small bodies.

    Raises:
        ValueError: ``body`` is not JSON (nor UTF-8).
        TooMany: an array there holds more values.
    """
    try:
        return await _Parser(body.decode(), max_items).document()
    except UnicodeDecodeError as exc:
        raise ValueError(f"the body is not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; RecursionError: nested too deep
        raise ValueError(f"the body is not JSON: {exc}") from None


class _Parser:
    """One large body, parsed a value of its top-level arrays at a time, with a turn for the loop every slice."""

    def __init__(self, text: str, most: int) -> None:
        self.text = text
        self.most = most
        self.turn = time.perf_counter() + SLICE

    def _skip(self, at: int) -> int:
        return _SPACE.match(self.text, at).end()  # type: ignore[union-attr]  # matches the empty string too

    def _expect(self, at: int, chars: str) -> str:
        found = self.text[at : at + 1]
        if not found or found not in chars:
            raise ValueError(f"expected one of {chars!r} at char {at}")
        return found

    async def document(self) -> Any:
        at = self._skip(0)
        value, at = await self._top(at)
        if self._skip(at) != len(self.text):
            raise ValueError(f"extra data at char {self._skip(at)}")
        return value

    async def _top(self, at: int) -> tuple[Any, int]:
        if self.text.startswith("{", at):
            return await self._object(at)
        return await self._value(at)

    async def _value(self, at: int) -> tuple[Any, int]:
        """The value at ``at``: an array a value at a time, anything else whole."""
        if self.text.startswith("[", at):
            return await self._array(at)
        value, end = _json.EXACT.raw_decode(self.text, at)
        return value, end

    async def _object(self, at: int) -> tuple[dict[str, Any], int]:
        members: dict[str, Any] = {}
        at = self._skip(at + 1)
        if self.text.startswith("}", at):
            return members, at + 1
        while True:
            self._expect(at, '"')
            key, at = _json.EXACT.raw_decode(self.text, at)
            self._expect(at := self._skip(at), ":")
            members[key], at = await self._value(self._skip(at + 1))
            if self._expect(at := self._skip(at), ",}") == "}":
                return members, at + 1
            at = self._skip(at + 1)

    async def _array(self, at: int) -> tuple[list[Any], int]:
        values: list[Any] = []
        append = values.append
        at = self._skip(at + 1)
        if self.text.startswith("]", at):
            return values, at + 1
        while True:
            value, at = _json.EXACT.raw_decode(self.text, at)
            append(value)
            if len(values) > self.most:
                raise TooMany(self.most)
            if self._expect(at := self._skip(at), ",]") == "]":
                return values, at + 1
            at = self._skip(at + 1)
            if time.perf_counter() >= self.turn:
                await anyio.sleep(0)
                self.turn = time.perf_counter() + SLICE
