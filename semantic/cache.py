"""The guarded semantic cache: embed -> search the scope's partition -> threshold + guards -> answer.

Entries (with provenance and their vectors) live in an EntryStore: SQLite beside the exact cache, or
Redis shared by replicas (semantic/entries.py, semantic/redis_entries.py). The faiss partitions live
in this process and are built from the store at start-up, so the index survives restarts with the
entries. A store shared by replicas also reports changes (`changes(position, wait_s)`): a follower
thread applies the others' inserts and deletes to this index, and rebuilds it whenever the store was
unreachable (a restarted Redis may have lost entries). The index only proposes candidates: entries
are read back from the store on every lookup, so a review status set on another replica, or an
entry deleted there but not yet followed here, is honoured at once. Rejected entries are never
served; a setting can require approval.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .embedder import Embedder
from .entries import STATUSES, EntryStore, SemanticEntry, SharedEntryStore, valid_id
from .exact import Status
from .guards import Verdict, check
from .index import PartitionedIndex
from .owners import Owner, Selector
from .risk import PERSONAL_DATA
from .scope import Scope
from .store import Answer, Purged, StoreUnavailable

if TYPE_CHECKING:  # the verifier imports torch; a cache without one never needs it
    from .calibration import Calibrator
    from .verifier import Verifier

log = logging.getLogger("strata.semantic")

WORD_VECTOR_CACHE_SIZE = 4096  # single-word MiniLM vectors kept for the substitution guard
FOLLOW_WAIT_S = 1.0  # a follower blocks this long for news, then checks whether the cache closed


@dataclass(frozen=True, slots=True)
class Screening:
    """Whether a query may use the semantic layer at all, decided before any embedding."""

    bypass_reason: str | None  # None: eligible
    personal: bool = False  # about the asker's own data: the caller must scope it to the end user


@dataclass(frozen=True, slots=True)
class SemanticLookup:
    status: Status
    reason: str = ""  # a miss: "no_candidate", or the guards' (and verifier's) reasons joined by commas
    score: float | None = None
    entry: SemanticEntry | None = None
    verdict: Verdict | None = None
    vector: np.ndarray | None = field(default=None, repr=False)  # the query's, reused on insert
    # A miss: the best-scored candidate within the threshold that the guards (or the verifier)
    # refused. Never served; its answer may still be the text the model gives (a draft for
    # speculative decoding).
    candidate: SemanticEntry | None = field(default=None, repr=False)


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

    def __init__(
        self,
        embedder: Embedder,
        store: EntryStore,
        settings: SemanticSettings,
        verifier: Verifier | None = None,
        calibrator: Calibrator | None = None,
    ):
        self.embedder = embedder
        self.store = store
        self.settings = settings
        self.verifier = verifier  # None: the rule guards decide alone
        # None: the verifier's fixed bars decide; else each tenant's false-hit bound does (calibration.py)
        self.calibrator = calibrator
        self.word_vectors: OrderedDict[str, np.ndarray] = OrderedDict()  # guarded by word_lock
        self.word_lock = threading.Lock()
        self.index = PartitionedIndex(embedder.dim)  # replaced whole by a rebuild; never mutated by two threads' swaps
        self.closing = threading.Event()
        self.follower = None
        position = self._rebuild()
        # True while the follower cannot reach a shared store: lookups bypass at once, even in
        # partitions whose index is empty here (written by the follower thread only)
        self.store_lost = position is None
        if self.store_lost:
            log.warning("semantic entry store unreachable at start: the layer bypasses until it is back")
        if isinstance(store, SharedEntryStore):  # shared by replicas: follow their inserts and deletes
            self.follower = threading.Thread(
                target=self._follow, args=(store, position), name="strata-semantic-follower", daemon=True
            )
            self.follower.start()

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
        """StoreUnavailable when the entry store cannot be reached (the caller bypasses the layer)."""
        if self.store_lost:
            raise StoreUnavailable("the semantic entry store is unreachable")
        vector = self.embedder.embed([query])[0]
        best: SemanticLookup | None = None
        for entry, score in self._candidates(scope.partition(context), vector):
            if not self._servable(entry, now):
                continue
            verdict = self._judged(
                query,
                entry,
                check(query, entry.prompt, score, self.settings.threshold, self.word_similarity),
                scope.tenant,
            )
            if verdict.accept:
                self.store.count_hit(entry.id)
                if self.calibrator is not None and verdict.probability is not None:
                    self.calibrator.served(scope.tenant, entry.id, _group(verdict.overruled), verdict.probability)
                return SemanticLookup("hit", score=score, entry=entry, verdict=verdict, vector=vector)
            near = entry if score >= self.settings.threshold else None  # refused by a guard, not by distance
            reasons = ",".join(verdict.reasons)
            best = best or SemanticLookup("miss", reasons, score, verdict=verdict, vector=vector, candidate=near)
        return best or SemanticLookup("miss", "no_candidate", vector=vector)

    def _judged(self, query: str, entry: SemanticEntry, verdict: Verdict, tenant: str) -> Verdict:
        """The guards' verdict seen by the verifier: at its fixed bars, or under the tenant's false-hit
        bound when a calibrator is set (which, without a verifier, has no score to judge: uncalibrated)."""
        if self.calibrator is None:
            return verdict if self.verifier is None else self.verifier.review(query, entry.prompt, verdict)
        from .verifier import reviewable

        if not reviewable(verdict):
            return verdict
        if self.verifier is None:
            return Verdict(False, verdict.score, (*verdict.reasons, "uncalibrated"))
        group = _group(verdict.reasons)
        probability = self.verifier.probability(query, entry.prompt, verdict.score)
        refusal = self.calibrator.decide(tenant, entry.id, group, probability)
        if refusal:
            return Verdict(False, verdict.score, (*verdict.reasons, refusal), probability)  # type: ignore[arg-type]
        return Verdict(True, verdict.score, (), probability, overruled=verdict.reasons)

    def _candidates(self, partition: str, vector: np.ndarray) -> list[tuple[SemanticEntry, float]]:
        """The index's nearest entries, re-scored with their exact float32 vectors, best first. An id
        the store no longer has (deleted on another replica, not yet followed), or has in another
        partition, is never served and leaves the index."""
        index = self.index
        ids = [entry_id for entry_id, _ in index.search(partition, vector, self.settings.candidates)]
        if not ids:
            return []
        found = [(entry, stored) for entry, stored in self.store.fetch(ids) if entry.partition == partition]
        for gone in set(ids) - {entry.id for entry, _ in found}:  # an id a restarted store gave another entry
            index.remove(gone)
        return sorted(((entry, float(stored @ vector)) for entry, stored in found), key=lambda pair: -pair[1])

    def insert(
        self,
        query: str,
        answer: Answer,
        scope: Scope,
        context: str,
        now: float,
        ttl_s: float | None = None,
        vector: np.ndarray | None = None,
        owner: Owner = Owner(),
    ) -> int:
        """Store an answer; a newer answer to the same question in the same partition replaces the
        older one (fresh review status and hit count), keeping its id, vector and owners (the new
        request's owner joins them)."""
        partition = scope.partition(context)
        if vector is None and self.store.find(partition, scope.tenant, query) is None:
            vector = self.embedder.embed([query])[0]
        if vector is None:  # the entry exists: put() keeps its vector (one deleted meanwhile is stored with
            vector = np.zeros(self.embedder.dim, dtype=np.float32)  # this one, which no query comes near)
        entry_id, created = self.store.put(partition, scope, query, answer, now, self._expiry(now, ttl_s), vector)
        if created:
            self.index.add(partition, [entry_id], vector.reshape(1, -1))
        self.store.own(entry_id, owner)
        return entry_id

    def insert_many(
        self, prompts: list[str], answers: list[str], vectors: np.ndarray, scope: Scope, context: str, now: float
    ) -> list[int]:
        """Bulk load (e.g. an FAQ import) with precomputed, normalised vectors; no de-duplication."""
        partition = scope.partition(context)
        ids = self.store.put_many(partition, scope, prompts, answers, vectors, now, self._expiry(now, None))
        self.index.add(partition, ids, vectors)
        return ids

    def _expiry(self, now: float, ttl_s: float | None) -> float | None:
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        return now + ttl if ttl > 0 else None

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
            embedded = dict(zip(missing, self.embedder.embed(missing)))
            known.update(embedded)
            with self.word_lock:
                self.word_vectors.update(embedded)
                while len(self.word_vectors) > WORD_VECTOR_CACHE_SIZE:
                    self.word_vectors.popitem(last=False)
        left_vector, right_vector = known[left], known[right]
        assert left_vector is not None and right_vector is not None, "both were embedded above"
        return float(left_vector @ right_vector)

    # -- administration ----------------------------------------------------------------------

    def get(self, entry_id: int) -> SemanticEntry | None:
        return self.store.get(entry_id) if valid_id(entry_id) else None

    def list_entries(
        self, tenant: str | None = None, status: str | None = None, limit: int = 100
    ) -> list[SemanticEntry]:
        return self.store.list_entries(tenant, status, limit)

    def set_status(self, entry_id: int, status: str) -> bool:
        """An admin's review; with a calibrator, approve / reject also turn the entry's hits into its
        tenant's evidence."""
        assert status in STATUSES, status
        entry = self.get(entry_id)
        if entry is None or not self.store.set_status(entry_id, status):
            return False
        if self.calibrator is not None and status != "unreviewed":
            self.calibrator.reviewed(entry.tenant, entry_id, status == "approved")
        return True

    def delete(self, entry_id: int) -> bool:
        if not valid_id(entry_id):
            return False
        self.index.remove(entry_id)
        return self.store.delete(entry_id)

    def own(self, entry_id: int, owner: Owner) -> None:
        """A hit: the entry is the hitting request's owner's too."""
        self.store.own(entry_id, owner)

    def purge_owned(self, selector: Selector) -> Purged:
        """A tenant's entries, or its session's or end user's share of them (semantic/owners.py)."""
        ids, size = self.store.release(selector)
        if self.calibrator is not None:
            self.calibrator.forget(ids, selector.tenant if selector.whole_tenant else None)
        return Purged(sum(self.delete(entry_id) for entry_id in ids), size)

    def stats(self) -> SemanticSnapshot:
        by_status, num_partitions = self.store.stats()
        return SemanticSnapshot(sum(by_status.values()), num_partitions, by_status)

    def purge(self) -> Purged:
        if self.calibrator is not None:
            self.calibrator.forget_all()
        return Purged(sum(self.delete(i) for i in self.store.all_ids()))

    def purge_expired(self, now: float) -> int:
        return sum(self.delete(i) for i in self.store.expired_ids(now))

    def close(self) -> None:
        self.closing.set()
        if self.follower is not None:
            self.follower.join(timeout=FOLLOW_WAIT_S + 2.0)
        self.store.close()
        if self.calibrator is not None:
            self.calibrator.close()

    # -- the index ---------------------------------------------------------------------------

    def _rebuild(self) -> str | None:
        """A fresh index from every entry in the store, swapped in whole; returns the store's change
        position read before the scan (None when the store cannot be reached: the index stays)."""
        try:
            position = self.store.position() if hasattr(self.store, "position") else None
            rows = self.store.vectors()
        except StoreUnavailable:
            return None
        index = PartitionedIndex(self.embedder.dim)
        by_partition: dict[str, list[tuple[int, np.ndarray]]] = {}
        for entry_id, partition, vector in rows:
            by_partition.setdefault(partition, []).append((entry_id, vector))
        for partition, items in by_partition.items():
            index.add(partition, [i for i, _ in items], np.stack([v for _, v in items]))
        self.index = index
        return position if position is not None else "rebuilt"

    def _follow(self, store: SharedEntryStore, position: str | None) -> None:
        """Apply the store's changes (every replica's inserts and deletes, this one's included:
        applying is idempotent) until the cache closes. After the store was unreachable the index is
        rebuilt, then followed from the position read before the rebuild."""
        while not self.closing.is_set():
            if position is None:
                position = self._rebuild()
                if position is None:
                    self.closing.wait(FOLLOW_WAIT_S / 4)
                    continue
                if self.store_lost:
                    log.info("semantic index rebuilt from the entry store, which is back")
                    self.store_lost = False
            try:
                changes, position = store.changes(position, FOLLOW_WAIT_S)
            except StoreUnavailable as exc:
                if not self.store_lost:
                    log.warning("semantic entry store unreachable (%s): the layer bypasses until it is back", exc)
                self.store_lost, position = True, None
                self.closing.wait(FOLLOW_WAIT_S / 4)
                continue
            for change in changes:
                self._apply(change)

    def _apply(self, change: tuple) -> None:
        """("add", id, partition, vector) or ("remove", id)."""
        if change[0] == "add":
            _, entry_id, partition, vector = change
            self.index.add(partition, [entry_id], vector.reshape(1, -1))
        else:
            self.index.remove(change[1])


def _group(objections: tuple[str, ...]) -> str:
    """The calibration group of a candidate no fact guard refused: word-order objections or none."""
    return "structural" if objections else "pass"
