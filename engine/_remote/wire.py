"""The JSON both sides of ``engine serve`` speak: a batch's result, and an error, each way.

What crosses, exactly, and what the client checks: docs/design.md, Remote engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from engine import _json as json
from engine._core.report import BatchResult, VerifierReport
from engine._errors import BudgetError, RubricError, ServiceError, VerificationError
from engine._reasons import a_or_an, excerpt

__all__ = [
    "INTERNAL",
    "JSON",
    "decode_error",
    "decode_result",
    "dump_error",
    "dump_result",
    "encode_error",
    "error_status",
]

JSON = "application/json"
INTERNAL = "InternalError"  # the type of an error the service did not mean: a bug, answered 500
_REPORT_FIELDS = frozenset(f.name for f in dataclasses.fields(VerifierReport))
_RESULT_FIELDS = frozenset(f.name for f in dataclasses.fields(BatchResult))
# fields a service of an older engine does not send: read as none
_OPTIONAL_REPORT = frozenset({"cache_hits", "deduped"})
_OPTIONAL_RESULT = frozenset({"cached"})
Scrub = Callable[[str], str]  # removes secrets from a text before a message quotes it
# HTTP status per error type: a verifier's failure is not the request's fault, but the request cannot
# be answered as asked either (422); malformed items are the caller's (400)
_STATUS = {"VerificationError": 422, "RubricError": 422, "BudgetError": 422, "ValueError": 400, "TypeError": 400}


def dump_result(result: BatchResult) -> bytes:
    """``result`` as JSON: the dataclasses' fields as they are, written by orjson (a third of the time a
    dict built per report took, on a one-item answer: the service writes one per request)."""
    return orjson.dumps(result, default=_plain, option=orjson.OPT_NON_STR_KEYS)  # cached: keyed by item index


def _plain(value: Any) -> dict[Any, Any]:
    """A mapping that is not a ``dict`` (a provenance or usage given as a read-only view) as one."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def decode_result(body: bytes, url: str, scrub: Scrub = str) -> BatchResult:
    """The ``BatchResult`` that :func:`dump_result` wrote, every field checked; ``ServiceError`` for anything else.

    Rewards are finite floats, ``verifier_of`` one valid report index per reward, each report's fields of their
    types (and its ``items`` the rewards ``verifier_of`` gives it), ``elapsed`` a finite float >= 0, ``usage``
    counts. How many rewards a batch needs is the caller's to check: only it knows what it sent.
    ``scrub`` removes secrets from what of the body a message quotes.
    """
    # each ServiceError is raised outside the handler: no context chained that would quote the body unscrubbed
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        data = _NOT_JSON
    if data is _NOT_JSON:
        shown = excerpt(scrub(body.decode(errors="replace"))) or "(empty body)"
        raise ServiceError(f"the scoring service at {url} answered HTTP 200 with a body that is not JSON: {shown!r}",
                           status=200)
    try:
        return _result(data)
    except _Malformed as exc:
        wrong = scrub(str(exc))
    raise ServiceError(f"the scoring service at {url} answered something that is not a batch's result: {wrong}",
                       status=200)


_NOT_JSON = object()


class _Malformed(Exception):
    """What is wrong with an answer, in words."""


def _result(data: Any) -> BatchResult:
    if not isinstance(data, dict):
        raise _Malformed(f"{a_or_an(type(data).__name__)}, not an object")
    _same_keys("the answer", data, _RESULT_FIELDS, _OPTIONAL_RESULT)
    rewards, verifier_of, reports = data["rewards"], data["verifier_of"], data["verifiers"]
    if not isinstance(rewards, list):
        raise _Malformed(f"its rewards are {a_or_an(type(rewards).__name__)}, not a list")
    # each check over a batch runs in C (a 4,096-item answer's took 1.3 ms a Python loop); a loop finds the culprit.
    # A float read from JSON is finite: json.loads refuses NaN, infinities and a number too large for a float.
    if not {float}.issuperset(map(type, rewards)):
        index, reward = next((i, r) for i, r in enumerate(rewards) if type(r) is not float)
        raise _Malformed(f"reward {index} is {_shown(reward)}, not a finite float")
    if not isinstance(reports, list):
        raise _Malformed(f"its verifiers are {a_or_an(type(reports).__name__)}, not a list")
    decoded = [_report(position, fields) for position, fields in enumerate(reports)]
    if not isinstance(verifier_of, list) or len(verifier_of) != len(rewards):
        shown = f"{len(verifier_of)} entries" if isinstance(verifier_of, list) else a_or_an(type(verifier_of).__name__)
        raise _Malformed(f"its verifier_of is {shown}, not one verifier's index per reward ({len(rewards)})")
    size = len(decoded)
    named = [verifier_of.count(position) for position in range(size)]  # a pass in C each: reports are few
    # every entry an int (no bool: True would pass for report 1) and each counted by one report: all valid
    if not {int}.issuperset(map(type, verifier_of)) or sum(named) != len(verifier_of):
        index, entry = next((i, w) for i, w in enumerate(verifier_of) if type(w) is not int or not 0 <= w < size)
        raise _Malformed(f"verifier_of[{index}] is {_shown(entry)}, not the index of one of its {size} reports")
    for position, (report, count) in enumerate(zip(decoded, named, strict=True)):
        if report.items != count:  # the figures a client's stats add up would not be the batch's
            raise _Malformed(f"verifier report {position} counts {report.items} items; verifier_of gives it {count}")
    elapsed, usage = data["elapsed"], data["usage"]
    if type(elapsed) is not float or elapsed < 0:
        raise _Malformed(f"its elapsed is {_shown(elapsed)}, not a finite float >= 0")
    _counts("its usage", usage)
    cached = data.get("cached", {})
    if not isinstance(cached, dict):
        raise _Malformed(f"its cached is {_shown(cached)}, not an object")
    served: dict[int, float] = {}
    for index, when in cached.items():
        if not (index.isascii() and index.isdigit() and int(index) < len(rewards)) or not _number(when):
            raise _Malformed("its cached is not an object of item indices to the times of the calls they were served")
        served[int(index)] = float(when)
    return BatchResult(rewards, decoded, elapsed, verifier_of, usage, cached=served)


