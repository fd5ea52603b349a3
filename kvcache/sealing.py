"""Data at rest, sealed with a key per tenant: AES-256-GCM, the ciphertext bound to its tenant and place.

    Keyring(store, wrapping_key)      per-tenant data keys, each wrapped (AES-256-GCM) by the wrapping key
      .seal(tenant, aad, plaintext)   -> bytes: version, key id, nonce, ciphertext + tag
      .open(tenant, aad, sealed)      -> plaintext; Unreadable when the tenant's key is gone, the bytes
                                         were sealed for another tenant or place, or were altered
      .digest(tenant, data)           -> a keyed hash for lookups by content (HMAC under the data key)
      .shred(tenant)                  the key leaves the store: everything sealed under it is unreadable
                                         at once, wherever a copy of it lies (crypto-shredding)
      .rewrap(new_wrapping_key)       every data key wrapped again (rotation of the wrapping key)
    Plain()                           the same interface without encryption (encryption at rest off)
    FileKeys(path)                    a key store in one JSON file (next to the data it opens)

The associated data of every seal is the tenant, the caller's `aad` (a block hash and namespace, an
entry key) and the key id, so a blob moved to another tenant, entry or key does not open. A nonce is
96 random bits per seal: a key seals far fewer than the 2^32 messages that bound random GCM nonces.

A key store maps tenant -> wrapped record (key id, nonce, wrapped key) plus one check record, which
opens only under the right wrapping key: a wrong key file stops start-up instead of reading as
"every tenant's data is gone". Keys are cached in memory; the cache is checked against the store at
every use for a file store (one stat), and at most KEY_CACHE_S old for a shared store.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SEALED_MARK, PLAIN_MARK = b"\x01", b"\x00"  # a blob's first byte: which of the two sealed it
KEY_ID_BYTES, NONCE_BYTES = 8, 12
CHECK = "__check__"  # the check record's name in a key store (never a tenant: tenants are API-key labels)
CHECK_TEXT = b"strata key store check v1"
KEY_CACHE_S = 2.0  # how stale a shared store's keys may be in memory (a purge announcement forgets at once)


class Unreadable(Exception):
    """A blob that cannot be opened: its key was shredded, or it is not what it claims to be."""


class WrongKey(RuntimeError):
    """The wrapping key does not open this key store (another key file, another server secret)."""


class KeyStoreDamaged(RuntimeError):
    """The key store's file does not parse: nothing in it can be trusted or opened."""


class Sealer(Protocol):
    def seal(self, tenant: str, aad: bytes, plaintext: bytes) -> bytes: ...
    def open(self, tenant: str, aad: bytes, sealed: bytes | memoryview) -> bytes: ...
    def digest(self, tenant: str, data: bytes) -> str: ...


class KeyStore(Protocol):
    """tenant -> wrapped key record. `add` keeps the first record of a tenant (another process's may win)."""

    def get(self, tenant: str) -> bytes | None: ...
    def add(self, tenant: str, record: bytes) -> bytes: ...
    def delete(self, tenant: str) -> bool: ...
    def records(self) -> dict[str, bytes]: ...
    def replace_all(self, records: dict[str, bytes]) -> None: ...
    def version(self) -> object: ...  # changes whenever the store does (None: cannot tell cheaply)


class Plain:
    """No encryption (STRATA_ENCRYPT_AT_REST=0): the bytes behind a one-byte marker, so data written in
    one mode reads as unreadable, never as garbage, in the other."""

    def seal(self, tenant: str, aad: bytes, plaintext: bytes) -> bytes:
        return PLAIN_MARK + plaintext

    def open(self, tenant: str, aad: bytes, sealed: bytes | memoryview) -> bytes:
        if sealed[:1] != PLAIN_MARK:
            raise Unreadable("sealed with a key; encryption at rest is off here")
        return bytes(sealed[1:])

    def digest(self, tenant: str, data: bytes) -> str:
        return hashlib.sha256(b"strata-digest|" + tenant.encode() + b"|" + data).hexdigest()


NO_SEALING = Plain()  # the stores' default


