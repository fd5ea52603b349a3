"""PrefixCache sessions on real MLX arrays: longest-prefix match, gather, and sharing by bytes."""

import mlx.core as mx
import numpy as np
import pytest

from kvcache import PrefixCache, TenantSalt, cacheability
from kvcache.chain import hash_blocks

BS = 16
LAYERS, HEADS, DIM = 2, 2, 8


def _kv_for(tokens):
    """Per-layer (keys, values) whose rows are a function of the token and its position."""
    rows = mx.array(np.asarray(tokens, dtype=np.float32))[None, None, :, None] + mx.arange(DIM, dtype=mx.float32)
    rows = mx.broadcast_to(rows, (1, HEADS, len(tokens), DIM))
    return [(rows + layer, rows - layer) for layer in range(LAYERS)]


def _store(cache, salt, tokens):
    with cache.open(salt, "model", tokens) as session:
        session.match(len(tokens))
        session.store(tokens, _kv_for(tokens), len(tokens))


@pytest.fixture
def cache():
    return PrefixCache(budget_bytes=1 << 30, block_size=BS)


SALT_A = TenantSalt(b"a" * 32)


def test_supersequence_match_reuses_every_full_block_of_the_shorter_prompt(cache):
    stored = list(range(100))
    _store(cache, SALT_A, stored)
    query = stored[:50]
    session = cache.open(SALT_A, "model", query)
    match = session.match(len(query))
    assert (match.num_matched_tokens, match.num_cached_tokens, match.tier) == (48, 48, "ram")
    keys, _ = session.gather(match.num_cached_tokens)[1]
    expected_keys, _ = _kv_for(query)[1]
    assert mx.array_equal(keys, expected_keys[:, :, :48, :])
    session.close()
    cache.pool.check()


def test_longest_common_prefix_ends_at_the_first_missing_block(cache):
    _store(cache, SALT_A, list(range(100)))
    query = list(range(40)) + [999] * 30  # diverges inside block 2 (tokens 32-47)
    session = cache.open(SALT_A, "model", query)
    assert session.match(len(query)).num_cached_tokens == 32
    session.close()


def test_fully_cached_prompt_still_recomputes_its_last_token(cache):
    tokens = list(range(64))
    _store(cache, SALT_A, tokens)
    session = cache.open(SALT_A, "model", tokens)
    match = session.match(len(tokens))
    assert (match.num_matched_tokens, match.num_cached_tokens) == (64, 63)
    keys, _ = session.gather(63)[0]
    assert keys.shape[2] == 63
    session.close()


def test_other_tenant_never_matches(cache):
    tokens = list(range(64))
    _store(cache, SALT_A, tokens)
    session = cache.open(TenantSalt(b"b" * 32), "model", tokens)
    assert session.match(len(tokens)).num_cached_tokens == 0
    session.close()


