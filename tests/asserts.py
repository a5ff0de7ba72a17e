"""What every test of a failed item asserts about its error, in one place.

A failure is one ``VerificationError`` (never a subclass, never a zero) naming the verifier, the
environment and the item, whose message says all of it. A test file binds its own verifier with
``functools.partial`` (``check = partial(check_error, kind="endpoint", environment="remote")``).
"""

from __future__ import annotations

import re
from typing import Any

from engine import VerificationError

__all__ = ["check_error"]


def check_error(
    err: BaseException,
    ref: str,
    reason: str | None = None,
    *,
    kind: str,
    environment: str,
    index: int,
    item_id: Any,
    match: str | None = None,
) -> None:
    """``err`` names the verifier ``kind`` ``ref``, ``environment`` and the item (``index``, ``item_id``).

    Its reason holds ``reason``, or matches the regular expression ``match`` whole (one of the two).
    """
    assert (reason is None) != (match is None), "check_error takes a reason or a match, not both"
    assert type(err) is VerificationError, repr(err)
    assert (err.kind, err.ref, err.environment, err.index, err.item_id) == (kind, ref, environment, index, item_id)
    if match is not None:
        assert re.fullmatch(match, err.reason), err.reason
    else:
        assert reason is not None and reason in err.reason, err.reason
    where = f"failed on item {index}" + (f" (id {item_id!r})" if item_id is not None else "")
    assert str(err) == f"{kind} verifier {ref!r} (environment {environment!r}) {where}: {err.reason}", str(err)
