"""Stores for semantic entries: one contract, two backends (SQLite here, Redis in redis_entries.py).

    EntryStore.put(partition, scope, prompt, answer, now, expires_at, vector) -> (id, created)
        a newer answer to the same question in the same partition replaces the older one (fresh
        review status and hit count) and keeps its id, vector and owners; `created` says which
    fetch(ids) -> [(SemanticEntry, float32 vector)]   the entries still present, in any order
    find(partition, tenant, prompt) -> id | None ; get(id) ; list_entries(tenant, status, limit)
    set_status(id, status) -> bool ; delete(id) -> bool ; count_hit(id)
    own(id, owner)                         the owner joins the entry's owners (if it still exists)
    release(selector) -> (ids, bytes)      take the selector's owners off; the ids left with none,
                                           which the caller deletes (semantic/owners.py)
    expired_ids(now) ; all_ids() ; vectors() -> [(id, partition, vector)] ; stats() ; close()

The cache keeps the faiss partitions; a store only keeps entries. SqliteEntries lives beside the
exact cache (":memory:" gives the in-memory store the tests and benchmarks use); every write is
committed before the call returns.

At rest an entry's prompt, answer and vector are sealed under its tenant's key (EntryCipher), each
bound to the entry's key: a keyed digest of (partition, prompt) under the same tenant key, which is
also how a question is found again. An entry that does not open (its tenant's key was shredded) is
left out of every read, as if gone.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .owners import Owner, OwnerTable, Selector
from .scope import Scope
from .sealing import NO_SEALING, Sealer, Unreadable
from .store import Answer, SqliteFile

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


class EntryCipher:
    """An entry's fields at rest: sealed under its tenant's key, bound to the entry's key and field."""

    def __init__(self, sealer: Sealer):
        self.sealer = sealer

    def key(self, tenant: str, partition: str, prompt: str) -> str:
        return self.sealer.digest(tenant, f"{partition}\0{prompt}".encode())

    def seal(self, tenant: str, key: str, field: str, data: bytes) -> bytes:
        return self.sealer.seal(tenant, f"semantic|{key}|{field}".encode(), data)

    def open(self, tenant: str, key: str, field: str, sealed: bytes) -> bytes:
        return self.sealer.open(tenant, f"semantic|{key}|{field}".encode(), sealed)

    def vector(self, tenant: str, key: str, sealed: bytes) -> np.ndarray | None:
        try:
            return np.frombuffer(self.open(tenant, key, "vector", sealed), dtype=np.float32)
        except Unreadable:
            return None

    def entry(self, row: tuple, key: str) -> SemanticEntry | None:
        """Row (_COLUMNS order) with its prompt and answer opened; None when they do not open."""
        try:
            prompt = self.open(row[1], key, "prompt", row[3]).decode()
            answer = self.open(row[1], key, "answer", row[4]).decode()
        except Unreadable:
            return None
        return SemanticEntry(row[0], row[1], json.loads(row[2]), prompt, answer, *row[5:])


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
    def find(self, partition: str, tenant: str, prompt: str) -> int | None: ...
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
    """Writes through the file's GroupCommit, lookups on its reading connection (SqliteFile)."""

    def __init__(self, path: Path | str, sealer: Sealer = NO_SEALING):
        self.cipher = EntryCipher(sealer)
        self.file = SqliteFile(path)
        self.owners = self.file.write(self._create_tables)

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
        tenant, cipher = scope.tenant, self.cipher
        key = cipher.key(tenant, partition, prompt)
        sealed_answer = cipher.seal(tenant, key, "answer", answer.text.encode())
        sealed_prompt = cipher.seal(tenant, key, "prompt", prompt.encode())
        sealed_vector = cipher.seal(tenant, key, "vector", _vector_bytes(vector))

        def write() -> tuple[int, bool]:
            row = self.file.db.execute(
                "SELECT id FROM semantic_entries WHERE partition = ? AND q = ?", (partition, key)
            ).fetchone()
            if row is not None:
                self.file.db.execute(
                    "UPDATE semantic_entries SET answer = ?, finish_reason = ?, completion_tokens = ?, "
                    "prompt_tokens = ?, created_at = ?, expires_at = ?, hit_count = 0, status = 'unreviewed' "
                    "WHERE id = ?",
                    (
                        sealed_answer,
                        answer.finish_reason,
                        answer.completion_tokens,
                        answer.prompt_tokens,
                        now,
                        expires_at,
                        row[0],
                    ),
                )
                return int(row[0]), False
            cursor = self.file.db.execute(
                "INSERT INTO semantic_entries (partition, q, tenant, scope, prompt, answer, finish_reason, "
                "completion_tokens, prompt_tokens, created_at, expires_at, hit_count, status, vector) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 'unreviewed', ?)",
                (
                    partition,
                    key,
                    tenant,
                    json.dumps(scope.as_dict()),
                    sealed_prompt,
                    sealed_answer,
                    answer.finish_reason,
                    answer.completion_tokens,
                    answer.prompt_tokens,
                    now,
                    expires_at,
                    sealed_vector,
                ),
            )
            return _inserted_id(cursor), True

        return self.file.write(write)

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
        tenant, cipher = scope.tenant, self.cipher
        rows = []
        for p, a, v in zip(prompts, answers, vectors):
            key = cipher.key(tenant, partition, p)
            sealed = [cipher.seal(tenant, key, f, data) for f, data in (("prompt", p.encode()), ("answer", a.encode()))]
            vector = cipher.seal(tenant, key, "vector", _vector_bytes(v))
            rows.append((partition, key, tenant, json.dumps(scope.as_dict()), *sealed, now, expires_at, vector))

        def write() -> list[int]:
            return [
                _inserted_id(
                    self.file.db.execute(
                        "INSERT INTO semantic_entries (partition, q, tenant, scope, prompt, answer, "
                        "created_at, expires_at, hit_count, status, vector) VALUES (?, ?, ?, ?, ?, ?, ?, "
                        "?, 0, 'unreviewed', ?)",
                        row,
                    )
                )
                for row in rows
            ]

        return self.file.write(write)

    def fetch(self, ids: list[int]) -> list[tuple[SemanticEntry, np.ndarray]]:
        ids = [i for i in ids if valid_id(i)]
        if not ids:
            return []
        rows = self.file.read(
            f"SELECT {_COLUMNS}, q, vector FROM semantic_entries WHERE id IN ({','.join('?' * len(ids))})", ids
        )
        opened = [(self.cipher.entry(row[:-2], row[-2]), self.cipher.vector(row[1], row[-2], row[-1])) for row in rows]
        return [(entry, vector) for entry, vector in opened if entry is not None and vector is not None]

    def find(self, partition: str, tenant: str, prompt: str) -> int | None:
        key = self.cipher.key(tenant, partition, prompt)
        rows = self.file.read("SELECT id FROM semantic_entries WHERE partition = ? AND q = ?", (partition, key))
        return int(rows[0][0]) if rows else None

    def get(self, entry_id: int) -> SemanticEntry | None:
        found = self.fetch([entry_id])
        return found[0][0] if found else None

    def list_entries(
        self, tenant: str | None = None, status: str | None = None, limit: int = 100
    ) -> list[SemanticEntry]:
        query, args = f"SELECT {_COLUMNS}, q FROM semantic_entries WHERE 1=1", list[object]()
        if tenant is not None:
            query, args = query + " AND tenant = ?", args + [tenant]
        if status is not None:
            query, args = query + " AND status = ?", args + [status]
        rows = self.file.read(query + " ORDER BY id DESC LIMIT ?", (*args, limit))
        entries = [self.cipher.entry(row[:-1], row[-1]) for row in rows]
        return [entry for entry in entries if entry is not None]

    def set_status(self, entry_id: int, status: str) -> bool:
        assert status in STATUSES, status
        if not valid_id(entry_id):
            return False
        return self.file.write(
            lambda: (
                self.file.db.execute("UPDATE semantic_entries SET status = ? WHERE id = ?", (status, entry_id)).rowcount
                > 0
            )
        )

    def delete(self, entry_id: int) -> bool:
        if not valid_id(entry_id):
            return False

        def write() -> bool:
            self.owners.forget([entry_id])
            return self.file.db.execute("DELETE FROM semantic_entries WHERE id = ?", (entry_id,)).rowcount > 0

        return self.file.write(write)

    def count_hit(self, entry_id: int) -> None:
        self.file.write(
            lambda: self.file.db.execute(
                "UPDATE semantic_entries SET hit_count = hit_count + 1 WHERE id = ?", (entry_id,)
            )
        )

    def own(self, entry_id: int, owner: Owner) -> None:
        def write() -> None:
            if self.file.db.execute("SELECT 1 FROM semantic_entries WHERE id = ?", (entry_id,)).fetchone():
                self.owners.add(entry_id, owner)

        self.file.write(write)

    def release(self, selector: Selector) -> tuple[list[int], int]:
        def write() -> tuple[list[int], int]:
            ids = self.owners.release(selector, "semantic_entries", "id")
            size = sum(
                self.file.db.execute(
                    "SELECT LENGTH(prompt) + LENGTH(answer) + LENGTH(vector) FROM semantic_entries WHERE id = ?",
                    (entry_id,),
                ).fetchone()[0]
                for entry_id in ids
            )
            return ids, size

        return self.file.write(write)

    def expired_ids(self, now: float) -> list[int]:
        rows = self.file.read(
            "SELECT id FROM semantic_entries WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
        )
        return [row[0] for row in rows]

    def all_ids(self) -> list[int]:
        return [row[0] for row in self.file.read("SELECT id FROM semantic_entries")]

    def vectors(self) -> list[tuple[int, str, np.ndarray]]:
        rows = self.file.read("SELECT id, partition, tenant, q, vector FROM semantic_entries")
        opened = [
            (entry_id, partition, self.cipher.vector(tenant, q, sealed))
            for entry_id, partition, tenant, q, sealed in rows
        ]
        return [(entry_id, partition, vector) for entry_id, partition, vector in opened if vector is not None]

    def stats(self) -> tuple[dict[str, int], int]:
        """(entries by status, number of partitions)."""
        by_status = dict(self.file.read("SELECT status, COUNT(*) FROM semantic_entries GROUP BY status"))
        ((num_partitions,),) = self.file.read("SELECT COUNT(DISTINCT partition) FROM semantic_entries")
        return {s: by_status.get(s, 0) for s in STATUSES}, num_partitions

    def close(self) -> None:
        self.file.close()

    def _create_tables(self) -> OwnerTable:
        columns = {row[1] for row in self.file.db.execute("PRAGMA table_info(semantic_entries)")}
        if columns and "q" not in columns:  # written before entries were sealed: plain text, dropped
            self.file.db.execute("DROP TABLE semantic_entries")
            self.file.db.execute("DROP TABLE IF EXISTS semantic_owners")
        self.file.db.execute(
            "CREATE TABLE IF NOT EXISTS semantic_entries (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            "partition TEXT NOT NULL, q TEXT NOT NULL, tenant TEXT NOT NULL, scope TEXT NOT NULL, "
            "prompt BLOB NOT NULL, answer BLOB NOT NULL, created_at REAL NOT NULL, expires_at REAL, "
            "hit_count INTEGER NOT NULL, status TEXT NOT NULL, vector BLOB NOT NULL, "
            "finish_reason TEXT NOT NULL DEFAULT 'stop', completion_tokens INTEGER NOT NULL DEFAULT 0, "
            "prompt_tokens INTEGER NOT NULL DEFAULT 0)"
        )
        self.file.db.execute("CREATE INDEX IF NOT EXISTS semantic_by_q ON semantic_entries(partition, q)")
        return OwnerTable(self.file.db, "semantic_owners", "INTEGER")


_COLUMNS = (
    "id, tenant, scope, prompt, answer, created_at, expires_at, hit_count, status, finish_reason, "
    "completion_tokens, prompt_tokens, partition"
)


def _vector_bytes(vector: np.ndarray) -> bytes:
    return np.asarray(vector, dtype=np.float32).tobytes()