def test_hundred_conversations_share_one_copy_of_the_system_prompt_by_bytes(cache):
    system = list(range(1000))
    before = mx.get_active_memory()
    for conversation in range(100):
        _store(cache, SALT_A, system + [5000 + conversation] * 100)
    block_bytes = LAYERS * 2 * HEADS * BS * DIM * 4
    shared_blocks, own_blocks = 1000 // BS, 1100 // BS - 1000 // BS
    assert cache.pool.num_bytes == (shared_blocks + 100 * own_blocks) * block_bytes
    unshared = 100 * (1100 // BS) * block_bytes
    assert cache.pool.num_bytes < 0.11 * unshared
    held = mx.get_active_memory() - before  # what MLX really holds: no block pins a bigger buffer
    assert held < 1.5 * cache.pool.num_bytes, (held, cache.pool.num_bytes)
    cache.pool.check()


def test_store_continues_a_chain_with_generated_tokens(cache):
    prompt = list(range(40))
    session = cache.open(SALT_A, "model", prompt)
    session.match(len(prompt))
    session.store(prompt, _kv_for(prompt), len(prompt))
    assert len(session.held) == 2
    sequence = prompt + [7] * 30
    session.store(sequence, _kv_for(sequence), len(sequence))
    assert len(session.held) == 4 and session.hashes == hash_blocks(sequence, BS, session.roots.tenant)
    with pytest.raises(AssertionError):
        session.store(prompt + [8] * 30, _kv_for(sequence), len(sequence))  # not a continuation
    session.close()
    follow_up = cache.open(SALT_A, "model", sequence + [1, 2, 3])
    assert follow_up.match(73).num_cached_tokens == 64
    follow_up.close()


def test_blocks_let_go_give_way_and_the_next_store_leaves_the_chain_without_a_gap():
    """A running sequence keeps its own KV: once it lets its blocks go they are free (evictable, not
    counted beside its own KV as blocks in use); its next store holds them again and stores anew
    what was evicted meanwhile."""
    block_bytes = LAYERS * 2 * HEADS * BS * DIM * 4
    cache = PrefixCache(budget_bytes=4 * block_bytes, block_size=BS)
    prompt = list(range(64))
    session = cache.open(SALT_A, "model", prompt)
    session.match(len(prompt))
    session.store(prompt, _kv_for(prompt), 48)
    assert cache.pool.free.num_bytes == 0  # held while stored
    session.let_go()
    assert session.held == [] and cache.pool.free.num_bytes == 3 * block_bytes
    cache.pool.check()
    assert cache.reserve(3 * block_bytes)  # room for running KV: the let-go blocks give way
    assert len(cache.pool.by_hash) == 1
    cache.unreserve(3 * block_bytes)
    session.store(prompt, _kv_for(prompt), 64)
    assert [block.block_hash for block in session.held] == session.hashes[:4]
    cache.pool.check()
    session.close()
    follow_up = cache.open(SALT_A, "model", prompt + [1])
    assert follow_up.match(65).num_cached_tokens == 64
    keys, _ = follow_up.gather(64)[0]
    assert mx.array_equal(keys, _kv_for(prompt)[0][0])
    follow_up.close()
    cache.pool.check()


def test_caches_that_cannot_be_cut_into_blocks_are_reported():
    from mlx_vlm.models.cache import ArraysCache, KVCache, RotatingKVCache

    assert cacheability([KVCache(), KVCache()]).ok
    verdict = cacheability([KVCache(), RotatingKVCache(max_size=128)])
    assert not verdict.ok and "RotatingKVCache" in verdict.reason
    hybrid = cacheability([ArraysCache(size=2), KVCache()])
    assert hybrid.ok and hybrid.snapshots and not cacheability([KVCache()]).snapshots


def _state(value: float):
    """A recurrent layer's arrays, as a gated-delta layer holds them (a conv window and a state)."""
    return ((mx.full((1, 3, 4), value), mx.full((1, 2, 4, 4), value)),)


def _store_with_snapshots(cache, salt, tokens, at: list[int], owner=None):
    with cache.open(salt, "model", tokens, owner=owner, snapshots=True) as session:
        session.match(len(tokens))
        for point in at:  # the session stores as chunks end, each at a snapshot point
            session.store(tokens, _kv_for(tokens), point, (point, _state(point)))
        session.store(tokens, _kv_for(tokens), len(tokens))


def test_a_hybrid_prefix_is_reused_up_to_the_deepest_block_with_a_snapshot(cache):
    tokens = list(range(100))
    _store_with_snapshots(cache, SALT_A, tokens, [32, 64])
    for query, reused, without_state in (
        (tokens, 64, 32),
        (tokens[:64], 32, 31),
        (tokens[:40], 32, 0),
        (tokens[:30], 0, 16),
    ):
        with cache.open(SALT_A, "model", query, snapshots=True) as session:
            match = session.match(len(query))
            assert match.num_cached_tokens == reused, (len(query), match)
            assert match.num_tokens_without_state == without_state, (len(query), match)
            if reused:
                ((conv, state),) = session.state_at(reused)
                assert float(conv[0, 0, 0]) == reused and float(state.sum()) == reused * 32
    with cache.open(SALT_A, "model", tokens) as plain:  # a plain-KV model reads the same blocks to the end
        assert plain.match(len(tokens)).num_cached_tokens == 96
    assert cache.counters.num_tokens_without_state == 32 + 31 + 16
    with cache.open(TenantSalt(b"b" * 32), "model", tokens, snapshots=True) as other:
        assert other.match(len(tokens)).num_cached_tokens == 0
    cache.pool.check()


def test_a_snapshot_joins_a_block_cached_without_one_and_counts_in_the_budget(cache):
    tokens = list(range(64))
    _store(cache, SALT_A, tokens)
    before = cache.pool.num_bytes
    _store_with_snapshots(cache, SALT_A, tokens, [32])
    snapshot_bytes = sum(a.nbytes for arrays in _state(0) for a in arrays)
    assert cache.pool.num_bytes == before + snapshot_bytes
    with cache.open(SALT_A, "model", tokens, snapshots=True) as session:
        assert session.match(len(tokens)).num_cached_tokens == 32
    cache.pool.check()


def test_purging_an_owner_frees_its_snapshots_with_its_blocks(cache):
    tokens = list(range(64))
    _store_with_snapshots(cache, SALT_A, tokens, [32, 48], owner="session-1")
    purged = cache.purge_owned(lambda owner: owner == "session-1")
    assert purged.num_entries == 4 and cache.pool.num_bytes == 0
    with cache.open(SALT_A, "model", tokens, snapshots=True) as session:
        assert session.match(len(tokens)).num_cached_tokens == 0
    cache.pool.check()


def _snapshot_ends(cache) -> list[int]:
    return sorted(block.end_token for block in cache.pool.by_hash.values() if block.state)


def _turn(cache, tokens, lasting=(), passing=(), pin=0, reply=()):
    """One request: match, store at its snapshot points (as its chunks end) and to its end, then
    its reply's blocks with a passing snapshot where they end (as the engine's finish does)."""
    with cache.open(SALT_A, "model", tokens, snapshots=True) as session:
        reused = session.match(len(tokens)).num_cached_tokens
        for point in sorted({*lasting, *passing}):
            if point > reused:
                session.store(tokens, _kv_for(tokens), point, (point, _state(point)), point in passing)
        session.store(tokens, _kv_for(tokens), len(tokens))
        if reply:
            end = (len(tokens) + len(reply)) // BS * BS
            sequence = list(tokens) + list(reply)
            session.store(sequence, _kv_for(sequence), end, (end, _state(end)), True)
        if pin:
            assert session.pin(pin, 60.0) == pin // BS
        return reused


def test_a_later_request_drops_the_passing_snapshots_it_resumed_past(cache):
    turn_1 = list(range(70))
    reply = list(range(500, 514))  # the request's own passing snapshots stay when its reply passes them
    assert _turn(cache, turn_1, lasting=[32], passing=[64], reply=reply) == 0
    assert _snapshot_ends(cache) == [32, 64, 80]
    for _ in range(2):  # the same prompt again (and its reply) finds its own end each time
        assert _turn(cache, turn_1, passing=[64], reply=reply) == 64
    assert _snapshot_ends(cache) == [32, 64, 80]
    before = cache.pool.num_bytes
    turn_2 = turn_1 + reply + list(range(600, 650))  # the next turn resumes at the reply's end
    assert _turn(cache, turn_2, passing=[112, 128]) == 80
    assert _snapshot_ends(cache) == [32, 80, 112, 128]  # the lasting one stays, and where it resumed
    snapshot_bytes = sum(a.nbytes for arrays in _state(0) for a in arrays)
    kv_bytes = 3 * LAYERS * 2 * HEADS * BS * DIM * 4  # turn 2 stored blocks 80-127
    assert cache.pool.num_bytes == before - snapshot_bytes + kv_bytes + 2 * snapshot_bytes
    assert cache.counters.num_snapshots_superseded == 1
    with cache.open(SALT_A, "model", turn_1, snapshots=True) as session:  # turn 1 edited: the lasting one
        assert session.match(len(turn_1)).num_cached_tokens == 32
    assert _turn(cache, turn_2 + list(range(700, 720)), passing=[144]) == 128
    assert _snapshot_ends(cache) == [32, 128, 144]
    assert cache.counters.num_snapshots_superseded == 3
    cache.pool.check()


def test_another_branch_and_a_pinned_block_keep_their_passing_snapshots():
    cache = PrefixCache(budget_bytes=1 << 30, block_size=BS, pin_budget_bytes=1 << 20)
    shared = list(range(40))
    _turn(cache, shared + list(range(100, 130)), passing=[48, 64], pin=64)
    _turn(cache, shared + list(range(200, 230)), passing=[48, 64])  # forks inside block 2: a sibling chain
    assert _snapshot_ends(cache) == [48, 48, 64, 64]
    _turn(cache, shared + list(range(100, 130)) + list(range(300, 340)), passing=[96])
    assert _snapshot_ends(cache) == [48, 48, 64, 64, 96]  # the first chain's were pinned: they stay
    assert cache.counters.num_snapshots_superseded == 0
    cache.pool.check()


def test_a_snapshot_not_kept_is_counted_with_its_reason():
    block_bytes = LAYERS * 2 * HEADS * BS * DIM * 4
    tokens = list(range(64))
    full = PrefixCache(budget_bytes=4 * block_bytes, block_size=BS, pin_budget_bytes=1 << 20)
    with full.open(SALT_A, "model", tokens, snapshots=True) as session:
        session.match(len(tokens))
        session.store(tokens, _kv_for(tokens), 64)  # four blocks held: no room for a state
        session.store(tokens, _kv_for(tokens), 64, (32, _state(32)))
        assert session.pin(16, 60.0) == 1
        session.store(tokens, _kv_for(tokens), 64, (16, _state(16)))
    short = PrefixCache(budget_bytes=2 * block_bytes, block_size=BS)
    with short.open(SALT_A, "model", tokens, snapshots=True) as session:
        session.match(len(tokens))
        session.store(tokens, _kv_for(tokens), 64, (64, _state(64)))  # blocks 3 and 4 do not fit
    assert full.counters.snapshot_skips == {"budget": 1, "pinned": 1}
    assert short.counters.snapshot_skips == {"chain_cut": 1}
    assert full.stats().counters.snapshot_skips == {"budget": 1, "pinned": 1}
    assert not any(block.state for block in full.pool.by_hash.values())
    full.pool.check()
    short.pool.check()


def test_snapshots_go_to_ssd_and_come_back_with_their_blocks(tmp_path):
    from kvcache.ssd import AdmissionPolicy, SsdConfig, SsdTier

    ssd = SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0)), "ns")
    writer = PrefixCache(1 << 30, BS, ssd)
    tokens = list(range(80))
    _store_with_snapshots(writer, SALT_A, tokens, [48])
    writer.persist()
    ssd.close(10)
    reader_ssd = SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0)), "ns")
    reader = PrefixCache(1 << 30, BS, reader_ssd)
    with reader.open(SALT_A, "model", tokens, snapshots=True) as session:
        match = session.match(len(tokens))
        assert (match.num_cached_tokens, match.tier) == (48, "ssd")
        ((conv, _),) = session.state_at(48)
        assert float(conv[0, 0, 0]) == 48.0
    reader.pool.check()
    reader_ssd.close(10)


