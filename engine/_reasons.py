"""Every foreign exception becomes one reason, in words, here: the one translation table (secrets scrubbed too).

No third-party module is imported: an exception of httpx's exists only if httpx was imported, so each is looked
up in ``sys.modules`` when one is described (a plugin's worker process imports this, and no HTTP stack).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import ssl

__all__ = ["REDACTED", "Scrubber", "a_or_an", "describe", "excerpt", "is_timeout", "tls_verification_failure"]

EXCERPT_CHARS = 200
_CHAIN_DEPTH = 8  # causes followed to find why a connection failed
REDACTED = "[redacted]"  # what a secret is replaced with in a message


def a_or_an(noun: str) -> str:
    """``noun`` with its indefinite article, for a message that names a kind or a type: "an int", "a list"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' and noun[:1] else 'a'} {noun}"


def excerpt(text: str | bytes, limit: int = EXCERPT_CHARS) -> str:
    """A short, single-line excerpt of a body, for error messages."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def tls_verification_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error behind ``exc``, if that is why it failed.

    The engine's transport chains it to the ``ConnectError`` it raises, httpx's own transport one
    link further (through httpcore's error), so the chain of causes is searched. (Without ssl
    imported, no TLS error can have happened: a worker process describing its plugin's failure
    need not import it.)
    """
    ssl_module: Any = sys.modules.get("ssl")
    if ssl_module is None:
        return None
    cause: BaseException | None = exc
    for _ in range(_CHAIN_DEPTH):
        if cause is None:
            return None
        if isinstance(cause, ssl_module.SSLCertVerificationError):
            return cast("ssl.SSLCertVerificationError", cause)
        cause = cause.__cause__ or cause.__context__
    return None


def describe(exc: BaseException) -> str:
    """A reason for ``VerificationError`` that says what happened, in words, for any exception.

    This is the single translation table from third-party exceptions (httpx, orjson, tenacity) to
    readable reasons; an exception with a ``reason`` string of its own (ours) is described by it,
    and everything else by its type and message.
    """
    tenacity: Any = sys.modules.get("tenacity")
    if tenacity is not None and isinstance(exc, tenacity.RetryError):
        attempt = exc.last_attempt
        last = attempt.exception()
        why = describe(last) if last is not None else "no exception"
        tries = attempt.attempt_number
        return f"gave up after {tries} attempt{'s' if tries != 1 else ''}; last: {why}"
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason
    httpx: Any = sys.modules.get("httpx")
    if httpx is not None and isinstance(exc, httpx.HTTPError):
        return _http_reason(exc, httpx)
    orjson: Any = sys.modules.get("orjson")
    if orjson is not None and isinstance(exc, orjson.JSONDecodeError):
        return f"response is not valid JSON ({exc})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a call running out of time, told by its type: ours saying so (``timed_out``), one of
    httpx's timeouts, a ``TimeoutError``, or retries whose last try was one of those."""
    tenacity: Any = sys.modules.get("tenacity")
    if tenacity is not None and isinstance(exc, tenacity.RetryError):
        last = exc.last_attempt.exception()
        return last is not None and is_timeout(last)
    timed_out = getattr(exc, "timed_out", None)
    if isinstance(timed_out, bool):
        return timed_out
    httpx: Any = sys.modules.get("httpx")
    return isinstance(exc, TimeoutError) or (httpx is not None and isinstance(exc, httpx.TimeoutException))


def _http_reason(exc: BaseException, httpx: Any) -> str:
    """The reason for one of httpx's errors: which phase timed out, why a connection failed."""
    if isinstance(exc, httpx.TimeoutException):
        phase = {
            httpx.ConnectTimeout: "connecting",
            httpx.ReadTimeout: "waiting for the response",
            httpx.WriteTimeout: "sending the request",
            httpx.PoolTimeout: "waiting for a free connection",
        }.get(type(exc), "the request")
        return f"timed out {phase}"
    if isinstance(exc, httpx.ConnectError):
        tls = tls_verification_failure(exc)
        if tls is not None:
            return f"TLS certificate verification failed: {tls.verify_message or tls} (a private CA goes in ca_bundle)"
        return f"could not connect: {str(exc) or type(exc).__name__}"
    return f"HTTP error ({type(exc).__name__}){f': {exc}' if str(exc) else ''}"


# How a JSON encoder may write a character inside a string besides itself and \uXXXX: json and orjson
# escape these short; '/' only some encoders escape (PHP's, Go's HTML-safe one ...), as '\/'.
_JSON_SHORT_ESCAPES = {
    '"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"
}


def _unicode_escapes(char: str) -> list[str]:
    """``char`` as JSON's ``\\uXXXX`` escapes (a surrogate pair beyond the BMP), as regex parts of either case."""
    point = ord(char)
    if point > 0xFFFF:
        point -= 0x10000
        units = [0xD800 + (point >> 10), 0xDC00 + (point & 0x3FF)]
    else:
        units = [point]
    return [rf"\\u(?i:{unit:04x})" for unit in units]


@functools.lru_cache(maxsize=256)
def _secret_pattern(secret: str) -> tuple[str, bytes]:
    """A regex (text, and bytes for UTF-8 bodies) matching ``secret`` however a JSON encoder wrote it.

    Each character may appear as itself, as its short escape (``\\"``, ``\\\\``, ``\\/``, ...) or as
    ``\\uXXXX`` in either case, mixed in any way: json with ensure_ascii, orjson, and encoders that
    escape '/' or more than they must all write one of these.
    """
    text: list[str] = []
    data: list[bytes] = []
    for char in secret:
        short = _JSON_SHORT_ESCAPES.get(char)
        escapes = ["".join(_unicode_escapes(char)), *([re.escape(short)] if short else [])]  # all ASCII
        text.append(f"(?:{'|'.join([*escapes, re.escape(char)])})")
        data.append(b"(?:" + b"|".join([*(part.encode() for part in escapes), re.escape(char.encode())]) + b")")
    return "".join(text), b"".join(data)


class Scrubber:
    """Removes secrets (header values read from the environment) from a text or a body, for messages.

    Each secret is removed as it is and in every form a JSON encoder may write it in (a server that
    echoes the key in a JSON body escapes its '"', '\\', '/' or non-ASCII characters). Scrub a body
    before cutting it to an excerpt: a cut through a secret would leave a part of it behind.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        # the longest first, so that a secret inside another leaves no part of the longer one behind
        ordered = sorted({secret for secret in secrets if secret}, key=len, reverse=True)
        patterns = [_secret_pattern(secret) for secret in ordered]
        self._pattern = re.compile("|".join(text for text, _ in patterns)) if patterns else None
        self._bytes = re.compile(b"|".join(data for _, data in patterns)) if patterns else None

    def __call__(self, text: str) -> str:
        return text if self._pattern is None else self._pattern.sub(REDACTED, text)

    def body(self, content: bytes) -> bytes:
        """``content`` with every secret replaced, byte for byte the same elsewhere (it may still be parsed)."""
        return content if self._bytes is None else self._bytes.sub(REDACTED.encode(), content)
