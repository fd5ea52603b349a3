"""The response layers in front of the engine: exact, then semantic. Answers here never run the model.

    ResponseCaches.context(request, caller, headers, images, model_fingerprint) -> RequestContext
    ResponseCaches.layers -> (ExactLayer, SemanticLayer), the enabled ones, cheapest first, each:
        lookup(ctx, trace) -> StoredResponse | None    records its outcome in the trace
        store(ctx, answer)                             after an engine answer; never raises

What may be shared, and with whom:
- Everything that shapes an answer is in both keys: the messages (images by pixel hash), max_tokens,
  stop, the penalties and logit bias, the tools offered, tool_choice and response_format, and the
  sampling (temperature, top_p, top_k, min_p, seed; at temperature 0 only the greedy choice counts,
  so those are dropped there: they change nothing). Tool calls are kept as the model wrote them and
  parsed again on a replay. Requests for logprobs or n > 1 bypass both layers: a stored text has
  neither. Conversations with tools bypass the semantic layer (the risk screen's tool rule).
- The exact layer serves identical deterministic requests (greedy, or seeded). The semantic layer
  serves only greedy answers: a sampled draw, even a seeded one, must not stand in for another
  question's answer.
- Personal questions (the risk rules' personal_data) are keyed to the named end user (OpenAI `user`,
  else the session) in both layers; with no end user named, both layers are bypassed (the exact
  layer with reason personal_unscoped): an answer about "my account" must not reach the whole tenant.
- A failing store (full disk, locked database) is logged and counted; the client gets its answer.
- No store call runs on the event loop: every lookup, store and ownership update runs on the store
  lane (StoreLane), a few worker threads of its own. A slow store (Redis behind a slow link, SQLite
  on a slow or locked disk) delays the requests that wait on it, never the streams and health checks
  the event loop serves, nor the threads other work runs on.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import anyio

from kvcache.sealing import Sealer
from semantic import (
    Answer,
    CacheControl,
    Draft,
    Embedder,
    EntryStore,
    ExactCache,
    ExactLookup,
    MemoryStore,
    MiniLMEmbedder,
    Owner,
    RedisEntries,
    RedisStore,
    ResponseStore,
    RiskPolicy,
    Scope,
    SemanticCache,
    SemanticLookup,
    SemanticSettings,
    SqliteEntries,
    SqliteStore,
    StoredResponse,
    StoreUnavailable,
    context_fingerprint,
    draft_key,
    exact_key,
    load_risk_patterns,
)
from semantic.calibration import Calibrator, Journal, SqliteJournal, load_evidence
from semantic.redis_calibration import RedisJournal
from semantic.risk import DEFAULT_PATTERNS_FILE, PERSONAL_DATA
from semantic.scope import VERSION_FIELDS
from vision import DecodedImage, DecodedVideo

from ..engine import Sampling, TextPart
from ..observability.trace import BYPASS, HIT, MISS, LayerOutcome, Trace
from ..requests.errors import bad_request
from ..requests.schemas import ChatRequest
from ..settings import Settings
from ..tenancy.auth import Caller
from ..tenancy.files import private_file
from ..tenancy.keyring import SemanticSealer, at_rest, keyring_for, unkeyed

T = TypeVar("T")
log = logging.getLogger("strata")
SESSION_HEADER = "x-strata-session"
STORE_THREADS = 16  # store calls in flight at once; more wait for a thread, never on the event loop


class StoreLane:
    """Runs blocking store calls on worker threads, at most `num_threads` at once."""

    def __init__(self, num_threads: int = STORE_THREADS):
        self.num_threads = num_threads
        self.limiter: anyio.CapacityLimiter | None = None  # made on first use, in the event loop

    async def run(self, call: Callable[..., T], *args: object) -> T:
        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(self.num_threads)
        return await anyio.to_thread.run_sync(call, *args, limiter=self.limiter)


@dataclass(slots=True)
class RequestContext:
    tenant: str
    scope: Scope
    control: CacheControl
    deterministic: bool  # the engine would give the same answer again (exact layer)
    greedy: bool  # the default decoding: the only answers the semantic layer shares
    exact_key: str
    query: str | None  # the last user message's text: what the semantic layer embeds
    context: str  # fingerprint of everything else (system, earlier turns, images, decoding, owner)
    semantic_bypass: str | None
    semantic_vector: object = None  # the query's embedding, kept from lookup for the insert
    # Why neither response layer may answer or store (a stored text cannot carry logprobs or n choices)
    bypass: str | None = None
    exact_bypass: str | None = None  # why the exact layer alone may not (a personal question, unscoped)
    owner: Owner = Owner()  # the session and end user whose request this is (purges select by them)
    draft_key: str = ""  # the key of this question's answer under any decoding parameters (semantic.draft_key)
    draft: tuple[int, ...] = ()  # the token ids kept under it (looked up by the exact layer)
    # Answers the layers hold for this question that may not answer it (another max_tokens, a refused
    # near-hit, the reply to the same question earlier in the conversation): drafts the engine verifies.
    references: list[str] = field(default_factory=list)


class ResponseCaches:
    def __init__(self, settings: Settings, embedder: Embedder | None = None):
        self.settings = settings
        self.risk = RiskPolicy(load_risk_patterns(settings.risk_patterns_file or DEFAULT_PATTERNS_FILE))
        self.sealer = keyring_for(settings)  # ids and cache keys are kept as keyed digests (at_rest)
        # A shared key store (Redis) is read again every KEY_CACHE_S: a digest may wait on it then,
        # so context() never runs on the event loop (a slow Redis would stall every stream).
        self.digests_may_wait = bool(settings.encrypt_at_rest and settings.redis_url)
        self.exact = _exact_cache(settings)
        self.semantic = _semantic_cache(settings, embedder)
        self.num_store_errors: Counter[str] = Counter()  # by layer
        lane = StoreLane()
        layers: list[ExactLayer | SemanticLayer] = []
        if self.exact is not None:
            layers.append(ExactLayer(self.exact, self.num_store_errors, lane))
        if self.semantic is not None:
            layers.append(SemanticLayer(self.semantic, self.num_store_errors, lane))
        self.layers = tuple(layers)  # the enabled ones, cheapest first

    def caches(self) -> list:
        """The response caches that are on (each speaks the cache protocol, gateway/engine/caches.py)."""
        return [cache for cache in (self.exact, self.semantic) if cache is not None]

    def stats(self) -> dict:
        """Each layer's snapshot; a store that cannot be reached reports `unavailable` instead."""
        out = {}
        for cache in self.caches():
            try:
                out[cache.name] = asdict(cache.stats())
            except StoreUnavailable:
                out[cache.name] = {"unavailable": True}
        if self.semantic is not None and self.semantic.calibrator is not None:
            try:
                out["semantic"]["bounds"] = self.semantic.calibrator.stats()  # per scope: bound, cut, estimate
            except StoreUnavailable:
                out["semantic"]["bounds_unavailable"] = True
        return out

    def expiring(self) -> dict:
        """layer -> its purge_expired(now), for the sweep."""
        stores = {}
        if self.exact is not None:
            stores["exact"] = self.exact.purge_expired
        if self.semantic is not None:
            stores["semantic"] = self.semantic.purge_expired
        return stores

    def close(self) -> None:
        for cache in self.caches():
            cache.close()

    # -- per request -------------------------------------------------------------------------

    def context(
        self,
        request: ChatRequest,
        caller: Caller,
        headers,
        images: list[DecodedImage | DecodedVideo],
        model_fingerprint: str,
    ) -> RequestContext:
        """CPU work (canonical JSON, SHA-256, RE2 risk rules): large requests call this off the event loop.
        `model_fingerprint`: the serving model's, so no model is ever answered from another's entries."""
        scope = Scope(caller.tenant, model_fingerprint, **_versions(request.metadata, headers))
        hashes = iter(image.pixel_hash for image in images)
        messages = [_canonical(m, hashes) for m in request.messages]
        last = request.messages[-1]
        query = " ".join(p.text for p in last.parts if isinstance(p, TextPart)) if last.role == "user" else None
        named = request_owner(request, headers, self.settings.limits.max_user_chars)
        owner = owner_at_rest(self.sealer, caller.tenant, named)
        end_user = request.user or named.session or None
        category = self.risk.category(query) if query else None
        bypass = self._semantic_bypass(request, query, category, end_user is not None)
        output = _output_shape(request)
        if category == PERSONAL_DATA and end_user is not None:
            output["end_user"] = end_user  # an answer about one user's own data is that user's alone
        elif apart := self.settings.end_user_apart(caller.tenant, owner.end_user):
            output["end_user"] = apart  # the tenant keeps its end users apart
        decoding = _decoding(request.sampling) | output
        key = at_rest(self.sealer, caller.tenant, "exact", exact_key(scope, messages, decoding))
        draft = at_rest(self.sealer, caller.tenant, "draft", draft_key(scope, messages, output))
        image_keys = [c.get("image") or c["video"] for m in messages for c in m["content"] if "text" not in c]
        context = context_fingerprint(messages[:-1] + [decoding], image_keys)
        sampling = request.sampling
        return RequestContext(
            caller.tenant,
            scope,
            parse_cache_control(headers, self.settings.max_cache_ttl_s),
            sampling.temperature == 0.0 or sampling.seed is not None,
            sampling.temperature == 0.0,
            key,
            query,
            context,
            bypass,
            bypass=_response_bypass(request) or _keyless(key, draft, owner.session, owner.end_user),
            exact_bypass="personal_unscoped" if category == PERSONAL_DATA and end_user is None else None,
            owner=owner,
            draft_key=draft,
            references=_earlier_answers(request),
        )

    def _semantic_bypass(
        self, request: ChatRequest, query: str | None, category: str | None, has_end_user: bool
    ) -> str | None:
        if self.semantic is None:
            return "disabled"
        if query is None or not query.strip():
            return "no_user_query"
        return self.semantic.screen(query, request.uses_tools, category, has_end_user).bypass_reason