def test_promotion_that_cannot_reserve_ram_recomputes_and_counts(tmp_path):
    from kvcache.ssd import AdmissionPolicy, SsdConfig, SsdTier

    ssd = SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0)), "ns")
    writer = PrefixCache(1 << 30, BS, ssd)
    tokens = list(range(64))
    _store(writer, SALT_A, tokens)
    writer.persist()
    ssd.drain(10)
    block_bytes = LAYERS * 2 * HEADS * BS * DIM * 4
    tight = PrefixCache(block_bytes, BS, ssd)  # room for one block, but four are on disk
    held = tight.open(SALT_A, "model", list(range(1000, 1016)))
    held.match(16)
    held.store(list(range(1000, 1016)), _kv_for(list(range(1000, 1016))), 16)  # the only slot, and in use
    session = tight.open(SALT_A, "model", tokens)
    match = session.match(len(tokens))
    assert match.num_cached_tokens == 0 and tight.counters.num_promotion_failures == 1
    session.close()
    held.close()
    again = tight.open(SALT_A, "model", tokens[:16] + [5] * 4)
    assert again.match(20).num_ssd_tokens == 16  # with the slot free, the first block is promoted
    again.close()
    ssd.close()


def _owned_store(cache, tokens, owner):
    with cache.open(SALT_A, "model", tokens, owner=owner) as session:
        session.match(len(tokens))
        session.store(tokens, _kv_for(tokens), len(tokens))


