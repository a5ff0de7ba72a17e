"""The verdict store: one SQLite file (WAL) of the judge's successful verdicts, shared by every process on a machine.

A verdict is keyed by a digest of everything that decides it (``engine._verifiers.rubric.verdicts``); only
successes are stored. Reads and writes run on one kept thread of the store's (``engine._core.threads``), in the
order they are given, so a batch's reads see the writes of the batches before it. Why and how: docs/design.md,
"The verdict cache".
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine._config import CacheConfig
from engine._core.threads import KeptThread, wait_future
from engine._errors import CacheError

__all__ = ["SCHEMA_VERSION", "CacheStats", "Database", "Verdict", "VerdictStore"]

logger = logging.getLogger("engine")

SCHEMA_VERSION = 1
LOOKUP_CHUNK = 500  # keys one SELECT asks for (SQLite's older builds allow 999 variables a statement)
_META = "engine_cache"  # the table that says a file is the engine's cache, and of which schema
_COLUMNS = ["key", "verifier", "reward", "created", "used", "hits"]
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {_META} (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS verdicts (
    key BLOB PRIMARY KEY, verifier TEXT NOT NULL, reward REAL NOT NULL,
    created REAL NOT NULL, used REAL NOT NULL, hits INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS verdicts_verifier ON verdicts(verifier);
CREATE INDEX IF NOT EXISTS verdicts_used ON verdicts(used);
"""
# what a lock held by another process past the busy timeout is: a skipped write, never a failed batch
_BUSY = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})

Verdict = tuple[float, float]  # (reward, unix time of the judge call that gave it)


@dataclass
class CacheStats:
    """What ``engine cache stats`` shows: entries, bytes on disk (with the WAL), and per verifier key its
    entries and the hits served from them."""

    path: Path
    entries: int = 0
    bytes: int = 0
    verifiers: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (entries, hits)


class Database:
    """The cache file, opened and checked: synchronous, used from one thread at a time (the store's, or a CLI's)."""

    def __init__(self, path: Path, *, busy_timeout: float) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.connection = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None,
                                              check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise CacheError(path, f"cannot open it: {exc}") from exc
        try:
            self._check()
        except BaseException:
            self.connection.close()
            raise

    def _check(self) -> None:
        """A new (empty) file gets the schema; one that is not SQLite, or holds other tables, is a ``CacheError``."""
        db, path = self.connection, self.path
        try:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            # another program's database is refused before anything is written: even WAL mode changes its file
            if tables and (_META not in tables or "verdicts" not in tables):
                shown = ", ".join(sorted(tables))
                raise CacheError(path, f"it is an SQLite database of another program (its tables: {shown})")
            db.execute("PRAGMA journal_mode=WAL")
            if not tables:
                db.execute("BEGIN IMMEDIATE")  # another process may be creating it too: one does, under the lock
                try:
                    for statement in filter(str.strip, _SCHEMA.split(";")):
                        db.execute(statement)
                    db.execute(f"INSERT OR IGNORE INTO {_META} VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if _META not in tables or "verdicts" not in tables:
                shown = ", ".join(sorted(tables))
                raise CacheError(path, f"it is an SQLite database of another program (its tables: {shown})")
            row = db.execute(f"SELECT value FROM {_META} WHERE name = 'schema'").fetchone()
            columns = [info[1] for info in db.execute("PRAGMA table_info(verdicts)")]
        except sqlite3.DatabaseError as exc:
            raise CacheError(path, f"it is not an SQLite database, or a damaged one ({exc})") from exc
        if row is None or row[0] != str(SCHEMA_VERSION) or columns != _COLUMNS:
            found = "no schema version" if row is None else f"schema version {row[0]}"
            raise CacheError(path, f"it has {found}, and this engine reads version {SCHEMA_VERSION}", ours=True)

    def lookup(self, keys: Sequence[bytes]) -> dict[bytes, Verdict]:
        """The verdicts of those ``keys`` that are stored: one indexed SELECT per ``LOOKUP_CHUNK`` keys."""
        found: dict[bytes, Verdict] = {}
        db = self.connection
        for start in range(0, len(keys), LOOKUP_CHUNK):
            part = keys[start : start + LOOKUP_CHUNK]
            marks = ",".join("?" * len(part))
            for key, reward, created in db.execute(
                f"SELECT key, reward, created FROM verdicts WHERE key IN ({marks})", part
            ):
                found[key] = (reward, created)
        return found

    def write(self, verifier: str, scored: Sequence[tuple[bytes, float, float]], hits: Sequence[bytes],
              now: float, max_entries: int) -> None:
        """Store ``scored`` (key, reward, call time) for ``verifier``, mark ``hits`` used at ``now``, and evict the
        least recently used past ``max_entries``: one transaction. A verdict stored already keeps its first time."""
        db = self.connection
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT INTO verdicts (key, verifier, reward, created, used) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET used = excluded.used",
                [(key, verifier, reward, created, now) for key, reward, created in scored],
            )
            if hits:  # one entry per item served: a key served twice is counted twice
                db.executemany("UPDATE verdicts SET used = ?, hits = hits + ? WHERE key = ?",
                               [(now, count, key) for key, count in Counter(hits).items()])
            if scored:
                (count,) = db.execute("SELECT count(*) FROM verdicts").fetchone()
                if count > max_entries:
                    db.execute("DELETE FROM verdicts WHERE key IN (SELECT key FROM verdicts ORDER BY used LIMIT ?)",
                               (count - max_entries,))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def stats(self) -> CacheStats:
        db = self.connection
        stats = CacheStats(self.path)
        for verifier, entries, hits in db.execute(
            "SELECT verifier, count(*), sum(hits) FROM verdicts GROUP BY verifier ORDER BY verifier"
        ):
            stats.verifiers[verifier] = (entries, hits or 0)
            stats.entries += entries
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                stats.bytes += Path(f"{self.path}{suffix}").stat().st_size
        return stats

    def clear(self, verifier: str | None = None) -> int:
        """Delete every verdict, or those of ``verifier``; how many went."""
        db = self.connection
        if verifier is None:
            deleted = db.execute("DELETE FROM verdicts").rowcount
        else:
            deleted = db.execute("DELETE FROM verdicts WHERE verifier = ?", (verifier,)).rowcount
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return int(deleted)

    def close(self) -> None:
        self.connection.close()


