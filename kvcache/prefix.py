"""Prefix caching policy: find the longest cached prefix, gather it, store new blocks.

    PrefixCache.open(salt, model, token_ids, spans, owner) -> PrefixSession   one per request; a context manager
    session.match(num_prompt_tokens) -> PrefixMatch  longest cached prefix (first missing block ends it)
    session.gather(num_tokens) -> [(keys, values)]   per layer, ready to seed a KV cache
    session.pin(num_tokens, ttl_s) -> int           keep its first blocks from LRU for a while
    session.pin_on_ssd(num_tokens, ttl_s) -> int    the same on the SSD tier (written there now)
    session.store(token_ids, layer_states, num_tokens, snapshot)   cache the full blocks of the first num_tokens
    session.let_go()                                 release the held blocks: the caller keeps its own KV
    session.map(num_tokens) -> [Block]               hold its first cached blocks for a reader in place; unmap()
    session.state_at(num_tokens) -> state            a hybrid model's recurrent-state snapshot there
    PrefixCache.purge_owned(selects) -> Purged       take owners off blocks (RAM; the SSD tier has its own)

A hybrid model (attention layers and recurrent layers: gated delta, Mamba, short convolutions) keeps
its attention layers' KV in blocks as any model, and its recurrent layers' state as snapshots taken
at chosen block boundaries, each held by the block it ends (so salts, owners, purges, retention and
the SSD tier treat it as the block's own data). A recurrent state sums the whole prefix and cannot be
cut: such a session (`snapshots=True`) reuses its prefix up to the deepest held block with a snapshot.

The session owns its chain: it derives the tenant-salted root and the block hashes from the tokens,
and extends the chain itself when `store` is given more tokens (the prompt plus the reply).

Each block records its owners (opaque labels: the gateway's tenant, session and end user): the
session's owner joins the owners of every block it matches or stores.

A session holds a reference on every block it matched or stored, so nothing it uses can be evicted
under it; close() releases them last-block-first, which leaves a chain's tail older in the LRU
than its head (tails are evicted before the prefixes that other chains share). A caller that keeps
its own copy of the KV (the engine's running sequence) calls let_go() once it has what it needs, so
its blocks are not held twice under one budget (its own KV and the cached copies): they stay cached
but may give way, and the next store() holds them again, storing anew any evicted meanwhile.
A caller that reads the cached blocks in place instead (a decoding row, once its prompt is stored)
holds them through map() and drops its own copy: the KV is then held once, in the pool, in use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeGuard

import mlx.core as mx

from .chain import ExtraSpan, Roots, hash_blocks, public_blocks
from .keys import PUBLIC_SALT, PUBLIC_TENANT, BlockHash, TenantSalt, chain_root
from .pool import Block, BlockPool, Ghost, Ghosts, PoolStats, Purged
from .quant import QuantConfig, from_tensors, quantize, restore, state_from_tensors, to_tensors
from .ssd import ReuseMeter, SpillRequest, SsdTier, spill_admits

SLICEABLE_CACHE_TYPES = ("KVCache",)  # caches whose state is (keys, values) along a token axis
# Recurrent layers (Mamba, gated delta, short convolutions) carry one state for the whole prefix, a
# list of arrays: it cannot be cut at a block boundary, only snapshotted there.
RECURRENT_CACHE_TYPES = ("ArraysCache", "MambaCache")


@dataclass(frozen=True, slots=True)
class Cacheability:
    ok: bool
    reason: str = ""
    snapshots: bool = False  # recurrent layers: reuse needs a state snapshot where it ends


def is_recurrent(cache_layer: object) -> bool:
    """Whether a layer's cache is a recurrent state (snapshotted) rather than KV (cut into blocks)."""
    return type(cache_layer).__name__ in RECURRENT_CACHE_TYPES


