"""RedisStore against a real redis-server: entries shared by replicas, Redis TTLs bounding what stays,
an unreachable or restarted server failing fast and recovering, and an entry's write sent again
when a reply comes later than the timeout."""

import time
import uuid

import pytest
import redis

from semantic import Owner, Selector, StoredResponse
from semantic.redis_store import (
    EXPIRY_GRACE_S,
    RETRY_AFTER_S,
    SOCKET_TIMEOUT_S,
    RedisLink,
    RedisStore,
    StoreUnavailable,
)
from tests.conftest import RedisServer


def _response(expires=None):
    return StoredResponse("answer", "stop", 10, 2, time.time(), expires)


def test_an_entry_stored_by_one_replica_is_read_by_another(redis_server):
    prefix = f"test-{uuid.uuid4().hex}:"
    replica_a, replica_b = RedisStore(redis_server.url, prefix), RedisStore(redis_server.url, prefix)
    replica_a.put("k", "tenant-a", _response(), Owner("s1"))
    assert replica_b.get("k", time.time()).text == "answer"
    assert replica_b.purge(Selector("tenant-a", session="s1")).num_entries == 1  # a purge through B ...
    assert replica_a.get("k", time.time()) is None  # ... is seen by A


def test_entries_carry_redis_ttls_past_their_expiry(redis_server):
    store = RedisStore(redis_server.url, f"test-{uuid.uuid4().hex}:")
    expires = time.time() + 100
    store.put("k", "t", _response(expires), Owner("s"))
    store.put("forever", "t", _response(None))
    ttl = store.client.pttl(store._entry("k")) / 1000
    assert 100 + EXPIRY_GRACE_S - 5 < ttl <= 100 + EXPIRY_GRACE_S
    assert store.client.pttl(store._owners("k")) > 0 and store.client.pttl(store._entry("forever")) == -1
    assert store.get("k", expires + 1) is None  # the logical expiry holds before Redis drops it


def test_an_unreachable_server_fails_fast_and_a_restarted_one_is_used_again(tmp_path):
    servers = [RedisServer(tmp_path)]
    try:
        _outage_and_recovery(tmp_path, servers)
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop()


def _outage_and_recovery(tmp_path, servers: list[RedisServer]) -> None:
    server = servers[0]
    store = RedisStore(server.url, "strata:exact:")
    store.put("k", "t", _response())
    server.stop()
    start = time.monotonic()
    with pytest.raises(StoreUnavailable):
        store.get("k", time.time())
    with pytest.raises(StoreUnavailable):  # within the retry window: at once, no socket wait
        store.put("k2", "t", _response())
    assert time.monotonic() - start < 2.0
    servers.append(RedisServer(tmp_path, server.port))  # the same server back, empty (no persistence)
    time.sleep(RETRY_AFTER_S)
    store.put("k3", "t", _response())
    assert store.get("k3", time.time()) is not None


def test_an_entry_written_through_a_reply_later_than_the_timeout_is_sent_again_and_kept(redis_server):
    """A loaded machine's Redis answering after the socket timeout: an entry's write (repeatable) is
    sent once more on a fresh connection and kept; a write that is not repeatable is not sent again."""
    store = RedisStore(redis_server.url, f"test-{uuid.uuid4().hex}:")
    store.get("warm", time.time())  # the pool holds a connection before the pause
    pauser = redis.Redis.from_url(redis_server.url)
    pauser.client_pause(int(SOCKET_TIMEOUT_S * 1500), all=False)  # writes wait 1.5 timeouts
    store.put("k", "t", _response())  # the first try times out; the second is answered at the pause's end
    assert store.get("k", time.time()).text == "answer"
    once = RedisLink(redis_server.url)
    pauser.client_pause(int(SOCKET_TIMEOUT_S * 1500), all=False)
    with pytest.raises(StoreUnavailable):
        once.transaction(lambda pipe: pipe.incr(store.prefix + "counter"))
    pauser.close()
