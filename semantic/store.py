"""Stores for exact-response entries: one contract, two backends.

    ResponseStore.get(key, now) -> StoredResponse | None   (expired entries are never returned)
    ResponseStore.put(key, tenant, response, owner)        the owner (session, end user) is added
    ResponseStore.own(key, owner)                          a hit: the entry is the hitting owner's too
    ResponseStore.delete(key) -> bool ; purge_expired(now) -> int ; purge_tenant(tenant) -> int
    ResponseStore.purge(selector) -> Purged                a tenant, or its session / end user (semantic/owners.py)

MemoryStore lives and dies with the process; SqliteStore (the default) survives restarts: WAL mode,
writes committed in groups (GroupCommit) before put() returns, reads on a connection of their own
(SqliteFile).

At rest (SqliteStore, RedisStore) an entry's body is sealed by the store's `sealer` under its tenant's
key, bound to the entry's key (sealed_response / opened_response): only the key, tenant and expiry
are plain. A body that does not open (its tenant's key was shredded) reads as a miss.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .owners import Owner, OwnerTable, Selector
from .sealing import NO_SEALING, Sealer, Unreadable
from .sealing import StoreUnavailable as StoreUnavailable  # the stores' one "cannot be used now" error

T = TypeVar("T")
BUSY_POLL_S = 0.002  # how often a write retries a file whose lock another connection holds
BUSY_WAIT_S = 5.0  # then its group fails (as SQLite's default busy timeout would)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the model said, as the response layers keep it and replay it."""

    text: str
    finish_reason: str = "stop"  # "stop" or "length": a replay ends the way the original did
    completion_tokens: int = 0
    prompt_tokens: int = 0  # replayed as usage, so a hit never runs the tokenizer
    token_ids: tuple[int, ...] = ()  # as the model generated it, when it did: kept as a draft (exact layer)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    created_at: float
    expires_at: float | None  # None: never expires


class ResponseStore(Protocol):
    def get(self, key: str, now: float) -> StoredResponse | None: ...
    def put(self, key: str, tenant: str, response: StoredResponse, owner: Owner = Owner()) -> None: ...
    def purge(self, selector: Selector) -> Purged: ...
    def own(self, key: str, owner: Owner) -> None: ...
    def delete(self, key: str) -> bool: ...
    def count(self) -> int: ...
    def purge_expired(self, now: float) -> int: ...
    def purge_tenant(self, tenant: str) -> int: ...
    def purge_all(self) -> int: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Purged:
    """What a purge removed (the cache protocol's result)."""

    num_entries: int = 0
    num_bytes: int = 0
    num_files: int = 0


def sealed_response(sealer: Sealer, tenant: str, key: str, response: StoredResponse) -> bytes:
    return sealer.seal(tenant, b"exact|" + key.encode(), json.dumps(asdict(response)).encode())


def opened_response(sealer: Sealer, tenant: str, key: str, sealed: bytes) -> StoredResponse | None:
    """The entry's body; None when it does not open (a shredded key: the entry is as good as gone)."""
    try:
        return StoredResponse(**json.loads(sealer.open(tenant, b"exact|" + key.encode(), sealed)))
    except Unreadable:
        return None


def _live(response: StoredResponse, now: float) -> bool:
    return response.expires_at is None or response.expires_at > now


