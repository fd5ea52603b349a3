"""The exact-response cache: a canonicalised request under the same scope -> the stored answer.

Only deterministic requests are cached (temperature 0, or a seed): a sampled answer is one draw
among many, and replaying it would hide that. Settings may opt in to caching those too.
"""

from __future__ import annotations

from collections.abc import Callable
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


def draft_key(scope: Scope, messages: list[dict[str, Any]], output: dict[str, Any]) -> str:
    """The key of a request's answer under any decoding parameters (max_tokens, stop, temperature,
    seed, ...): only the output's shape (a schema, tools) stays in it. Such an answer is kept as a
    draft (its token ids are verified by the model, never served), for the engine's speculative decoding."""
    return digest("draft", {"scope": scope.as_dict(), "messages": messages, "output": output})


@dataclass(frozen=True, slots=True)
class Draft:
    """An answer's token ids as the model generated them, kept for the same question asked again."""

    token_ids: tuple[int, ...]
    finish_reason: str
    created_at: float
    expires_at: float | None


@dataclass(frozen=True, slots=True)
class ExactSnapshot:
    num_entries: int


class ExactCache:
    """Cache protocol: `name`, `stats()`, `purge()`, `close()` (any thread: the stores lock)."""

    name = "exact"

    def __init__(
        self,
        store: ResponseStore,
        default_ttl_s: float,
        cache_nondeterministic: bool = False,
        drafts: ResponseStore | None = None,
    ):
        self.store = store
        # Drafts (store_draft): a store of their own beside the answers, so counts and deletions by
        # key see answers only; purges and expiry reach both. None: no drafts are kept.
        self.drafts = drafts
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

    def store_draft(self, key: str, tenant: str, draft: Draft, control: CacheControl, owner: Owner) -> None:
        """Keep an answer's token ids under its draft key (draft_key()), whatever its decoding: the
        latest wins, but for an answer that begins the one kept (cut by max_tokens or a stop
        sequence), which leaves the longer one kept (and the owner's too). A draft is stored as an
        entry whose text is the ids, space-separated, in the drafts' own store."""
        if self.drafts is None or control.no_store or not draft.token_ids:
            return
        kept = self.draft(key, draft.created_at)
        if kept is not None and kept[: len(draft.token_ids)] == draft.token_ids:
            self.drafts.own(key, owner)
            return
        text = " ".join(map(str, draft.token_ids))
        self.drafts.put(
            key, tenant, StoredResponse(text, draft.finish_reason, 0, 0, draft.created_at, draft.expires_at), owner
        )

    def draft(self, key: str, now: float) -> tuple[int, ...] | None:
        """The token ids of the latest answer kept under a draft key, if any."""
        found = self.drafts.get(key, now) if self.drafts is not None else None
        return tuple(int(token) for token in found.text.split()) if found is not None else None

    def stats(self) -> ExactSnapshot:
        return ExactSnapshot(self.store.count())

    def purge(self) -> Purged:
        self._drafts_too(lambda drafts: drafts.purge_all())
        return Purged(self.store.purge_all())

    def purge_tenant(self, tenant: str) -> int:
        self._drafts_too(lambda drafts: drafts.purge_tenant(tenant))
        return self.store.purge_tenant(tenant)

    def purge_expired(self, now: float) -> int:
        self._drafts_too(lambda drafts: drafts.purge_expired(now))
        return self.store.purge_expired(now)

    def own(self, key: str, owner: Owner) -> None:
        """A hit: the entry is the hitting request's owner's too (a purge of the one that stored it
        then leaves it to the others)."""
        self.store.own(key, owner)

    def purge_owned(self, selector: Selector) -> Purged:
        """A tenant's entries, or its session's or end user's share of them (semantic/owners.py); the
        drafts they own go with them (counted apart: the result counts answers)."""
        self._drafts_too(lambda drafts: drafts.purge(selector))
        return self.store.purge(selector)

    def close(self) -> None:
        self._drafts_too(lambda drafts: drafts.close())
        self.store.close()

    def _drafts_too(self, work: Callable[[ResponseStore], object]) -> None:
        if self.drafts is not None:
            work(self.drafts)

    def expiry(self, control: CacheControl, now: float) -> float | None:
        ttl = control.ttl_s if control.ttl_s is not None else self.default_ttl_s
        return now + ttl if ttl > 0 else None