class ExactLayer:
    name = "exact"

    def __init__(self, cache: ExactCache, store_errors: Counter, lane: StoreLane):
        self.cache = cache
        self.store_errors = store_errors
        self.lane = lane

    async def lookup(self, ctx: RequestContext, trace: Trace) -> StoredResponse | None:
        if reason := ctx.bypass or ctx.exact_bypass:
            trace.record("exact", LayerOutcome.of(BYPASS, reason=reason))
            return None
        try:
            result = await self.lane.run(self._looked_up, ctx, time.time())
        except StoreUnavailable:
            self.store_errors["exact"] += 1
            trace.record("exact", LayerOutcome.of(BYPASS, reason="store_unavailable"))
            return None
        details = (
            {"age": f"{result.age_s:.1f}"}
            if result.status == HIT
            else ({"reason": result.reason} if result.reason else {})
        )
        trace.record("exact", LayerOutcome.of(result.status, **details))
        return result.response

    def _looked_up(self, ctx: RequestContext, now: float) -> ExactLookup:
        """The lookup, and on a hit the entry made the hitting owner's too; otherwise the answer kept
        under the draft key (a sampled request's too): one trip to the store lane."""
        result = self.cache.lookup(ctx.exact_key, ctx.control, ctx.deterministic, now)
        if result.status == HIT:
            _guarded(self.store_errors, "exact", self.cache.own, ctx.exact_key, ctx.owner)
        else:
            ctx.draft = self._kept_draft(ctx.draft_key, now)
        return result

    def _kept_draft(self, key: str, now: float) -> tuple[int, ...]:
        """The draft kept under the key, if any; a drafts store that fails costs the draft only."""
        try:
            return self.cache.draft(key, now) or ()
        except Exception as exc:  # noqa: BLE001 - a draft only ever makes an answer faster
            self.store_errors["exact"] += 1
            log.warning("exact draft read failed: %s: %s", type(exc).__name__, exc)
            return ()

    async def store(self, ctx: RequestContext, answer: Answer) -> None:
        if ctx.bypass or ctx.exact_bypass:
            return
        now = time.time()
        response = StoredResponse(
            answer.text,
            answer.finish_reason,
            answer.prompt_tokens,
            answer.completion_tokens,
            now,
            self.cache.expiry(ctx.control, now),
        )
        draft = Draft(answer.token_ids, answer.finish_reason, now, response.expires_at)
        await self.lane.run(self._stored, ctx, response, draft)

    def _stored(self, ctx: RequestContext, response: StoredResponse, draft: Draft) -> None:
        """The answer under its exact key (when deterministic), its token ids under its draft key."""
        cache, errors = self.cache, self.store_errors
        _guarded(
            errors,
            "exact",
            cache.store_response,
            ctx.exact_key,
            ctx.tenant,
            response,
            ctx.control,
            ctx.deterministic,
            ctx.owner,
        )
        _guarded(errors, "exact", cache.store_draft, ctx.draft_key, ctx.tenant, draft, ctx.control, ctx.owner)


