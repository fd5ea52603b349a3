"""The guarded semantic cache: embed -> search the scope's partition -> threshold + guards -> answer.

Entries (with provenance and their vectors) live in SQLite beside the exact cache; the faiss
partitions are rebuilt from them at start-up, so the index survives restarts with the entries and
can never disagree with them. Rejected entries are never served; a setting can require approval.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .embedder import Embedder
from .guards import Verdict, check
from .index import PartitionedIndex
from .scope import Scope

STATUSES = ("unreviewed", "approved", "rejected")

DEFAULT_RISK_PATTERNS = {
    # answers about one end user's own data must never be served to another end user of the tenant
    "personal_data": [r"\bmy (current |account |remaining )?(balance|credit score|test results?)\b",
                      r"\b(status|tracking)\b[^?.!]*\bmy\b",
                      r"\b(where|when)\b[^?.!]*\bmy (order|package|parcel|delivery|refund|payment)\b",
                      r"\bwhy (was|is|did|were|has|have)\b[^?.!]*\bmy\b"],
    "medical": [r"\b(dosage|dose|overdose|mg\b|milligrams?|prescri\w+|symptoms?|diagnos\w+|side effects?)\b"],
    "self_harm": [r"\b(suicide|suicidal|kill myself|self[- ]harm|hurt myself)\b"],
    "legal": [r"\b(lawsuit|sue|legal advice|liable|liability|court)\b"],
    "financial_advice": [r"\b(should i (buy|sell|invest)|stock tips?|investment advice)\b"],
}


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


@dataclass(frozen=True, slots=True)
class SemanticLookup:
    status: str  # hit | miss | bypass
    reason: str = ""
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
    risk_patterns: dict[str, list[str]] = field(default_factory=lambda: dict(DEFAULT_RISK_PATTERNS))


class RiskPolicy:
    def __init__(self, patterns: dict[str, list[str]]):
        self.patterns = {category: [re.compile(p, re.I) for p in group] for category, group in patterns.items()}

    def category(self, text: str) -> str | None:
        return next((c for c, group in self.patterns.items() if any(p.search(text) for p in group)), None)


class SemanticCache:
    def __init__(self, embedder: Embedder, db_path: Path, settings: SemanticSettings):
        self.embedder = embedder
        self.settings = settings
        self.risk = RiskPolicy(settings.risk_patterns)
        self.index = PartitionedIndex(embedder.dim)
        self.word_vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self.lock = threading.Lock()
        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._create_tables()
        self._rebuild_index()

    # -- lookup and insert -------------------------------------------------------------------

    def bypass_reason(self, query: str, has_tools: bool) -> str | None:
        if has_tools:
            return "tools"
        category = self.risk.category(query)
        return f"risk:{category}" if category else None

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
        scored = [(_entry(row), float(np.frombuffer(row[-1], dtype=np.float32) @ vector)) for row in rows]
        return sorted(scored, key=lambda pair: -pair[1])

    def insert(self, query: str, answer: str, scope: Scope, context: str, now: float,
               ttl_s: float | None = None, vector: np.ndarray | None = None) -> int:
        partition = scope.partition(context)
        existing = self._find(partition, query)
        if existing is not None:
            return existing
        vector = self.embedder.embed([query])[0] if vector is None else vector
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        with self.lock:
            cursor = self.db.execute(
                "INSERT INTO semantic_entries (partition, tenant, scope, prompt, answer, created_at, expires_at, "
                "hit_count, status, vector) VALUES (?, ?, ?, ?, ?, ?, ?, 0, 'unreviewed', ?)",
                (partition, scope.tenant, json.dumps(scope.as_dict()), query, answer, now,
                 now + ttl if ttl > 0 else None, np.asarray(vector, dtype=np.float32).tobytes()))
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
        """MiniLM cosine of two single words (vectors kept in a small LRU)."""
        missing = [w for w in (left, right) if w not in self.word_vectors]
        if missing:
            for word, vector in zip(missing, self.embedder.embed(missing)):
                self.word_vectors[word] = vector
                if len(self.word_vectors) > 4096:
                    self.word_vectors.popitem(last=False)
        return float(self.word_vectors[left] @ self.word_vectors[right])

    # -- administration ----------------------------------------------------------------------

    def get(self, entry_id: int) -> SemanticEntry | None:
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
        with self.lock:
            return self.db.execute("UPDATE semantic_entries SET status = ? WHERE id = ?", (status, entry_id)).rowcount > 0

    def delete(self, entry_id: int) -> bool:
        self.index.remove(entry_id)
        with self.lock:
            return self.db.execute("DELETE FROM semantic_entries WHERE id = ?", (entry_id,)).rowcount > 0

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
                            "status TEXT NOT NULL, vector BLOB NOT NULL)")
            self.db.execute("CREATE INDEX IF NOT EXISTS semantic_by_partition ON semantic_entries(partition, prompt)")

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


_COLUMNS = "id, tenant, scope, prompt, answer, created_at, expires_at, hit_count, status"


def _entry(row) -> SemanticEntry:
    return SemanticEntry(row[0], row[1], json.loads(row[2]), row[3], row[4], row[5], row[6], row[7], row[8])