def _cached(cache, tokens) -> int:
    with cache.open(SALT_A, "model", tokens) as session:
        return session.match(len(tokens)).num_cached_tokens


def test_purging_a_session_keeps_the_blocks_another_session_shares(cache):
    system = list(range(1000, 1048))  # three whole blocks, stored by both sessions
    _owned_store(cache, system + list(range(64)), "A")
    _owned_store(cache, system + list(range(500, 564)), "B")
    removed = cache.purge_owned(lambda owner: owner == "A")
    assert removed.num_entries == 4  # A's own blocks; the three shared ones stay for B
    assert _cached(cache, system + list(range(64))) == 48  # the shared system prompt still hits
    assert _cached(cache, system + list(range(500, 564))) == 48 + 63
    miss = cache.open(SALT_A, "model", system + list(range(64)))
    assert miss.match(112).miss_reason == "purged"
    miss.close()
    assert cache.purge_owned(lambda owner: owner == "B").num_entries == 3 + 4
    assert not cache.pool.by_hash
    cache.pool.check()


def test_a_block_in_use_outlives_its_purge_until_released(cache):
    tokens = list(range(64))
    _owned_store(cache, tokens, "A")
    running = cache.open(SALT_A, "model", tokens, owner="A")  # a request of A's is on the model
    assert running.match(64).num_cached_tokens == 63
    assert cache.purge_owned(lambda owner: owner == "A").num_entries == 4
    assert len(running.gather(63)) == LAYERS  # its KV is still there for it
    cache.pool.check()
    running.close()  # released: now they go
    assert not cache.pool.by_hash and cache.pool.counters.num_purged == 4
    cache.pool.check()


