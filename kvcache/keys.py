"""Key types of the kvcache library. Each is built in exactly one function, over canonical bytes,
with SHA-256 (never Python's hash(): it is seeded per process and 64-bit)."""

from __future__ import annotations

import hashlib
import hmac
from typing import NewType

import numpy as np

TenantSalt = NewType("TenantSalt", bytes)  # secret, server-derived; never a client-chosen value
BlockHash = NewType("BlockHash", bytes)  # 32-byte SHA-256 digest


def tenant_salt(server_secret: bytes, tenant: str) -> TenantSalt:
    """HMAC-SHA256(server secret, tenant id): stable per tenant, unguessable without the secret."""
    return TenantSalt(hmac.new(server_secret, b"strata-tenant-salt|" + tenant.encode(), hashlib.sha256).digest())


def end_user_salt(tenant: TenantSalt, end_user: str) -> TenantSalt:
    """HMAC-SHA256(tenant salt, end user id): the salt of one end user's own caches within a tenant
    that keeps its end users apart."""
    return TenantSalt(hmac.new(tenant, b"strata-end-user-salt|" + end_user.encode(), hashlib.sha256).digest())


PUBLIC_SALT = TenantSalt(hashlib.sha256(b"strata-public-prefix-salt-v1").digest())  # not secret: public texts are
PUBLIC_TENANT = "__public__"  # whose data key seals public blocks at rest (a tenant purge never shreds it)


def rejoin(root: BlockHash, public_hash: BlockHash) -> BlockHash:
    """The parent of the first block after a public prefix: the tenant's root joined to the last
    public block's hash, so what follows a shared public prefix is the tenant's own again."""
    return BlockHash(hashlib.sha256(b"strata-kv-rejoin-v1|" + root + public_hash).digest())


def chain_root(salt: TenantSalt, namespace: str) -> BlockHash:
    """The parent of a prompt's first block. The tenant salt enters here, so the whole chain is
    tenant-specific; `namespace` (model fingerprint, block size) keeps other models' blocks apart."""
    return BlockHash(hashlib.sha256(b"strata-kv-root-v1|" + salt + b"|" + namespace.encode()).digest())


def block_hash(parent: BlockHash, token_bytes: bytes, extra: bytes) -> BlockHash:
    """H(parent, block tokens as little-endian int32, extra keys such as image content hashes)."""
    digest = hashlib.sha256(parent)
    digest.update(len(token_bytes).to_bytes(4, "little"))
    digest.update(token_bytes)
    digest.update(len(extra).to_bytes(4, "little"))
    digest.update(extra)
    return BlockHash(digest.digest())


def token_bytes(token_ids) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()
