"""kvcache: prefix KV blocks with chained, tenant-salted hashes, in a byte-budgeted block pool.

A library: never imports `gateway`, never reads HTTP headers; returns typed results.
See README.md in this folder for the architecture and invariants.
"""

from .chain import ExtraSpan, hash_blocks
from .keys import BlockHash, TenantSalt, block_hash, chain_root, end_user_salt, tenant_salt
from .pool import Block, BlockPool, FreeBlockQueue, Purged
from .prefix import (
    Cacheability,
    PrefixCache,
    PrefixCacheStats,
    PrefixMatch,
    PrefixSession,
    PrefixSnapshot,
    cacheability,
    default_budget_bytes,
    is_recurrent,
    state_nbytes,
)

__all__ = [
    "Block",
    "BlockHash",
    "BlockPool",
    "Cacheability",
    "ExtraSpan",
    "FreeBlockQueue",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixMatch",
    "PrefixSession",
    "PrefixSnapshot",
    "Purged",
    "TenantSalt",
    "block_hash",
    "cacheability",
    "chain_root",
    "default_budget_bytes",
    "end_user_salt",
    "hash_blocks",
    "is_recurrent",
    "state_nbytes",
    "tenant_salt",
]
