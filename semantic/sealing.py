"""What semantic's stores ask of the sealing at rest, and the errors they know. The stores seal
what they keep by tenant, open it back and look entries up by keyed digests, through any object
with these three methods; the gateway passes its tenants' keyring, adapted to raise the errors
below (semantic imports no other library).

    Sealer.seal(tenant, aad, plaintext) -> bytes
    Sealer.open(tenant, aad, sealed) -> bytes      Unreadable when it does not open
    Sealer.digest(tenant, data) -> str             a keyed hash for lookups by content
    NO_SEALING                                     the stores' default: the bytes behind a marker

Errors: `Unreadable` (a blob whose key was shredded, or not what it claims to be: the entry reads
as absent) and `StoreUnavailable` (a store, or the key store behind a sealer, cannot be used now:
the layer is bypassed, the request still answered).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

PLAIN_MARK = b"\x00"  # a blob's first byte when it is not sealed


class Unreadable(Exception):
    """A blob that cannot be opened: its key was shredded, or it is not what it claims to be."""


class StoreUnavailable(Exception):
    """A store (or the key store its sealer needs) cannot be used now; the layer is bypassed."""


class Sealer(Protocol):
    def seal(self, tenant: str, aad: bytes, plaintext: bytes) -> bytes: ...
    def open(self, tenant: str, aad: bytes, sealed: bytes | memoryview) -> bytes: ...
    def digest(self, tenant: str, data: bytes) -> str: ...


class Plain:
    """No encryption: the bytes behind a one-byte marker, so a sealed blob reads as Unreadable,
    never as garbage."""

    def seal(self, tenant: str, aad: bytes, plaintext: bytes) -> bytes:
        return PLAIN_MARK + plaintext

    def open(self, tenant: str, aad: bytes, sealed: bytes | memoryview) -> bytes:
        if sealed[:1] != PLAIN_MARK:
            raise Unreadable("sealed with a key; encryption at rest is off here")
        return bytes(sealed[1:])

    def digest(self, tenant: str, data: bytes) -> str:
        return hashlib.sha256(b"strata-digest|" + tenant.encode() + b"|" + data).hexdigest()


NO_SEALING = Plain()