class SemanticLayer:
    name = "semantic"

    def __init__(self, cache: SemanticCache, store_errors: Counter, lane: StoreLane):
        self.cache = cache
        self.store_errors = store_errors
        self.lane = lane

    async def lookup(self, ctx: RequestContext, trace: Trace) -> StoredResponse | None:
        reason = ctx.semantic_bypass or _ineligible(ctx)
        if reason or ctx.query is None:  # a request with no user query has semantic_bypass set
            trace.record("semantic", LayerOutcome.of(BYPASS, reason=reason or "no_user_query"))
            return None
        try:
            result = await self.lane.run(self._looked_up, ctx.query, ctx, time.time())
        except StoreUnavailable:
            self.store_errors["semantic"] += 1
            trace.record("semantic", LayerOutcome.of(BYPASS, reason="store_unavailable"))
            return None
        ctx.semantic_vector = result.vector
        if result.candidate is not None:
            ctx.references.append(result.candidate.answer)
        trace.record("semantic", _semantic_outcome(result))
        entry = result.entry
        if result.status != HIT or entry is None:
            return None
        return StoredResponse(
            entry.answer,
            entry.finish_reason,
            entry.prompt_tokens,
            entry.completion_tokens,
            entry.created_at,
            entry.expires_at,
        )

    def _looked_up(self, query: str, ctx: RequestContext, now: float) -> SemanticLookup:
        """The lookup, and on a hit the entry made the hitting owner's too: one trip to the store lane."""
        result = self.cache.lookup(query, ctx.scope, ctx.context, now)
        if result.status == HIT and result.entry is not None:
            _guarded(self.store_errors, "semantic", self.cache.own, result.entry.id, ctx.owner)
        return result

    async def store(self, ctx: RequestContext, answer: Answer) -> None:
        if ctx.semantic_bypass is not None or ctx.bypass or ctx.control.no_store or not ctx.greedy:
            return
        insert = (
            self.cache.insert,
            ctx.query,
            answer,
            ctx.scope,
            ctx.context,
            time.time(),
            ctx.control.ttl_s,
            ctx.semantic_vector,
            ctx.owner,
        )
        await self.lane.run(_guarded, self.store_errors, "semantic", *insert)  # embeds first if no lookup did


