"""The response layers in front of the engine: exact, then semantic. Answers here never run the model.

    ResponseCaches.context(request, caller, headers, images) -> RequestContext   (scope, keys, policy)
    ResponseCaches.lookup(ctx, trace) -> StoredResponse | None                   (records both layers)
    ResponseCaches.store(ctx, completion)                                        (after an engine answer)
"""

from __future__ import annotations

import asyncio
import re
import time
from functools import partial
from dataclasses import dataclass

import anyio

from semantic import (CacheControl, Embedder, ExactCache, MemoryStore, MiniLMEmbedder, Scope, SemanticCache, SemanticLookup,
                      SemanticSettings, SqliteStore, StoredResponse, context_fingerprint, exact_key)
from semantic.scope import VERSION_FIELDS
from vision import DecodedImage

from .auth import Caller
from .errors import bad_request
from .schemas import ChatRequest, TextPart
from .settings import Settings
from .trace import BYPASS, HIT, MISS, LayerOutcome, Trace


@dataclass(slots=True)
class RequestContext:
    tenant: str
    scope: Scope
    control: CacheControl
    deterministic: bool
    exact_key: str
    query: str | None  # the last user message's text: what the semantic layer embeds
    context: str  # fingerprint of everything else (system, earlier turns, images)
    semantic_bypass: str | None
    semantic_vector: object = None  # the query's embedding, kept from lookup for the insert