class MemoryStore:
    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, StoredResponse]] = {}
        self.owners: dict[str, set[Owner]] = {}  # key -> its owners; invariant: same keys as entries
        self.lock = threading.Lock()

    def get(self, key: str, now: float) -> StoredResponse | None:
        with self.lock:
            found = self.entries.get(key)
        return found[1] if found and _live(found[1], now) else None

    def put(self, key: str, tenant: str, response: StoredResponse, owner: Owner = Owner()) -> None:
        with self.lock:
            self.entries[key] = (tenant, response)
            self.owners.setdefault(key, set()).add(owner)

    def own(self, key: str, owner: Owner) -> None:
        with self.lock:
            if key in self.owners:
                self.owners[key].add(owner)

    def delete(self, key: str) -> bool:
        with self.lock:
            self.owners.pop(key, None)
            return self.entries.pop(key, None) is not None

    def purge_expired(self, now: float) -> int:
        with self.lock:
            dead = [k for k, (_, r) in self.entries.items() if not _live(r, now)]
            return self._remove(dead).num_entries

    def purge_tenant(self, tenant: str) -> int:
        return self.purge(Selector(tenant)).num_entries

    def purge(self, selector: Selector) -> Purged:
        with self.lock:
            dead = []
            for key, (tenant, _) in self.entries.items():
                if tenant != selector.tenant:
                    continue
                owners = self.owners[key]
                owners.difference_update([o for o in owners if selector.matches(o)])
                if selector.whole_tenant or not owners:
                    dead.append(key)
            return self._remove(dead)

    def _remove(self, keys: list[str]) -> Purged:
        size = sum(len(json.dumps(asdict(self.entries[key][1]))) for key in keys)  # as SqliteStore keeps it
        for key in keys:
            del self.entries[key]
            del self.owners[key]
        return Purged(len(keys), size)

    def count(self) -> int:
        with self.lock:
            return len(self.entries)

    def purge_all(self) -> int:
        with self.lock:
            removed = len(self.entries)
            self.entries.clear()
            self.owners.clear()
        return removed

    def close(self) -> None:
        pass


class GroupCommit:
    """Writes to one SQLite connection from many threads, committed in groups. A writer queues its
    work; whichever writer holds the connection runs every queued work in one transaction. N writers
    that arrive while the file's write lock is held elsewhere (another process, a slow or busy disk)
    wait for it once, together, instead of N times in turn (and twice each when a write is two
    statements). A group fails together: each of its writers gets the error.

    The group waits for the file's lock itself, polling every BUSY_POLL_S: SQLite's own busy handler
    backs off to 100 ms between tries and misses a lock that is free for a few milliseconds between
    another writer's transactions (measured: 4 writers against a writer holding the lock 300 ms at a
    time, 5 ms apart, waited 1.8-2.1 s each; polling, about one hold)."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock):
        self.db = db  # autocommit (isolation_level=None): the transaction is opened here
        db.execute("PRAGMA busy_timeout = 0")  # _begin() waits instead
        self.lock = lock  # held by the one thread running a group on `db`
        self.queue_lock = threading.Lock()
        self.queued: list[_Work] = []  # works not yet taken into a group; guarded by queue_lock

    def run(self, work: Callable[[], T]) -> T:
        item = _Work(work)
        with self.queue_lock:
            self.queued.append(item)
        with self.lock:
            if not item.done:  # no earlier group took it
                with self.queue_lock:
                    group, self.queued = self.queued, []
                self._commit(group)
        if item.error is not None:
            raise item.error
        return item.result

    def _begin(self) -> None:
        """Take the file's write lock (WAL: COMMIT then needs no other), waiting up to BUSY_WAIT_S."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            try:
                self.db.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                    raise
            time.sleep(BUSY_POLL_S)

    def _commit(self, group: list[_Work]) -> None:
        try:
            self._begin()
            for item in group:
                item.result = item.work()
            self.db.execute("COMMIT")
        except Exception as exc:  # noqa: BLE001 - handed to every writer of the group
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            for item in group:
                item.error = exc
        for item in group:
            item.done = True


@dataclass(slots=True)
class _Work:
    work: Callable[[], Any]
    result: Any = None
    error: Exception | None = None
    done: bool = False  # set under GroupCommit.lock once its group committed or failed