def _ineligible(ctx: RequestContext) -> str | None:
    if ctx.bypass:
        return ctx.bypass
    if ctx.control.no_cache:
        return "no_cache"
    if not ctx.greedy:
        return "sampled"
    return None


def _keyless(*digests: str) -> str | None:
    """Why neither response layer may look up or write: a digest of this request (its exact and draft
    keys, its session, its end user) made while the tenants' key store was out of reach. The store may be back
    by the time the answer is written, and an entry then sits under a key, or with an owner, that no
    later request or purge computes."""
    return "store_unavailable" if any(unkeyed(digest) for digest in digests) else None


def _guarded(errors: Counter, layer: str, write, *args) -> None:
    """A failing store (full disk, locked database) is logged and counted; it never costs the answer."""
    try:
        write(*args)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        errors[layer] += 1
        log.warning("%s cache write failed: %s: %s", layer, type(exc).__name__, exc)


def _decoding(sampling: Sampling) -> dict:
    """What shapes an answer besides the messages. At temperature 0 the greedy choice ignores top_p,
    top_k, min_p and seed, so they are left out: greedy requests share entries whatever they send
    there. Penalties and logit bias change greedy answers too; they are in the key only when set, so
    entries stored before they existed keep matching."""
    decoding = {"max_tokens": sampling.max_tokens, "stop": list(sampling.stop), "temperature": sampling.temperature}
    if sampling.temperature != 0.0:
        decoding.update(top_p=sampling.top_p, seed=sampling.seed)
        if sampling.top_k or sampling.min_p:
            decoding.update(top_k=sampling.top_k, min_p=sampling.min_p)
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.logit_bias:
        decoding.update(
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            logit_bias=[list(pair) for pair in sampling.logit_bias],
        )
    return decoding