class ResponseCaches:
    def __init__(self, settings: Settings, model_fingerprint: str, embedder: Embedder | None = None):
        self.settings = settings
        self.model_fingerprint = model_fingerprint
        self.exact = _exact_cache(settings)
        self.semantic = _semantic_cache(settings, embedder)

    def close(self) -> None:
        if self.exact:
            self.exact.store.close()
        if self.semantic:
            self.semantic.close()

    # -- per request -------------------------------------------------------------------------

    def context(self, request: ChatRequest, caller: Caller, headers, images: list[DecodedImage]) -> RequestContext:
        scope = Scope(caller.tenant, self.model_fingerprint, **_versions(request.metadata, headers))
        hashes = iter(image.pixel_hash for image in images)
        messages = [{"role": m.role, "content": [{"text": p.text} if isinstance(p, TextPart) else {"image": next(hashes)}
                                                 for p in m.parts]} for m in request.messages]
        sampling = request.sampling
        key = exact_key(scope, messages, {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                                          "top_p": sampling.top_p, "seed": sampling.seed, "stop": list(sampling.stop)})
        last = request.messages[-1]
        query = " ".join(p.text for p in last.parts if isinstance(p, TextPart)) if last.role == "user" else None
        image_keys = [c["image"] for m in messages for c in m["content"] if "image" in c]
        # max_tokens shapes the answer (a truncated answer must not serve a request allowing more)
        context = context_fingerprint(messages[:-1] + [{"max_tokens": sampling.max_tokens}], image_keys)
        bypass = self._semantic_bypass(request, query)
        deterministic = sampling.temperature == 0.0 or sampling.seed is not None
        return RequestContext(caller.tenant, scope, parse_cache_control(headers), deterministic, key, query, context, bypass)

    def _semantic_bypass(self, request: ChatRequest, query: str | None) -> str | None:
        if self.semantic is None:
            return "disabled"
        if query is None or not query.strip():
            return "no_user_query"
        return self.semantic.bypass_reason(query, has_tools=request.uses_tools)

    async def lookup(self, ctx: RequestContext, trace: Trace) -> StoredResponse | None:
        found = self._lookup_exact(ctx, trace)
        if found is not None:
            trace.served_by = "exact"
            trace.record("semantic", LayerOutcome.of(BYPASS, reason="exact_hit"))
            return found
        with trace.timed("semantic"):
            found = await self._lookup_semantic(ctx, trace)
        if found is not None:
            trace.served_by = "semantic"
        return found

    def _lookup_exact(self, ctx: RequestContext, trace: Trace) -> StoredResponse | None:
        if self.exact is None:
            return None
        with trace.timed("exact"):
            result = self.exact.lookup(ctx.exact_key, ctx.control, ctx.deterministic, time.time())
        details = {"reason": result.reason} if result.reason else {}
        if result.status == HIT:
            details = {"age": f"{result.age_s:.1f}"}
        trace.record("exact", LayerOutcome.of(result.status, **details))
        return result.response

    async def _lookup_semantic(self, ctx: RequestContext, trace: Trace) -> StoredResponse | None:
        reason = ctx.semantic_bypass or self._ineligible(ctx)
        if reason:
            trace.record("semantic", LayerOutcome.of(BYPASS, reason=reason))
            return None
        result: SemanticLookup = await anyio.to_thread.run_sync(
            self.semantic.lookup, ctx.query, ctx.scope, ctx.context, time.time())
        ctx.semantic_vector = result.vector
        trace.record("semantic", _semantic_outcome(result))
        if result.status != HIT:
            return None
        entry = result.entry
        return StoredResponse(entry.answer, "stop", 0, 0, entry.created_at, entry.expires_at)

    def _ineligible(self, ctx: RequestContext) -> str | None:
        if ctx.control.no_cache:
            return "no-cache"
        if not (ctx.deterministic or self.settings.cache_nondeterministic):
            return "nondeterministic"
        return None

    def store(self, ctx: RequestContext, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Keep an engine answer in both layers, each subject to its own eligibility."""
        now = time.time()
        if self.exact is not None:
            response = StoredResponse(text, finish_reason, prompt_tokens, completion_tokens, now,
                                      self.exact.expiry(ctx.control, now))
            self.exact.store_response(ctx.exact_key, ctx.tenant, response, ctx.control, ctx.deterministic)
        if self.semantic is not None and ctx.semantic_bypass is None and not ctx.control.no_store \
                and (ctx.deterministic or self.settings.cache_nondeterministic):
            insert = partial(self.semantic.insert, ctx.query, text, ctx.scope, ctx.context, now, ctx.control.ttl_s,
                             ctx.semantic_vector)
            if ctx.semantic_vector is not None:
                insert()  # the lookup embedded the query already: a row and a vector add, ~0.1 ms
            else:  # no-cache skipped the lookup: embedding (~12 ms) must not block the event loop
                asyncio.get_running_loop().run_in_executor(None, insert)


def _semantic_outcome(result: SemanticLookup) -> LayerOutcome:
    if result.status == HIT:
        return LayerOutcome.of(HIT, score=f"{result.score:.2f}", entry=result.entry.id)
    if result.score is None:
        return LayerOutcome.of(MISS, reason=result.reason)
    return LayerOutcome.of(MISS, score=f"{result.score:.2f}", reason=result.reason)


def _versions(metadata: dict[str, str], headers) -> dict[str, str]:
    """Scope versions from `metadata`, or else from X-Strata-Prompt-Version (and friends) headers."""
    versions = {}
    for name in VERSION_FIELDS:
        header = "x-strata-" + name.replace("_", "-")
        versions[name] = metadata.get(name) or headers.get(header) or ""
    return versions


_MAX_AGE = re.compile(r"max-age\s*=\s*(\d+)")


def parse_cache_control(headers) -> CacheControl:
    value = (headers.get("cache-control") or "").lower()
    max_age = _MAX_AGE.search(value)
    ttl = headers.get("x-strata-cache-ttl")
    if ttl is not None and (not ttl.strip().isdigit() or int(ttl) < 1):
        raise bad_request("X-Strata-Cache-TTL must be a whole number of seconds, at least 1", "invalid_header")
    return CacheControl(no_store="no-store" in value, no_cache="no-cache" in value,
                        max_age_s=float(max_age.group(1)) if max_age else None,
                        ttl_s=float(ttl) if ttl is not None else None)


def _exact_cache(settings: Settings) -> ExactCache | None:
    if settings.exact_store == "off":
        return None
    store = MemoryStore() if settings.exact_store == "memory" else SqliteStore(settings.data_dir / "responses.db")
    return ExactCache(store, settings.exact_ttl_s, settings.cache_nondeterministic)


def _semantic_cache(settings: Settings, embedder: Embedder | None) -> SemanticCache | None:
    if not settings.semantic_enabled:
        return None
    config = SemanticSettings(threshold=settings.semantic_threshold, require_approved=settings.semantic_require_approved,
                              default_ttl_s=settings.semantic_ttl_s)
    return SemanticCache(embedder or MiniLMEmbedder(), settings.data_dir / "semantic.db", config)
