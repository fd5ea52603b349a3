"""The cluster's key store in a real Redis: processes sharing it follow a rotation of the wrapping
key, and a key is never added under a key the store has left."""

from __future__ import annotations

import pytest

from gateway.tenancy.keyring import KEYS_HASH, RedisKeys
from kvcache.sealing import CHECK, Keyring, KeysRotated

KEY, NEW_KEY = bytes(range(32)), bytes(range(1, 33))


@pytest.fixture
def url(redis_server):
    redis_server.flush()
    return redis_server.url


def test_replicas_sharing_redis_follow_a_rotation_and_add_no_key_under_the_old_one(url):
    key_file = [KEY]
    replica = Keyring(RedisKeys(url), KEY, reload=lambda: key_file[0])
    acme = replica.seal("acme", b"p", b"acme data")
    globex = Keyring(RedisKeys(url), KEY).seal("globex", b"p", b"globex data")
    assert Keyring(RedisKeys(url), KEY).rewrap(NEW_KEY) == 2

    assert replica.open("acme", b"p", acme) == b"acme data"
    with pytest.raises(KeysRotated):
        replica.seal("initech", b"p", b"x")
    assert set(RedisKeys(url).records()) == {CHECK, "acme", "globex"}
    key_file[0] = NEW_KEY
    assert replica.open("globex", b"p", globex) == b"globex data"
    initech = replica.seal("initech", b"p", b"initech data")
    assert Keyring(RedisKeys(url), NEW_KEY).open("initech", b"p", initech) == b"initech data"


def test_an_add_against_an_old_check_record_is_refused_atomically(url):
    store = RedisKeys(url)
    Keyring(store, KEY)  # writes the check record
    check = store.get(CHECK)
    assert store.add("acme", b"record-1", check) == b"record-1"
    assert store.add("acme", b"record-2", check) == b"record-1"  # the first record of a tenant stays
    store.link.client.hset(KEYS_HASH, CHECK, b"another check record")
    assert store.add("globex", b"record-3", check) is None and store.get("globex") is None


def test_a_rewrite_keeps_a_key_added_while_it_was_computed(url):
    store = RedisKeys(url)
    Keyring(store, KEY)
    other = RedisKeys(url)

    def change(records):
        if "late" not in records:  # another replica adds a key between the read and the write
            other.add("late", b"late-record", None)
        return {tenant: record + b"!" for tenant, record in records.items()}

    written = store.rewrite(change)
    assert written["late"] == b"late-record!" and store.get("late") == b"late-record!"