def _report(position: int, fields: Any) -> VerifierReport:
    """One report, each field checked against its type (counts whole numbers >= 0, seconds finite numbers)."""
    where = f"verifier report {position}"
    if not isinstance(fields, dict):
        raise _Malformed(f"{where} is {a_or_an(type(fields).__name__)}, not an object")
    _same_keys(where, fields, _REPORT_FIELDS, _OPTIONAL_REPORT)
    for name in ("kind", "ref", "key"):
        if not isinstance(fields[name], str):
            raise _Malformed(f"{where}'s {name} is {_shown(fields[name])}, not a string")
    if not isinstance(fields["provenance"], dict):
        raise _Malformed(f"{where}'s provenance is {_shown(fields['provenance'])}, not an object")
    for name in ("items", "peak_in_flight", "retries", *(_OPTIONAL_REPORT & fields.keys())):
        if not _count(fields[name]):
            raise _Malformed(f"{where}'s {name} is {_shown(fields[name])}, not a whole number >= 0")
    if fields["reward_sum"] is None:  # a sum of finite rewards that overflowed, which orjson writes as null
        fields["reward_sum"] = math.nan
    elif not _number(fields["reward_sum"]):
        raise _Malformed(f"{where}'s reward_sum is {_shown(fields['reward_sum'])}, not a finite number")
    for name in ("waited", "busy", "active"):
        if not _number(fields[name]):
            raise _Malformed(f"{where}'s {name} is {_shown(fields[name])}, not a finite number")
    for name, each in (("latencies", _number), ("latency_items", _count), ("startup", _number)):
        values = fields[name]
        if not isinstance(values, list) or not all(each(value) for value in values):
            what = "finite numbers" if each is _number else "whole numbers >= 0"
            raise _Malformed(f"{where}'s {name} is not a list of {what}")
    _counts(f"{where}'s spent", fields["spent"])
    window = fields["window"]
    if window is not None and not (_count(window) and window >= 1):
        raise _Malformed(f"{where}'s window is {_shown(window)}, not null or a whole number >= 1")
    return VerifierReport(**fields)


def _same_keys(where: str, data: dict[str, Any], expected: frozenset[str], optional: frozenset[str]) -> None:
    missing, unknown = sorted(expected - optional - data.keys()), sorted(data.keys() - expected)
    if missing or unknown:
        said = [f"lacks {', '.join(missing)}"] if missing else []
        said += [f"has unknown {', '.join(map(repr, unknown))}"] if unknown else []
        raise _Malformed(f"{where} {' and '.join(said)}")


def _counts(where: str, value: Any) -> None:
    """Counts by name, whole numbers >= 0; but ``spend``, money at the judge's prices: a number >= 0."""
    if not isinstance(value, dict) or not all(
        _number(count) and count >= 0 if name == "spend" else _count(count) for name, count in value.items()
    ):
        raise _Malformed(f"{where} is not an object of whole numbers >= 0 (and a spend, a number >= 0)")


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _number(value: Any) -> bool:
    return type(value) is int or type(value) is float  # finite, both: an int however wide, a float read from JSON


def _shown(value: Any) -> str:
    """A value an answer held, for a message: a number as it is, anything else by its type (no quoting)."""
    if type(value) in (int, float):
        return repr(value)
    return "null" if value is None else a_or_an(type(value).__name__)


def error_status(exc: BaseException) -> int:
    """The HTTP status an error is answered with."""
    return _STATUS.get(_type_of(exc), 500)


