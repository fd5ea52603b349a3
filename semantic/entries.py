"""Stores for semantic entries: one contract, two backends (SQLite here, Redis in redis_entries.py).

    EntryStore.put(partition, scope, prompt, answer, now, expires_at, vector) -> (id, created)
        a newer answer to the same question in the same partition replaces the older one (fresh
        review status and hit count) and keeps its id, vector and owners; `created` says which
    fetch(ids) -> [(SemanticEntry, float32 vector)]   the entries still present, in any order
    find(partition, prompt) -> id | None ; get(id) ; list_entries(tenant, status, limit)
    set_status(id, status) -> bool ; delete(id) -> bool ; count_hit(id)
    own(id, owner)                         the owner joins the entry's owners (if it still exists)
    release(selector) -> (ids, bytes)      take the selector's owners off; the ids left with none,
                                           which the caller deletes (semantic/owners.py)
    expired_ids(now) ; all_ids() ; vectors() -> [(id, partition, vector)] ; stats() ; close()

The cache keeps the faiss partitions; a store only keeps entries. SqliteEntries lives beside the
exact cache (":memory:" gives the in-memory store the tests and benchmarks use); every write is
committed before the call returns.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .owners import Owner, OwnerTable, Selector
from .scope import Scope
from .store import Answer

STATUSES = ("unreviewed", "approved", "rejected")
MAX_ENTRY_ID = 2**63 - 1  # SQLite INTEGER and Redis counters; a larger id names no entry (and must not raise)


@dataclass(frozen=True, slots=True)
class SemanticEntry:
    id: int
    tenant: str
    scope: dict
    prompt: str
    answer: str
    created_at: float
    expires_at: float | None
    hit_count: int
    status: str
    finish_reason: str = "stop"  # replayed as the original ended: "stop" or "length"
    completion_tokens: int = 0
    prompt_tokens: int = 0  # of the stored question: a hit reports it without tokenising
    partition: str = ""  # its scope and context (Scope.partition): a lookup serves only its own


def _inserted_id(cursor: sqlite3.Cursor) -> int:
    assert cursor.lastrowid is not None, "an INSERT sets lastrowid"
    return cursor.lastrowid


def valid_id(entry_id: int) -> bool:
    return 0 < entry_id <= MAX_ENTRY_ID


class EntryStore(Protocol):
    def put(
        self,
        partition: str,
        scope: Scope,
        prompt: str,
        answer: Answer,
        now: float,
        expires_at: float | None,
        vector: np.ndarray,
    ) -> tuple[int, bool]: ...
    def put_many(
        self,
        partition: str,
        scope: Scope,
        prompts: list[str],
        answers: list[str],
        vectors: np.ndarray,
        now: float,
        expires_at: float | None,
    ) -> list[int]: ...
    def fetch(self, ids: list[int]) -> list[tuple[SemanticEntry, np.ndarray]]: ...
    def find(self, partition: str, prompt: str) -> int | None: ...
    def get(self, entry_id: int) -> SemanticEntry | None: ...
    def list_entries(self, tenant: str | None, status: str | None, limit: int) -> list[SemanticEntry]: ...
    def set_status(self, entry_id: int, status: str) -> bool: ...
    def delete(self, entry_id: int) -> bool: ...
    def count_hit(self, entry_id: int) -> None: ...
    def own(self, entry_id: int, owner: Owner) -> None: ...
    def release(self, selector: Selector) -> tuple[list[int], int]: ...
    def expired_ids(self, now: float) -> list[int]: ...
    def all_ids(self) -> list[int]: ...
    def vectors(self) -> list[tuple[int, str, np.ndarray]]: ...
    def stats(self) -> tuple[dict[str, int], int]: ...
    def close(self) -> None: ...


@runtime_checkable
class SharedEntryStore(EntryStore, Protocol):
    """A store shared by replicas: it also reports every replica's inserts and deletes, from a
    position on: ([("add", id, partition, vector) | ("remove", id)], the next position)."""

    def changes(self, position: str, wait_s: float) -> tuple[list[tuple], str]: ...


class SqliteEntries:
    def __init__(self, path: Path | str):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()  # guards self.db
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        with self.lock:
            self._create_tables()

    def put(
        self,
        partition: str,
        scope: Scope,
        prompt: str,
        answer: Answer,
        now: float,
        expires_at: float | None,
        vector: np.ndarray,
    ) -> tuple[int, bool]:
        with self.lock:
            row = self.db.execute(
                "SELECT id FROM semantic_entries WHERE partition = ? AND prompt = ?", (partition, prompt)
            ).fetchone()
            if row is not None:
                self.db.execute(
                    "UPDATE semantic_entries SET answer = ?, finish_reason = ?, completion_tokens = ?, "
                    "prompt_tokens = ?, created_at = ?, expires_at = ?, hit_count = 0, status = 'unreviewed' "
                    "WHERE id = ?",
                    (
                        answer.text,
                        answer.finish_reason,
                        answer.completion_tokens,
                        answer.prompt_tokens,
                        now,
                        expires_at,
                        row[0],
                    ),
                )
                return int(row[0]), False
            cursor = self.db.execute(
                "INSERT INTO semantic_entries (partition, tenant, scope, prompt, answer, finish_reason, "
                "completion_tokens, prompt_tokens, created_at, expires_at, hit_count, status, vector) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 'unreviewed', ?)",
                (
                    partition,
                    scope.tenant,
                    json.dumps(scope.as_dict()),
                    prompt,
                    answer.text,
                    answer.finish_reason,
                    answer.completion_tokens,
                    answer.prompt_tokens,
                    now,
                    expires_at,
                    _vector_bytes(vector),
                ),
            )
            return _inserted_id(cursor), True

    def put_many(
        self,
        partition: str,
        scope: Scope,
        prompts: list[str],
        answers: list[str],
        vectors: np.ndarray,
        now: float,
        expires_at: float | None,
    ) -> list[int]:
        """Bulk load (an FAQ import, a benchmark) without de-duplication, in one transaction."""
        rows = [
            (partition, scope.tenant, json.dumps(scope.as_dict()), p, a, now, expires_at, _vector_bytes(v))
            for p, a, v in zip(prompts, answers, vectors)
        ]
        with self.lock:
            self.db.execute("BEGIN")
            ids = [
                _inserted_id(
                    self.db.execute(
                        "INSERT INTO semantic_entries (partition, tenant, scope, prompt, answer, "
                        "created_at, expires_at, hit_count, status, vector) VALUES (?, ?, ?, ?, ?, ?, "
                        "?, 0, 'unreviewed', ?)",
                        row,
                    )
                )
                for row in rows
            ]
            self.db.execute("COMMIT")
        return ids

    def fetch(self, ids: list[int]) -> list[tuple[SemanticEntry, np.ndarray]]:
        ids = [i for i in ids if valid_id(i)]
        if not ids:
            return []
        with self.lock:
            rows = self.db.execute(
                f"SELECT {_COLUMNS}, vector FROM semantic_entries WHERE id IN ({','.join('?' * len(ids))})", ids
            ).fetchall()
        return [(_entry(row[:-1]), np.frombuffer(row[-1], dtype=np.float32)) for row in rows]

    def find(self, partition: str, prompt: str) -> int | None:
        with self.lock:
            row = self.db.execute(
                "SELECT id FROM semantic_entries WHERE partition = ? AND prompt = ?", (partition, prompt)
            ).fetchone()
        return int(row[0]) if row else None

    def get(self, entry_id: int) -> SemanticEntry | None:
        found = self.fetch([entry_id])
        return found[0][0] if found else None

    def list_entries(
        self, tenant: str | None = None, status: str | None = None, limit: int = 100
    ) -> list[SemanticEntry]:
        query, args = f"SELECT {_COLUMNS} FROM semantic_entries WHERE 1=1", list[object]()
        if tenant is not None:
            query, args = query + " AND tenant = ?", args + [tenant]
        if status is not None:
            query, args = query + " AND status = ?", args + [status]
        with self.lock:
            rows = self.db.execute(query + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
        return [_entry(row) for row in rows]

    def set_status(self, entry_id: int, status: str) -> bool:
        assert status in STATUSES, status
        if not valid_id(entry_id):
            return False
        with self.lock:
            return (
                self.db.execute("UPDATE semantic_entries SET status = ? WHERE id = ?", (status, entry_id)).rowcount > 0
            )

    def delete(self, entry_id: int) -> bool:
        if not valid_id(entry_id):
            return False
        with self.lock:
            self.owners.forget([entry_id])
            return self.db.execute("DELETE FROM semantic_entries WHERE id = ?", (entry_id,)).rowcount > 0

    def count_hit(self, entry_id: int) -> None:
        with self.lock:
            self.db.execute("UPDATE semantic_entries SET hit_count = hit_count + 1 WHERE id = ?", (entry_id,))

    def own(self, entry_id: int, owner: Owner) -> None:
        with self.lock:
            if self.db.execute("SELECT 1 FROM semantic_entries WHERE id = ?", (entry_id,)).fetchone():
                self.owners.add(entry_id, owner)

    def release(self, selector: Selector) -> tuple[list[int], int]:
        with self.lock:
            ids = self.owners.release(selector, "semantic_entries", "id")
            size = sum(
                self.db.execute(
                    "SELECT LENGTH(prompt) + LENGTH(answer) + LENGTH(vector) FROM semantic_entries WHERE id = ?",
                    (entry_id,),
                ).fetchone()[0]
                for entry_id in ids
            )
        return ids, size

    def expired_ids(self, now: float) -> list[int]:
        with self.lock:
            return [
                r[0]
                for r in self.db.execute(
                    "SELECT id FROM semantic_entries WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
                )
            ]

    def all_ids(self) -> list[int]:
        with self.lock:
            return [row[0] for row in self.db.execute("SELECT id FROM semantic_entries")]

    def vectors(self) -> list[tuple[int, str, np.ndarray]]:
        with self.lock:
            rows = self.db.execute("SELECT id, partition, vector FROM semantic_entries").fetchall()
        return [(entry_id, partition, np.frombuffer(vector, dtype=np.float32)) for entry_id, partition, vector in rows]

    def stats(self) -> tuple[dict[str, int], int]:
        """(entries by status, number of partitions)."""
        with self.lock:
            by_status = dict(
                self.db.execute("SELECT status, COUNT(*) FROM semantic_entries GROUP BY status").fetchall()
            )
            num_partitions = self.db.execute("SELECT COUNT(DISTINCT partition) FROM semantic_entries").fetchone()[0]
        return {s: by_status.get(s, 0) for s in STATUSES}, num_partitions

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def _create_tables(self) -> None:  # caller holds the lock
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS semantic_entries (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            "partition TEXT NOT NULL, tenant TEXT NOT NULL, scope TEXT NOT NULL, prompt TEXT NOT NULL, "
            "answer TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL, hit_count INTEGER NOT NULL, "
            "status TEXT NOT NULL, vector BLOB NOT NULL, finish_reason TEXT NOT NULL DEFAULT 'stop', "
            "completion_tokens INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0)"
        )
        self.db.execute("CREATE INDEX IF NOT EXISTS semantic_by_partition ON semantic_entries(partition, prompt)")
        self.owners = OwnerTable(self.db, "semantic_owners", "INTEGER")
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(semantic_entries)")}
        for column, ddl in (
            ("finish_reason", "TEXT NOT NULL DEFAULT 'stop'"),
            ("completion_tokens", "INTEGER NOT NULL DEFAULT 0"),
            ("prompt_tokens", "INTEGER NOT NULL DEFAULT 0"),
        ):
            if column not in columns:  # a database written by an earlier version
                self.db.execute(f"ALTER TABLE semantic_entries ADD COLUMN {column} {ddl}")


_COLUMNS = (
    "id, tenant, scope, prompt, answer, created_at, expires_at, hit_count, status, finish_reason, "
    "completion_tokens, prompt_tokens, partition"
)


def _entry(row) -> SemanticEntry:
    return SemanticEntry(row[0], row[1], json.loads(row[2]), *row[3:])


def _vector_bytes(vector: np.ndarray) -> bytes:
    return np.asarray(vector, dtype=np.float32).tobytes()