class Keyring:
    """Invariant: `keys` holds tenant -> (key id, data key) as the store held them when `fetched`
    (a time.monotonic()); the store's record is the truth, the cache only saves unwrapping it."""

    def __init__(self, store: KeyStore, wrapping_key: bytes):
        self.store = store
        self.wrapper = AESGCM(wrapping_key)
        self.lock = threading.Lock()
        self.keys: dict[str, tuple[bytes, bytes]] = {}
        self.fetched: dict[str, float] = {}
        self.seen_version = store.version()
        self.checked = False
        try:
            self._check()
        except RuntimeError:  # WrongKey, KeyStoreDamaged: start-up must stop here
            raise
        except Exception:  # noqa: BLE001 - a shared store out of reach: checked at the first use instead
            pass

    def seal(self, tenant: str, aad: bytes, plaintext: bytes) -> bytes:
        key_id, key = self._own_key(tenant)
        nonce = secrets.token_bytes(NONCE_BYTES)
        return SEALED_MARK + key_id + nonce + _cipher(key).encrypt(nonce, plaintext, _bound(tenant, aad, key_id))

    def open(self, tenant: str, aad: bytes, sealed: bytes | memoryview) -> bytes:
        if sealed[:1] != SEALED_MARK:
            raise Unreadable("not sealed (written with encryption at rest off)")
        key_id = bytes(sealed[1 : 1 + KEY_ID_BYTES])
        nonce = bytes(sealed[1 + KEY_ID_BYTES : 1 + KEY_ID_BYTES + NONCE_BYTES])
        found = self._key(tenant, create=False)
        if found is None or found[0] != key_id:
            raise Unreadable(f"the key it was sealed with is gone (tenant {tenant!r} was purged)")
        try:
            ciphertext = memoryview(sealed)[1 + KEY_ID_BYTES + NONCE_BYTES :]  # no copy of a tensor's bytes
            return _cipher(found[1]).decrypt(nonce, ciphertext, _bound(tenant, aad, key_id))
        except InvalidTag:
            raise Unreadable("does not open under its tenant's key: another tenant's, moved or altered") from None

    def digest(self, tenant: str, data: bytes) -> str:
        key = self._own_key(tenant)[1]
        return hmac.new(key, b"strata-digest|" + data, hashlib.sha256).hexdigest()

    def shred(self, tenant: str) -> bool:
        """The tenant's key out of the store and memory (whether it had one); a new one is made at its next seal."""
        with self.lock:
            self.keys.pop(tenant, None)
            self.fetched.pop(tenant, None)
        return self.store.delete(tenant)

    def forget(self, tenant: str) -> None:
        """Drop the cached key (another replica shredded it): the next use asks the store."""
        with self.lock:
            self.keys.pop(tenant, None)
            self.fetched.pop(tenant, None)

    def rewrap(self, new_wrapping_key: bytes) -> int:
        """Every data key wrapped under the new key, in one replacement of the store; how many."""
        records = {}
        for tenant, record in self.store.records().items():
            if tenant == CHECK:
                continue
            key_id, key = self._unwrap(tenant, record)
            records[tenant] = wrap(AESGCM(new_wrapping_key), tenant, key_id, key)
        records[CHECK] = wrap(AESGCM(new_wrapping_key), CHECK, b"\0" * KEY_ID_BYTES, CHECK_TEXT)
        self.store.replace_all(records)
        self.wrapper = AESGCM(new_wrapping_key)
        return len(records) - 1

    def _check(self) -> None:
        """WrongKey unless the store's check record opens (written first when the store is new)."""
        record = self.store.get(CHECK)
        if record is None:
            record = self.store.add(CHECK, wrap(self.wrapper, CHECK, b"\0" * KEY_ID_BYTES, CHECK_TEXT))
        try:
            self._unwrap(CHECK, record)
        except Unreadable:
            raise WrongKey(
                "the wrapping key does not open this key store (another key file or server secret)"
            ) from None
        self.checked = True

    def _own_key(self, tenant: str) -> tuple[bytes, bytes]:
        found = self._key(tenant, create=True)
        assert found is not None, "a missing key is created"
        return found

    def _key(self, tenant: str, create: bool) -> tuple[bytes, bytes] | None:
        if not self.checked:
            self._check()
        with self.lock:
            self._drop_stale()
            if tenant in self.keys:
                return self.keys[tenant]
        record = self.store.get(tenant)
        if record is None and create:
            key_id, key = secrets.token_bytes(KEY_ID_BYTES), secrets.token_bytes(32)
            record = self.store.add(tenant, wrap(self.wrapper, tenant, key_id, key))
        if record is None:
            return None
        found = self._unwrap(tenant, record)
        with self.lock:
            self.keys[tenant], self.fetched[tenant] = found, time.monotonic()
        return found

    def _drop_stale(self) -> None:
        """The caller holds the lock. A file store: drop all when the file changed; a shared store:
        drop keys fetched more than KEY_CACHE_S ago."""
        version = self.store.version()
        if version is not None:
            if version != self.seen_version:
                self.keys, self.fetched, self.seen_version = {}, {}, version
            return
        now = time.monotonic()
        for tenant in [t for t, at in self.fetched.items() if now - at > KEY_CACHE_S]:
            self.keys.pop(tenant, None)
            self.fetched.pop(tenant, None)

    def _unwrap(self, tenant: str, record: bytes) -> tuple[bytes, bytes]:
        key_id, nonce, wrapped = record[:KEY_ID_BYTES], record[KEY_ID_BYTES : KEY_ID_BYTES + NONCE_BYTES], record[20:]
        try:
            return key_id, self.wrapper.decrypt(nonce, wrapped, _wrapped_for(tenant, key_id))
        except InvalidTag:
            raise Unreadable(f"the key record of {tenant!r} does not open under the wrapping key") from None


