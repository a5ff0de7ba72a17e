"""Counting repeated ids: ``OUT.ids`` holds a 16-byte hash of each record's ``id``, counted once the run is complete.

Derived data, rebuilt on resume; counted in buckets, in bounded memory: docs/design.md, Crash-safe finish.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

import orjson

from engine._backfill.files import sibling

__all__ = ["ID_HASH_BYTES", "count_repeated", "id_hash", "ids_path"]

ID_HASH_BYTES = 16  # blake2b-128 of an id's JSON (sorted keys): two ids share one with probability ~n^2 / 2^129
ID_BUCKET_ROWS = 1 << 14  # hashes sorted at a time when counting repeated ids (~1 MiB as Python bytes)
ID_MAX_BUCKET_BITS = 8  # at most 256 buckets: past 256 * 16,384 rows (4.2M) a bucket grows with the file
ID_SPREAD_ROWS = 1 << 16  # hashes read at a time while spreading them over the buckets (1 MiB)


def ids_path(output: Path) -> Path:
    """Where the hashes of the ids of ``output``'s records are kept until the run finishes."""
    return sibling(output, ".ids")


def id_hash(row_id: Any) -> bytes | None:
    """The hash an id is counted by; None for an id written as null (None, and NaN or infinity, as orjson writes them).

    Keys are sorted: ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` are one id, as they are one JSON object.
    """
    encoded = orjson.dumps(row_id, option=orjson.OPT_SORT_KEYS)
    if encoded == b"null":
        return None
    return hashlib.blake2b(encoded, digest_size=ID_HASH_BYTES).digest()


def count_repeated(ids: Path) -> tuple[int, int]:
    """``(records whose id an earlier one had, distinct ids occurring more than once)`` in ids file ``ids``.

    Memory stays bounded: the hashes are spread by their first byte over up to
    ``2 ** ID_MAX_BUCKET_BITS`` temporary files of ~:data:`ID_BUCKET_ROWS` hashes each (equal hashes
    share a bucket; a file is opened only to append a block's worth, so few descriptors are used),
    and each bucket is sorted on its own. Exact unless two different ids share a 128-bit hash.
    """
    try:
        total = ids.stat().st_size // ID_HASH_BYTES
    except FileNotFoundError:
        return 0, 0
    bits = 0
    while bits < ID_MAX_BUCKET_BITS and total > ID_BUCKET_ROWS << bits:
        bits += 1
    repeated = distinct = 0
    with tempfile.TemporaryDirectory(prefix="engine-ids-") as scratch:  # not beside the output: kill -9 leaves it
        parts = [ids] if bits == 0 else [Path(scratch) / str(n) for n in range(1 << bits)]
        if bits:
            pending = [bytearray() for _ in parts]
            with ids.open("rb") as source:
                while block := source.read(ID_HASH_BYTES * ID_SPREAD_ROWS):
                    shift = 8 - bits
                    for start in range(0, len(block), ID_HASH_BYTES):
                        pending[block[start] >> shift] += block[start : start + ID_HASH_BYTES]
                    for part, hashes in zip(parts, pending, strict=True):
                        if hashes:
                            with part.open("ab") as f:
                                f.write(hashes)
                            hashes.clear()
        for part in parts:
            data = part.read_bytes()
            previous, run = b"", 0
            for value in sorted(data[i : i + ID_HASH_BYTES] for i in range(0, len(data), ID_HASH_BYTES)):
                if value == previous:
                    repeated += 1
                    run += 1
                    distinct += run == 1
                else:
                    previous, run = value, 0
    return repeated, distinct
