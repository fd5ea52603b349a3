"""One contract, every semantic EntryStore: in memory, SQLite, and Redis (a real redis-server), the
last two also sealed under a real keyring; then
the guarded cache over each, and replicas sharing one Redis whose faiss indexes follow each other."""

import time
import uuid

import numpy as np
import pytest

from gateway.tenancy.keyring import SemanticSealer
from kvcache.sealing import FileKeys, Keyring
from semantic import Answer, Owner, RedisEntries, Scope, Selector, SemanticCache, SemanticSettings, SqliteEntries
from semantic.sealing import NO_SEALING
from semantic.store import StoreUnavailable

SCOPE = Scope("tenant-a", "model-1")
PARTITION = SCOPE.partition("ctx")


def _vector(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    return v / np.linalg.norm(v)


def _open(kind: str, tmp_path, request):
    sealer = (
        SemanticSealer(Keyring(FileKeys(tmp_path / "keys.json"), bytes(32))) if kind.endswith("sealed") else NO_SEALING
    )
    if kind.startswith("redis"):
        url = request.getfixturevalue("redis_server").url
        return RedisEntries(url, prefix=f"test-{uuid.uuid4().hex}:", sealer=sealer)
    return SqliteEntries(":memory:" if kind == "memory" else tmp_path / "semantic.db", sealer)


@pytest.fixture(params=["memory", "sqlite", "redis", "sqlite-sealed", "redis-sealed"])
def store(request, tmp_path):
    backend = _open(request.param, tmp_path, request)
    yield backend
    backend.close()


def test_put_then_fetch_returns_the_entry_and_its_vector(store):
    entry_id, created = store.put(
        PARTITION,
        SCOPE,
        "How do I reset it?",
        Answer("Hold the button.", "length", completion_tokens=5, prompt_tokens=7),
        100.0,
        200.0,
        _vector(1),
    )
    assert created and entry_id > 0
    ((entry, vector),) = store.fetch([entry_id, 10**6])
    assert (entry.prompt, entry.answer, entry.finish_reason, entry.completion_tokens, entry.prompt_tokens) == (
        "How do I reset it?",
        "Hold the button.",
        "length",
        5,
        7,
    )
    assert (entry.tenant, entry.partition, entry.status, entry.hit_count) == ("tenant-a", PARTITION, "unreviewed", 0)
    assert entry.created_at == 100.0 and entry.expires_at == 200.0 and entry.scope == SCOPE.as_dict()
    assert np.array_equal(vector, _vector(1))
    assert (
        store.find(PARTITION, "tenant-a", "How do I reset it?") == entry_id
        and store.find("other", "tenant-a", "How do I reset it?") is None
    )


def test_a_newer_answer_replaces_the_entry_keeping_id_vector_and_owners(store):
    first, _ = store.put(PARTITION, SCOPE, "q", Answer("old"), 1.0, None, _vector(1))
    store.own(first, Owner("s1"))
    store.set_status(first, "approved")
    store.count_hit(first)
    again, created = store.put(PARTITION, SCOPE, "q", Answer("new"), 2.0, 50.0, _vector(2))
    assert again == first and not created
    entry = store.get(first)
    assert (entry.answer, entry.status, entry.hit_count, entry.expires_at) == ("new", "unreviewed", 0, 50.0)
    assert np.array_equal(store.fetch([first])[0][1], _vector(1))
    assert store.release(Selector("tenant-a", session="s1"))[0] == [first]  # s1 was its only owner


def test_status_delete_and_stats(store):
    a, _ = store.put(PARTITION, SCOPE, "a", Answer("1"), 1.0, None, _vector(1))
    b, _ = store.put("other-partition", SCOPE, "b", Answer("2"), 1.0, None, _vector(2))
    assert store.set_status(a, "rejected") and not store.set_status(10**6, "approved")
    assert store.stats() == ({"unreviewed": 1, "approved": 0, "rejected": 1}, 2)
    assert [e.id for e in store.list_entries("tenant-a", None, 10)] == [b, a]
    assert [e.id for e in store.list_entries(None, "rejected", 10)] == [a]
    assert store.delete(a) and not store.delete(a) and not store.delete(2**70)
    assert store.get(a) is None and store.find(PARTITION, "tenant-a", "a") is None
    assert store.stats() == ({"unreviewed": 1, "approved": 0, "rejected": 0}, 1)
    assert sorted(i for i, _, _ in store.vectors()) == [b] == store.all_ids()


def test_owners_release_keeps_shared_entries(store):
    shared, _ = store.put(PARTITION, SCOPE, "shared", Answer("x"), 1.0, None, _vector(1))
    mine, _ = store.put(PARTITION, SCOPE, "mine", Answer("y"), 1.0, None, _vector(2))
    store.own(shared, Owner("s1"))
    store.own(shared, Owner("s2"))
    store.own(mine, Owner("s1", "u1"))
    store.own(10**6, Owner("s1"))  # no such entry: nothing happens
    ids, size = store.release(Selector("tenant-a", session="s1"))
    assert ids == [mine] and size > 0
    assert store.release(Selector("tenant-b"))[0] == []
    assert sorted(store.release(Selector("tenant-a"))[0]) == [shared, mine]


def test_expired_ids_are_the_due_ones(store):
    due, _ = store.put(PARTITION, SCOPE, "due", Answer("x"), 1.0, 10.0, _vector(1))
    store.put(PARTITION, SCOPE, "later", Answer("y"), 1.0, 100.0, _vector(2))
    store.put(PARTITION, SCOPE, "never", Answer("z"), 1.0, None, _vector(3))
    assert store.expired_ids(50.0) == [due]


@pytest.fixture(params=["memory", "redis"])
def cache(request, tmp_path, embedder):
    live = SemanticCache(embedder, _open(request.param, tmp_path, request), SemanticSettings())
    yield live
    live.close()


def test_the_guarded_cache_behaves_the_same_over_each_store(cache):
    entry_id = cache.insert(
        "How do I reset my password?", Answer("Use the reset link."), SCOPE, "ctx", now=0, owner=Owner("s1")
    )
    hit = cache.lookup("What is the way to reset my password?", SCOPE, "ctx", now=1)
    assert hit.status == "hit" and hit.entry.id == entry_id and cache.get(entry_id).hit_count == 1
    assert (
        cache.lookup("What is the way to reset my password?", Scope("tenant-b", "model-1"), "ctx", 1).reason
        == "no_candidate"
    )
    cache.insert("How do I enable dark mode?", Answer("Settings."), SCOPE, "ctx", now=0, ttl_s=10)
    assert cache.lookup("Why can't I enable dark mode?", SCOPE, "ctx", now=1).reason == "negation"
    assert cache.lookup("How do I enable dark mode?", SCOPE, "ctx", now=11).status == "miss"  # expired, deleted
    assert cache.purge_owned(Selector("tenant-a", session="s1")).num_entries == 1
    assert cache.stats().num_entries == 0 and len(cache.index) == 0


def _until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the other replica never followed"
        time.sleep(0.01)
    return True


def test_replicas_on_one_redis_follow_each_others_changes(redis_server, embedder):
    prefix = f"test-{uuid.uuid4().hex}:"
    a = SemanticCache(embedder, RedisEntries(redis_server.url, prefix), SemanticSettings())
    b = SemanticCache(embedder, RedisEntries(redis_server.url, prefix), SemanticSettings())
    try:
        stored = time.monotonic()
        entry_id = a.insert("How do I export my data?", Answer("Use Export."), SCOPE, "ctx", now=0)
        _until(lambda: b.lookup("How can I export my data?", SCOPE, "ctx", now=1).status == "hit")
        assert time.monotonic() - stored < 2.0
        a.set_status(entry_id, "rejected")  # read back on every lookup: no delay at all
        assert b.lookup("How can I export my data?", SCOPE, "ctx", now=1).status == "miss"
        other = b.insert("Where are the invoices?", Answer("Billing."), SCOPE, "ctx", now=0)
        _until(lambda: other in a.index.partition_of)
        a.purge_owned(Selector("tenant-a"))
        _until(lambda: len(b.index) == 0)
        assert b.lookup("Where can I find the invoices?", SCOPE, "ctx", now=1).reason == "no_candidate"
        c = SemanticCache(embedder, RedisEntries(redis_server.url, prefix), SemanticSettings())  # a third, started late
        a.insert("What are the opening hours?", Answer("9 to 5."), SCOPE, "ctx", now=0)
        assert c.lookup("When are you open?", SCOPE, "ctx", now=1).score > 0.5
        c.close()
    finally:
        a.close()
        b.close()


def test_a_restarted_redis_degrades_then_recovers(tmp_path, embedder):
    from tests.conftest import RedisServer

    server = RedisServer(tmp_path / "redis")
    cache = SemanticCache(embedder, RedisEntries(server.url), SemanticSettings())
    try:
        cache.insert("How do I export my data?", Answer("Use Export."), SCOPE, "ctx", now=0)
        server.stop()
        with pytest.raises(StoreUnavailable):
            cache.lookup("How can I export my data?", SCOPE, "ctx", now=1)
        server = RedisServer(tmp_path / "redis", port=server.port)  # no persistence: it comes back empty
        time.sleep(1.5)  # past the store's down window; the follower rebuilds from the empty store
        _until(lambda: len(cache.index) == 0)
        assert cache.lookup("How can I export my data?", SCOPE, "ctx", now=1).reason == "no_candidate"
        entry_id = cache.insert("Where are the invoices?", Answer("Billing."), SCOPE, "ctx", now=0)
        assert entry_id == 1  # the restarted server numbers from 1 again: the old index could not be trusted
        assert cache.lookup("Where can I find the invoices?", SCOPE, "ctx", now=1).status == "hit"
    finally:
        cache.close()
        server.stop()


def test_an_index_entry_naming_another_partitions_entry_is_never_served(embedder):
    """A restarted Redis numbers entries from 1 again: until the follower rebuilds, this replica's
    index may hold an old id that now names another tenant's entry. The store's partition decides."""
    from semantic import PartitionedIndex

    cache = SemanticCache(embedder, SqliteEntries(":memory:"), SemanticSettings())
    other_tenant = Scope("tenant-b", "model-1")
    question = "What is the refund policy?"
    entry_id = cache.insert(question, Answer("Tenant b's answer."), other_tenant, "ctx", now=0)
    stale = PartitionedIndex(embedder.dim)  # as if the id had been tenant-a's before the restart
    stale.add(SCOPE.partition("ctx"), [entry_id], embedder.embed([question]))
    cache.index = stale
    result = cache.lookup(question, SCOPE, "ctx", now=1)
    assert result.status == "miss" and result.reason == "no_candidate"
    assert entry_id not in cache.index.partition_of  # and it leaves the index
    cache.close()


def test_a_cache_started_while_redis_is_down_bypasses_until_it_comes(tmp_path, embedder):
    from gateway.operations.cluster import free_ports
    from tests.conftest import RedisServer

    port = free_ports(1)
    cache = SemanticCache(embedder, RedisEntries(f"redis://127.0.0.1:{port}/0"), SemanticSettings())
    server = None
    try:
        with pytest.raises(StoreUnavailable):  # an empty index here must not pass for "no candidate"
            cache.lookup("How do I export my data?", SCOPE, "ctx", now=1)
        server = RedisServer(tmp_path / "redis", port=port)
        _until(lambda: not cache.store_lost)
        assert cache.lookup("How do I export my data?", SCOPE, "ctx", now=1).reason == "no_candidate"
    finally:
        cache.close()
        if server is not None:
            server.stop()


def test_sealed_entries_keep_no_text_and_vanish_from_every_read_once_their_tenant_is_shredded(tmp_path):
    keyring = Keyring(FileKeys(tmp_path / "keys.json"), bytes(32))
    store = SqliteEntries(tmp_path / "semantic.db", SemanticSealer(keyring))
    other = Scope("tenant-b", "model-1")
    mine, _ = store.put(
        PARTITION, SCOPE, "Where is the quokka-ledger kept?", Answer("In vault 7."), 1.0, None, _vector(1)
    )
    theirs, _ = store.put(other.partition("ctx"), other, "Where is it?", Answer("Upstairs."), 1.0, None, _vector(2))
    store.file.db.execute("PRAGMA wal_checkpoint(FULL)")
    raw = b"".join(path.read_bytes() for path in tmp_path.glob("semantic.db*"))
    assert b"quokka-ledger" not in raw and b"vault 7" not in raw and _vector(1).tobytes() not in raw
    keyring.shred("tenant-a")
    assert [entry.id for entry, _ in store.fetch([mine, theirs])] == [theirs]
    assert [row[0] for row in store.vectors()] == [theirs] and store.list_entries("tenant-a") == []
    assert store.find(PARTITION, "tenant-a", "Where is the quokka-ledger kept?") is None  # a new key: a new digest
    store.close()
