"""BlockPool and FreeBlockQueue: ref counts, O(1) LRU order, byte budget, in-use blocks never evicted."""

import pytest

from kvcache import Block, BlockHash, BlockPool, FreeBlockQueue


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def test_free_queue_removes_from_the_middle_and_keeps_order():
    queue = FreeBlockQueue()
    blocks = [Block(_h(i)) for i in range(5)]
    for block in blocks:
        queue.append(block)
    queue.remove(blocks[2])
    assert [b.block_hash for b in queue] == [_h(0), _h(1), _h(3), _h(4)]
    assert queue.pop_oldest() is blocks[0]
    assert queue.num_blocks == 3
    assert blocks[2].prev is None and blocks[2].next is None


def test_pool_evicts_least_recently_used_free_blocks_to_fit_the_budget():
    pool = BlockPool(budget_bytes=300)
    for i in range(3):
        pool.release(pool.insert(Block(_h(i), (), 100)))
    pool.acquire(pool.get(_h(0)))  # block 0 is used again ...
    pool.release(pool.get(_h(0)))  # ... so it is now the most recently used
    pool.release(pool.insert(Block(_h(3), (), 100)))
    assert pool.get(_h(1)) is None  # the LRU one went
    assert all(pool.get(_h(i)) is not None for i in (0, 2, 3))
    assert pool.counters.num_evicted == 1
    pool.check()


def test_blocks_in_use_are_never_evicted_and_inserts_are_refused_instead():
    pool = BlockPool(budget_bytes=200)
    held = [pool.insert(Block(_h(i), (), 100)) for i in range(2)]  # both held (ref 1)
    assert pool.insert(Block(_h(9), (), 100)) is None
    assert pool.counters.num_rejected == 1
    assert all(pool.get(_h(i)) is b for i, b in enumerate(held))
    pool.release(held[0])
    assert pool.insert(Block(_h(9), (), 100)) is not None
    assert pool.get(_h(0)) is None and pool.get(_h(1)) is held[1]
    pool.check()


def test_block_larger_than_budget_is_refused():
    pool = BlockPool(budget_bytes=50)
    assert pool.insert(Block(_h(1), (), 51)) is None
    pool.check()


def test_release_of_a_free_block_is_an_error():
    pool = BlockPool(budget_bytes=100)
    block = pool.insert(Block(_h(1), (), 10))
    pool.release(block)
    with pytest.raises(AssertionError):
        pool.release(block)


def test_a_reservation_evicts_free_blocks_and_spills_them_but_never_blocks_in_use():
    spilled = []
    pool = BlockPool(budget_bytes=400, on_evict=lambda block: spilled.append(block.block_hash))
    held = pool.insert(Block(_h(0), (), 100))  # in use
    for i in (1, 2, 3):
        pool.release(pool.insert(Block(_h(i), (), 100)))
    assert pool.reserve(150)  # 100 held + 150 reserved leave room for one free block: two give way, oldest first
    assert spilled == [_h(1), _h(2)] and pool.get(_h(3)) is not None and pool.get(_h(0)) is held
    assert pool.counters.num_evicted_to_reserve == 2
    pool.check()


def test_a_reservation_that_cannot_be_had_changes_nothing_and_inserts_never_take_reserved_room():
    pool = BlockPool(budget_bytes=300)
    held = pool.insert(Block(_h(0), (), 100))
    pool.release(pool.insert(Block(_h(1), (), 100)))
    assert pool.reserve(150)  # evicts the free block
    assert not pool.reserve(100)  # 100 held + 150 reserved + 100 > 300
    assert pool.get(_h(0)) is held and pool.reserved_bytes == 150
    assert pool.insert(Block(_h(2), (), 100)) is None  # a cached block never takes a running sequence's room
    pool.unreserve(150)
    assert pool.insert(Block(_h(2), (), 100)) is not None
    pool.check()


