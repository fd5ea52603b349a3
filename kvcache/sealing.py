"""Data at rest, sealed with a key per tenant: AES-256-GCM, the ciphertext bound to its tenant and place.

    Keyring(store, wrapping_key)      per-tenant data keys, each wrapped (AES-256-GCM) by the wrapping key
      .seal(tenant, aad, plaintext)   -> bytes: version, key id, nonce, ciphertext + tag
      .open(tenant, aad, sealed)      -> plaintext; Unreadable when the tenant's key is gone, the bytes
                                         were sealed for another tenant or place, or were altered
      .digest(tenant, data)           -> a keyed hash for lookups by content (HMAC under the data key)
      .shred(tenant)                  the key leaves the store: everything sealed under it is unreadable
                                         at once, wherever a copy of it lies (crypto-shredding)
      .rewrap(new_wrapping_key)       every data key wrapped again (rotation of the wrapping key); other
                                         processes follow with their key file read again (KeysRotated
                                         until it holds the new key)
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
from collections.abc import Callable
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


class StoreUnavailable(Exception):
    """A store (the key store, or one whose data it opens) cannot be used now; the layer is
    bypassed, the request still answered."""


class KeysRotated(StoreUnavailable):
    """The key store was rewrapped under a wrapping key this process does not hold (yet)."""


class KeyStoreDamaged(RuntimeError):
    """The key store's file does not parse: nothing in it can be trusted or opened."""


class Sealer(Protocol):
    def seal(self, tenant: str, aad: bytes, plaintext: bytes) -> bytes: ...
    def open(self, tenant: str, aad: bytes, sealed: bytes | memoryview) -> bytes: ...
    def digest(self, tenant: str, data: bytes) -> str: ...


