"""Flattening a trajectory, whatever shape the harness submitted, into the text a judge reads.

The rules, in order:

* a string is itself;
* ``None`` is no text (assistant messages that only call tools have ``content: null``);
* a list or tuple is its elements flattened and joined with newlines, skipping those with no text
  (``None``, ``""``, an image part, a list of nothing but those), so no blank lines appear;
* a message, as a mapping or as an object with attributes, is its ``content`` if that is not
  ``None``, else its ``text``; content that is a list of parts is flattened like any list;
* a part that has a ``type`` but no text (``{"type": "image_url", ...}``) is no text;
* anything else (numbers, bytes, a mapping with neither ``content`` nor ``text``) is a
  ``TypeError`` that names the shape and where it was found, never ``str()`` of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["flatten"]

_MISSING = object()


def _field(message: Any, name: str) -> Any:
    if isinstance(message, Mapping):
        return message.get(name, _MISSING)
    return getattr(message, name, _MISSING)


def _flatten(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return value
    if value is None:
        return None
    if isinstance(value, list | tuple):
        pieces = [piece for i, element in enumerate(value) if (piece := _flatten(element, f"{path}[{i}]"))]
        return "\n".join(pieces) if pieces else None
    if isinstance(value, bytes | bytearray | int | float | complex | set | frozenset):
        raise TypeError(f"cannot flatten trajectory: {type(value).__name__} at {path}")
    content, text = _field(value, "content"), _field(value, "text")
    if content is not _MISSING and content is not None:
        return _flatten(content, f"{path}.content")
    if text is not _MISSING and text is not None:
        return _flatten(text, f"{path}.text")
    if content is not _MISSING or text is not _MISSING or _field(value, "type") is not _MISSING:
        return None
    raise TypeError(
        f"cannot flatten trajectory: {type(value).__name__} at {path} has neither 'content' nor 'text'"
    )


def flatten(trajectory: Any) -> str:
    """The text of ``trajectory``; see the module docstring for the rules."""
    return _flatten(trajectory, "trajectory") or ""
