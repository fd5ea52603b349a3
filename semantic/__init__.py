"""semantic: the exact-response cache and the guarded semantic cache.

A library: never imports `gateway`, never reads HTTP headers; returns typed results
(`ExactLookup`, `SemanticLookup`, `Verdict`). See README.md in this folder.
"""

from .cache import DEFAULT_RISK_PATTERNS, RiskPolicy, SemanticCache, SemanticEntry, SemanticLookup, SemanticSettings
from .embedder import Embedder, MiniLMEmbedder
from .exact import CacheControl, ExactCache, ExactLookup, exact_key
from .guards import Verdict, check
from .index import PartitionedIndex
from .scope import Scope, context_fingerprint
from .store import MemoryStore, ResponseStore, SqliteStore, StoredResponse

__all__ = [
    "CacheControl", "DEFAULT_RISK_PATTERNS", "Embedder", "ExactCache", "ExactLookup", "MemoryStore", "MiniLMEmbedder",
    "PartitionedIndex", "ResponseStore", "RiskPolicy", "Scope", "SemanticCache", "SemanticEntry", "SemanticLookup",
    "SemanticSettings", "SqliteStore", "StoredResponse", "Verdict", "check", "context_fingerprint", "exact_key",
]
