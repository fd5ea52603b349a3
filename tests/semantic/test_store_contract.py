"""One contract, every ResponseStore backend: memory, SQLite, and Redis (a real redis-server), the
last two also sealing what they keep under a real keyring (encryption at rest)."""

import uuid

import pytest

from gateway.tenancy.keyring import SemanticSealer
from kvcache.sealing import FileKeys, Keyring
from semantic import MemoryStore, SqliteStore, StoredResponse
from semantic.redis_store import RedisStore
from semantic.sealing import NO_SEALING


@pytest.fixture(params=["memory", "sqlite", "redis", "sqlite-sealed", "redis-sealed"])
def store(request, tmp_path):
    sealer = (
        SemanticSealer(Keyring(FileKeys(tmp_path / "keys.json"), bytes(32)))
        if request.param.endswith("sealed")
        else NO_SEALING
    )
    if request.param.startswith("redis"):
        server = request.getfixturevalue("redis_server")
        backend = RedisStore(server.url, prefix=f"test-{uuid.uuid4().hex}:", sealer=sealer)  # its own namespace
    else:
        backend = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "responses.db", sealer)
    yield backend
    backend.close()


def _response(text="hello", created=100.0, expires=None):
    return StoredResponse(text, "stop", 10, 2, created, expires)


def test_put_then_get_returns_the_same_response(store):
    store.put("k1", "tenant-a", _response())
    assert store.get("k1", now=101.0) == _response()
    assert store.get("missing", now=101.0) is None


def test_expired_entries_are_never_returned_and_purge_removes_them(store):
    store.put("old", "t", _response(expires=150.0))
    store.put("forever", "t", _response(expires=None))
    assert store.get("old", now=149.0) is not None
    assert store.get("old", now=150.0) is None
    assert store.purge_expired(now=200.0) == 1
    assert store.get("forever", now=10**9) is not None


def test_put_replaces_and_delete_removes(store):
    store.put("k", "t", _response("first"))
    store.put("k", "t", _response("second"))
    assert store.get("k", 101.0).text == "second"
    assert store.delete("k") is True
    assert store.delete("k") is False


def test_purge_tenant_leaves_other_tenants(store):
    store.put("a1", "tenant-a", _response())
    store.put("a2", "tenant-a", _response())
    store.put("b1", "tenant-b", _response())
    assert store.purge_tenant("tenant-a") == 2
    assert store.get("a1", 101.0) is None and store.get("b1", 101.0) is not None


def test_sqlite_store_survives_reopening(tmp_path):
    first = SqliteStore(tmp_path / "r.db")
    first.put("k", "t", _response("persisted"))
    first.close()
    second = SqliteStore(tmp_path / "r.db")
    assert second.get("k", 101.0).text == "persisted"
    second.close()


def test_a_session_purge_keeps_what_another_session_of_the_tenant_still_owns(store):
    from semantic import Owner, Selector

    store.put("shared", "tenant-a", _response("system prompt answer"), Owner("session-a"))
    store.put("shared", "tenant-a", _response("system prompt answer"), Owner("session-b"))
    store.put("only-a", "tenant-a", _response("private"), Owner("session-a", "alice"))
    store.put("anonymous", "tenant-a", _response())
    store.put("other", "tenant-b", _response(), Owner("session-a"))
    purged = store.purge(Selector("tenant-a", session="session-a"))
    assert purged.num_entries == 1 and purged.num_bytes > len("private")  # the stored record's bytes
    assert store.get("only-a", 101.0) is None
    assert store.get("shared", 101.0) is not None and store.get("anonymous", 101.0) is not None
    assert store.get("other", 101.0) is not None  # the same session id in another tenant is another session
    assert store.purge(Selector("tenant-a", session="session-b")).num_entries == 1  # its last owner left
    assert store.get("shared", 101.0) is None


def test_an_end_user_purge_and_a_tenant_purge(store):
    from semantic import Owner, Selector

    store.put("k1", "t", _response(), Owner("s1", "alice"))
    store.put("k2", "t", _response(), Owner("s2", "alice"))
    store.put("k3", "t", _response(), Owner("s2", "bob"))
    assert store.purge(Selector("t", end_user="alice")).num_entries == 2
    assert store.get("k3", 101.0) is not None
    assert store.purge(Selector("t")).num_entries == 1 and store.count() == 0


def test_a_hit_makes_the_entry_the_hitting_sessions_too(store):
    from semantic import Owner, Selector

    store.put("k", "t", _response(), Owner("session-a"))
    store.own("k", Owner("session-b"))
    store.own("missing", Owner("session-b"))  # nothing to own: nothing happens
    assert store.purge(Selector("t", session="session-a")).num_entries == 0
    assert store.get("k", 101.0) is not None
    assert store.purge(Selector("t", session="session-b")).num_entries == 1


def test_a_sealed_entry_keeps_no_text_and_reads_as_absent_once_its_tenant_is_shredded(tmp_path):
    keyring = Keyring(FileKeys(tmp_path / "keys.json"), bytes(32))
    store = SqliteStore(tmp_path / "responses.db", SemanticSealer(keyring))
    store.put("k1", "acme", _response("the harbour-ledger answer"))
    store.put("k2", "globex", _response("globex's answer"))
    store.file.db.execute("PRAGMA wal_checkpoint(FULL)")
    assert b"harbour-ledger" not in b"".join(p.read_bytes() for p in tmp_path.glob("responses.db*"))
    keyring.shred("acme")
    assert store.get("k1", now=101.0) is None and store.get("k2", now=101.0) == _response("globex's answer")
    store.close()