def owner_at_rest(sealer: Sealer, tenant: str, owner: Owner) -> Owner:
    """The owner as every layer records it: its session and end user as keyed digests (at_rest)."""
    return Owner(at_rest(sealer, tenant, "session", owner.session), at_rest(sealer, tenant, "end_user", owner.end_user))


def request_owner(request: ChatRequest, headers, max_chars: int) -> Owner:
    """The session (`metadata.session_id`, else the X-Strata-Session header) and the end user (the
    OpenAI `user` field) a request belongs to; "" for none."""
    session = request.metadata.get("session_id") or headers.get(SESSION_HEADER) or ""
    if len(session) > max_chars:
        raise bad_request(f"the session id must be at most {max_chars} characters", "invalid_header", "session_id")
    return Owner(session, request.user or "")


def _canonical(message, hashes) -> dict:
    """A message as the keys see it: images by pixel hash; tool calls, results and earlier thinking
    only when present, so plain messages keep the keys they always had."""
    canonical = {
        "role": message.role,
        "content": [_canonical_part(p, hashes) for p in message.parts],
    }
    if message.tool_calls:
        canonical["tool_calls"] = [[call.id, call.name, call.arguments] for call in message.tool_calls]
    if message.tool_call_id is not None:
        canonical["tool_call_id"] = message.tool_call_id
    if message.reasoning:
        canonical["reasoning"] = message.reasoning
    return canonical


def _canonical_part(part, hashes) -> dict:
    if isinstance(part, TextPart):
        return {"text": part.text}
    return {"video" if part.video else "image": next(hashes)}


def _output_shape(request: ChatRequest) -> dict:
    """The tools offered, the tool choice, the response format and the template's switches: they shape
    the answer, so they are in both keys (only when set: plain requests keep their keys)."""
    shape: dict = {}
    if request.callable_tools:
        tools = [[t.name, t.description, t.parameters] for t in request.callable_tools]
        shape.update(tools=tools, tool_choice=request.tool_choice)
    if request.response_format is not None:
        shape["response_format"] = request.response_format
    if request.switches.thinking is not None:
        shape["thinking"] = request.switches.thinking
    if request.switches.effort is not None:
        shape["effort"] = request.switches.effort
    return shape


def _earlier_answers(request: ChatRequest) -> list[str]:
    """The assistant's replies to earlier user messages with the same text as the last one."""
    last = request.messages[-1]
    if last.role != "user":
        return []
    text = [part for part in last.parts if isinstance(part, TextPart)]
    return [
        " ".join(p.text for p in after.parts if isinstance(p, TextPart))
        for before, after in zip(request.messages[:-1], request.messages[1:-1])
        if before.role == "user" and after.role == "assistant" and before.parts == last.parts and text
    ]


def _response_bypass(request: ChatRequest) -> str | None:
    if request.sampling.top_logprobs is not None:
        return "logprobs"  # a stored answer has no log probabilities
    if request.n > 1:
        return "n"  # one stored answer cannot stand for several draws
    return None


def _semantic_outcome(result: SemanticLookup) -> LayerOutcome:
    """`hit; score=0.97; entry=3[; p=0.98][; overruled=order]` or `miss[; score=0.93]; reason=...[; p=0.12]`:
    p is the verifier's P(same answer), when it was asked."""
    verdict = result.verdict
    verifier = {"p": f"{verdict.probability:.2f}"} if verdict and verdict.probability is not None else {}
    if result.status == HIT and result.entry is not None:
        overruled = {"overruled": ",".join(verdict.overruled)} if verdict and verdict.overruled else {}
        return LayerOutcome.of(HIT, score=f"{result.score:.2f}", entry=result.entry.id, **verifier, **overruled)
    if result.score is None:
        return LayerOutcome.of(MISS, reason=result.reason)
    return LayerOutcome.of(MISS, score=f"{result.score:.2f}", reason=result.reason, **verifier)


