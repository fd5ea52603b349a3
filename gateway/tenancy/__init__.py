"""Who a request belongs to and what is theirs: API keys and tenants, the tenants' data keys (at rest), declared public prefixes, sessions, owner-only files."""
