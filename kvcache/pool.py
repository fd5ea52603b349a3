"""The block pool: cached KV blocks by hash, with ref counts, a byte budget and an O(1) segmented LRU.

Invariants (checked by `check()` in tests):
- every block is in `by_hash`; a block is in the free queue iff its ref_count == 0;
- blocks in use (ref_count > 0) are never evicted;
- `num_bytes` == sum of the blocks' nbytes; `free.num_bytes` == sum over the free queue's blocks;
- `num_bytes + reserved_bytes <= budget_bytes`;
- a block is `purged` iff a purge took its last owner while it was in use: it leaves the pool
  when its last holder releases it, never through the free queue (a new owner clears the mark);
- a pinned block holds one reference of its own until its pin ends (TTL passed, purged, or given
  up to make room): `pins` maps it to its end, and `pinned_bytes[tenant]` sums the pinned blocks of
  the tenant whose key seals them (`Block.tenant`), at most `pin_budget_bytes` per tenant: a tenant's
  end users, each with a chain root of their own when kept apart, share their tenant's budget.

Eviction is a segmented LRU (SLRU), scan-resistant: a free block that was never reused since it was
stored waits in `probation`, one reused at least once in `protected` (at most PROTECTED_FRACTION of
the budget; its least recent overflow goes back to probation's recent end), and eviction takes
probation's least recent block first. A flood of one-off prompts so churns probation only, and the
system prompts everyone reuses stay. (`segmented=False`: one LRU queue, the policy before; the cache
simulator, evals.cache_sim, replays both on every trace.)

Owners are opaque labels (the gateway's "tenant, session, end user"): a block shared by several
sessions is owned by each of them, and a purge removes the selected owners' references, deleting a
block only once no owner is left.

Reservations are bytes held under the same budget for KV that lives outside the pool: the running
sequences' own caches. Reserving evicts free blocks to make room (cached blocks give way to running
sequences), and a reservation is never taken back by an insert (never the reverse).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .keys import BlockHash

SENTINEL = BlockHash(b"")  # the free queue's head and tail, never in the pool
K = TypeVar("K", bound=Hashable)


@dataclass(slots=True, eq=False)
class Block:
    block_hash: BlockHash
    kv: tuple = ()  # per layer: (keys, values), each (1, kv_heads, block_size, head_dim) or Quantized
    nbytes: int = 0  # kv and state
    ref_count: int = 0
    parent_hash: BlockHash | None = None
    end_token: int = 0  # the block covers tokens [end_token - block_size, end_token) of its chain
    scope: str = ""  # a digest of the chain's root (tenant), written to SSD metadata
    tenant: str = ""  # whose data key seals it at rest (keys.PUBLIC_TENANT for a public prefix's block)
    num_hits: int = 0  # lookups that reused this block
    last_used: float = 0.0  # time.monotonic() when it last became free: expire() drops idle blocks
    token_ids: tuple[int, ...] = ()  # the block's tokens (where a diverging prompt first differs)
    stored_at: float = 0.0  # time.monotonic() when it entered the pool (miss diagnosis: how long it lived)
    owners: set[str] = field(default_factory=set)
    purged: bool = False  # no owner left, but in use: it goes when released
    # A hybrid model's recurrent layers' state after the block's last token (per recurrent layer, its
    # arrays), or () when no snapshot was taken here: a prefix is restorable only up to a block with one.
    state: tuple = ()
    # The snapshot passes: it marks where one request's prompt or reply ended (False: it lasts — a
    # snapshot interval, a breakpoint, an image's end — or there is none). A passing snapshot goes
    # once a later request resumes past it on its chain.
    passing: bool = False
    protected: bool = False  # while free: in the protected segment (reused since stored), else probation
    # intrusive links of the free queue; None while the block is in use
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Blocks with ref_count 0, least recently used at the head.

    An intrusive doubly linked list with sentinel head and tail: removing a block from the middle
    (when a lookup reuses it) is O(1) and allocates nothing, unlike deque.remove (O(n)) or an
    OrderedDict keyed by hash (a dict operation and a node per move).
    """

    def __init__(self) -> None:
        self.head = Block(SENTINEL)
        self.tail = Block(SENTINEL)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_blocks = 0
        self.num_bytes = 0

    def append(self, block: Block) -> None:
        last = self.tail.prev
        assert last is not None, "the sentinels are always linked"
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block
        self.num_blocks += 1
        self.num_bytes += block.nbytes

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"{block.block_hash!r} is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_blocks -= 1
        self.num_bytes -= block.nbytes

    def oldest(self) -> Block | None:
        """The least recently used free block, left in the queue; None when it is empty."""
        first = self.head.next
        return None if first is None or first is self.tail else first

    def pop_oldest(self) -> Block | None:
        oldest = self.oldest()
        if oldest is not None:
            self.remove(oldest)
        return oldest

    def __iter__(self) -> Iterator[Block]:
        node = self.head.next
        while node is not None and node is not self.tail:
            yield node
            node = node.next