@lru_cache(maxsize=1024)
def _cipher(key: bytes) -> AESGCM:
    """A data key's cipher (its key schedule made once, not at every seal)."""
    return AESGCM(key)


def wrap(wrapper: AESGCM, tenant: str, key_id: bytes, key: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return key_id + nonce + wrapper.encrypt(nonce, key, _wrapped_for(tenant, key_id))


def _wrapped_for(tenant: str, key_id: bytes) -> bytes:
    return b"strata-data-key|" + tenant.encode() + b"|" + key_id


def _bound(tenant: str, aad: bytes, key_id: bytes) -> bytes:
    tenant_bytes = tenant.encode()
    return b"strata-sealed-v1|" + len(tenant_bytes).to_bytes(4, "little") + tenant_bytes + key_id + aad


def wrapping_key(server_secret: bytes) -> bytes:
    """The wrapping key when no key file is given: derived from the server secret (HMAC-SHA256)."""
    return hmac.new(server_secret, b"strata-wrapping-key-v1", hashlib.sha256).digest()


def read_key_file(path: Path) -> bytes:
    """A key file: 32 random bytes, raw or as 64 hex digits. ValueError with the reason otherwise."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"the key file {path} cannot be read: {exc.strerror or exc}") from None
    text = raw.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode())
        except (UnicodeDecodeError, ValueError):
            pass
    if len(raw) == 32:
        return raw
    raise ValueError(f"the key file {path} must hold 32 random bytes, raw or as 64 hex digits ({len(raw)} bytes)")


class FileKeys:
    """A key store in one JSON file ({tenant: hex record}), 0600, rewritten whole and renamed into
    place under an exclusive lock on a lock file beside it, so processes sharing the folder never lose
    each other's keys. `version()` is the file's (inode, size, mtime): a cheap test of change."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def get(self, tenant: str) -> bytes | None:
        return self.records().get(tenant)

    def add(self, tenant: str, record: bytes) -> bytes:
        with self._locked():
            records = self.records()
            if tenant not in records:
                records[tenant] = record
                self._write(records)
            return records[tenant]

    def delete(self, tenant: str) -> bool:
        with self._locked():
            records = self.records()
            if records.pop(tenant, None) is None:
                return False
            self._write(records)
            return True

    def records(self) -> dict[str, bytes]:
        try:
            stored = json.loads(self.path.read_text())
            return {tenant: bytes.fromhex(record) for tenant, record in stored.items()}
        except FileNotFoundError:
            return {}
        except (ValueError, AttributeError, TypeError):
            raise KeyStoreDamaged(
                f"{self.path} is damaged: restore it from where it is kept, or remove it to start "
                "afresh (every tenant's stored data then becomes unreadable)"
            ) from None

    def replace_all(self, records: dict[str, bytes]) -> None:
        with self._locked():
            self._write(records)

    def version(self) -> object:
        try:
            status = self.path.stat()
        except FileNotFoundError:
            return 0, 0, 0
        return status.st_ino, status.st_size, status.st_mtime_ns

    def _write(self, records: dict[str, bytes]) -> None:
        temp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}")
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            json.dump({tenant: record.hex() for tenant, record in records.items()}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, self.path)

    def _locked(self):
        return _FileLock(self.lock_path)


class _FileLock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc_info) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
