"""Stores for exact-response entries: one contract, two backends.

    ResponseStore.get(key, now) -> StoredResponse | None   (expired entries are never returned)
    ResponseStore.put(key, tenant, response, owner)        the owner (session, end user) is added
    ResponseStore.own(key, owner)                          a hit: the entry is the hitting owner's too
    ResponseStore.delete(key) -> bool ; purge_expired(now) -> int ; purge_tenant(tenant) -> int
    ResponseStore.purge(selector) -> Purged                a tenant, or its session / end user (semantic/owners.py)

MemoryStore lives and dies with the process; SqliteStore (the default) survives restarts: WAL mode,
one connection guarded by a lock, every write committed before put() returns.

At rest (SqliteStore, RedisStore) an entry's body is sealed by the store's `sealer` under its tenant's
key, bound to the entry's key (sealed_response / opened_response): only the key, tenant and expiry
are plain. A body that does not open (its tenant's key was shredded) reads as a miss.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from .owners import Owner, OwnerTable, Selector
from .sealing import NO_SEALING, Sealer, Unreadable
from .sealing import StoreUnavailable as StoreUnavailable  # the stores' one "cannot be used now" error


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


class SqliteStore:
    def __init__(self, path: Path, sealer: Sealer = NO_SEALING):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()
        self.sealer = sealer
        with self.lock:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS exact_entries (key TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
                "expires_at REAL, body BLOB NOT NULL)"  # sealed_response()
            )
            self.db.execute("CREATE INDEX IF NOT EXISTS exact_by_tenant ON exact_entries(tenant)")
            self.owners = OwnerTable(self.db, "exact_owners", "TEXT")

    def get(self, key: str, now: float) -> StoredResponse | None:
        with self.lock:
            row = self.db.execute(
                "SELECT tenant, body FROM exact_entries WHERE key = ? AND (expires_at IS NULL OR expires_at > ?)",
                (key, now),
            ).fetchone()
        return opened_response(self.sealer, row[0], key, row[1]) if row else None

    def put(self, key: str, tenant: str, response: StoredResponse, owner: Owner = Owner()) -> None:
        body = sealed_response(self.sealer, tenant, key, response)
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO exact_entries (key, tenant, expires_at, body) VALUES (?, ?, ?, ?)",
                (key, tenant, response.expires_at, body),
            )
            self.owners.add(key, owner)

    def own(self, key: str, owner: Owner) -> None:
        with self.lock:
            if self.db.execute("SELECT 1 FROM exact_entries WHERE key = ?", (key,)).fetchone():
                self.owners.add(key, owner)

    def delete(self, key: str) -> bool:
        with self.lock:
            self.owners.forget([key])
            return self.db.execute("DELETE FROM exact_entries WHERE key = ?", (key,)).rowcount > 0

    def purge_expired(self, now: float) -> int:
        with self.lock:
            removed = self.db.execute(
                "DELETE FROM exact_entries WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            ).rowcount
            self.owners.sweep("exact_entries", "key")
            return removed

    def purge_tenant(self, tenant: str) -> int:
        return self.purge(Selector(tenant)).num_entries

    def purge(self, selector: Selector) -> Purged:
        with self.lock:
            keys = self.owners.release(selector, "exact_entries", "key")
            size = sum(
                self.db.execute("SELECT LENGTH(body) FROM exact_entries WHERE key = ?", (key,)).fetchone()[0]
                for key in keys
            )
            self.db.executemany("DELETE FROM exact_entries WHERE key = ?", [(key,) for key in keys])
            return Purged(len(keys), size)

    def count(self) -> int:
        with self.lock:
            return self.db.execute("SELECT COUNT(*) FROM exact_entries").fetchone()[0]

    def purge_all(self) -> int:
        with self.lock:
            self.db.execute("DELETE FROM exact_owners")
            return self.db.execute("DELETE FROM exact_entries").rowcount

    def close(self) -> None:
        with self.lock:
            self.db.close()