def test_a_failed_make_room_evicts_nothing():
    pool = BlockPool(budget_bytes=300)
    pool.insert(Block(_h(0), (), 200))  # in use
    pool.release(pool.insert(Block(_h(1), (), 100)))
    assert not pool.make_room(150)  # even with the free block gone, 200 + 150 > 300
    assert pool.get(_h(1)) is not None and pool.counters.num_evicted == 0
    pool.check()


def test_expire_drops_idle_free_blocks_oldest_first_and_never_blocks_in_use():
    import time

    spilled = []
    pool = BlockPool(10_000, on_evict=spilled.append)
    blocks = [pool.insert(Block(f"h{i}".encode(), nbytes=100)) for i in range(4)]
    for block in blocks[:3]:
        pool.release(block)  # blocks[3] stays in use
    blocks[0].last_used = blocks[1].last_used = time.monotonic() - 100  # idle for 100 s
    removed = pool.expire(idle_s=50)
    assert (removed.num_entries, removed.num_bytes) == (2, 200) and spilled == []  # expiry never spills
    assert pool.get(b"h2") is blocks[2] and pool.get(b"h3") is blocks[3]
    assert pool.expire(idle_s=50, now=time.monotonic() + 1000).num_entries == 1  # h2; h3 is in use
    assert pool.get(b"h3") is blocks[3] and pool.counters.num_expired == 3
    pool.check()


def test_purge_takes_owners_off_and_deletes_blocks_left_with_none():
    pool = BlockPool(budget_bytes=1000)
    shared, own = pool.insert(Block(_h(1), (), 100)), pool.insert(Block(_h(2), (), 100))
    shared.owners, own.owners = {"A", "B"}, {"A"}
    pool.release(shared), pool.release(own)
    removed = pool.purge_owned(lambda owner: owner == "A")
    assert (removed.num_entries, removed.num_bytes) == (1, 100)
    assert pool.get(_h(1)).owners == {"B"} and pool.get(_h(2)) is None
    pool.acquire(pool.get(_h(1)), "C")  # a third session reuses the shared block: it owns it too
    assert pool.get(_h(1)).owners == {"B", "C"}
    pool.check()


# -- pins (cache breakpoints) --------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pinning_pool(budget=500, pin_budget=200, **kwargs):
    clock = Clock()
    return BlockPool(budget, pin_budget_bytes=pin_budget, clock=clock, **kwargs), clock


def _cached(pool, i, tenant="tenant-a", scope=""):
    """A cached block of `tenant`'s, on the chain `scope` (an end user's own root; the tenant's by default)."""
    block = pool.insert(Block(_h(i), (), 100, scope=scope or tenant, tenant=tenant))
    pool.release(block)
    return block


def test_a_pinned_block_survives_an_lru_storm_that_evicts_an_unpinned_one():
    pool, _ = _pinning_pool()
    pinned, unpinned = _cached(pool, 0), _cached(pool, 1)
    assert pool.pin(pinned, 300)
    for i in range(2, 12):  # a storm of newer blocks through a 500-byte pool
        _cached(pool, i)
    assert pool.get(pinned.block_hash) is pinned and pool.get(unpinned.block_hash) is None
    pool.check()


def test_a_pin_past_its_ttl_is_an_ordinary_block_again():
    pool, clock = _pinning_pool()
    block = _cached(pool, 0)
    pool.pin(block, 300)
    clock.now += 299
    assert pool.expire_pins() == 0 and block.ref_count == 1
    pool.pin(block, 0.5)  # pinned again to end sooner: the later end stays
    clock.now += 2
    assert pool.expire_pins() == 1 and block.ref_count == 0 and pool.counters.num_pins_expired == 1
    for i in range(1, 6):
        _cached(pool, i)
    assert pool.get(block.block_hash) is None  # evicted as any LRU block
    pool.check()


