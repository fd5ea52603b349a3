"""The server's keyring: one per process and key store, shared by the engine's SSD tier and the
response stores, so a tenant purge's shredding takes effect in both at once.

    keyring_for(settings) -> Sealer       Keyring (encryption at rest on) or Plain (off)
    RedisKeys(url)                        the key store of a cluster: one Redis hash, strata:keys
    rotate(settings, new_key_file)        `strata keys rotate`: every data key wrapped under a new key

Where the data keys live: in Redis with STRATA_REDIS_URL (every replica shares them, as it shares the
entries), else in `keys.json` beside the server secret (replicas sharing a KV folder share the secret
file's folder as well). The wrapping key: STRATA_KEY_FILE, else derived from the server secret. A key
file kept apart from the data dir (a mounted secret) means a copy of the data dir alone opens nothing.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from kvcache.sealing import NO_SEALING, FileKeys, Keyring, Sealer, WrongKey, read_key_file, wrapping_key
from semantic.redis_store import RedisLink

from .auth import load_server_secret
from .settings import Settings

KEYS_HASH = "strata:keys"
_keyrings: dict[tuple, Sealer] = {}
_lock = threading.Lock()


class RedisKeys:
    """A key store in one Redis hash (tenant -> record): HSETNX keeps the first key of a tenant."""

    def __init__(self, url: str):
        self.link = RedisLink(url)

    def get(self, tenant: str) -> bytes | None:
        return self.link.call(self.link.client.hget, KEYS_HASH, tenant)

    def add(self, tenant: str, record: bytes) -> bytes:
        self.link.call(self.link.client.hsetnx, KEYS_HASH, tenant, record)
        return self.link.call(self.link.client.hget, KEYS_HASH, tenant)

    def delete(self, tenant: str) -> bool:
        return bool(self.link.call(self.link.client.hdel, KEYS_HASH, tenant))

    def records(self) -> dict[str, bytes]:
        return {
            tenant.decode(): record for tenant, record in self.link.call(self.link.client.hgetall, KEYS_HASH).items()
        }

    def replace_all(self, records: dict[str, bytes]) -> None:
        def write(pipe) -> None:
            pipe.delete(KEYS_HASH)
            pipe.hset(KEYS_HASH, mapping=records)

        self.link.transaction(write)

    def version(self) -> object:
        return None  # no cheap test of change: keys are re-read after KEY_CACHE_S


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
                found = Keyring(store, key)
            except WrongKey as exc:
                source = f"the key file {settings.key_file}" if settings.key_file else "the server secret's key"
                raise RuntimeError(f"{source} does not open the key store at {where[1]}: {exc}") from None
            _keyrings[cached_as] = found
        return found


def rotate(settings: Settings, new_key_file: Path) -> int:
    """Wrap every tenant's data key under the key in `new_key_file` (the data is not touched); how
    many keys. Restart the servers with STRATA_KEY_FILE pointing at the new file afterwards."""
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