def cacheability(cache_layers: Sequence[object]) -> Cacheability:
    """Plain KV is cut into blocks, recurrent layers are snapshotted at block boundaries; any other
    cache (a rotating window's ring buffer) cannot be reused: report, never guess."""
    kinds = {type(c).__name__ for c in cache_layers}
    unsupported = kinds.difference(SLICEABLE_CACHE_TYPES, RECURRENT_CACHE_TYPES)
    if unsupported:
        return Cacheability(False, "uncacheable:" + "+".join(sorted(unsupported)))
    return Cacheability(True, snapshots=bool(kinds.intersection(RECURRENT_CACHE_TYPES)))


Tier = Literal["", "ram", "ssd", "ram+ssd"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    num_prompt_tokens: int
    num_matched_tokens: int  # tokens in matched full blocks
    num_cached_tokens: int  # tokens actually reused: matched, capped at prompt - 1
    num_ram_tokens: int  # of the matched tokens, found in RAM ...
    num_ssd_tokens: int  # ... and promoted from the SSD tier
    # Why the chain stopped before the prompt's last full block ("" when it did not): "cold" (never
    # cached), "evicted" / "expired" / "purged" (cached, then removed so), "diverged" (the block
    # before, or the tenant's chain root, has other cached children: the prompt differs from them).
    miss_reason: str = ""
    # Where: the first missing block's start; for "diverged", the first token that differs from the
    # closest cached sibling (in_image: the tokens agree, an image's pixels differ).
    miss_at_token: int = 0
    miss_tier: str = ""  # evicted / expired / purged: from "ram" or "ssd"
    miss_lived_s: float = 0.0  # ... after this many seconds in that tier
    miss_in_image: bool = False
    num_public_tokens: int = 0  # the prompt's leading tokens in public blocks (shared by every tenant)
    chain: tuple[BlockHash, ...] = ()  # the prompt's full blocks' hashes: for traces and what-if curves
    # A hybrid model's matched tokens past the deepest held snapshot (reusable had a state been kept
    # where they end): recomputed for want of one
    num_tokens_without_state: int = 0

    @property
    def tier(self) -> Tier:
        """Where the reused tokens came from; "" when nothing was reused."""
        if not self.num_cached_tokens:
            return ""
        if self.num_ram_tokens and self.num_ssd_tokens:
            return "ram+ssd"
        return "ssd" if self.num_ssd_tokens else "ram"


@dataclass(frozen=True, slots=True)
class Miss:
    reason: str
    at_token: int
    tier: str = ""
    lived_s: float = 0.0
    in_image: bool = False


@dataclass(slots=True)
class PrefixCacheStats:
    num_lookups: int = 0
    num_hits: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_blocks_stored: int = 0
    num_ssd_promoted: int = 0
    num_promotion_failures: int = 0  # the RAM budget could not be reserved: recomputed instead
    num_ssd_not_read: int = 0  # lookups that left blocks on SSD: reading them is slower than recomputing here
    num_snapshots_superseded: int = 0  # passing snapshots dropped: a later request resumed past them
    num_tokens_without_state: int = 0  # hybrid models: matched tokens recomputed, no snapshot held where they end
    # snapshots asked for and not kept, by reason: "budget" (no room without evicting blocks in use),
    # "pinned" (the block's pin budget was spent on it without one), "chain_cut" (its block could not
    # be stored)
    snapshot_skips: dict = field(default_factory=dict)
    miss_reasons: dict = field(default_factory=dict)  # PrefixMatch.miss_reason -> lookups


@dataclass(frozen=True, slots=True)
class PrefixSnapshot:
    counters: PrefixCacheStats
    pool: PoolStats
    num_blocks: int
    num_bytes: int
    budget_bytes: int
    reserved_bytes: int  # of the budget, held by running sequences' own KV


class PrefixCache:
    """The RAM tier. Cache protocol: `name`, `stats()`, `purge()`, `close()`; like every call here
    they belong to the one thread that runs the model (blocks are MLX arrays)."""

    name = "prefix"

    def __init__(
        self,
        budget_bytes: int,
        block_size: int,
        ssd: SsdTier | None = None,
        quant: QuantConfig | None = None,
        write_through: bool = False,
        pin_budget_bytes: int = 0,
        clock=time.monotonic,
    ):
        self.block_size = block_size
        self.ssd = ssd
        # Every new block is offered to SSD when stored, not when evicted (and the admission policy's
        # hit count is not asked): a replica that dies leaves its conversations on a shared tier.
        self.write_through = write_through and ssd is not None
        self.quant = quant
        self.pool = BlockPool(
            budget_bytes,
            on_evict=self._spill if ssd else None,
            on_discard=self._remember,
            pin_budget_bytes=pin_budget_bytes,
            clock=clock,
        )
        self.counters = PrefixCacheStats()
        self.ghosts: Ghosts[BlockHash] = Ghosts()  # blocks that left RAM: why a later lookup missed
        # Whether a block on SSD is restored rather than recomputed: the engine sets it at start-up
        # from what it measured (judge_ssd); True until then.
        self.restore_from_ssd = True
        self.reuse = ReuseMeter()  # evicted blocks asked for again: the SSD admission rule measures it

    def judge_ssd(self, read_s_per_byte: float, prefill_s_per_token: float, bytes_per_token: int) -> bool:
        """Restore from SSD only where reading a token's KV is faster than computing it again (a
        slow network folder beside a fast accelerator: SGLang's HiCache users measured such). Sets
        and returns restore_from_ssd."""
        self.restore_from_ssd = read_s_per_byte * bytes_per_token < prefill_s_per_token
        return self.restore_from_ssd

    def stats(self) -> PrefixSnapshot:
        pool = self.pool
        counters = replace(
            self.counters,
            miss_reasons=dict(self.counters.miss_reasons),
            snapshot_skips=dict(self.counters.snapshot_skips),
        )
        return PrefixSnapshot(
            counters, replace(pool.counters), len(pool.by_hash), pool.num_bytes, pool.budget_bytes, pool.reserved_bytes
        )

    def purge(self) -> Purged:
        """Every block in RAM that no running request holds (nothing is spilled to SSD on the way)."""
        return self.pool.drop_free()

    def purge_owned(self, selects) -> Purged:
        """Take the owners `selects(owner)` picks off every RAM block; blocks left with none go."""
        return self.pool.purge_owned(selects)

    def close(self) -> None:
        self.purge()

    def reserve(self, nbytes: int) -> bool:
        """Hold nbytes of this cache's budget for a running sequence's own KV: one budget for cached
        blocks and running sequences. Free blocks are evicted (spilled to SSD) to make room; False
        when blocks in use and other reservations leave too little (the caller waits and retries)."""
        return self.pool.reserve(nbytes)

    def unreserve(self, nbytes: int) -> None:
        self.pool.unreserve(nbytes)

    def _remember(self, block: Block, how: str) -> None:
        self.ghosts.remember(block.block_hash, Ghost(how, time.monotonic() - block.stored_at, time.time()))

    def last_removal(self, block_hash: BlockHash) -> Miss | None:
        """How the block last left a tier (the later of RAM and SSD), if it was remembered."""
        ram = self.ghosts.get(block_hash)
        ssd = self.ssd.ghost(block_hash.hex()) if self.ssd is not None else None
        if ssd is not None and (ram is None or ssd.at >= ram.at):
            return Miss(ssd.how, 0, "ssd", ssd.lived_s)
        return Miss(ram.how, 0, "ram", ram.lived_s) if ram is not None else None

    def _spill(self, block: Block) -> None:
        ssd = self.ssd
        assert ssd is not None, "the pool spills only when the cache has an SSD tier"
        if spill_admits(ssd.config.admission, self.reuse, block):
            ssd.offer(_spill_request(block, self.block_size))
        else:
            ssd.refused()

    def persist(self) -> int:
        """Offer every admissible RAM block to the SSD tier (at shutdown). Returns how many."""
        if self.ssd is None:
            return 0
        blocks = [
            b
            for b in self.pool.by_hash.values()
            if not b.purged and self.ssd.admits(b.num_hits, b.end_token, self.reuse.worth(b.num_hits))
        ]
        for block in blocks:
            self.ssd.offer(_spill_request(block, self.block_size))
        return len(blocks)

    def open(
        self,
        salt: TenantSalt,
        model_fingerprint: str,
        token_ids: Sequence[int],
        spans: Sequence[ExtraSpan] = (),
        owner: str | None = None,
        snapshots: bool = False,
        tenant: str = "",
        public_tokens: int = 0,
    ) -> PrefixSession:
        """`owner`: who the request is (an opaque label purges select by); None records nobody.
        `snapshots`: the model has recurrent layers (reuse ends at a block with a state snapshot).
        `tenant`: whose data key seals the blocks at rest. `public_tokens`: the prompt's first tokens
        are exactly a declared public text: the blocks wholly inside it are shared by every tenant."""
        namespace = f"{model_fingerprint}|block={self.block_size}"
        roots = Roots(
            chain_root(salt, namespace),
            chain_root(PUBLIC_SALT, namespace),
            public_blocks(public_tokens, spans, self.block_size),
        )
        return PrefixSession(self, roots, tuple(token_ids), tuple(spans), owner, snapshots, tenant)


class PrefixSession:
    """Invariant: hashes == roots.hash_blocks(token_ids, block size, spans); held[i] is the block of
    hashes[i], acquired once, for i < len(held); mapped[i] too, acquired once more (map()), for
    i < len(mapped)."""

    def __init__(
        self,
        cache: PrefixCache,
        roots: Roots,
        token_ids: tuple[int, ...],
        spans: tuple[ExtraSpan, ...],
        owner: str | None = None,
        snapshots: bool = False,
        tenant: str = "",
    ):
        self.cache = cache
        self.owner = owner
        self.snapshots = snapshots
        self.tenant = tenant
        self.pool = cache.pool
        self.roots = roots
        self.spans = spans
        self.token_ids = token_ids
        self.hashes = roots.hash_blocks(token_ids, cache.block_size, spans)
        self.scope = roots.tenant.hex()[:16]
        self.held: list[Block] = []
        self.mapped: list[Block] = []
        self.closed = False

    def __enter__(self) -> PrefixSession:
        return self

    def __exit__(self, *exc_info) -> None:
        if not self.closed:
            self.close()

    def match(self, num_prompt_tokens: int) -> PrefixMatch:
        """Walk the chain in RAM, then continue the same chain on SSD; the first miss ends it. A
        hybrid session drops the passing snapshots other requests left before where it resumes."""
        for block_hash in self.hashes:
            block = self.pool.get(block_hash)
            if block is None:
                break
            self.pool.acquire(block, self.owner)
            block.num_hits += 1
            self.held.append(block)
        num_ram = len(self.held)
        if self.cache.ssd is not None:
            self._promote_from_ssd()
        size = self.cache.block_size
        matched = len(self.held) * size
        cached = self._reusable(num_prompt_tokens - 1)  # the last prompt token is always recomputed
        if self.snapshots:  # only a hybrid's blocks carry passing snapshots
            self._drop_passing_before(cached // size - 1)
        without_state = min(matched, num_prompt_tokens - 1) - cached
        stats = self.cache.counters
        stats.num_tokens_without_state += without_state
        stats.num_lookups += 1
        stats.num_hits += cached > 0
        stats.num_prompt_tokens += num_prompt_tokens
        stats.num_cached_tokens += cached
        miss = self._why_missed(num_prompt_tokens)
        if miss is not None:
            stats.miss_reasons[miss.reason] = stats.miss_reasons.get(miss.reason, 0) + 1
        stopped = miss or Miss("", 0)
        return PrefixMatch(
            num_prompt_tokens,
            matched,
            cached,
            num_ram * size,
            matched - num_ram * size,
            stopped.reason,
            stopped.at_token,
            stopped.tier,
            stopped.lived_s,
            stopped.in_image,
            self.roots.num_public * size,
            tuple(self.hashes[: num_prompt_tokens // size]),
            without_state,
        )

    def _reusable(self, limit: int) -> int:
        """Tokens of the held blocks that can be reused, at most `limit`: any count for plain KV; for a
        hybrid model, the end of the deepest held block within it that has a state snapshot."""
        matched = min(len(self.held) * self.cache.block_size, limit)
        if not self.snapshots:
            return matched
        for index in reversed(range(matched // self.cache.block_size)):
            if self.held[index].state:
                return self.held[index].end_token
        return 0

    def _why_missed(self, num_prompt_tokens: int) -> Miss | None:
        """Why the match stopped before the prompt's last full block that could be reused (None: it
        did not). Ghosts and siblings are looked up under this tenant's salted hashes only, so a miss
        never tells of another tenant's blocks."""
        index, size = len(self.held), self.cache.block_size
        start = index * size
        if index >= len(self.hashes) or start >= num_prompt_tokens - 1:
            return None
        removal = self.cache.last_removal(self.hashes[index])
        if removal is not None:
            return replace(removal, at_token=start)
        siblings = self.pool.children.get(self.roots.parent(index, self.hashes))
        if not siblings:
            return Miss("cold", start)
        mine = self.token_ids[start : start + size]
        same = max(_common_prefix(mine, self.pool.by_hash[h].token_ids) for h in siblings)
        if same < len(mine):
            return Miss("diverged", start + same)
        # the same tokens and another hash: an image in this block has other pixels
        image_start = min(
            (span.start for span in self.spans if span.start < start + size and span.end > start), default=start
        )
        return Miss("diverged", max(image_start, start), in_image=True)

    def _promote_from_ssd(self) -> None:
        """Continue the chain on SSD. RAM is reserved for the whole run of blocks on disk before any
        read; a run that cannot be reserved is recomputed (counted), and a block that cannot be read
        or verified ends the match there."""
        ssd, start = self.cache.ssd, len(self.held)
        assert ssd is not None, "promotion is asked for only when the cache has an SSD tier"
        if not self.cache.restore_from_ssd:
            self.cache.counters.num_ssd_not_read += (
                ssd.contains(self.hashes[start].hex()) if start < len(self.hashes) else 0
            )
            return
        run, sizes = self._run_on_ssd(start)
        if len(run) < len(self.hashes) - start and ssd.refresh():  # other writers of a shared folder
            run, sizes = self._run_on_ssd(start)
        if not run:
            return
        if not self.pool.make_room(sum(sizes)):
            self.cache.counters.num_promotion_failures += 1
            return
        for offset, tensors in enumerate(ssd.read_chain(run)):
            kv, state = from_tensors(tensors, self.cache.quant), state_from_tensors(tensors)
            block = self._new_block(start + offset, kv, state)
            block.owners |= ssd.owners_of(run[offset])
            stored = self.pool.insert(block)
            if stored is None:
                self.cache.counters.num_promotion_failures += 1
                return
            stored.num_hits += 1
            self.held.append(stored)
            self.cache.counters.num_ssd_promoted += 1

    def _run_on_ssd(self, start: int) -> tuple[list[str], list[int]]:
        """The chain's blocks from `start` that the SSD tier holds, up to the first it lacks, and their RAM sizes."""
        ssd = self.cache.ssd
        assert ssd is not None, "promotion is asked for only when the cache has an SSD tier"
        run: list[str] = []
        sizes: list[int] = []
        for block_hash in self.hashes[start:]:
            size = ssd.ram_size_of(block_hash.hex())
            if size is None:
                break
            run.append(block_hash.hex())
            sizes.append(size)
        return run, sizes

    def _new_block(self, index: int, kv: tuple, state: tuple = ()) -> Block:
        self.cache.reuse.asked_again(self.hashes[index])  # absent from RAM and asked for: was it evicted?
        parent = self.roots.parent(index, self.hashes)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + state_nbytes(state)  # from shapes: nothing is evaluated
        size = self.cache.block_size
        public = index < self.roots.num_public
        return Block(
            self.hashes[index],
            kv,
            nbytes,
            parent_hash=parent,
            end_token=(index + 1) * size,
            scope=self.roots.public.hex()[:16] if public else self.scope,
            tenant=PUBLIC_TENANT if public else self.tenant,
            token_ids=self.token_ids[index * size : (index + 1) * size],
            owners={self.owner} if self.owner is not None else set(),
            state=state,
        )

    def gather(self, num_tokens: int, start: int = 0) -> list[tuple[mx.array, mx.array]]:
        """Per layer, a copy of the held blocks' keys and values of tokens [start, num_tokens)
        (`start` on a block boundary)."""
        size = self.cache.block_size
        assert start % size == 0, (start, size)
        blocks = self.held[start // size : -(-num_tokens // size)]
        assert start + len(blocks) * size >= num_tokens, (len(blocks), size, num_tokens)
        layers = []
        for layer in range(len(blocks[0].kv)):
            keys = mx.concatenate([restore(b.kv[layer][0]) for b in blocks], axis=2)[:, :, : num_tokens - start, :]
            values = mx.concatenate([restore(b.kv[layer][1]) for b in blocks], axis=2)[:, :, : num_tokens - start, :]
            layers.append((keys, values))
        return layers

    def store(
        self,
        token_ids: Sequence[int],
        layer_states: Sequence[tuple[mx.array, mx.array]],
        num_tokens: int,
        snapshot: tuple[int, tuple] | None = None,
        passing: bool = False,
        first: int = 0,
    ) -> int:
        """Cache every full block of the first `num_tokens` of `token_ids` that this session does not
        hold. `token_ids` is the session's tokens or a continuation of them (the prompt and the reply).
        `layer_states` hold the tokens from `first` on (those before are blocks this session maps,
        which stay in the pool while mapped: they are held again, never copied).
        `snapshot`: (tokens, state), the recurrent layers' state after that many tokens (a block
        boundary within num_tokens), kept by the block it ends; `passing`: it marks only where this
        request ended (Block.passing): a later request that resumes past it drops it (match)."""
        self._extend(tuple(token_ids[:num_tokens]))
        size = self.cache.block_size
        num_blocks = min(num_tokens // size, len(self.hashes))
        assert first <= len(self.mapped) * size, (first, len(self.mapped))
        new_arrays, new_blocks = [], []
        for index in range(len(self.held), num_blocks):
            block, created = self._block_for(index, (layer_states, first), snapshot, passing)
            if block is None:
                break  # budget full of blocks in use: the chain cannot grow past here
            self.held.append(block)
            if created:
                new_arrays += [getattr(a, "data", a) for pair in block.kv for a in pair]
                new_arrays += [array for arrays in block.state for array in arrays]
                new_blocks.append(block)
        new_arrays += self._add_snapshot(snapshot, passing)
        mx.eval(new_arrays)  # copy the new blocks out now, so the request's cache buffers can be freed
        ssd = self.cache.ssd
        if self.cache.write_through and ssd is not None:  # write_through implies an SSD tier
            for block in new_blocks:
                ssd.offer(_spill_request(block, size))
        return len(new_blocks)

    def _extend(self, token_ids: tuple[int, ...]) -> None:
        """Grow the chain to cover `token_ids`, hashing only the blocks it does not have yet."""
        shared = min(len(token_ids), len(self.token_ids))
        assert token_ids[:shared] == self.token_ids[:shared], "store() with tokens that do not continue the session's"
        if len(token_ids) <= len(self.token_ids):
            return
        known = len(self.hashes)
        parent = self.roots.parent(known, self.hashes)
        self.hashes += hash_blocks(token_ids, self.cache.block_size, parent, self.spans, first_block=known)
        self.token_ids = token_ids

    def _block_for(
        self, index: int, states: tuple, snapshot: tuple[int, tuple] | None, passing: bool
    ) -> tuple[Block | None, bool]:
        """The pool's block at chain position `index`, held (a mapped block always is: in use, it
        stays indexed even when purged); else a new one from `states`, the caller's per-layer
        (keys, values) and the token they start at."""
        existing = self.pool.get(self.hashes[index])
        if existing is not None:
            self.pool.acquire(existing, self.owner)
            return existing, False
        layer_states, first = states
        end = (index + 1) * self.cache.block_size
        assert end - self.cache.block_size >= first, (index, first)
        cut = slice(end - self.cache.block_size - first, end - first)
        kv = tuple((self._keep(k[:, :, cut, :], end), self._keep(v[:, :, cut, :], end)) for k, v in layer_states)
        state = _own_state(snapshot[1]) if snapshot is not None and snapshot[0] == end else ()
        block = self.pool.insert(self._new_block(index, kv, state))
        if block is not None:
            self.cache.counters.num_blocks_stored += 1
            block.passing = bool(state) and passing
        return block, block is not None

    def _add_snapshot(self, snapshot: tuple[int, tuple] | None, passing: bool) -> list[mx.array]:
        """A held block that ends where the snapshot was taken and has none gets it (the block was
        cached before, without one); the arrays to evaluate. A snapshot there already stays, and
        lasts if either does."""
        if snapshot is None or not self.snapshots:
            return []
        num_tokens, state = snapshot
        size = self.cache.block_size
        assert num_tokens % size == 0, "snapshots are taken at block boundaries"
        index = num_tokens // size - 1
        if index < 0:
            return []
        if index >= len(self.held):
            return self._skip_snapshot("chain_cut")
        block = self.held[index]
        if block.state:
            block.passing = block.passing and passing
            return []
        own = _own_state(state)
        if not self.pool.add_state(block, own, state_nbytes(own)):
            return self._skip_snapshot("pinned" if block.block_hash in self.pool.pins else "budget")
        block.passing = passing
        return [array for arrays in own for array in arrays]

    def _skip_snapshot(self, reason: str) -> list[mx.array]:
        skips = self.cache.counters.snapshot_skips
        skips[reason] = skips.get(reason, 0) + 1
        return []

    def _drop_passing_before(self, index: int) -> None:
        """This request resumes at held[index]: the passing snapshots other requests left on
        held[:index] are behind the conversation now (pinned blocks keep theirs: a pin's bytes are
        counted with its snapshot)."""
        for block in self.held[: max(index, 0)]:
            if block.passing and block.block_hash not in self.pool.pins:
                self.pool.drop_state(block, state_nbytes(block.state))
                self.cache.counters.num_snapshots_superseded += 1

    def state_at(self, num_tokens: int) -> tuple:
        """The recurrent-state snapshot after the first num_tokens (a reusable count from match())."""
        block = self.held[num_tokens // self.cache.block_size - 1]
        assert block.end_token == num_tokens and block.state, "match() reuses up to a block with a snapshot"
        return block.state

    def _keep(self, x: mx.array, end_token: int):
        """A copy the block owns (never a view pinning the request's buffer), quantised if configured."""
        quant = self.cache.quant
        if quant is not None and end_token >= quant.min_tokens:
            return quantize(x, quant)
        return mx.contiguous(x)

    def pin(self, num_tokens: int, ttl_s: float) -> int:
        """Pin the held blocks of the first num_tokens tokens (whole blocks) for ttl_s, within their
        tenant's pin budget (its end users' chains share it); how many were pinned."""
        num_blocks = min(num_tokens // self.cache.block_size, len(self.held))
        pinned = 0
        for block in self.held[:num_blocks]:
            if not self.pool.pin(block, ttl_s):
                break  # the budget is spent: a pinned prefix never has a gap
            pinned += 1
        return pinned

    def pin_on_ssd(self, num_tokens: int, ttl_s: float) -> int:
        """Write the held blocks of the first num_tokens tokens to the SSD tier now (past its
        admission rule) and pin them there for ttl_s, within the tenant's SSD pin budget; how many
        were pinned (0 without an SSD tier)."""
        ssd = self.cache.ssd
        if ssd is None:
            return 0
        blocks = self.held[: min(num_tokens // self.cache.block_size, len(self.held))]
        for block in blocks:
            ssd.offer(_spill_request(block, self.cache.block_size))
        return ssd.pin(self.tenant, [(b.block_hash.hex(), b.nbytes) for b in blocks], time.time() + ttl_s)

    def write_to_ssd(self) -> int:
        """Offer every held block to the SSD tier now, past its admission rule: the KV of a preempted
        sequence, which RAM will likely evict before the sequence resumes. How many were offered
        (0 without an SSD tier)."""
        ssd = self.cache.ssd
        if ssd is None:
            return 0
        return sum(ssd.offer(_spill_request(block, self.cache.block_size)) for block in self.held)

    def map(self, num_tokens: int) -> list[Block]:
        """Hold the cached blocks of the session's first `num_tokens` tokens for a running sequence
        that reads them where they are, instead of a copy of its own: whole blocks of plain
        (unquantised) KV from the chain's start, up to the first not in RAM; every block mapped so
        far. A later call maps on from where the last stopped (a prompt maps its cached prefix as it
        comes in, then the blocks it stored itself as it joins the decode rows). They stay in use
        (never evicted) until unmap() or close(). A block's arrays are never written: the sequence
        writes its later tokens elsewhere."""
        assert not self.closed, "map() on a closed session"
        for block_hash in self.hashes[len(self.mapped) : num_tokens // self.cache.block_size]:
            block = self.pool.get(block_hash)
            if not _mappable(block):
                break
            self.pool.acquire(block)
            self.mapped.append(block)
        return list(self.mapped)

    def num_tokens_in_use(self, num_tokens: int) -> int:
        """Of the first `num_tokens`, the tokens map() would read in place now whose blocks another
        reader holds already (from the start, up to the first that is free or not mappable): mapping
        them adds nothing to what the pool keeps. Looked up, nothing held. A free block costs the
        budget when mapped (it can no longer be evicted), so it is not counted."""
        count = 0
        for block_hash in self.hashes[: num_tokens // self.cache.block_size]:
            block = self.pool.get(block_hash)
            if not _mappable(block) or not block.ref_count:
                break
            count += 1
        return count * self.cache.block_size

    def unmap(self) -> None:
        """Let go of the blocks map() holds, last first."""
        for block in reversed(self.mapped):
            self.pool.release(block)
        self.mapped = []

    def let_go(self) -> None:
        """Release every held block now, last first (as close() does); the session stays open. Its
        next store() walks the chain from the start: blocks still cached are held again, blocks
        evicted meanwhile are stored again from the caller's KV, so the chain it leaves has no gap."""
        for block in reversed(self.held):
            self.pool.release(block)
        self.held = []

    def close(self) -> None:
        assert not self.closed, "PrefixSession closed twice"
        self.closed = True
        self.unmap()
        for block in reversed(self.held):
            self.pool.release(block)
        self.held = []


def _mappable(block: Block | None) -> TypeGuard[Block]:
    """Whether a sequence can read the block in place: in RAM, not purged, plain (unquantised) KV."""
    return block is not None and not block.purged and bool(block.kv) and isinstance(block.kv[0][0], mx.array)


def _spill_request(block: Block, block_size: int) -> SpillRequest:
    return SpillRequest(
        block.block_hash,
        block.parent_hash or b"",
        block_size,
        block.scope,
        to_tensors(block.kv, block.state),
        tuple(sorted(block.owners)),
        block.tenant,
    )


def _own_state(state: tuple) -> tuple:
    """A snapshot the block owns: contiguous copies (a row of a batched state is a view that would
    pin the whole batch's buffer). Never quantised: a recurrent state compounds every rounding."""
    return tuple(tuple(mx.contiguous(array) for array in arrays) for arrays in state)


def state_nbytes(state: tuple) -> int:
    """Bytes of a recurrent-state snapshot (per layer, its arrays), from shapes: nothing is evaluated."""
    return sum(array.nbytes for arrays in state for array in arrays)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two blocks share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def default_budget_bytes(fraction: float = 0.25) -> int:
    """A fraction of the memory available now (Linux MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * fraction)
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)
