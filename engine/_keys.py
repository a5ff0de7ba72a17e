"""What a key or a name that matches nothing is told: the one wording, with the closest known one named.

Every table that refuses unknown keys (the config's, a manifest's, its verifier object) and every name that must
match something that exists (a ``[pins]`` environment, a ``[refs]`` key) says it here, so a typo reads alike anywhere.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["TYPO", "closest", "first_unknown", "unknown_key"]

TYPO = 0.6  # difflib's similarity from which a key is taken for a typo of a known one (its own default)


def closest(word: str, choices: Iterable[str], *, cutoff: float = TYPO) -> str | None:
    """The choice most like ``word``, if one is at least ``cutoff`` alike (0: whichever is closest); else None."""
    matches = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def first_unknown(given: Iterable[str], known: Iterable[str]) -> str | None:
    """The first of ``given`` (in its order: a file's) that is not in ``known``, or None."""
    allowed = set(known)
    return next((key for key in given if key not in allowed), None)


def unknown_key(key: str, known: Iterable[str]) -> str:
    """What is wrong with ``key``, which its table does not take: the known key it may be a typo of, and all of them."""
    keys = sorted(known)
    near = closest(key, keys)
    guess = f", did you mean {near!r}?" if near is not None else ""
    return f"unknown key{guess} (known: {', '.join(keys)})"