PROTECTED_FRACTION = 0.4  # of the budget, what reused free blocks may hold (evals.cache_sim: 0.2-0.8 tried)


class SegmentedFreeBlocks:
    """The free blocks as two LRU queues: `probation` (never reused since stored) and `protected`
    (reused), the latter at most `protected_bytes`. Invariant: a free block is in protected iff its
    `protected` flag is set; the queues' counts add up to the free blocks'."""

    def __init__(self, protected_bytes: int) -> None:
        self.probation, self.protected = FreeBlockQueue(), FreeBlockQueue()
        self.protected_bytes = protected_bytes

    @property
    def num_blocks(self) -> int:
        return self.probation.num_blocks + self.protected.num_blocks

    @property
    def num_bytes(self) -> int:
        return self.probation.num_bytes + self.protected.num_bytes

    def append(self, block: Block) -> None:
        block.protected = block.num_hits > 0
        (self.protected if block.protected else self.probation).append(block)
        while self.protected.num_bytes > self.protected_bytes:
            demoted = self.protected.pop_oldest()
            assert demoted is not None, "protected bytes come from protected blocks"
            demoted.protected = False
            self.probation.append(demoted)

    def remove(self, block: Block) -> None:
        (self.protected if block.protected else self.probation).remove(block)
        block.protected = False

    def pop_oldest(self) -> Block | None:
        """The next block to evict: probation's least recent, else protected's."""
        victim = self.probation.oldest() or self.protected.oldest()
        if victim is not None:
            self.remove(victim)
        return victim

    def __iter__(self) -> Iterator[Block]:
        yield from self.probation
        yield from self.protected


@dataclass(frozen=True, slots=True)
class Ghost:
    """A block that left a tier: how, after how long there, and when (time.time())."""

    how: str  # "evicted" | "expired" | "purged"
    lived_s: float
    at: float


GHOST_CAPACITY = 65536  # removed block hashes a tier remembers for miss reasons (~5 MB)


class Ghosts(Generic[K]):
    """Recently removed blocks and how they went, oldest first, at most `capacity`: a miss on one of
    them says evicted / expired / purged rather than cold. Keys are salted block hashes, so no lookup
    can learn of another tenant's blocks. Not thread-safe: the tier that owns it guards it."""

    def __init__(self, capacity: int = GHOST_CAPACITY) -> None:
        self.capacity = capacity
        self.by_key: OrderedDict[K, Ghost] = OrderedDict()

    def remember(self, key: K, ghost: Ghost) -> None:
        self.by_key[key] = ghost
        self.by_key.move_to_end(key)
        while len(self.by_key) > self.capacity:
            self.by_key.popitem(last=False)

    def get(self, key: K) -> Ghost | None:
        return self.by_key.get(key)


@dataclass(frozen=True, slots=True)
class Purged:
    """What a purge removed (the cache protocol's result; every layer reports these three)."""

    num_entries: int = 0  # blocks
    num_bytes: int = 0
    num_files: int = 0


