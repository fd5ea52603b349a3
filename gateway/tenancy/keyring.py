"""The server's keyring: one per process and key store, shared by the engine's SSD tier and the
response stores, so a tenant purge's shredding takes effect in both at once.

    keyring_for(settings) -> Sealer       Keyring (encryption at rest on) or Plain (off)
    RedisKeys(url)                        the key store of a cluster: one Redis hash, strata:keys
    rotate(settings, new_key_file)        `strata keys rotate`: every data key wrapped under a new key
                                          (safe while servers run: see below)
    at_rest(sealer, tenant, kind, value)  an id or cache key as the stores keep it: a keyed digest
    SemanticSealer(sealer)                the keyring as semantic's stores take it (their protocol, errors)
    UNAVAILABLE                           either library's "a store is out of reach", to catch both

Where the data keys live: in Redis with STRATA_REDIS_URL (every replica shares them, as it shares the
entries), else in `keys.json` beside the server secret (replicas sharing a KV folder share the secret
file's folder as well). The wrapping key: STRATA_KEY_FILE, else derived from the server secret. A key
file kept apart from the data dir (a mounted secret) means a copy of the data dir alone opens nothing.

Rotation while servers run: the store is rewrapped in one atomic write, and a key only enters the
store under the key the store is wrapped under then. A running server keeps every data key it holds
(they do not change); for another tenant's key it reads its key file again, so replacing the file
STRATA_KEY_FILE names with the new key (mv, not an edit in place) completes the rotation with no
restart. Until then those requests get 503 key_store_rotated and the cache layers bypass them.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import redis

from kvcache.sealing import (
    CHECK,
    NO_SEALING,
    FileKeys,
    Keyring,
    Sealer,
    StoreUnavailable,
    Unreadable,
    WrongKey,
    read_key_file,
    wrapping_key,
)
from semantic import sealing as semantic_sealing
from semantic.redis_store import RedisLink

from ..settings import Settings
from .auth import load_server_secret

KEYS_HASH = "strata:keys"
ADD_SCRIPT = """
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[4] then return false end
redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3])
return redis.call('HGET', KEYS[1], ARGV[2])
"""  # ARGV: the check record's name, tenant, record, the check record the adder knows ('' for none)
_keyrings: dict[tuple, Sealer] = {}
_lock = threading.Lock()


class RedisKeys:
    """A key store in one Redis hash (tenant -> record): an add keeps the first key of a tenant, and
    only while the check record is the one the adder knows (one Lua script: atomic)."""

    def __init__(self, url: str):
        self.link = RedisLink(url)
        self.add_script = self.link.client.register_script(ADD_SCRIPT)

    def get(self, tenant: str) -> bytes | None:
        return self._call(self.link.client.hget, KEYS_HASH, tenant)

    def add(self, tenant: str, record: bytes, check: bytes | None) -> bytes | None:
        return self._call(self.add_script, keys=[KEYS_HASH], args=[CHECK, tenant, record, check or b""])

    def delete(self, tenant: str) -> bool:
        return bool(self._call(self.link.client.hdel, KEYS_HASH, tenant))

    def records(self) -> dict[str, bytes]:
        return _decoded(self._call(self.link.client.hgetall, KEYS_HASH))

    def rewrite(self, change: Callable[[dict[str, bytes]], dict[str, bytes]]) -> dict[str, bytes]:
        """Read, change and write back under WATCH: a write by anyone in between starts it again."""

        def run() -> dict[str, bytes]:
            with self.link.client.pipeline() as pipe:
                while True:
                    try:
                        pipe.watch(KEYS_HASH)
                        records = change(_decoded(pipe.hgetall(KEYS_HASH)))
                        pipe.multi()
                        pipe.delete(KEYS_HASH)
                        pipe.hset(KEYS_HASH, mapping=records)  # type: ignore[arg-type]  # redis-py's Mapping key type is invariant
                        pipe.execute()
                        return records
                    except redis.WatchError:
                        continue

        return self._call(run)

    def version(self) -> object:
        return None  # no cheap test of change: keys are re-read after KEY_CACHE_S

    def _call(self, *args, **kwargs):
        """The link's call, its Redis outage as the key store's (kvcache's StoreUnavailable)."""
        try:
            return self.link.call(*args, **kwargs)
        except semantic_sealing.StoreUnavailable as exc:
            raise StoreUnavailable(str(exc)) from exc


# A store out of reach, as either library says it: semantic's stores (Redis) or kvcache's key store.
UNAVAILABLE = (semantic_sealing.StoreUnavailable, StoreUnavailable)


class SemanticSealer:
    """The tenants' keyring (kvcache's) as semantic's stores take it (semantic.sealing.Sealer): the
    same keys, sealed blobs and digests; its errors raised as semantic's, which the stores know."""

    def __init__(self, sealer: Sealer):
        self.sealer = sealer

    def seal(self, tenant: str, aad: bytes, plaintext: bytes) -> bytes:
        with _as_semantic():
            return self.sealer.seal(tenant, aad, plaintext)

    def open(self, tenant: str, aad: bytes, sealed: bytes | memoryview) -> bytes:
        with _as_semantic():
            return self.sealer.open(tenant, aad, sealed)

    def digest(self, tenant: str, data: bytes) -> str:
        with _as_semantic():
            return self.sealer.digest(tenant, data)


@contextmanager
def _as_semantic() -> Iterator[None]:
    try:
        yield
    except Unreadable as exc:
        raise semantic_sealing.Unreadable(str(exc)) from exc
    except StoreUnavailable as exc:
        raise semantic_sealing.StoreUnavailable(str(exc)) from exc


def at_rest(sealer: Sealer, tenant: str, kind: str, value: str) -> str:
    """What the stores keep for a client's id (`kind` "session", "end_user") or a cache key ("exact",
    "draft"): a keyed digest under the tenant's data key, so the data folder or a Redis dump neither
    names an end user nor confirms a guessed prompt (a key is recomputable from a prompt, a digest
    under a key the folder does not hold is not). Equal values give equal digests while the tenant's
    key lives (lookups, ownership and purges match); a purge that shreds the key unlinks them. "" stays
    "". When the key store cannot be reached the digest is unkeyed and marked: the stores cannot seal
    then either, so nothing is written under it, and the engine's salts still keep end users apart."""
    if not value:
        return ""
    data = f"{kind}|{value}".encode()
    try:
        return sealer.digest(tenant, data)
    except StoreUnavailable:
        return UNKEYED + hashlib.sha256(b"strata-unkeyed|" + tenant.encode() + b"|" + data).hexdigest()


UNKEYED = "unkeyed:"  # marks a digest made while the key store was out of reach (at_rest)


def unkeyed(digest: str) -> bool:
    """The digest was made without the tenant's key: nothing may be looked up or written under it
    (the key store may be back by the time a write would run, and the entry then sits under a key no
    later request computes)."""
    return digest.startswith(UNKEYED)


def keyring_for(settings: Settings) -> Sealer:
    """The process's sealer for these settings (the same object for the same store and key).
    RuntimeError with the reason when the key file is missing or unreadable, or does not open the store."""
    if not settings.encrypt_at_rest:
        return NO_SEALING
    key = _wrapping_key(settings)
    where = ("redis", settings.redis_url) if settings.redis_url else ("file", str(_keys_path(settings).resolve()))
    cached_as = (*where, hashlib.sha256(key).hexdigest())
    with _lock:
        found = _keyrings.get(cached_as)
        if found is None:
            store = RedisKeys(settings.redis_url) if settings.redis_url else FileKeys(_keys_path(settings))
            try:
                found = Keyring(store, key, reload=partial(_wrapping_key, settings))
            except WrongKey as exc:
                source = f"the key file {settings.key_file}" if settings.key_file else "the server secret's key"
                raise RuntimeError(f"{source} does not open the key store at {where[1]}: {exc}") from None
            _keyrings[cached_as] = found
        return found


def rotate(settings: Settings, new_key_file: Path) -> int:
    """Wrap every tenant's data key under the key in `new_key_file` (the data is not touched); how
    many keys. Then put the new key where STRATA_KEY_FILE points (running servers read it again)."""
    keyring = keyring_for(settings)
    if not isinstance(keyring, Keyring):
        raise RuntimeError("encryption at rest is off (STRATA_ENCRYPT_AT_REST=0): there are no keys to rotate")
    new_key = _read(new_key_file)
    count = keyring.rewrap(new_key)
    with _lock:
        _keyrings.clear()
    return count


def _wrapping_key(settings: Settings) -> bytes:
    if settings.key_file is not None:
        return _read(settings.key_file)
    return wrapping_key(load_server_secret(_secret_path(settings)))


def _read(path: Path) -> bytes:
    try:
        return read_key_file(path)
    except ValueError as exc:
        raise RuntimeError(f"{exc} (STRATA_KEY_FILE)") from None


def _secret_path(settings: Settings) -> Path:
    return settings.secret_file or settings.data_dir / "server.secret"


def _keys_path(settings: Settings) -> Path:
    return _secret_path(settings).with_name("keys.json")


def _decoded(records: Mapping[bytes | str, bytes | str]) -> dict[str, bytes]:
    """Redis's hash as tenant -> record (the client answers bytes; its type says bytes or str)."""
    return {_text(tenant): _bytes(record) for tenant, record in records.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
