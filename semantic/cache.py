"""The guarded semantic cache: embed -> search the scope's partition -> threshold + guards -> answer.

Entries (with provenance and their vectors) live in SQLite beside the exact cache; the faiss
partitions are rebuilt from them at start-up, so the index survives restarts with the entries and
can never disagree with them. Rejected entries are never served; a setting can require approval.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .embedder import Embedder
from .exact import Status
from .guards import Verdict, check
from .index import PartitionedIndex
from .risk import PERSONAL_DATA
from .owners import Owner, OwnerTable, Selector
from .scope import Scope
from .store import Answer, Purged

STATUSES = ("unreviewed", "approved", "rejected")
MAX_ENTRY_ID = 2**63 - 1  # SQLite INTEGER; a larger id names no entry (and must not raise)
WORD_VECTOR_CACHE_SIZE = 4096  # single-word MiniLM vectors kept for the substitution guard


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


@dataclass(frozen=True, slots=True)
class Screening:
    """Whether a query may use the semantic layer at all, decided before any embedding."""

    bypass_reason: str | None  # None: eligible
    personal: bool = False  # about the asker's own data: the caller must scope it to the end user


@dataclass(frozen=True, slots=True)
class SemanticLookup:
    status: Status
    reason: str = ""  # a miss: "no_candidate", or the guards' reasons (GuardReason) joined by commas
    score: float | None = None
    entry: SemanticEntry | None = None
    verdict: Verdict | None = None
    vector: np.ndarray | None = field(default=None, repr=False)  # the query's, reused on insert


@dataclass(frozen=True, slots=True)
class SemanticSettings:
    threshold: float = 0.80
    candidates: int = 5
    require_approved: bool = False
    default_ttl_s: float = 7 * 24 * 3600.0
    # MiniLM reads at most 256 word pieces (~1,000 characters of English); two longer queries that
    # differ only after the cut would embed alike, so they are never compared at all.
    max_query_chars: int = 1000


@dataclass(frozen=True, slots=True)
class SemanticSnapshot:
    num_entries: int
    num_partitions: int
    num_by_status: dict[str, int]


class SemanticCache:
    """Cache protocol: `name`, `stats()`, `purge()`, `close()` (any thread)."""

    name = "semantic"

    def __init__(self, embedder: Embedder, db_path: Path, settings: SemanticSettings):
        self.embedder = embedder
        self.settings = settings
        self.index = PartitionedIndex(embedder.dim)
        self.word_vectors: OrderedDict[str, np.ndarray] = OrderedDict()  # guarded by word_lock
        self.word_lock = threading.Lock()
        self.lock = threading.Lock()  # guards self.db
        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._create_tables()
        self._rebuild_index()

    # -- lookup and insert -------------------------------------------------------------------

    def warm_up(self) -> None:
        """MiniLM's first call costs ~300 ms (lazy initialisation): pay it at start-up, not on a request."""
        self.embedder.embed(["warm up the semantic layer"])

    def screen(self, query: str, has_tools: bool, risk_category: str | None, has_end_user: bool) -> Screening:
        """Tools, over-long queries and risky topics (`RiskPolicy.category` of the query) bypass;
        personal questions are eligible only when the caller names the end user to scope them to."""
        if has_tools:
            return Screening("tools")
        if len(query) > self.settings.max_query_chars:
            return Screening("query_too_long")
        if risk_category == PERSONAL_DATA:
            return Screening(None, personal=True) if has_end_user else Screening(f"risk:{PERSONAL_DATA}")
        return Screening(f"risk:{risk_category}" if risk_category else None)

    def lookup(self, query: str, scope: Scope, context: str, now: float) -> SemanticLookup:
        vector = self.embedder.embed([query])[0]
        best: SemanticLookup | None = None
        for entry, score in self._candidates(scope.partition(context), vector):
            if not self._servable(entry, now):
                continue
            verdict = check(query, entry.prompt, score, self.settings.threshold, self.word_similarity)
            if verdict.accept:
                self._count_hit(entry.id)
                return SemanticLookup("hit", score=score, entry=entry, verdict=verdict, vector=vector)
            best = best or SemanticLookup("miss", ",".join(verdict.reasons), score, verdict=verdict, vector=vector)
        return best or SemanticLookup("miss", "no_candidate", vector=vector)

    def _candidates(self, partition: str, vector: np.ndarray) -> list[tuple[SemanticEntry, float]]:
        """The index's nearest entries, re-scored with their exact float32 vectors, best first."""
        found = self.index.search(partition, vector, self.settings.candidates)
        if not found:
            return []
        ids = [entry_id for entry_id, _ in found]
        with self.lock:
            rows = self.db.execute(f"SELECT {_COLUMNS}, vector FROM semantic_entries WHERE id IN "
                                   f"({','.join('?' * len(ids))})", ids).fetchall()
        scored = [(_entry(row[:-1]), float(np.frombuffer(row[-1], dtype=np.float32) @ vector)) for row in rows]
        return sorted(scored, key=lambda pair: -pair[1])

    def insert(self, query: str, answer: Answer, scope: Scope, context: str, now: float,
               ttl_s: float | None = None, vector: np.ndarray | None = None, owner: Owner = Owner()) -> int:
        """Store an answer; a newer answer to the same question in the same partition replaces the
        older one (fresh review status and hit count), keeping its id, vector and owners (the new
        request's owner joins them)."""
        entry_id = self._insert(query, answer, scope, context, now, ttl_s, vector)
        with self.lock:
            self.owners.add(entry_id, owner)
        return entry_id

    def _insert(self, query: str, answer: Answer, scope: Scope, context: str, now: float, ttl_s: float | None,
                vector: np.ndarray | None) -> int:
        partition = scope.partition(context)
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        expires = now + ttl if ttl > 0 else None
        existing = self._find(partition, query)
        if existing is not None:
            with self.lock:
                self.db.execute("UPDATE semantic_entries SET answer = ?, finish_reason = ?, completion_tokens = ?, "
                                "prompt_tokens = ?, created_at = ?, expires_at = ?, hit_count = 0, status = 'unreviewed' "
                                "WHERE id = ?", (answer.text, answer.finish_reason, answer.completion_tokens,
                                                 answer.prompt_tokens, now, expires, existing))
            return existing
        vector = self.embedder.embed([query])[0] if vector is None else vector
        with self.lock:
            cursor = self.db.execute(
                "INSERT INTO semantic_entries (partition, tenant, scope, prompt, answer, finish_reason, "
                "completion_tokens, prompt_tokens, created_at, expires_at, hit_count, status, vector) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 'unreviewed', ?)",
                (partition, scope.tenant, json.dumps(scope.as_dict()), query, answer.text, answer.finish_reason,
                 answer.completion_tokens, answer.prompt_tokens, now, expires,
                 np.asarray(vector, dtype=np.float32).tobytes()))
            entry_id = int(cursor.lastrowid)
        self.index.add(partition, [entry_id], vector.reshape(1, -1))
        return entry_id

    def insert_many(self, prompts: list[str], answers: list[str], vectors: np.ndarray, scope: Scope, context: str,
                    now: float) -> list[int]:
        """Bulk load (e.g. an FAQ import) with precomputed, normalised vectors; no de-duplication."""
        partition = scope.partition(context)
        expires = now + self.settings.default_ttl_s if self.settings.default_ttl_s > 0 else None
        rows = [(partition, scope.tenant, json.dumps(scope.as_dict()), p, a, now, expires,
                 np.asarray(v, dtype=np.float32).tobytes()) for p, a, v in zip(prompts, answers, vectors)]
        with self.lock:
            self.db.execute("BEGIN")
            ids = [int(self.db.execute("INSERT INTO semantic_entries (partition, tenant, scope, prompt, answer, created_at, "
                                       "expires_at, hit_count, status, vector) VALUES (?, ?, ?, ?, ?, ?, ?, 0, "
                                       "'unreviewed', ?)", row).lastrowid) for row in rows]
            self.db.execute("COMMIT")
        self.index.add(partition, ids, vectors)
        return ids

    def _servable(self, entry: SemanticEntry, now: float) -> bool:
        if entry.expires_at is not None and entry.expires_at <= now:
            self.delete(entry.id)
            return False
        if entry.status == "rejected":
            return False
        return entry.status == "approved" or not self.settings.require_approved

    def word_similarity(self, left: str, right: str) -> float:
        """MiniLM cosine of two single words (vectors kept in a small LRU shared by lookup threads)."""
        with self.word_lock:
            known = {w: self.word_vectors.get(w) for w in (left, right)}
        missing = [w for w, vector in known.items() if vector is None]
        if missing:
            known.update(zip(missing, self.embedder.embed(missing)))
            with self.word_lock:
                for word in missing:
                    self.word_vectors[word] = known[word]
                while len(self.word_vectors) > WORD_VECTOR_CACHE_SIZE:
                    self.word_vectors.popitem(last=False)
        return float(known[left] @ known[right])

    # -- administration ----------------------------------------------------------------------

    def get(self, entry_id: int) -> SemanticEntry | None:
        if not 0 < entry_id <= MAX_ENTRY_ID:
            return None
        with self.lock:
            row = self.db.execute(f"SELECT {_COLUMNS} FROM semantic_entries WHERE id = ?", (entry_id,)).fetchone()
        return _entry(row) if row else None

    def list_entries(self, tenant: str | None = None, status: str | None = None, limit: int = 100) -> list[SemanticEntry]:
        query, args = f"SELECT {_COLUMNS} FROM semantic_entries WHERE 1=1", []
        if tenant is not None:
            query, args = query + " AND tenant = ?", args + [tenant]
        if status is not None:
            query, args = query + " AND status = ?", args + [status]
        with self.lock:
            rows = self.db.execute(query + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
        return [_entry(row) for row in rows]

    def set_status(self, entry_id: int, status: str) -> bool:
        assert status in STATUSES, status
        if not 0 < entry_id <= MAX_ENTRY_ID:
            return False
        with self.lock:
            return self.db.execute("UPDATE semantic_entries SET status = ? WHERE id = ?", (status, entry_id)).rowcount > 0

    def delete(self, entry_id: int) -> bool:
        if not 0 < entry_id <= MAX_ENTRY_ID:
            return False
        self.index.remove(entry_id)
        with self.lock:
            self.owners.forget([entry_id])
            return self.db.execute("DELETE FROM semantic_entries WHERE id = ?", (entry_id,)).rowcount > 0

    def own(self, entry_id: int, owner: Owner) -> None:
        """A hit: the entry is the hitting request's owner's too."""
        with self.lock:
            if self.db.execute("SELECT 1 FROM semantic_entries WHERE id = ?", (entry_id,)).fetchone():
                self.owners.add(entry_id, owner)

    def purge_owned(self, selector: Selector) -> Purged:
        """A tenant's entries, or its session's or end user's share of them (semantic/owners.py)."""
        with self.lock:
            ids = self.owners.release(selector, "semantic_entries", "id")
            size = sum(self.db.execute("SELECT LENGTH(prompt) + LENGTH(answer) + LENGTH(vector) FROM semantic_entries "
                                       "WHERE id = ?", (entry_id,)).fetchone()[0] for entry_id in ids)
        return Purged(sum(self.delete(entry_id) for entry_id in ids), size)

    def stats(self) -> SemanticSnapshot:
        with self.lock:
            by_status = dict(self.db.execute("SELECT status, COUNT(*) FROM semantic_entries GROUP BY status").fetchall())
            num_partitions = self.db.execute("SELECT COUNT(DISTINCT partition) FROM semantic_entries").fetchone()[0]
        return SemanticSnapshot(sum(by_status.values()), num_partitions, {s: by_status.get(s, 0) for s in STATUSES})

    def purge(self) -> Purged:
        with self.lock:
            ids = [row[0] for row in self.db.execute("SELECT id FROM semantic_entries")]
        return Purged(sum(self.delete(i) for i in ids))

    def purge_expired(self, now: float) -> int:
        with self.lock:
            ids = [r[0] for r in self.db.execute(
                "SELECT id FROM semantic_entries WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))]
        return sum(self.delete(i) for i in ids)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- storage -----------------------------------------------------------------------------

    def _create_tables(self) -> None:
        with self.lock:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS semantic_entries (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                            "partition TEXT NOT NULL, tenant TEXT NOT NULL, scope TEXT NOT NULL, prompt TEXT NOT NULL, "
                            "answer TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL, hit_count INTEGER NOT NULL, "
                            "status TEXT NOT NULL, vector BLOB NOT NULL, finish_reason TEXT NOT NULL DEFAULT 'stop', "
                            "completion_tokens INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0)")
            self.db.execute("CREATE INDEX IF NOT EXISTS semantic_by_partition ON semantic_entries(partition, prompt)")
            self.owners = OwnerTable(self.db, "semantic_owners", "INTEGER")
            columns = {row[1] for row in self.db.execute("PRAGMA table_info(semantic_entries)")}
            for column, ddl in (("finish_reason", "TEXT NOT NULL DEFAULT 'stop'"),
                                ("completion_tokens", "INTEGER NOT NULL DEFAULT 0"),
                                ("prompt_tokens", "INTEGER NOT NULL DEFAULT 0")):
                if column not in columns:  # a database written by an earlier version
                    self.db.execute(f"ALTER TABLE semantic_entries ADD COLUMN {column} {ddl}")

    def _rebuild_index(self) -> None:
        with self.lock:
            rows = self.db.execute("SELECT id, partition, vector FROM semantic_entries").fetchall()
        by_partition: dict[str, list[tuple[int, bytes]]] = {}
        for entry_id, partition, vector in rows:
            by_partition.setdefault(partition, []).append((entry_id, vector))
        for partition, items in by_partition.items():
            vectors = np.stack([np.frombuffer(v, dtype=np.float32) for _, v in items])
            self.index.add(partition, [i for i, _ in items], vectors)

    def _find(self, partition: str, prompt: str) -> int | None:
        with self.lock:
            row = self.db.execute("SELECT id FROM semantic_entries WHERE partition = ? AND prompt = ?",
                                  (partition, prompt)).fetchone()
        return int(row[0]) if row else None

    def _count_hit(self, entry_id: int) -> None:
        with self.lock:
            self.db.execute("UPDATE semantic_entries SET hit_count = hit_count + 1 WHERE id = ?", (entry_id,))


_COLUMNS = ("id, tenant, scope, prompt, answer, created_at, expires_at, hit_count, status, finish_reason, "
            "completion_tokens, prompt_tokens")


def _entry(row) -> SemanticEntry:
    return SemanticEntry(row[0], row[1], json.loads(row[2]), *row[3:])