@dataclass(slots=True)
class PoolStats:
    num_pinned: int = 0  # pins taken (a block pinned again only moves its end)
    num_pins_refused: int = 0  # pins past the tenant's pin budget
    num_pins_expired: int = 0
    num_pins_given_up: int = 0  # pins ended early so running sequences fit (the blocks spill to SSD)
    num_inserted: int = 0
    num_evicted: int = 0
    num_rejected: int = 0  # inserts refused: the budget was held by blocks in use and reservations
    num_evicted_to_reserve: int = 0  # of num_evicted, evicted to make room for a reservation
    num_expired: int = 0  # free blocks dropped by expire(): idle past the retention
    num_purged: int = 0  # blocks whose last owner a purge removed


class BlockPool:
    def __init__(
        self,
        budget_bytes: int,
        on_evict: Callable[[Block], None] | None = None,
        on_discard: Callable[[Block, str], None] | None = None,
        pin_budget_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        segmented: bool = True,
    ):
        self.budget_bytes = budget_bytes
        self.pin_budget_bytes = pin_budget_bytes  # per tenant; 0: nothing is pinned
        self.clock = clock  # pins' TTLs run on it (tests inject one)
        self.pins: dict[BlockHash, float] = {}  # pinned block -> when its pin ends (clock time)
        self.pinned_bytes: dict[str, int] = {}  # tenant -> bytes of its pinned blocks
        self.on_evict = on_evict  # e.g. spill to the SSD tier; called before the block's data is dropped
        self.on_discard = on_discard  # (block, "evicted" | "expired" | "purged") once it has left the pool
        self.by_hash: dict[BlockHash, Block] = {}
        # parent hash (None: a chain's first block) -> its blocks in the pool
        self.children: dict[BlockHash | None, set[BlockHash]] = {}
        self.free: FreeBlockQueue | SegmentedFreeBlocks = (
            SegmentedFreeBlocks(int(budget_bytes * PROTECTED_FRACTION)) if segmented else FreeBlockQueue()
        )
        self.num_bytes = 0
        self.reserved_bytes = 0  # held for KV outside the pool (running sequences)
        self.counters = PoolStats()

    def get(self, block_hash: BlockHash) -> Block | None:
        return self.by_hash.get(block_hash)

    def acquire(self, block: Block, owner: str | None = None) -> None:
        """Hold a block; `owner` (when given) joins its owners."""
        if block.ref_count == 0:
            self.free.remove(block)
        block.ref_count += 1
        if owner is not None:
            block.owners.add(owner)
            block.purged = False

    def release(self, block: Block) -> None:
        assert block.ref_count > 0, f"release of a free block {block.block_hash!r}"
        block.ref_count -= 1
        if block.ref_count == 0 and block.purged:
            self._discard(block, "purged")
        elif block.ref_count == 0:
            block.last_used = time.monotonic()
            self.free.append(block)  # each free queue stays ordered by last_used

    def insert(self, block: Block) -> Block | None:
        """Add a block, acquired once by the caller; evicts LRU free blocks to fit the budget.
        Returns None (and counts it) if the budget cannot be met without evicting blocks in use."""
        block_hash, nbytes = block.block_hash, block.nbytes
        assert block_hash not in self.by_hash, "insert of a block that is cached already"
        if not self.make_room(nbytes):
            self.counters.num_rejected += 1
            return None
        block.ref_count = 1
        block.stored_at = time.monotonic()
        self.by_hash[block_hash] = block
        self.children.setdefault(block.parent_hash, set()).add(block_hash)
        self.num_bytes += nbytes
        self.counters.num_inserted += 1
        return block

    def add_state(self, block: Block, state: tuple, nbytes: int) -> bool:
        """Give a cached block in use a recurrent-state snapshot of nbytes (it had none), within the
        budget; False, changing nothing, when it does not fit or the block is pinned (its pin budget
        was spent on its size without one)."""
        assert block.ref_count > 0 and not block.state, "a snapshot joins a held block that has none"
        if block.block_hash in self.pins or not self.make_room(nbytes):
            return False
        block.state = state
        block.nbytes += nbytes
        self.num_bytes += nbytes
        return True

    def drop_state(self, block: Block, nbytes: int) -> None:
        """Take a held block's snapshot of nbytes off; its KV stays cached."""
        assert block.ref_count > 0 and block.state and block.block_hash not in self.pins, "a held, unpinned snapshot"
        block.state, block.passing = (), False
        block.nbytes -= nbytes
        self.num_bytes -= nbytes

    def pin(self, block: Block, ttl_s: float) -> bool:
        """Keep a cached block from LRU eviction for ttl_s (a pinned block pinned again keeps the later
        end); False, pinning nothing, past its tenant's pin budget."""
        until = self.clock() + ttl_s
        if block.block_hash in self.pins:
            self.pins[block.block_hash] = max(until, self.pins[block.block_hash])
            return True
        pinned = self.pinned_bytes.get(block.tenant, 0)
        if pinned + block.nbytes > self.pin_budget_bytes:
            self.counters.num_pins_refused += 1
            return False
        self.acquire(block)
        self.pins[block.block_hash] = until
        self.pinned_bytes[block.tenant] = pinned + block.nbytes
        self.counters.num_pinned += 1
        return True

    def expire_pins(self) -> int:
        """End every pin past its TTL: its block is an ordinary cached block again. Returns how many."""
        now = self.clock()
        ended = [block_hash for block_hash, until in self.pins.items() if until <= now]
        for block_hash in ended:
            self._unpin(self.by_hash[block_hash])
        self.counters.num_pins_expired += len(ended)
        return len(ended)

    def _unpin(self, block: Block) -> None:
        del self.pins[block.block_hash]
        self.pinned_bytes[block.tenant] -= block.nbytes
        if not self.pinned_bytes[block.tenant]:
            del self.pinned_bytes[block.tenant]
        self.release(block)

    def _give_up_pins(self, nbytes: int) -> None:
        """End pins, the soonest to end first, until nbytes more could fit (or none is left): running
        sequences come before pins; the blocks go to the LRU end and spill to SSD when evicted."""
        for block_hash in sorted(self.pins, key=self.pins.__getitem__):
            if self.num_bytes - self.free.num_bytes + self.reserved_bytes + nbytes <= self.budget_bytes:
                return
            self._unpin(self.by_hash[block_hash])
            self.counters.num_pins_given_up += 1

    def make_room(self, nbytes: int) -> bool:
        """Evict LRU free blocks until nbytes more fit, giving up pins first when blocks in use hold
        too much; False, evicting nothing, when blocks in use and reservations still do."""
        if self.num_bytes - self.free.num_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
            self._give_up_pins(nbytes)
        if self.num_bytes - self.free.num_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
            return False
        while self.num_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
            victim = self.free.pop_oldest()
            assert victim is not None, "the free queue held the bytes that make room"
            if self.on_evict is not None:
                self.on_evict(victim)
            self._discard(victim, "evicted")
            self.counters.num_evicted += 1
        return True

    def reserve(self, nbytes: int) -> bool:
        """Hold nbytes of the budget for KV outside the pool, evicting free blocks (spilled by
        on_evict) to make room; False, changing nothing, when it cannot be had now."""
        evicted = self.counters.num_evicted
        if not self.make_room(nbytes):
            return False
        self.reserved_bytes += nbytes
        self.counters.num_evicted_to_reserve += self.counters.num_evicted - evicted
        return True

    def unreserve(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.reserved_bytes, (nbytes, self.reserved_bytes)
        self.reserved_bytes -= nbytes

    def drop_free(self) -> Purged:
        """Remove every block no session holds (pins end first), without the eviction callback
        (nothing spills)."""
        for block_hash in list(self.pins):
            self._unpin(self.by_hash[block_hash])
        num_blocks, num_bytes = 0, 0
        while (victim := self.free.pop_oldest()) is not None:
            num_blocks, num_bytes = num_blocks + 1, num_bytes + victim.nbytes
            self._discard(victim, "purged")
        return Purged(num_blocks, num_bytes)

    def purge_owned(self, selects: Callable[[str], bool]) -> Purged:
        """Take the selected owners off every block; a block left with no owner leaves now, or when
        its last holder releases it if a running request holds it (counted now: it is unreachable
        to later owners only once gone, but nothing keeps it past that request)."""
        num_blocks, num_bytes = 0, 0
        for block in list(self.by_hash.values()):
            selected = {owner for owner in block.owners if selects(owner)}
            if not selected:
                continue
            block.owners -= selected
            if block.owners:
                continue
            num_blocks, num_bytes = num_blocks + 1, num_bytes + block.nbytes
            if block.block_hash in self.pins:
                block.purged = True
                self._unpin(block)  # it leaves now, or with the last request that holds it
            elif block.ref_count:
                block.purged = True
            else:
                self.free.remove(block)
                self._discard(block, "purged")
        self.counters.num_purged += num_blocks
        return Purged(num_blocks, num_bytes)

    def expire(self, idle_s: float, now: float | None = None) -> Purged:
        """Drop the free blocks nobody used for idle_s seconds (the RAM tier's retention), oldest
        first, without the eviction callback: what expired is not spilled."""
        cutoff = (time.monotonic() if now is None else now) - idle_s
        num_blocks, num_bytes = 0, 0
        # a scan of the free blocks (every 10 s): probation is ordered by arrival, not by last use
        for victim in sorted((b for b in self.free if b.last_used < cutoff), key=lambda b: b.last_used):
            self.free.remove(victim)
            num_blocks, num_bytes = num_blocks + 1, num_bytes + victim.nbytes
            self._discard(victim, "expired")
        self.counters.num_expired += num_blocks
        return Purged(num_blocks, num_bytes)

    def _discard(self, block: Block, reason: str) -> None:
        """Forget a block already out of the free queue, and drop its data."""
        del self.by_hash[block.block_hash]
        siblings = self.children[block.parent_hash]
        siblings.discard(block.block_hash)
        if not siblings:
            del self.children[block.parent_hash]
        self.num_bytes -= block.nbytes
        block.kv, block.state = (), ()
        if self.on_discard is not None:
            self.on_discard(block, reason)

    def check(self) -> None:
        """Assert the invariants above; for tests."""
        free = list(self.free)
        assert len(free) == self.free.num_blocks, (len(free), self.free.num_blocks)
        assert sum(b.nbytes for b in free) == self.free.num_bytes, "free bytes out of step with the free queue"
        assert all(b.ref_count == 0 for b in free), "a block in use sits in the free queue"
        assert not any(b.purged for b in free), "a purged block sits in the free queue"
        in_use = [b for b in self.by_hash.values() if b.ref_count > 0]
        assert len(free) + len(in_use) == len(self.by_hash), (len(free), len(in_use), len(self.by_hash))
        total = sum(b.nbytes for b in self.by_hash.values())
        assert total == self.num_bytes, (total, self.num_bytes)
        pinned: dict[str, int] = {}
        for block_hash in self.pins:
            block = self.by_hash[block_hash]
            assert block.ref_count >= 1, "a pinned block holds a reference"
            pinned[block.tenant] = pinned.get(block.tenant, 0) + block.nbytes
        assert pinned == self.pinned_bytes, (pinned, self.pinned_bytes)
        assert all(used <= self.pin_budget_bytes for used in pinned.values()), "a tenant's pins passed its budget"
        assert self.num_bytes + self.reserved_bytes <= self.budget_bytes, (
            self.num_bytes,
            self.reserved_bytes,
            self.budget_bytes,
        )
