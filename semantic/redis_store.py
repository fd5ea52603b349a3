"""The exact-response store in Redis: the ResponseStore contract (semantic/store.py), shared by every
replica that points at the same server.

Layout under `prefix` (default "strata:exact:"):
    e:<key>       the entry: JSON of its tenant, expiry and sealed body (base64 of store.sealed_response)
    o:<key>       set of its owners, each JSON [session, end user]
    t:<tenant>    set of the tenant's keys (purges by tenant, session or end user read only these)
    all           set of every key (count)
    exp           sorted set JSON [tenant, key] -> expires_at (purge_expired reads only what is due)

Expiry is exact and logical, as in the other stores: get() never returns an entry past expires_at
by the caller's clock. Redis TTLs bound what stays behind: an entry and its owners carry a TTL of
expires_at plus EXPIRY_GRACE_S, so a replica that never sweeps still leaks nothing; the index sets
are cleaned by purge_expired. Writes of one operation go in one MULTI/EXEC.

Failure: a Redis that cannot be reached raises StoreUnavailable within the socket timeouts, and for
RETRY_AFTER_S afterwards raises it at once (no request waits on a dead server twice in a row); the
gateway turns it into `bypass; reason=store_unavailable` and keeps answering.
"""

from __future__ import annotations

import base64
import json
import threading
import time

import redis

from .owners import Owner, Selector
from .sealing import NO_SEALING, Sealer
from .store import Purged, StoredResponse, StoreUnavailable, opened_response, sealed_response

EXPIRY_GRACE_S = 60.0
RETRY_AFTER_S = 1.0
CONNECT_TIMEOUT_S = 0.25
SOCKET_TIMEOUT_S = 1.0


class RedisStore:
    def __init__(self, url: str, prefix: str = "strata:exact:", sealer: Sealer = NO_SEALING):
        self.link = RedisLink(url)
        self.client = self.link.client
        self.prefix = prefix
        self.sealer = sealer

    # -- the contract --------------------------------------------------------------------------

    def get(self, key: str, now: float) -> StoredResponse | None:
        raw = self.link.call(self.client.get, self._entry(key))
        if raw is None:
            return None
        entry = json.loads(raw)
        if entry["expires_at"] is not None and entry["expires_at"] <= now:
            return None
        return opened_response(self.sealer, entry["tenant"], key, base64.b64decode(entry["body"]))

    def put(self, key: str, tenant: str, response: StoredResponse, owner: Owner = Owner()) -> None:
        body = base64.b64encode(sealed_response(self.sealer, tenant, key, response)).decode()
        value = json.dumps({"tenant": tenant, "expires_at": response.expires_at, "body": body})

        def write(pipe) -> None:
            pipe.set(self._entry(key), value)
            pipe.sadd(self._owners(key), _owner(owner))
            pipe.sadd(self._tenant(tenant), key)
            pipe.sadd(self.prefix + "all", key)
            if response.expires_at is None:
                pipe.persist(self._entry(key))
                pipe.persist(self._owners(key))
                pipe.zrem(self.prefix + "exp", _due(tenant, key))
            else:
                deadline_ms = int((max(response.expires_at, time.time()) + EXPIRY_GRACE_S) * 1000)
                pipe.pexpireat(self._entry(key), deadline_ms)
                pipe.pexpireat(self._owners(key), deadline_ms)
                pipe.zadd(self.prefix + "exp", {_due(tenant, key): response.expires_at})

        self.link.transaction(write, repeatable=True)

    def own(self, key: str, owner: Owner) -> None:
        if self.link.call(self.client.exists, self._entry(key)):
            self.link.call(self.client.sadd, self._owners(key), _owner(owner))

    def delete(self, key: str) -> bool:
        raw = self.link.call(self.client.get, self._entry(key))
        if raw is None:
            return False
        self._remove([(key, json.loads(raw)["tenant"])])
        return True

    def purge_expired(self, now: float) -> int:
        due = [
            tuple(json.loads(m)) for m in self.link.call(self.client.zrangebyscore, self.prefix + "exp", "-inf", now)
        ]
        return self._remove([(key, tenant) for tenant, key in due]).num_entries

    def purge_tenant(self, tenant: str) -> int:
        return self.purge(Selector(tenant)).num_entries

    def purge(self, selector: Selector) -> Purged:
        keys = sorted(k.decode() for k in self.link.call(self.client.smembers, self._tenant(selector.tenant)))
        if not selector.whole_tenant:
            keys = [key for key in keys if self._release(key, selector)]
        return self._remove([(key, selector.tenant) for key in keys])

    def count(self) -> int:
        return int(self.link.call(self.client.scard, self.prefix + "all"))

    def purge_all(self) -> int:
        keys = self.link.call(lambda: list(self.client.scan_iter(match=self.prefix + "*", count=1000)))
        removed = self.count()
        for start in range(0, len(keys), 1000):
            self.link.call(self.client.delete, *keys[start : start + 1000])
        return removed

    def close(self) -> None:
        self.link.close()

    # -- parts ---------------------------------------------------------------------------------

    def _release(self, key: str, selector: Selector) -> bool:
        return release_owners(self.link, self._owners(key), selector)

    def _remove(self, keys: list[tuple[str, str]]) -> Purged:
        """Delete entries and their index members, given with their tenants: the entries still
        present (Redis may have dropped some by TTL already) and their bytes."""
        if not keys:
            return Purged()
        raws = [
            raw for raw in self.link.call(self.client.mget, [self._entry(key) for key, _ in keys]) if raw is not None
        ]

        def write(pipe) -> None:
            for key, tenant in keys:
                pipe.delete(self._entry(key), self._owners(key))
                pipe.srem(self.prefix + "all", key)
                pipe.srem(self._tenant(tenant), key)
                pipe.zrem(self.prefix + "exp", _due(tenant, key))

        self.link.transaction(write, repeatable=True)
        return Purged(len(raws), sum(len(raw) for raw in raws))

    def _entry(self, key: str) -> str:
        return f"{self.prefix}e:{key}"

    def _owners(self, key: str) -> str:
        return f"{self.prefix}o:{key}"

    def _tenant(self, tenant: str) -> str:
        return f"{self.prefix}t:{tenant}"