def remove(path: Path) -> None:
    """Delete a cache file that is not one (with its WAL and shared-memory files): what ``engine cache clear`` does
    to a file the engine cannot open, so that the next open makes a new one."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


class VerdictStore:
    """The open cache of an engine: its database on one kept thread; lookups awaited, writes put behind them.

    A write that stays locked past the busy timeout is skipped with a warning (a lost write costs a judge
    call later, never a wrong reward); a lookup that fails is a miss, with a warning.
    """

    def __init__(self, database: Database, config: CacheConfig) -> None:
        self.path = config.path
        self._database = database
        self._max_entries = config.max_entries
        self._thread = KeptThread("engine-cache")

    @classmethod
    async def open(cls, config: CacheConfig) -> VerdictStore:
        """The cache of ``config``, opened (made if new) in a thread; ``CacheError`` if the file is not a cache."""
        thread = KeptThread("engine-cache-open")
        try:
            database = await wait_future(thread.submit(lambda: Database(config.path, busy_timeout=config.busy_timeout)))
        finally:
            thread.close()
        return cls(database, config)

    async def lookup(self, keys: Sequence[bytes]) -> dict[bytes, Verdict]:
        """The stored verdicts of ``keys``; none, with a warning, if the read fails."""
        if not keys:
            return {}
        return await wait_future(self._thread.submit(lambda: self._lookup(keys)))

    def _lookup(self, keys: Sequence[bytes]) -> dict[bytes, Verdict]:
        try:
            return self._database.lookup(keys)
        except sqlite3.Error as exc:
            logger.warning("verdict cache %s: a read failed, its %d items are judged (%s)", self.path, len(keys), exc)
            return {}

    def write(self, verifier: str, scored: Sequence[tuple[bytes, float, float]], hits: Sequence[bytes],
              now: float) -> None:
        """Store a batch's new verdicts of ``verifier`` and mark its hits, behind what came before; not waited for."""
        if scored or hits:
            self._thread.submit(lambda: self._write(verifier, scored, hits, now))

    def _write(self, verifier: str, scored: Sequence[tuple[bytes, float, float]], hits: Sequence[bytes],
               now: float) -> None:
        try:
            self._database.write(verifier, scored, hits, now, self._max_entries)
        except sqlite3.Error as exc:
            locked = isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode in _BUSY
            self._skipped(verifier, scored, exc, locked)

    def _skipped(self, verifier: str, scored: Sequence[Any], exc: sqlite3.Error, locked: bool = False) -> None:
        why = "the file stayed locked by another process past [cache] busy_timeout" if locked else str(exc)
        logger.warning("verdict cache %s: %d verdicts of %s not stored: %s (they will be judged again)",
                       self.path, len(scored), verifier, why)

    async def aclose(self) -> None:
        """Wait for the writes given, then close the database."""
        await wait_future(self._thread.submit(self._database.close))
        self._thread.close()
