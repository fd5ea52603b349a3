"""The exact-response cache: a canonicalised request under the same scope -> the stored answer.

Only deterministic requests are cached (temperature 0, or a seed): a sampled answer is one draw
among many, and replaying it would hide that. Settings may opt in to caching those too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .owners import Owner, Selector
from .scope import Scope, digest
from .store import Purged, ResponseStore, StoredResponse


@dataclass(frozen=True, slots=True)
class CacheControl:
    """What the client asked of the caches (parsed from headers by the gateway)."""

    no_store: bool = False  # store nothing from this request
    no_cache: bool = False  # do not answer from cache (still store)
    max_age_s: float | None = None  # accept only entries younger than this
    ttl_s: float | None = None  # keep what this request stores for this long


Status = Literal["hit", "miss", "bypass"]
ExactReason = Literal["", "nondeterministic", "no_cache", "too_old"]


@dataclass(frozen=True, slots=True)
class ExactLookup:
    status: Status
    key: str
    reason: ExactReason = ""
    response: StoredResponse | None = None
    age_s: float = 0.0


def exact_key(scope: Scope, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> str:
    """Messages are canonical dicts (images as content hashes); sampling holds what changes answers."""
    return digest("exact", {"scope": scope.as_dict(), "messages": messages, "sampling": sampling})


@dataclass(frozen=True, slots=True)
class ExactSnapshot:
    num_entries: int


class ExactCache:
    """Cache protocol: `name`, `stats()`, `purge()`, `close()` (any thread: the stores lock)."""

    name = "exact"

    def __init__(self, store: ResponseStore, default_ttl_s: float, cache_nondeterministic: bool = False):
        self.store = store
        self.default_ttl_s = default_ttl_s
        self.cache_nondeterministic = cache_nondeterministic

    def eligible(self, deterministic: bool) -> bool:
        return deterministic or self.cache_nondeterministic

    def lookup(self, key: str, control: CacheControl, deterministic: bool, now: float) -> ExactLookup:
        if not self.eligible(deterministic):
            return ExactLookup("bypass", key, "nondeterministic")
        if control.no_cache:
            return ExactLookup("bypass", key, "no_cache")
        found = self.store.get(key, now)
        if found is None:
            return ExactLookup("miss", key)
        age = now - found.created_at
        if control.max_age_s is not None and age > control.max_age_s:
            return ExactLookup("miss", key, "too_old", age_s=age)
        return ExactLookup("hit", key, response=found, age_s=age)

    def store_response(
        self,
        key: str,
        tenant: str,
        response: StoredResponse,
        control: CacheControl,
        deterministic: bool,
        owner: Owner = Owner(),
    ) -> bool:
        if control.no_store or not self.eligible(deterministic):
            return False
        self.store.put(key, tenant, response, owner)
        return True

    def stats(self) -> ExactSnapshot:
        return ExactSnapshot(self.store.count())

    def purge(self) -> Purged:
        return Purged(self.store.purge_all())

    def purge_tenant(self, tenant: str) -> int:
        return self.store.purge_tenant(tenant)

    def own(self, key: str, owner: Owner) -> None:
        """A hit: the entry is the hitting request's owner's too (a purge of the one that stored it
        then leaves it to the others)."""
        self.store.own(key, owner)

    def purge_owned(self, selector: Selector) -> Purged:
        """A tenant's entries, or its session's or end user's share of them (semantic/owners.py)."""
        return self.store.purge(selector)

    def close(self) -> None:
        self.store.close()

    def expiry(self, control: CacheControl, now: float) -> float | None:
        ttl = control.ttl_s if control.ttl_s is not None else self.default_ttl_s
        return now + ttl if ttl > 0 else None
