"""Who is calling: API key -> tenant (never from the client's body or headers), and the tenant's salt.

Without STRATA_API_KEYS the server is single-tenant: every caller is tenant "default".
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvcache import TenantSalt, tenant_salt

from ..requests.errors import ApiError

log = logging.getLogger("strata")
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    salt: TenantSalt


def load_server_secret(path: Path) -> bytes:
    """32 random bytes kept in `path` (mode 0600), created on first start. Replicas that share a KV
    tier share this file (tenant salts must agree for their block hashes to): it is created whole,
    written aside and then hard-linked into place, so a replica starting at the same moment reads all
    32 bytes or finds no file, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        aside = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(32))
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(aside, path)
        except FileExistsError:
            pass  # another replica made it first: use its secret
        finally:
            aside.unlink()
    secret = path.read_bytes()
    if len(secret) != 32:
        raise RuntimeError(f"{path} is damaged ({len(secret)} bytes, expected 32)")
    return secret


class Authenticator:
    def __init__(self, api_keys: dict[str, str], admin_key: str | None, server_secret: bytes):
        self.api_keys = api_keys
        self.admin_key = admin_key
        self.salts = {tenant: tenant_salt(server_secret, tenant) for tenant in {*api_keys.values(), DEFAULT_TENANT}}

    def caller(self, authorization: str | None) -> Caller:
        if not self.api_keys:
            return Caller(DEFAULT_TENANT, self.salts[DEFAULT_TENANT])
        key = _bearer(authorization)
        for known, tenant in self.api_keys.items():
            if key is not None and hmac.compare_digest(key.encode(), known.encode()):
                return Caller(tenant, self.salts[tenant])
        raise ApiError(
            401,
            "missing or invalid API key (use Authorization: Bearer <key>)",
            "invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def is_admin(self, authorization: str | None) -> bool:
        key = _bearer(authorization)
        return (
            self.admin_key is not None
            and key is not None
            and hmac.compare_digest(key.encode(), self.admin_key.encode())
        )

    def require_admin(self, authorization: str | None) -> None:
        if self.admin_key is None:
            raise ApiError(403, "admin routes are disabled: set STRATA_ADMIN_KEY", "admin_disabled")
        key = _bearer(authorization)
        if key is None or not hmac.compare_digest(key.encode(), self.admin_key.encode()):
            raise ApiError(
                401, "missing or invalid admin key", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
            )


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
