"""Conversation entries in a SQLite file that the router's worker processes on one host
share: what `--workers N` uses when no Redis is given, so every core serves turns with
reuse and nothing has to be installed (SQLite is in Python's standard library).

The contract is `RedisState`'s (state.py): an entry is written after a successful turn,
replaced atomically so that the replacer alone gets the old entry back (and releases its
lease), and is gone at D's lease expiry. SQLite serialises writers with a file lock; each
call is one short transaction, run inline on the event loop (on tmpfs, CPU machine: a
256-token conversation's entry takes 27 us to store and 7 us to read, a 24k-token one's
150 and 70 us; the sweep's count of 100k entries 0.02-0.09 ms, 1.8 ms cold). A call that
would wait longer than `timeout_s` for the lock fails: "no entry" (the turn recomputes),
counted in ``kvferry_router_state_errors`` as a Redis failure is.

Bounded like the in-memory registry: checked at most once a second, the entries beyond
`max_entries` nearest their expiry are let go and returned to the caller, which releases
their leases on D; expired entries are deleted then too (D ended their leases already).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar

from ..metrics import RouterMetrics
from .entry_codec import decode_entry, encode_entry
from .registry import ConversationEntry
from .store_log import ThrottledLog

log = logging.getLogger(__name__)

URL_PREFIX = "sqlite://"
"""``sqlite:///dev/shm/kvferry/state.db``: the path follows the two slashes."""

SWEEP_EVERY_S = 1.0
SETUP_TIMEOUT_S = 10.0
"""Creating the table may wait for the other workers doing the same at start-up."""

T = TypeVar("T")


def path_of(url: str) -> str:
    """The file of a ``sqlite://`` state URL (an absolute path)."""
    path = url.removeprefix(URL_PREFIX)
    if not url.startswith(URL_PREFIX) or not path.startswith("/"):
        raise ValueError(f"a SQLite state URL is sqlite:///absolute/path, got {url!r}")
    return path


def connect(path: str, timeout_s: float) -> sqlite3.Connection:
    """Open the database, making it (WAL, the table) if it is new."""
    # isolation_level=None: no implicit transactions; each call opens its own.
    # check_same_thread=False: the app may be made in another thread than its loop runs in;
    # only that loop uses the connection.
    db = sqlite3.connect(path, timeout=SETUP_TIMEOUT_S, isolation_level=None,
                         check_same_thread=False)
    # WAL: readers never wait for the writer. synchronous=OFF: a cache of leases that
    # expire anyway; a host crash loses entries (recompute), never corrupts an answer.
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("CREATE TABLE IF NOT EXISTS conversations (tenant TEXT NOT NULL, "
               "cid TEXT NOT NULL, expiry REAL NOT NULL, entry BLOB NOT NULL, "
               "PRIMARY KEY (tenant, cid))")
    db.execute("CREATE INDEX IF NOT EXISTS by_expiry ON conversations (expiry)")
    db.execute(f"PRAGMA busy_timeout={max(1, int(timeout_s * 1000))}")
    return db


class SqliteState:
    """Entries in one SQLite file, shared by the router processes of one host."""

    def __init__(self, path: str, metrics: RouterMetrics, timeout_s: float = 0.1,
                 max_entries: int = 100_000) -> None:
        self.metrics = metrics
        self.max_entries = max_entries
        self.db = connect(path, timeout_s)
        self._next_sweep = 0.0
        self._log = ThrottledLog(log)

    def _call(self, op: str, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """(ok, result) of one transaction; a failure is counted and means "no entry"."""
        try:
            return True, fn()  # a write rolls back on its own (`with self.db`)
        except sqlite3.Error as exc:
            locked = isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)
            kind = "timeout" if locked else type(exc).__name__
            self.metrics.state_errors.labels(op=op, kind=kind).inc()
            self._log.warning(f"sqlite state {op} failed ({kind}: {exc}); this turn goes "
                              "without shared conversation state")
            return False, None

    async def get(self, tenant: str, conversation_id: str, now: float) -> ConversationEntry | None:
        _, row = self._call("get", lambda: self.db.execute(
            "SELECT entry FROM conversations WHERE tenant=? AND cid=? AND expiry>?",
            (tenant, conversation_id, now)).fetchone())
        return decode_entry(row[0]) if row else None

    async def replace(self, tenant: str, conversation_id: str, entry: ConversationEntry
                      ) -> list[ConversationEntry] | None:
        now = time.time()
        if entry.expiry <= now:
            old = await self.drop(tenant, conversation_id)
            return [e for e in (old, entry) if e is not None]

        def swap() -> list[ConversationEntry]:
            with self.db:  # BEGIN (deferred) .. COMMIT, or ROLLBACK on an error
                self.db.execute("BEGIN IMMEDIATE")
                row = self.db.execute(
                    "SELECT entry FROM conversations WHERE tenant=? AND cid=?",
                    (tenant, conversation_id)).fetchone()
                self.db.execute("INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?)",
                                (tenant, conversation_id, entry.expiry, encode_entry(entry)))
                let_go = self._sweep(now)
            old = decode_entry(row[0]) if row else None
            if old is not None and old.lease_id != entry.lease_id:
                let_go.append(old)
            return let_go

        ok, released = self._call("replace", swap)
        return released if ok else None

    def _sweep(self, now: float) -> list[ConversationEntry]:
        """Inside a write: at most once a second, delete expired entries and let go of the
        ones above the bound (returned: their leases are still held on D)."""
        if now < self._next_sweep:
            return []
        self._next_sweep = now + SWEEP_EVERY_S
        self.db.execute("DELETE FROM conversations WHERE expiry<=?", (now,))
        (n,) = self.db.execute("SELECT count(*) FROM conversations").fetchone()
        if n <= self.max_entries:
            return []
        rows = self.db.execute(
            "DELETE FROM conversations WHERE rowid IN (SELECT rowid FROM conversations "
            "ORDER BY expiry LIMIT ?) RETURNING entry", (n - self.max_entries,)).fetchall()
        return [e for (raw,) in rows if (e := decode_entry(raw)) is not None]

    async def drop(self, tenant: str, conversation_id: str) -> ConversationEntry | None:
        def delete() -> ConversationEntry | None:
            with self.db:
                rows = self.db.execute(  # fetchall: the statement ends, and so its write
                    "DELETE FROM conversations WHERE tenant=? AND cid=? RETURNING entry",
                    (tenant, conversation_id)).fetchall()
            return decode_entry(rows[0][0]) if rows else None

        _, entry = self._call("drop", delete)
        return entry

    async def size(self) -> int | None:
        ok, row = self._call("size", lambda: self.db.execute(
            "SELECT count(*) FROM conversations WHERE expiry>?", (time.time(),)).fetchone())
        return int(row[0]) if ok and row else None

    async def close(self) -> None:
        self.db.close()