def _versions(metadata: dict[str, str], headers) -> dict[str, str]:
    """Scope versions from `metadata`, or else from X-Strata-Prompt-Version (and friends) headers."""
    versions = {}
    for name in VERSION_FIELDS:
        header = "x-strata-" + name.replace("_", "-")
        versions[name] = metadata.get(name) or headers.get(header) or ""
    return versions


_MAX_AGE = re.compile(r"max-age\s*=\s*([0-9]{1,10})")
_SECONDS = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() also accepts '²', which int() refuses


def parse_cache_control(headers, max_ttl_s: float) -> CacheControl:
    value = (headers.get("cache-control") or "").lower()
    max_age = _MAX_AGE.search(value)
    ttl = headers.get("x-strata-cache-ttl")
    if ttl is not None:
        ttl = ttl.strip()
        if not _SECONDS.fullmatch(ttl) or not 1 <= int(ttl) <= max_ttl_s:
            raise bad_request(
                f"X-Strata-Cache-TTL must be a whole number of seconds from 1 to {max_ttl_s:.0f}", "invalid_header"
            )
    return CacheControl(
        no_store="no-store" in value,
        no_cache="no-cache" in value,
        max_age_s=float(max_age.group(1)) if max_age else None,
        ttl_s=float(ttl) if ttl is not None else None,
    )


def _exact_cache(settings: Settings) -> ExactCache | None:
    if settings.exact_store == "off":
        return None
    store: ResponseStore
    drafts: ResponseStore  # answers' token ids (speculative decoding's drafts), beside the answers
    sealer = SemanticSealer(keyring_for(settings))  # what is kept at rest is sealed by tenant (memory is not)
    if settings.redis_url:  # shared by every replica pointing at the same Redis
        store = RedisStore(settings.redis_url, sealer=sealer)
        drafts = RedisStore(settings.redis_url, "strata:draft:", sealer)
    elif settings.exact_store == "memory":
        store, drafts = MemoryStore(), MemoryStore()
    else:
        store = SqliteStore(private_file(settings.data_dir / "responses.db"), sealer)
        drafts = SqliteStore(private_file(settings.data_dir / "drafts.db"), sealer)
    return ExactCache(store, settings.exact_ttl_s, settings.cache_nondeterministic, drafts)


def _semantic_cache(settings: Settings, embedder: Embedder | None) -> SemanticCache | None:
    if not settings.semantic_enabled:
        return None
    config = SemanticSettings(
        threshold=settings.semantic_threshold,
        require_approved=settings.semantic_require_approved,
        default_ttl_s=settings.semantic_ttl_s,
    )
    store: EntryStore
    sealer = SemanticSealer(keyring_for(settings))
    if settings.redis_url:  # shared by every replica; each follows the others' changes into its own index
        store = RedisEntries(settings.redis_url, sealer=sealer)
    else:
        store = SqliteEntries(private_file(settings.data_dir / "semantic.db"), sealer)
    from semantic.verifier import CALIBRATED_FILE, WEIGHTS_FILE, Verifier  # torch: only when the layer is on

    embedder = embedder or MiniLMEmbedder()
    # under a false-hit bound, the verifier its calibration evidence was never trained on
    weights = WEIGHTS_FILE if settings.semantic_max_false_hit_rate is None else CALIBRATED_FILE
    verifier = Verifier.load(embedder, weights) if settings.semantic_verifier else None
    cache = SemanticCache(embedder, store, config, verifier, _calibrator(settings))
    cache.warm_up()
    return cache


def _calibrator(settings: Settings) -> Calibrator | None:
    """The tenants' false-hit bounds, when one is set: the shipped evidence plus the review verdicts,
    in Redis when the semantic entries are (every replica learns from every verdict), else in
    DATA_DIR/calibration.db (this replica's)."""
    if settings.semantic_max_false_hit_rate is None:
        return None
    journal: Journal = (
        RedisJournal(settings.redis_url)
        if settings.redis_url
        else SqliteJournal(private_file(settings.data_dir / "calibration.db"))
    )
    return Calibrator(load_evidence(), settings.semantic_max_false_hit_rate, settings.semantic_tenant_bounds, journal)