def test_diverged_names_the_first_differing_token_and_images(cache):
    tokens = list(range(40))
    _store(cache, SALT_A, tokens)
    changed = tokens[:21] + [999] + tokens[22:]
    with cache.open(SALT_A, "model", changed) as session:
        match = session.match(len(changed))
    assert (match.miss_reason, match.miss_at_token, match.miss_in_image) == ("diverged", 21, False)
    from kvcache import ExtraSpan

    _store_spans = [ExtraSpan(18, 22, b"image-1")]
    with cache.open(SALT_A, "model", tokens, _store_spans) as session:
        session.match(len(tokens))
        session.store(tokens, _kv_for(tokens), len(tokens))
    with cache.open(SALT_A, "model", tokens, [ExtraSpan(18, 22, b"image-2")]) as session:
        match = session.match(len(tokens))
    assert (match.miss_reason, match.miss_at_token, match.miss_in_image) == ("diverged", 18, True)  # the image


def test_write_through_leaves_a_conversation_on_a_shared_tier_for_another_replica(tmp_path):
    """Replica A stores a chain and dies without persisting; replica B, sharing A's folder, continues
    the conversation from the tier: every full block is reused, with the same keys and values."""
    from kvcache.ssd import AdmissionPolicy, SsdConfig, SsdTier

    def tier(name):
        return SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=5), writer=name), "ns")

    ssd_a, ssd_b = tier("a"), tier("b")
    replica_a = PrefixCache(1 << 30, BS, ssd_a, write_through=True)
    tokens = list(range(70))
    _store(replica_a, SALT_A, tokens)  # never reused in RAM: admission (min_hits=5) alone would write nothing
    assert ssd_a.drain(10) and ssd_a.stats().counters.num_spilled == 4
    replica_b = PrefixCache(1 << 30, BS, ssd_b)
    with replica_b.open(SALT_A, "model", tokens + [99]) as session:
        match = session.match(len(tokens) + 1)
        assert match.num_ssd_tokens == 64 and match.num_cached_tokens == 64
        restored = session.gather(64)
    expected = _kv_for(tokens[:64])
    assert all(
        mx.array_equal(k, ek).item() and mx.array_equal(v, ev).item() for (k, v), (ek, ev) in zip(restored, expected)
    )
    ssd_c = tier("c")
    assert PrefixCache(1 << 30, BS, ssd_c).write_through is False  # only when asked
    for ssd in (ssd_a, ssd_b, ssd_c):
        ssd.close()


