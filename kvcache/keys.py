"""Key types of the kvcache library. Each is built in exactly one function."""

from __future__ import annotations

import hashlib
import hmac
from typing import NewType

TenantSalt = NewType("TenantSalt", bytes)  # secret, server-derived; never a client-chosen value


def tenant_salt(server_secret: bytes, tenant: str) -> TenantSalt:
    """HMAC-SHA256(server secret, tenant id): stable per tenant, unguessable without the secret."""
    return TenantSalt(hmac.new(server_secret, b"strata-tenant-salt|" + tenant.encode(), hashlib.sha256).digest())
