"""The JSON both sides of ``engine serve`` speak: a batch's result, and an error, each way.

A result is ``BatchResult``'s fields as they are (``rewards``, ``verifiers``, ``elapsed``,
``verifier_of``, ``usage``), each verifier report its dataclass fields; floats cross exactly
(orjson writes the shortest repr that reads back to the same float). An error is
``{"error": {"type", "kind", "ref", "environment", "index", "item_id", "message"}}``: the client
raises the same class with the same fields, or ``ServiceError`` for anything that is not one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import orjson

from engine._core.report import BatchResult, VerifierReport
from engine._errors import RubricError, ServiceError, VerificationError

__all__ = [
    "INTERNAL",
    "JSON",
    "decode_error",
    "decode_result",
    "dump_result",
    "encode_error",
    "error_status",
]

JSON = "application/json"
INTERNAL = "InternalError"  # the type of an error the service did not mean: a bug, answered 500
_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(VerifierReport))
# HTTP status per error type: a verifier's failure is not the request's fault, but the request cannot
# be answered as asked either (422); malformed items are the caller's (400)
_STATUS = {"VerificationError": 422, "RubricError": 422, "ValueError": 400, "TypeError": 400}


def dump_result(result: BatchResult) -> bytes:
    """``result`` as JSON: the dataclasses' fields as they are, written by orjson (a third of the time a
    dict built per report took, on a one-item answer: the service writes one per request)."""
    return orjson.dumps(result, default=_plain)


def _plain(value: Any) -> dict[Any, Any]:
    """A mapping that is not a ``dict`` (a provenance or usage given as a read-only view) as one."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def decode_result(data: Any) -> BatchResult:
    """The ``BatchResult`` that :func:`dump_result` wrote; ``ServiceError`` for anything else."""
    try:
        if not isinstance(data, dict) or not isinstance(data.get("verifiers"), list):
            raise TypeError("not a batch result")
        reports = []
        for fields in data["verifiers"]:
            if not isinstance(fields, dict) or set(fields) != set(_REPORT_FIELDS):
                raise TypeError("a verifier report's fields differ")
            reports.append(VerifierReport(**fields))
        rewards, verifier_of = data["rewards"], data["verifier_of"]
        if not isinstance(rewards, list) or not all(type(reward) is float for reward in rewards):
            raise TypeError("its rewards are not all floats")
        if not isinstance(verifier_of, list) or len(verifier_of) != len(rewards):
            raise TypeError("it does not name the verifier of each item")
        return BatchResult(rewards, reports, float(data["elapsed"]), verifier_of, dict(data["usage"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ServiceError(f"the service answered something that is not a batch's result: {exc}") from exc


def error_status(exc: BaseException) -> int:
    """The HTTP status an error is answered with."""
    return _STATUS.get(_type_of(exc), 500)


def _type_of(exc: BaseException) -> str:
    if isinstance(exc, RubricError):
        return "RubricError"
    if isinstance(exc, VerificationError):
        return "VerificationError"
    if isinstance(exc, TypeError):
        return "TypeError"
    if isinstance(exc, ValueError):
        return "ValueError"
    return INTERNAL


def encode_error(exc: BaseException, *, kind: str | None = None, message: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` for ``exc``: a verification error's fields, or the message of any other.

    ``kind`` overrides the type (a service's own refusals: ``Unauthorized``, ``TooLarge``, ...).
    """
    fields: dict[str, Any] = {"type": kind or _type_of(exc), "kind": None, "ref": None, "environment": None,
                              "index": None, "item_id": None, "message": message or str(exc)}
    if isinstance(exc, VerificationError):
        fields.update(kind=exc.kind, ref=exc.ref, environment=exc.environment, index=exc.index,
                      item_id=exc.item_id, message=exc.reason)
    return {"error": fields}


def decode_error(status: int, body: bytes, url: str) -> Exception:
    """The exception an error answer stands for: the one the service raised, or ``ServiceError``."""
    try:
        error = orjson.loads(body)["error"]
        kind, message = error["type"], error["message"]
        if not isinstance(error, Mapping) or not isinstance(message, str):
            raise TypeError("not an error")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        shown = body[:200].decode(errors="replace")
        return ServiceError(f"the scoring service at {url} answered HTTP {status}: {shown!r}", status=status)
    where = {name: error.get(name) for name in ("environment", "index", "item_id")}
    if kind == "VerificationError":
        return VerificationError(str(error["kind"]), str(error["ref"]), message, **where)
    if kind == "RubricError":
        return RubricError(str(error["ref"]), message, **where)
    if kind == "ValueError":
        return ValueError(message)
    if kind == "TypeError":
        return TypeError(message)
    return ServiceError(f"the scoring service at {url} answered HTTP {status}: {kind}: {message}", status=status)