class RedisLink:
    """One Redis client whose failures become StoreUnavailable, with the down window above."""

    def __init__(self, url: str, socket_timeout_s: float = SOCKET_TIMEOUT_S):
        self.client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=socket_timeout_s, health_check_interval=30
        )
        self.down_until = 0.0  # time.monotonic() before which calls fail at once
        self.lock = threading.Lock()  # guards down_until

    def call(self, operation, *args, **kwargs):
        with self.lock:
            if time.monotonic() < self.down_until:
                raise StoreUnavailable("redis was unreachable moments ago")
        try:
            return operation(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            with self.lock:
                self.down_until = time.monotonic() + RETRY_AFTER_S
            raise StoreUnavailable(f"redis: {exc}") from None

    def transaction(self, write, repeatable: bool = False) -> None:
        """`write(pipe)` queues commands that run in one MULTI/EXEC. A `repeatable` write (running it
        twice leaves what running it once would) that fails on its connection — a server restarted
        under it, a reply later than the timeout on a loaded machine — is sent once more on a fresh
        connection before the store counts as down: a cache entry is not lost to one slow reply."""

        def run():
            with self.client.pipeline(transaction=True) as pipe:
                write(pipe)
                pipe.execute()

        def run_again_once():
            try:
                run()
            except (redis.ConnectionError, redis.TimeoutError):
                run()

        self.call(run_again_once if repeatable else run)

    def stream_end(self, stream: str) -> str:
        """The id of a stream's last record ("0-0" when it has none): what follows it is news."""
        last = self.call(self.client.xrevrange, stream, count=1)
        return last[0][0].decode() if last else "0-0"

    def close(self) -> None:
        self.client.close()


def release_owners(link: RedisLink, owners_key: str, selector: Selector) -> bool:
    """Take the selector's owners out of an entry's owner set (JSON [session, end user] members);
    True when none is left (the entry must go)."""
    owners = [_parse_owner(raw) for raw in link.call(link.client.smembers, owners_key)]
    gone = [_owner(owner) for owner in owners if selector.matches(owner)]
    if gone:
        link.call(link.client.srem, owners_key, *gone)
    return len(gone) == len(owners)


def _due(tenant: str, key: str) -> str:
    return json.dumps([tenant, key])


def _owner(owner: Owner) -> str:
    return json.dumps([owner.session, owner.end_user])


def _parse_owner(raw: bytes) -> Owner:
    session, end_user = json.loads(raw)
    return Owner(session, end_user)
