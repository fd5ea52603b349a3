"""semantic: the exact-response cache and the guarded semantic cache.

A library: never imports `gateway`, never reads HTTP headers; returns typed results
(`ExactLookup`, `SemanticLookup`, `Verdict`). See README.md in this folder.
"""

from .cache import Screening, SemanticCache, SemanticEntry, SemanticLookup, SemanticSettings, SemanticSnapshot
from .embedder import Embedder, MiniLMEmbedder
from .entries import EntryStore, SqliteEntries
from .exact import CacheControl, Draft, ExactCache, ExactLookup, ExactSnapshot, draft_key, exact_key
from .guards import Verdict, check
from .index import PartitionedIndex
from .owners import Owner, Selector, owner_label
from .redis_entries import RedisEntries
from .redis_store import RedisStore
from .risk import PERSONAL_DATA, RiskPatterns, RiskPolicy, load_risk_patterns
from .scope import Scope, context_fingerprint
from .store import Answer, MemoryStore, Purged, ResponseStore, SqliteStore, StoredResponse, StoreUnavailable

__all__ = [
    "PERSONAL_DATA",
    "Answer",
    "CacheControl",
    "Draft",
    "Embedder",
    "EntryStore",
    "ExactCache",
    "ExactLookup",
    "ExactSnapshot",
    "MemoryStore",
    "MiniLMEmbedder",
    "Owner",
    "PartitionedIndex",
    "Purged",
    "RedisEntries",
    "RedisStore",
    "ResponseStore",
    "RiskPatterns",
    "RiskPolicy",
    "Scope",
    "Screening",
    "Selector",
    "SemanticCache",
    "SemanticEntry",
    "SemanticLookup",
    "SemanticSettings",
    "SemanticSnapshot",
    "SqliteEntries",
    "SqliteStore",
    "StoreUnavailable",
    "StoredResponse",
    "Verdict",
    "check",
    "context_fingerprint",
    "draft_key",
    "exact_key",
    "load_risk_patterns",
    "owner_label",
]