class KeyStore(Protocol):
    """tenant -> wrapped key record. `add` keeps the first record of a tenant (another process's may
    win) and returns the one kept; None, adding nothing, when `check` is given and the store's check
    record is no longer it (the store was rewrapped under another key). `rewrite` replaces every
    record by `change(records)` atomically (no add lands between the read and the write); the result."""

    def get(self, tenant: str) -> bytes | None: ...
    def add(self, tenant: str, record: bytes, check: bytes | None) -> bytes | None: ...
    def delete(self, tenant: str) -> bool: ...
    def records(self) -> dict[str, bytes]: ...
    def rewrite(self, change: Callable[[dict[str, bytes]], dict[str, bytes]]) -> dict[str, bytes]: ...
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
    """Invariant: `keys` holds tenant -> (key id, data key) as unwrapped from the store's record;
    `confirmed[tenant]` says when the store last showed that record: (the file store's version, a
    time.monotonic(), the store's check record then). A key is used unconfirmed while the file is
    unchanged, or for KEY_CACHE_S with a shared store; then the record is read again: gone
    (shredded) drops the key, gone with the whole store (a Redis restarted empty) writes the key
    held back, another key id unwraps the new one, the same key id keeps the key without unwrapping
    it (so a rotation of the wrapping key leaves every key in use working). `wrapper` opens the
    store's records while the check record is `check_record`; when the store was rewrapped under
    another key, `reload` (the key file read again) gives the new one."""

    def __init__(self, store: KeyStore, wrapping_key: bytes, reload: Callable[[], bytes] | None = None):
        self.store = store
        self.wrapper = AESGCM(wrapping_key)
        self.reload = reload
        self.lock = threading.Lock()
        self.keys: dict[str, tuple[bytes, bytes]] = {}
        self.confirmed: dict[str, tuple[object, float, bytes | None]] = {}
        self.check_record: bytes | None = None
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
        self.forget(tenant)
        return self.store.delete(tenant)

    def forget(self, tenant: str) -> None:
        """Drop the cached key (another replica shredded it): the next use asks the store."""
        with self.lock:
            self.keys.pop(tenant, None)
            self.confirmed.pop(tenant, None)

    def rewrap(self, new_wrapping_key: bytes) -> int:
        """Every data key wrapped under the new key, in one atomic rewrite of the store (a key added
        meanwhile is rewrapped too, or added after and refused: see `_add`); how many. Unreadable,
        and nothing changed, when a record does not open under the key held."""
        new_wrapper = AESGCM(new_wrapping_key)

        def rewrapped(records: dict[str, bytes]) -> dict[str, bytes]:
            tenants = [tenant for tenant in records if tenant != CHECK]
            out = {tenant: wrap(new_wrapper, tenant, *self._unwrap(tenant, records[tenant])) for tenant in tenants}
            return out | {CHECK: wrap(new_wrapper, CHECK, b"\0" * KEY_ID_BYTES, CHECK_TEXT)}

        written = self.store.rewrite(rewrapped)
        self.wrapper, self.check_record = new_wrapper, written[CHECK]
        return len(written) - 1

    def _check(self) -> None:
        """WrongKey unless the store's check record opens (written first when the store is new)."""
        record = self.store.get(CHECK)
        if record is None:
            record = self.store.add(CHECK, wrap(self.wrapper, CHECK, b"\0" * KEY_ID_BYTES, CHECK_TEXT), None)
        if record is None or not _opens(self.wrapper, record):
            raise WrongKey("the wrapping key does not open this key store (another key file or server secret)")
        self.check_record = record

    def _own_key(self, tenant: str) -> tuple[bytes, bytes]:
        found = self._key(tenant, create=True)
        assert found is not None, "a missing key is created"
        return found

    def _key(self, tenant: str, create: bool) -> tuple[bytes, bytes] | None:
        if self.check_record is None:
            self._check()
        version = self.store.version()
        with self.lock:
            if self._fresh(tenant, version):
                return self.keys[tenant]
            cached, seen = self.keys.get(tenant), self.confirmed.get(tenant)
        check, record = self.store.get(CHECK), self.store.get(tenant)
        if record is None and cached is not None and seen is not None and self._emptied_since(seen[2], check):
            record, check = self._written_back(tenant, cached), self.check_record
        if record is None and create:
            record, check = self._add(tenant), self.check_record
        if record is None:
            self.forget(tenant)
            return None
        found = cached if cached is not None and cached[0] == record[:KEY_ID_BYTES] else self._unwrapped(tenant, record)
        with self.lock:
            self.keys[tenant], self.confirmed[tenant] = found, (version, time.monotonic(), check)
        return found

    def _emptied_since(self, seen_check: bytes | None, check: bytes | None) -> bool:
        """Whether the store was emptied (a Redis restarted without its data) since it showed a key
        under the check record `seen_check`: the check record is gone, or is another one that opens
        under the same wrapping key (written again after the emptying; a rotation's does not open).
        A tenant's record gone under the same check record was shredded."""
        return check != seen_check and (check is None or _opens(self.wrapper, check))

    def _written_back(self, tenant: str, held: tuple[bytes, bytes]) -> bytes | None:
        """The key this process holds, back in an emptied store (the record it keeps: another
        replica's write-back of the same key may come first), so that what was sealed under it stays
        readable and its digests stay the same on every replica. The one window left: a replica that
        has not yet read a purge's announcement (which makes it forget the key) when the store is
        emptied brings that shredded key back."""
        self._check()  # the check record written again (or the one another replica wrote first)
        return self.store.add(tenant, wrap(self.wrapper, tenant, *held), self.check_record)

    def _fresh(self, tenant: str, version: object) -> bool:
        """The caller holds the lock. Whether the cached key may be used without asking the store."""
        if tenant not in self.confirmed:
            return False
        seen_version, at, _ = self.confirmed[tenant]
        return version == seen_version if version is not None else time.monotonic() - at <= KEY_CACHE_S

    def _add(self, tenant: str) -> bytes:
        """A new key for the tenant, wrapped under the key the store is wrapped under now; the
        record the store keeps (another process's may win). Never a record under a key the store
        left: the store refuses an add made against an old check record (`KeyStore.add`)."""
        key_id, key = secrets.token_bytes(KEY_ID_BYTES), secrets.token_bytes(32)
        for _ in range(3):
            record = self.store.add(tenant, wrap(self.wrapper, tenant, key_id, key), self.check_record)
            if record is not None:
                return record
            self._follow_rotation()
        raise KeysRotated("the key store keeps being rewrapped: retry")

    def _unwrapped(self, tenant: str, record: bytes) -> tuple[bytes, bytes]:
        try:
            return self._unwrap(tenant, record)
        except Unreadable:
            if not self._follow_rotation():
                raise
        return self._unwrap(tenant, record)

    def _follow_rotation(self) -> bool:
        """After a record failed to open or an add was refused: True when the store was rewrapped
        under the key `reload` now gives (held from here on), or was emptied (its check record is
        written again); False when the store still opens under the key held (the record itself is
        bad). KeysRotated when it opens under neither."""
        record = self.store.get(CHECK)
        if record is None:  # the store was emptied (a Redis restarted without its data): new again
            self._check()
            return True
        if _opens(self.wrapper, record):
            self.check_record = record
            return False
        try:
            new_wrapper = AESGCM(self.reload()) if self.reload is not None else None
        except (OSError, ValueError, RuntimeError) as exc:  # a key file being replaced, unreadable
            raise KeysRotated(f"the key store was rewrapped and the key file cannot be read now: {exc}") from None
        if new_wrapper is None or not _opens(new_wrapper, record):
            raise KeysRotated(
                "the key store was rewrapped under another wrapping key (strata keys rotate): "
                "put the new key in the file STRATA_KEY_FILE names, which this server reads again"
            )
        self.wrapper, self.check_record = new_wrapper, record
        return True

    def _unwrap(self, tenant: str, record: bytes) -> tuple[bytes, bytes]:
        key_id, nonce, wrapped = record[:KEY_ID_BYTES], record[KEY_ID_BYTES : KEY_ID_BYTES + NONCE_BYTES], record[20:]
        try:
            return key_id, self.wrapper.decrypt(nonce, wrapped, _wrapped_for(tenant, key_id))
        except InvalidTag:
            raise Unreadable(f"the key record of {tenant!r} does not open under the wrapping key") from None


def _opens(wrapper: AESGCM, check_record: bytes) -> bool:
    key_id, nonce = check_record[:KEY_ID_BYTES], check_record[KEY_ID_BYTES : KEY_ID_BYTES + NONCE_BYTES]
    try:
        return wrapper.decrypt(nonce, check_record[20:], _wrapped_for(CHECK, key_id)) == CHECK_TEXT
    except InvalidTag:
        return False


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

    def add(self, tenant: str, record: bytes, check: bytes | None) -> bytes | None:
        with self._locked():
            records = self.records()
            if check is not None and records.get(CHECK) != check:
                return None
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

    def rewrite(self, change: Callable[[dict[str, bytes]], dict[str, bytes]]) -> dict[str, bytes]:
        with self._locked():
            records = change(self.records())
            self._write(records)
            return records

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
