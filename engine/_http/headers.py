"""Extra request headers whose values name environment variables: ``Authorization = "Basic ${VERIFIER_AUTH}"``.

Checked when the config is built, filled in at each call, for endpoints and the judge: docs/design.md, Transport.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["HEADER_VARIABLE", "check_headers", "fill_headers", "token_problem"]

HEADER_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")  # ${NAME} in a header's value
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# the engine sets these itself: they frame the request, or say what the engine can read back
_ENGINE_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "content-type", "accept-encoding"}
)


def check_headers(value: Any, fail: Callable[[str, str], Exception]) -> Mapping[str, str]:
    """A read-only copy of a ``headers`` table, validated: names are HTTP tokens, values name variables.

    ``fail(subkey, message)`` builds the error for a bad entry (``subkey`` is "" for the table itself).
    """
    if not isinstance(value, Mapping):
        raise fail("", 'must be a table of header name = "...${VARIABLE}..."')
    for name, template in value.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise fail(f".{name}", "is not a valid HTTP header name")
        if name.lower() in _ENGINE_HEADERS:
            raise fail(f".{name}", "is set by the engine itself")
        # never echo the value: someone may have pasted a token itself here
        if not isinstance(template, str) or not HEADER_VARIABLE.search(template):
            raise fail(f".{name}", "must name an environment variable as ${NAME} (a secret never goes here)")
        if "$" in HEADER_VARIABLE.sub("", template) or not template.isprintable():
            raise fail(f".{name}", "may hold text and ${NAME} variables only (no other '$', no control characters)")
    return MappingProxyType(dict(value))


def fill_headers(
    templates: Iterable[tuple[str, str]], fail: Callable[[str], Exception]
) -> tuple[dict[str, str], list[str]]:
    """The headers with their variables read now, and the values read (the secrets to scrub from messages).

    ``fail(reason)`` builds the error for a variable that is unset, empty, or not fit for a header.
    """
    headers: dict[str, str] = {}
    secrets: list[str] = []
    for name, template in templates:

        def value(match: re.Match[str], name: str = name) -> str:
            variable = match[1]
            text = os.environ.get(variable, "")
            if not text:
                raise fail(f"header {name}: environment variable {variable} is not set (or empty)")
            if not (text.isascii() and text.isprintable()):  # a line break would end the header early
                raise fail(f"header {name}: environment variable {variable} holds characters a header cannot carry")
            secrets.append(text)
            return text

        headers[name] = HEADER_VARIABLE.sub(value, template)
    return headers, secrets


def token_problem(token: str) -> str | None:
    """What keeps ``token`` from being sent as a bearer token (``Authorization: Bearer <token>``), or None.

    Printable ASCII without spaces (0x21-0x7e): a token read from a file with its newline, or pasted with
    a space, would never match the one the other side holds. The words never quote the token, nor any
    character of it.
    """
    if not token:
        return "is empty"
    for position, char in enumerate(token):
        if "\x21" <= char <= "\x7e":
            continue
        if char in _NAMED:
            what = _NAMED[char]
        elif char <= "\x7f":
            what = f"a control character (0x{ord(char):02x})"
        else:
            what = "a non-ASCII character"
        where = ("at its start" if position == 0 else "at its end" if position == len(token) - 1
                 else f"at position {position + 1} of {len(token)}")
        return f"holds {what} {where}: a token is printable ASCII without spaces (0x21-0x7e)"
    return None


_NAMED = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", " ": "a space"}