def _type_of(exc: BaseException) -> str:
    if isinstance(exc, BudgetError):
        return "BudgetError"
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
    fields: dict[str, Any] = {"type": kind or _type_of(exc), "kind": None, "ref": None, "key": None,
                              "environment": None, "index": None, "item_id": None, "timed_out": False,
                              "cannot_load": False, "message": message or str(exc)}
    if isinstance(exc, VerificationError):
        fields.update(kind=exc.kind, ref=exc.ref, key=exc.key, environment=exc.environment, index=exc.index,
                      item_id=exc.item_id, timed_out=exc.timed_out, cannot_load=exc.cannot_load,
                      message=exc.reason)
    if isinstance(exc, BudgetError):
        fields.update(budget=exc.budget, measure=exc.measure, limit=exc.limit, spent=exc.spent)
    return {"error": fields}


def dump_error(exc: BaseException, *, kind: str | None = None, message: str | None = None) -> bytes:
    """:func:`encode_error` as JSON, every integer exact (an item's id may be wider than 64 bits)."""
    return json.dumps(encode_error(exc, kind=kind, message=message))


def decode_error(status: int, body: bytes, url: str) -> Exception:
    """The exception an error answer stands for: the one the service raised, or ``ServiceError``."""
    try:
        error = json.loads(body)["error"]
        if not isinstance(error, dict):
            raise TypeError("not an error")
        kind, message = error["type"], error["message"]
        if not isinstance(kind, str) or not isinstance(message, str):
            raise TypeError("not an error")
        if kind in ("VerificationError", "RubricError", "BudgetError"):
            ref = _text(error, "ref")
            if kind == "RubricError":
                return RubricError(ref, message, **_verification_fields(error))
            if kind == "BudgetError":
                return BudgetError(_text(error, "kind"), ref, message, **_budget_fields(error),
                                      **_verification_fields(error))
            verifier_kind = _text(error, "kind")  # read first: a body without one is not an error (its text quoted)
            return VerificationError(verifier_kind, ref, message, **_verification_fields(error))
    except (json.JSONDecodeError, KeyError, TypeError):
        shown = excerpt(body) or "(empty body)"
        return ServiceError(f"the scoring service at {url} answered HTTP {status}: {shown!r}", status=status)
    except _Malformed as exc:
        return ServiceError(f"the scoring service at {url} answered HTTP {status} with a {kind} whose {exc}",
                            status=status)
    if kind == "ValueError":
        return ValueError(message)
    if kind == "TypeError":
        return TypeError(message)
    return ServiceError(f"the scoring service at {url} answered HTTP {status}: {kind}: {message}", status=status)


# a verification error's fields besides its kind, ref and message, each with the types it must be of (bool is not
# int: an index of true is refused); those in _REQUIRED must be given: a default would be a guess (a timeout counted
# as none, a failure filed under another verifier's key), so an answer without one is refused
_REQUIRED = frozenset({"key", "timed_out", "cannot_load"})
_ERROR_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "key": ((str,), "a string"),
    "environment": ((str, type(None)), "a string or null"),
    "index": ((int, type(None)), "a whole number >= 0 or null"),
    "timed_out": ((bool,), "true or false"),
    "cannot_load": ((bool,), "true or false"),
}


def _verification_fields(error: dict[str, Any]) -> dict[str, Any]:
    """The fields of a verification error an answer gives besides its kind, ref and message, each checked
    (``_Malformed`` naming one of the wrong type: a peer's word is not taken for a field it cannot be)."""
    fields: dict[str, Any] = {"item_id": error.get("item_id")}  # any JSON value: the item's own id
    for name, (types, what) in _ERROR_FIELDS.items():
        if name not in error:
            if name in _REQUIRED:
                raise _Malformed(f"{name} is missing")
            continue
        value = error[name]
        if type(value) not in types or (name == "index" and value is not None and value < 0):
            raise _Malformed(f"{name} is {_shown(value)}, not {what}")
        fields[name] = value
    return fields


_MEASURES = frozenset({"tokens", "spend"})


def _budget_fields(error: dict[str, Any]) -> dict[str, Any]:
    """A budget error's own fields, each checked (``_Malformed`` naming one that is missing or of the wrong type)."""
    fields: dict[str, Any] = {}
    for name in ("budget", "measure", "limit", "spent"):
        if name not in error:
            raise _Malformed(f"{name} is missing")
        value = error[name]
        if name in ("budget", "measure"):
            what = '"tokens" or "spend"' if name == "measure" else "a string"
            if not isinstance(value, str) or (name == "measure" and value not in _MEASURES):
                raise _Malformed(f"{name} is {_shown(value)}, not {what}")
        elif not _number(value) or value < 0:
            raise _Malformed(f"{name} is {_shown(value)}, not a number >= 0")
        fields[name] = value
    return fields


def _text(error: dict[str, Any], name: str) -> str:
    """A field a verification error needs, a string (``KeyError`` or ``TypeError`` if it is not there as one)."""
    value = error[name]
    if not isinstance(value, str):
        raise TypeError(f"{name} is not a string")
    return value