def test_each_tenant_pins_within_its_own_budget():
    pool, _ = _pinning_pool(budget=1000, pin_budget=200)
    a = [_cached(pool, i, "tenant-a") for i in range(3)]
    b = [_cached(pool, 10 + i, "tenant-b") for i in range(2)]
    assert pool.pin(a[0], 60) and pool.pin(a[1], 60) and not pool.pin(a[2], 60)
    assert pool.pin(b[0], 60) and pool.pin(b[1], 60)  # tenant a's pins never spend tenant b's budget
    assert pool.pinned_bytes == {"tenant-a": 200, "tenant-b": 200} and pool.counters.num_pins_refused == 1
    pool.check()


def test_a_tenants_end_users_share_its_pin_budget():
    """End users kept apart have chain roots of their own: their pins still spend one tenant's budget."""
    pool, _ = _pinning_pool(budget=1000, pin_budget=200)
    users = [_cached(pool, i, "tenant-a", scope=f"root-of-user-{i}") for i in range(4)]
    assert [pool.pin(block, 60) for block in users] == [True, True, False, False]
    assert pool.pinned_bytes == {"tenant-a": 200}
    pool.check()


def test_running_sequences_come_before_pins_and_the_pinned_blocks_spill():
    spilled = []
    pool, _ = _pinning_pool(budget=300, pin_budget=300, on_evict=spilled.append)
    blocks = [_cached(pool, i) for i in range(3)]
    for block in blocks:
        pool.pin(block, 300)
    assert pool.reserve(150)  # a running sequence needs room: the soonest-ending pins give way
    assert pool.counters.num_pins_given_up == 2 and len(spilled) == 2 and blocks[2].block_hash in pool.pins
    pool.check()


def test_a_purge_ends_the_pins_of_what_it_removes():
    pool, _ = _pinning_pool()
    block = _cached(pool, 0)
    pool.acquire(block, "tenant-a/session-1")
    pool.release(block)
    pool.pin(block, 300)
    assert pool.purge_owned(lambda owner: owner.startswith("tenant-a")).num_entries == 1
    assert pool.get(block.block_hash) is None and not pool.pins and not pool.pinned_bytes
    other = _cached(pool, 1)
    pool.pin(other, 300)
    pool.drop_free()
    assert pool.get(other.block_hash) is None and not pool.pins
    pool.check()


def _held(pool: BlockPool, name: bytes, hits: int = 0) -> Block:
    block = pool.insert(Block(BlockHash(name), nbytes=10))
    assert block is not None
    block.num_hits = hits
    return block


def test_reused_blocks_outlive_a_flood_of_one_off_blocks_and_overflow_back_into_probation():
    pool = BlockPool(100)  # protected: at most 40 bytes
    hot = [_held(pool, b"hot-%d" % i, hits=1) for i in range(5)]
    for block in hot:
        pool.release(block)
    for i in range(30):  # a flood: three times the budget of blocks nobody reuses
        pool.release(_held(pool, b"scan-%d" % i))
    assert all(pool.get(block.block_hash) is not None and block.protected for block in hot[1:])
    assert pool.get(hot[0].block_hash) is None  # 50 bytes reused, 40 protected: the oldest aged into probation
    pool.check()
    flat = BlockPool(100, segmented=False)
    old = [_held(flat, b"hot-%d" % i, hits=1) for i in range(5)]
    for block in old:
        flat.release(block)
    for i in range(30):
        flat.release(_held(flat, b"scan-%d" % i))
    assert all(flat.get(block.block_hash) is None for block in old)  # one LRU queue: the flood took them


def test_retention_expires_idle_blocks_from_both_segments():
    pool = BlockPool(100)
    reused, fresh = _held(pool, b"reused", hits=2), _held(pool, b"fresh")
    pool.release(reused)
    pool.release(fresh)
    reused.last_used, fresh.last_used = 0.0, 5.0
    assert pool.expire(idle_s=10, now=12.0).num_entries == 1 and pool.get(reused.block_hash) is None
    assert pool.expire(idle_s=10, now=20.0).num_entries == 1 and not pool.by_hash
    pool.check()
