"""Prefix caching policy: find the longest cached prefix, gather it, store new blocks.

    PrefixCache.open(hashes) -> PrefixSession        one per request; close() exactly once
    session.match(num_prompt_tokens) -> PrefixMatch  longest cached prefix (first missing block ends it)
    session.gather(num_tokens) -> [(keys, values)]   per layer, ready to seed a KV cache
    session.store(hashes, layer_states, num_tokens)  cache the full blocks of the first num_tokens

A session holds a reference on every block it matched or stored, so nothing it uses can be evicted
under it; close() releases them last-block-first, which leaves a chain's tail older in the LRU
than its head (tails are evicted before the prefixes that other chains share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from .chain import ExtraSpan, hash_blocks
from .keys import BlockHash, TenantSalt, chain_root
from .pool import Block, BlockPool

SLICEABLE_CACHE_TYPES = ("KVCache",)  # caches whose state is (keys, values) along a token axis


@dataclass(frozen=True, slots=True)
class Cacheability:
    ok: bool
    reason: str = ""


def cacheability(cache_layers: Sequence[object]) -> Cacheability:
    """Rotating/sliding-window or SSM caches cannot be cut into blocks: report, never guess."""
    kinds = {type(c).__name__ for c in cache_layers}
    unsupported = kinds.difference(SLICEABLE_CACHE_TYPES)
    if unsupported:
        return Cacheability(False, "uncacheable:" + "+".join(sorted(unsupported)))
    return Cacheability(True)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    num_prompt_tokens: int
    num_matched_tokens: int  # tokens in matched full blocks
    num_cached_tokens: int  # tokens actually reused: matched, capped at prompt - 1
    tier: str  # "ram" when anything matched, else ""


@dataclass(slots=True)
class PrefixCacheStats:
    num_lookups: int = 0
    num_hits: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_blocks_stored: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(budget_bytes)
        self.stats = PrefixCacheStats()

    def root(self, salt: TenantSalt, model_fingerprint: str) -> BlockHash:
        return chain_root(salt, f"{model_fingerprint}|block={self.block_size}")

    def hash(self, token_ids: Sequence[int], root: BlockHash, spans: Sequence[ExtraSpan] = ()) -> list[BlockHash]:
        return hash_blocks(token_ids, self.block_size, root, spans)

    def open(self, hashes: Sequence[BlockHash]) -> PrefixSession:
        return PrefixSession(self, list(hashes))


class PrefixSession:
    def __init__(self, cache: PrefixCache, hashes: list[BlockHash]):
        self.cache = cache
        self.pool = cache.pool
        self.hashes = hashes
        self.held: list[Block] = []  # blocks [0, len(held)) of the chain, each acquired once
        self.closed = False

    def match(self, num_prompt_tokens: int) -> PrefixMatch:
        for block_hash in self.hashes:
            block = self.pool.get(block_hash)
            if block is None:
                break
            self.pool.acquire(block)
            self.held.append(block)
        matched = len(self.held) * self.cache.block_size
        cached = min(matched, num_prompt_tokens - 1)  # the last prompt token is always recomputed
        stats = self.cache.stats
        stats.num_lookups += 1
        stats.num_hits += cached > 0
        stats.num_prompt_tokens += num_prompt_tokens
        stats.num_cached_tokens += cached
        return PrefixMatch(num_prompt_tokens, matched, cached, "ram" if cached > 0 else "")

    def gather(self, num_tokens: int) -> list[tuple[mx.array, mx.array]]:
        size = self.cache.block_size
        blocks = self.held[: -(-num_tokens // size)]
        assert len(blocks) * size >= num_tokens, (len(blocks), size, num_tokens)
        layers = []
        for layer in range(len(blocks[0].kv)):
            keys = mx.concatenate([b.kv[layer][0] for b in blocks], axis=2)[:, :, :num_tokens, :]
            values = mx.concatenate([b.kv[layer][1] for b in blocks], axis=2)[:, :, :num_tokens, :]
            layers.append((keys, values))
        return layers

    def store(self, hashes: Sequence[BlockHash], layer_states: Sequence[tuple[mx.array, mx.array]], num_tokens: int) -> int:
        """Cache every full block of the first `num_tokens` tokens that this session does not hold.
        `hashes` must extend the session's chain (a longer sequence with the same prefix)."""
        size = self.cache.block_size
        num_blocks = min(num_tokens // size, len(hashes))
        assert all(b.block_hash == h for b, h in zip(self.held, hashes)), "store() on a different chain"
        new_arrays, num_new = [], 0
        for index in range(len(self.held), num_blocks):
            block, created = self._block_for(hashes[index], layer_states, index * size, (index + 1) * size)
            if block is None:
                break  # budget full of blocks in use: the chain cannot grow past here
            self.held.append(block)
            if created:
                new_arrays += [a for pair in block.kv for a in pair]
                num_new += 1
        mx.eval(new_arrays)  # copy the new blocks out now, so the request's cache buffers can be freed
        self.hashes = list(hashes)
        return num_new

    def _block_for(self, block_hash: BlockHash, layer_states, begin: int, end: int) -> tuple[Block | None, bool]:
        existing = self.pool.get(block_hash)
        if existing is not None:
            self.pool.acquire(existing)
            return existing, False
        kv = tuple((mx.contiguous(k[:, :, begin:end, :]), mx.contiguous(v[:, :, begin:end, :])) for k, v in layer_states)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)  # from shape and dtype: nothing is evaluated
        block = self.pool.insert(block_hash, kv, nbytes)
        if block is not None:
            self.cache.stats.num_blocks_stored += 1
        return block, block is not None

    def close(self) -> None:
        assert not self.closed, "PrefixSession closed twice"
        self.closed = True
        for block in reversed(self.held):
            self.pool.release(block)
        self.held = []


def default_budget_bytes(fraction: float = 0.25) -> int:
    """A fraction of the memory available now (Linux MemAvailable; else physical memory)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * fraction)
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)