class SqliteFile:
    """One SQLite file used from many threads. `db`, the writing connection (WAL), takes writes
    through GroupCommit (`write`); lookups go through a connection of their own (`read`), which in
    WAL mode never waits for a writer, so a lookup is not held up by a write waiting on the file's
    lock. An in-memory database (":memory:") has one connection for both."""

    def __init__(self, path: Path | str):
        in_memory = str(path) == ":memory:"
        if not in_memory:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()  # the writing connection `db`
        self.db.execute("PRAGMA journal_mode=WAL")  # before GroupCommit: it waits on SQLite's busy timeout
        self.writes = GroupCommit(self.db, self.lock)
        self.reader = (
            self.db if in_memory else sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        )
        self.read_lock = self.lock if in_memory else threading.Lock()  # the reading connection `reader`

    def read(self, sql: str, args: tuple | list = ()) -> list[tuple]:
        with self.read_lock:
            return self.reader.execute(sql, args).fetchall()

    def write(self, work: Callable[[], T]) -> T:
        return self.writes.run(work)

    def close(self) -> None:
        if self.reader is not self.db:
            with self.read_lock:
                self.reader.close()
        with self.lock:
            self.db.close()


class SqliteStore:
    def __init__(self, path: Path, sealer: Sealer = NO_SEALING):
        self.file = SqliteFile(path)
        self.sealer = sealer
        self.file.db.execute("PRAGMA synchronous=NORMAL")
        self.owners = self.file.write(self._create_tables)

    def _create_tables(self) -> OwnerTable:
        self.file.db.execute(
            "CREATE TABLE IF NOT EXISTS exact_entries (key TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
            "expires_at REAL, body BLOB NOT NULL)"  # sealed_response()
        )
        self.file.db.execute("CREATE INDEX IF NOT EXISTS exact_by_tenant ON exact_entries(tenant)")
        return OwnerTable(self.file.db, "exact_owners", "TEXT")

    def get(self, key: str, now: float) -> StoredResponse | None:
        rows = self.file.read(
            "SELECT tenant, body FROM exact_entries WHERE key = ? AND (expires_at IS NULL OR expires_at > ?)",
            (key, now),
        )
        return opened_response(self.sealer, rows[0][0], key, rows[0][1]) if rows else None

    def put(self, key: str, tenant: str, response: StoredResponse, owner: Owner = Owner()) -> None:
        body = sealed_response(self.sealer, tenant, key, response)

        def write() -> None:
            self.file.db.execute(
                "INSERT OR REPLACE INTO exact_entries (key, tenant, expires_at, body) VALUES (?, ?, ?, ?)",
                (key, tenant, response.expires_at, body),
            )
            self.owners.add(key, owner)

        self.file.write(write)

    def own(self, key: str, owner: Owner) -> None:
        def write() -> None:
            if self.file.db.execute("SELECT 1 FROM exact_entries WHERE key = ?", (key,)).fetchone():
                self.owners.add(key, owner)

        self.file.write(write)

    def delete(self, key: str) -> bool:
        def write() -> bool:
            self.owners.forget([key])
            return self.file.db.execute("DELETE FROM exact_entries WHERE key = ?", (key,)).rowcount > 0

        return self.file.write(write)

    def purge_expired(self, now: float) -> int:
        def write() -> int:
            removed = self.file.db.execute(
                "DELETE FROM exact_entries WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            ).rowcount
            self.owners.sweep("exact_entries", "key")
            return removed

        return self.file.write(write)

    def purge_tenant(self, tenant: str) -> int:
        return self.purge(Selector(tenant)).num_entries

    def purge(self, selector: Selector) -> Purged:
        def write() -> Purged:
            keys = self.owners.release(selector, "exact_entries", "key")
            size = sum(
                self.file.db.execute("SELECT LENGTH(body) FROM exact_entries WHERE key = ?", (key,)).fetchone()[0]
                for key in keys
            )
            self.file.db.executemany("DELETE FROM exact_entries WHERE key = ?", [(key,) for key in keys])
            return Purged(len(keys), size)

        return self.file.write(write)

    def count(self) -> int:
        ((count,),) = self.file.read("SELECT COUNT(*) FROM exact_entries")
        return count

    def purge_all(self) -> int:
        def write() -> int:
            self.file.db.execute("DELETE FROM exact_owners")
            return self.file.db.execute("DELETE FROM exact_entries").rowcount

        return self.file.write(write)

    def close(self) -> None:
        self.file.close()
