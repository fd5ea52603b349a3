"""kvcache: prefix KV blocks with chained, tenant-salted hashes.

A library: never imports `gateway`, never reads HTTP headers; returns typed results.
"""

from .keys import TenantSalt, tenant_salt

__all__ = ["TenantSalt", "tenant_salt"]