def test_blocks_on_ssd_are_recomputed_where_reading_them_is_slower(tmp_path):
    from kvcache.ssd import AdmissionPolicy, SsdConfig, SsdTier

    ssd = SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0)), "ns")
    writer = PrefixCache(1 << 30, BS, ssd)
    tokens = list(range(64))
    with writer.open(SALT_A, "model", tokens) as session:
        session.match(len(tokens))
        session.store(tokens, _kv_for(tokens), len(tokens))
    writer.persist()
    ssd.close(10)
    read_s_per_byte = SsdTier(SsdConfig(tmp_path / "probe"), "ns").read_s_per_byte(1 << 20)
    assert 0 < read_s_per_byte < 1e-3 and not list((tmp_path / "probe").rglob(".tmp-*"))  # the probe is gone
    for slower, expected in ((True, 0), (False, 63)):  # the last prompt token is always computed
        reader = PrefixCache(1 << 30, BS, SsdTier(SsdConfig(tmp_path / "kv"), "ns"))
        prefill_s_per_token = 1e-9 if slower else 1.0
        assert reader.judge_ssd(read_s_per_byte, prefill_s_per_token, 4096) is not slower
        with reader.open(SALT_A, "model", tokens) as session:
            assert session.match(len(tokens)).num_cached_tokens == expected
        assert reader.counters.num_ssd_not_read == slower
        assert reader.ssd is not None
        reader.ssd.close(10)


def test_a_session_maps_its_prefix_as_it_comes_in_then_on_past_what_it_stored():
    """map() holds the cached blocks of the prefix (which another session's num_tokens_in_use then
    counts: blocks a reader holds, looked up without holding them), then maps on past the blocks the
    session stored itself from KV that starts after the mapped ones; a mapped block purged meanwhile stays in the pool while read and is held again by
    the store (its arrays never copied); every block is released once."""
    cache = PrefixCache(budget_bytes=1 << 30, block_size=BS)
    tokens = list(range(100))
    _owned_store(cache, tokens[:48], "A")  # three blocks
    session = cache.open(SALT_A, "model", tokens)  # records no owner: A's purge takes the blocks
    other = cache.open(SALT_A, "model", tokens)
    assert other.num_tokens_in_use(99) == 0  # cached but free: mapping them would keep them from eviction
    session.match(100)
    mapped = session.map(48)
    assert len(mapped) == 3 and other.num_tokens_in_use(99) == 48 and other.num_tokens_in_use(47) == 32
    other.close()
    session.let_go()
    assert all(b.ref_count == 1 for b in mapped)  # held by the mapping alone
    purged = mapped[1]
    assert cache.purge_owned(lambda owner: owner == "A").num_entries >= 1 and purged.purged
    own = [(k[:, :, 48:], v[:, :, 48:]) for k, v in _kv_for(tokens)]  # the session's KV starts at token 48
    session.store(tokens, own, 96, first=48)
    assert cache.pool.get(session.hashes[1]) is purged and purged.ref_count == 2  # mapped, and held by the store
    fifth = np.array(cache.pool.get(session.hashes[4]).kv[0][0])  # from the session's KV, at its position
    np.testing.assert_array_equal(fifth, np.array(_kv_for(tokens)[0][0][:, :, 64:80]))
    session.let_go()
    assert len(session.map(99)) == 6  # on past the mapped three: the blocks it stored
    session.close()
    assert all(b.ref_count == 0 for b in cache.pool.by_hash.values()) and purged.ref_count == 0
    cache.pool.check()
