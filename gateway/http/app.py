"""The Litestar app: its routes, the lifespan that builds and closes the services, and the glue
that belongs to no layer: the Responses API's orchestration (the stored conversation in front of a
chat completion; its shapes are responses_api.py's), the streams' pings while a prompt waits or
prefills (Anthropic `ping` events, OpenAI `: ping` comment lines), settings mapped to the engine's config
(engine_config), and the metrics collector's view of the services. A request's way through the
cache layers is pipeline.py.

POST /v1/chat/completions   OpenAI chat completions (JSON or SSE)
POST /v1/responses          OpenAI Responses API (previous_response_id kept per tenant)
POST /v1/messages           Anthropic Messages API (JSON or SSE); /v1/messages/count_tokens
GET|DELETE /v1/responses/ID a stored response (the caller's tenant's only)
POST /v1/embeddings         MiniLM sentence embeddings
GET  /v1/models             the served model
GET  /health, /healthz      liveness: 503 with the reason when the engine worker died or is stuck;
                            details (model, BLAS, queue) only with the admin key
GET  /health/ready          readiness: 503 until the warm-up ended well
GET  /metrics               Prometheus text format (gateway/observability/metrics.py)
GET  /dashboard             the operator's page; its data: GET /admin/dashboard/data (admin key)
GET  /admin/stats           per-layer counters (admin key)
GET  /schema                OpenAPI (Litestar)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import anyio
from litestar import Litestar, Request, Response, delete, get, post
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath
from litestar.response import Stream
from prometheus_client import CollectorRegistry, generate_latest

from kvcache import default_budget_bytes
from kvcache.quant import QuantConfig
from kvcache.sealing import NO_SEALING, Sealer
from kvcache.ssd import AdmissionPolicy, SsdConfig
from semantic import Embedder

from ..blas import blas_in_use, core_in_use
from ..checkpoints import resolve_model_path
from ..engine import CacheConfig, Engine, EngineConfig, vector_products_loaded
from ..formats import anthropic_api, openai_format, responses_api
from ..observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..observability.metrics import ModelGauge, RequestMetrics, StateCollector
from ..observability.requestlog import BlockTrace, RequestStart, ResponseLog
from ..observability.stats import LayerCounters
from ..observability.trace import ignored_value
from ..operations.admin import ADMIN_CACHE_ROUTES, end_idle_sessions, purge_announced, require_admin
from ..operations.dashboard import DASHBOARD_ROUTES, History
from ..operations.purge_feed import PurgeFeed
from ..operations.sweeper import Sweeper
from ..requests.errors import EXCEPTION_HANDLERS, ApiError, bad_request, echo
from ..requests.normalize import DEFAULT_RULES_FILE, Normalizer, load_rules
from ..requests.schemas import ChatRequest, parse_chat_request, parse_json_body
from ..serving.cache_diagnostics import PromptPrint, PromptPrints, cache_miss
from ..serving.conversations import ConversationStore
from ..serving.embeddings import MODEL_NAMES as EMBEDDING_MODELS
from ..serving.embeddings import Embeddings, parse_embeddings_request
from ..serving.models import ServedModels, model_entries
from ..serving.pipeline import Pipeline, off_loop
from ..serving.responses import ResponseCaches
from ..settings import Settings
from ..tenancy.auth import Authenticator, Caller, load_server_secret
from ..tenancy.files import private_dir, private_file
from ..tenancy.keyring import UNAVAILABLE, at_rest, keyring_for
from ..tenancy.public_prefixes import PublicPrefixes, load_file
from ..tenancy.sessions import SessionClock

log = logging.getLogger("strata")
T = TypeVar("T")
EXACT_KEY_HEADER = "X-Strata-Exact-Key"
VERSION = "0.1.0"


@dataclass(slots=True)
class Services:
    settings: Settings
    engine: Engine  # the default model's (the first): readiness, embeddings, diagnosis
    models: ServedModels  # every model served, loaded or not; requests lease theirs
    auth: Authenticator
    pipeline: Pipeline
    counters: LayerCounters
    responses: ResponseCaches
    embeddings: Embeddings
    conversations: ConversationStore
    metrics: CollectorRegistry  # GET /metrics renders it
    purge_feed: PurgeFeed | None = None  # with Redis: purges announced to, and heard from, the other replicas
    keyring: Sealer = NO_SEALING  # seals what every layer keeps at rest; a tenant purge shreds its key here
    prompt_prints: PromptPrints = field(default_factory=PromptPrints)  # Anthropic cache diagnostics


def _services(request: Request) -> Services:
    return request.app.state.services


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    services = _services(request)
    caller = services.auth.caller(request.headers.get("authorization"))
    raw = await request.body()
    chat_request = await off_loop(len(raw), partial(_parse, raw, services))
    starting = services.pipeline.start(chat_request, caller, request.headers, len(raw))
    if chat_request.stream:

        def chunks(turn) -> AsyncGenerator[bytes, None]:
            tools = _tools(turn, chat_request)
            stamp, usage = turn.model.stamp, chat_request.include_usage
            return openai_format.sse(turn.events(), turn.completions, turn.trace, stamp, usage, tools)

        errors = openai_format.error_chunks
        return await _pinged_stream(services, request, chat_request, starting, OPENAI_PING, chunks, errors)
    turn = await _unless_client_leaves(request, starting)
    if turn is None:  # it left while the choices were admitted and prefilled: their jobs were cancelled
        return Response(b"", status_code=499)
    request.state.turn = turn  # for the request's log line
    if await _client_left(request, turn):
        return Response(b"", status_code=499)  # nobody reads it: the job was cancelled
    body = openai_format.response_body(turn.completions, turn.trace, turn.model.stamp, _tools(turn, chat_request))
    return Response(body, headers=_headers(services, turn))


async def _pinged_stream(
    services: Services,
    request: Request,
    chat_request: ChatRequest,
    starting: Awaitable,
    ping: bytes,
    chunks: Callable[[Any], AsyncGenerator[bytes, None]],
    error_chunks: Callable[[ApiError], list[bytes]],
) -> Response:
    """An SSE answer (chat completions, Responses, Messages): with the cache headers when the prompt
    is in within one ping interval (an error before then is an HTTP error), else started at once with
    `ping` every interval while it waits in the queue or prefills (OpenAI: an SSE comment line, which
    every client skips; Anthropic: its `ping` event), so no client or proxy in between gives up on a
    silent stream; the cache facts are then in the usage only, and an error ends the stream in the
    API's own error events."""
    task = asyncio.ensure_future(starting)
    ping_s = services.settings.stream_ping_s
    if await _left_first(request, task, ping_s):  # once streaming, Litestar notices a client leaving
        return Response(b"", status_code=499)
    if task.done():
        turn = task.result()
        request.state.turn = turn  # for the request's log line
        return Stream(chunks(turn), media_type="text/event-stream", headers=_stream_headers(services, turn))
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if chat_request.ignored:
        headers["X-Strata-Ignored"] = ignored_value(list(chat_request.ignored))
    pinging = _keeping_alive(request, task, ping_s, ping, chunks, error_chunks)
    return Stream(pinging, media_type="text/event-stream", headers=headers)


async def _keeping_alive(request: Request, task: asyncio.Future, ping_s: float, ping: bytes, chunks, error_chunks):
    try:
        while not task.done():
            yield ping
            await asyncio.wait({task}, timeout=ping_s)
        turn = task.result()
    except Exception as exc:  # noqa: BLE001 - the stream has begun: every error ends it in the API's shape
        for chunk in error_chunks(_streamed_error(exc)):
            yield chunk
        return
    finally:
        if not task.done():  # the client left while its prompt waited or prefilled: cancel its jobs
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    request.state.turn = turn
    async for chunk in chunks(turn):
        yield chunk


OPENAI_PING = b": ping\n\n"  # a comment line: every SSE client skips it


def _streamed_error(exc: Exception) -> ApiError:
    """What an error would have answered over HTTP, as an error the started stream ends with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UNAVAILABLE):
        return ApiError(503, f"the cache store cannot be reached ({exc}): retry", "store_unavailable")
    log.exception("a streamed request failed before its answer began")
    return ApiError(500, "internal server error", "internal_error")


def _headers(services: Services, turn) -> dict[str, str]:
    """The trace's X-Cache-* headers, and the request's exact-cache key when that layer is on (an
    admin deletes one bad answer by it: DELETE /admin/exact/{key})."""
    headers = turn.trace.headers()
    if services.responses.exact is not None:
        headers[EXACT_KEY_HEADER] = turn.ctx.exact_key
    return headers


def _stream_headers(services: Services, turn) -> dict[str, str]:
    return {**_headers(services, turn), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _client_left(request: Request, turn) -> bool:
    """Finish a non-streaming answer; True if the client left first (its job was then cancelled).
    A replay finishes at once: nothing to abandon."""
    if turn.cached:
        await turn.finish()
        return False
    return await _client_left_first(request, turn.finish())


def _tools(turn, chat_request):
    """The model's tool-call format when the reply may hold calls to parse out (keeping as many as
    the request lets one answer make)."""
    return turn.model.engine.tools.limited(chat_request.max_tool_calls) if chat_request.parses_tool_calls else None


def _authorization(request: Request) -> str | None:
    """The caller's key: `Authorization: Bearer`, or Anthropic's `x-api-key` header."""
    key = request.headers.get("x-api-key")
    return request.headers.get("authorization") or (f"Bearer {key}" if key else None)


@dataclass(frozen=True, slots=True)
class _Message:
    """One /v1/messages request: the neutral request, its caller, its id and whether it asked for
    cache diagnostics (and against which earlier message)."""

    request: ChatRequest
    caller: Caller
    message_id: str
    diagnose: bool
    previous_id: str | None

    def stream(self, services: Services, turn) -> anthropic_api.MessageStream:
        """The answer's shaping, once its prompt is in (the diagnostics need its cached tokens)."""
        return anthropic_api.MessageStream(
            self.message_id,
            turn.model.stamp.name,
            turn.completion,
            _tools(turn, self.request),
            self.request.show_thinking,
            self._diagnostics(services, turn) if self.diagnose else None,
        )

    def _diagnostics(self, services: Services, turn) -> dict:
        """Why this prompt did not continue the previous message's (None: it did); this message's
        print is kept for the next request to ask about."""
        key, tenant = bytes(self.caller.salt), self.caller.tenant
        request, _ = services.pipeline.normalizer.apply(self.request, tenant)
        current = PromptPrint.of(request, turn.model.stamp.fingerprint, key, turn.completion.prompt_tokens)
        previous = services.prompt_prints.recall(tenant, self.previous_id) if self.previous_id else None
        reason = None
        if self.previous_id is not None:
            reason = cache_miss(previous, request, current, key, turn.completion.cached_tokens)
        services.prompt_prints.remember(tenant, self.message_id, current)
        return {"cache_miss_reason": reason}


@post("/v1/messages", status_code=200)
async def create_message(request: Request) -> Response:
    services = _services(request)
    caller = services.auth.caller(_authorization(request))
    raw = await request.body()
    chat_request, (diagnose, previous_id) = await off_loop(len(raw), partial(_parse_anthropic, raw, services))
    message = _Message(chat_request, caller, anthropic_api.new_id(), diagnose, previous_id)
    starting = asyncio.ensure_future(services.pipeline.start(chat_request, caller, request.headers, len(raw)))
    if chat_request.stream:
        chunks = partial(_message_chunks, services, message)
        errors = _anthropic_error_events
        return await _pinged_stream(services, request, chat_request, starting, anthropic_api.PING, chunks, errors)
    turn = await _unless_client_leaves(request, starting)
    if turn is None:
        return Response(b"", status_code=499)
    request.state.turn = turn  # for the request's log line
    if await _client_left(request, turn):
        return Response(b"", status_code=499)
    body = anthropic_api.message_body(message.stream(services, turn), _usage(turn))
    return Response(body, headers=_headers(services, turn))


def _usage(turn) -> dict:
    return anthropic_api.usage(turn.completion, turn.trace, turn.pins)


def _anthropic_error_events(error: ApiError) -> list[bytes]:
    return [anthropic_api.error_event(error)]


async def _message_chunks(services: Services, message: _Message, turn):
    stream = message.stream(services, turn)
    yield stream.start(_usage(turn))
    async for chunk in anthropic_api.stream_events(turn.events(), stream, partial(_usage, turn)):
        yield chunk


@post("/v1/messages/count_tokens", status_code=200)
async def count_message_tokens(request: Request) -> dict:
    """The prompt's tokens as the engine would see them (images expanded); nothing runs."""
    services = _services(request)
    caller = services.auth.caller(_authorization(request))
    raw = await request.body()
    limits = services.settings.limits
    body = await off_loop(len(raw), partial(parse_json_body, raw, limits.max_json_depth))
    parse = partial(anthropic_api.parse_messages_request, {"max_tokens": 1, **body}, limits)  # no max_tokens here
    chat_request, _ = services.pipeline.normalizer.apply(await off_loop(len(raw), parse), caller.tenant)
    async with services.models.lease(chat_request.model) as model:
        return {"input_tokens": await model.chat.count_tokens(chat_request)}


def _parse_anthropic(raw: bytes, services: Services) -> tuple[ChatRequest, tuple[bool, str | None]]:
    limits = services.settings.limits
    body = services.models.with_defaults(parse_json_body(raw, limits.max_json_depth))
    return anthropic_api.parse_messages_request(body, limits), anthropic_api.diagnostics_asked(body)


@post("/v1/responses", status_code=200)
async def create_response(request: Request) -> Response:
    services = _services(request)
    caller = services.auth.caller(request.headers.get("authorization"))
    raw = await request.body()
    limits = services.settings.limits
    body = await off_loop(len(raw), partial(_responses_body, raw, limits.max_json_depth))
    previous_id = body.get("previous_response_id")
    apart = await off_loop(
        0, partial(_apart_user, services, caller.tenant, body), services.pipeline.responses.digests_may_wait
    )
    history = await _history(services, previous_id, caller.tenant, apart)
    stored = body.get("store", True) is not False
    if stored:
        await _check_quota(services, caller.tenant, len(raw))
    body = services.models.with_defaults(body)
    chat_request, conversation = await off_loop(len(raw), partial(responses_api.parse_request, body, history, limits))
    added = conversation[len(history or []) :]  # what this turn adds: a stored turn keeps only that
    starting = services.pipeline.start(chat_request, caller, request.headers, len(raw))
    response_id = responses_api.new_id()

    async def finished(turn, message: dict, response: dict) -> None:
        if not stored:
            return
        owner = turn.ctx.owner
        try:
            await anyio.to_thread.run_sync(
                services.conversations.save,
                response_id,
                caller.tenant,
                owner.session or None,
                owner.end_user or None,
                [*added, message],
                response,
                time.time(),
                previous_id,
            )
        except UNAVAILABLE as exc:  # the key store (Redis) is out of reach: the answer still goes out
            log.warning("response %s not stored: %s", response_id, exc)

    if chat_request.stream:

        def events(turn) -> AsyncGenerator[bytes, None]:
            tools, done = _tools(turn, chat_request), partial(finished, turn)
            return responses_api.stream_events(
                turn.events(), turn.completion, turn.trace, response_id, body, previous_id, tools, done
            )

        failed = partial(responses_api.failed_events, response_id=response_id, body=body, previous_id=previous_id)
        return await _pinged_stream(services, request, chat_request, starting, OPENAI_PING, events, failed)
    turn = await _unless_client_leaves(request, starting)
    if turn is None:
        return Response(b"", status_code=499)
    request.state.turn = turn  # for the request's log line
    tools = _tools(turn, chat_request)
    if await _client_left(request, turn):
        return Response(b"", status_code=499)
    kinds, summary = responses_api.ToolKinds.of(body), responses_api.wants_summary(body)
    items, message = responses_api.output(turn.completion, tools, kinds, summary)
    response = responses_api.response_object(response_id, body, turn.completion, turn.trace, items, previous_id)
    await finished(turn, message, response)
    return Response(response, headers=_headers(services, turn))


def _responses_body(raw: bytes, max_depth: int) -> dict:
    """The body, every field's type checked before previous_response_id and store are read."""
    body = parse_json_body(raw, max_depth)
    responses_api.check_shape(body)
    return body


@get("/v1/responses/{response_id:str}")
async def get_response(request: Request, response_id: FromPath[str]) -> dict:
    services = _services(request)
    caller = services.auth.caller(request.headers.get("authorization"))
    response = await anyio.to_thread.run_sync(services.conversations.response, response_id, caller.tenant, time.time())
    if response is None:
        raise _no_response(response_id)
    return response


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(request: Request, response_id: FromPath[str]) -> dict:
    services = _services(request)
    caller = services.auth.caller(request.headers.get("authorization"))
    if not await anyio.to_thread.run_sync(services.conversations.delete, response_id, caller.tenant):
        raise _no_response(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def _check_quota(services: Services, tenant: str, num_bytes: int) -> None:
    """413 before any work when storing a request of `num_bytes` could take the tenant's stored
    responses past its quota (the output's bytes are bounded by max_output_tokens and not counted)."""
    quota = services.settings.conversation_quota_bytes
    if not quota:
        return
    used = await anyio.to_thread.run_sync(services.conversations.used_bytes, tenant)
    if used + num_bytes > quota:
        raise ApiError(
            413,
            f"this tenant's stored responses hold {used} bytes; storing this request ({num_bytes} bytes) "
            f"would pass its quota of {quota} bytes: send 'store': false, or delete stored responses "
            "(DELETE /v1/responses/{id})",
            "storage_quota_exceeded",
            "store",
        )


def _no_response(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"no stored response {echo(response_id)} (expired, deleted, not stored, or never made)",
        "response_not_found",
        "response_id",
    )


def _apart_user(services: Services, tenant: str, body: dict) -> str | None:
    """For a tenant that keeps its end users apart: the end user the request names, as stored
    (at_rest; "" for none): a stored response continues only under the end user it was stored for
    (another's previous_response_id is not found, as a response of another tenant is not). None: the
    tenant's end users share its stored responses, as OpenAI's do within a project."""
    user = body.get("user")
    if not services.settings.isolates_end_users(tenant) or not isinstance(user, str | None):
        return None
    return at_rest(services.keyring, tenant, "end_user", user or "")


async def _history(services: Services, previous_id, tenant: str, end_user: str | None) -> list[dict] | None:
    """The stored conversation `previous_id` continues; 404 when this tenant has none by that id
    (for `end_user`, see _apart_user)."""
    if previous_id is None:
        return None
    if not isinstance(previous_id, str) or not previous_id:
        raise bad_request("'previous_response_id' must be a string", "invalid_type", "previous_response_id")
    load = partial(services.conversations.load, previous_id, tenant, time.time(), end_user)
    history = await anyio.to_thread.run_sync(load)
    if history is None:
        raise ApiError(
            404,
            f"no stored response {echo(previous_id)} (expired, not stored, or never made)",
            "previous_response_not_found",
            "previous_response_id",
        )
    return history


@post("/v1/embeddings", status_code=200)
async def create_embeddings(request: Request) -> Response:
    services = _services(request)
    caller = services.auth.caller(request.headers.get("authorization"))
    raw = await request.body()
    limits = services.settings.limits
    body = await off_loop(len(raw), partial(parse_json_body, raw, limits.max_json_depth))
    parsed = parse_embeddings_request(body, limits, services.embeddings.engine_model)
    answer = await _unless_client_leaves(request, services.embeddings.create(parsed, caller.tenant))
    return Response(b"", status_code=499) if answer is None else Response(answer)


def _parse(raw: bytes, services: Services):
    limits = services.settings.limits
    return parse_chat_request(services.models.with_defaults(parse_json_body(raw, limits.max_json_depth)), limits)


async def _client_left_first(request: Request, finishing) -> bool:
    """Await `finishing` (a non-streaming answer) unless the client disconnects first; then cancel
    it, which closes the job's events and stops the engine between two steps. True if it left."""

    async def finished() -> bool:
        await finishing
        return True

    return await _unless_client_leaves(request, finished()) is None


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first: `work` is then cancelled, which
    cancels every job it started (all n choices; those still queued or prefilling too). Errors of
    `work` (ApiError, the deadline) are raised."""
    task = asyncio.ensure_future(work)
    if await _left_first(request, task):
        return None
    return task.result()


async def _left_first(request: Request, task: asyncio.Future, timeout_s: float | None = None) -> bool:
    """Wait for `task` (at most timeout_s) while watching the client: True when it disconnected
    first (the task is then cancelled, and with it every job it started)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    left = watcher.done() and not task.done()
    for pending in (watcher, task) if left else (watcher,):
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
    return left


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone: after the body, the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@get("/v1/models")
async def list_models(request: Request) -> dict:
    services = _services(request)
    services.auth.caller(request.headers.get("authorization"))
    models = services.models
    served = [
        {"id": status.name, "object": "model", "created": 0, "owned_by": "strata", "state": status.state}
        | ({"aliases": aliases} if (aliases := models.aliases_of(status.name)) else {})
        for status in models.statuses()
    ]
    embedding = {"id": EMBEDDING_MODELS[0], "object": "model", "created": 0, "owned_by": "strata", "state": "loaded"}
    return {"object": "list", "data": [*served, embedding]}


@get(["/health", "/healthz"])
async def health(request: Request) -> Response:
    """Liveness: 200 while the engine worker runs and steps when work waits, else 503 with the reason.
    Anyone may ask; the model fingerprint and queue state are for admins."""
    services = _services(request)
    state = _least_healthy(services)
    body = {"status": "ok"} if state.alive else {"status": "unavailable", "reason": state.reason}
    if services.auth.is_admin(request.headers.get("authorization")):
        body |= _health_details(services)
    return Response(body, status_code=200 if state.alive else 503)


@get("/health/ready")
async def ready(request: Request) -> Response:
    """Readiness: 503 until the engine's warm-up has ended well (and whenever it is not alive)."""
    services = _services(request)
    state = services.engine.health(services.settings.stuck_after_s)
    if state.ready:
        return Response({"status": "ready"}, status_code=200)
    return Response({"status": "not_ready", "reason": state.reason}, status_code=503)


def _least_healthy(services: Services):
    """The default model's health, or the first loaded model's that is not alive (its name in the reason)."""
    default = services.engine.health(services.settings.stuck_after_s)
    for model in services.models.loaded():
        state = model.engine.health(services.settings.stuck_after_s)
        if not state.alive and default.alive:
            return replace(state, reason=f"model {model.stamp.name!r}: {state.reason}")
    return default


def _health_details(services: Services) -> dict:
    engine = services.engine.snapshot()
    return {
        "model": services.engine.info.name,
        "model_fingerprint": services.engine.info.fingerprint,
        "blas": blas_in_use(),
        "blas_core": core_in_use(),  # OpenBLAS's kernels (e.g. SkylakeX), None on another BLAS
        "one_row_products": vector_products_loaded(),  # through sgemv (gateway/engine/vector_products.c)
        "multi_tenant": services.settings.multi_tenant,
        "queue_depth": engine.queue_depth,
        "engine_busy": engine.busy,
        "engine_running": engine.num_running,
        "models": {status.name: status.state for status in services.models.statuses()},
    }


@get("/metrics", media_type=METRICS_CONTENT_TYPE)
async def metrics(request: Request) -> Response:
    """Prometheus text format (gateway/observability/metrics.py): no prompts, sessions or keys in any label."""
    services = _services(request)
    if not services.settings.metrics_enabled:
        raise ApiError(404, "metrics are off on this server (STRATA_METRICS=0)", "metrics_disabled")
    body = await anyio.to_thread.run_sync(generate_latest, services.metrics)
    return Response(body, media_type=METRICS_CONTENT_TYPE)


def _state_collector(services: Services) -> StateCollector:
    settings, responses = services.settings, services.responses
    on_disk = settings.exact_store == "sqlite" and not settings.redis_url
    files = {"exact": settings.data_dir / "responses.db"} if on_disk else {}
    if responses.semantic is not None and not settings.redis_url:
        files["semantic"] = settings.data_dir / "semantic.db"

    def read() -> tuple:
        engine = services.engine
        return (engine.snapshot(), engine.health(settings.stuck_after_s), engine.cache_stats(), responses.stats())

    def index_bytes() -> int:
        semantic = responses.semantic
        return len(semantic.index) * semantic.embedder.dim * 4 if semantic is not None else 0  # float32 vectors

    def models() -> tuple[list[ModelGauge], int]:
        return services.models.gauges(), services.models.pool.limit_bytes

    return StateCollector(read, files, index_bytes, settings.ssd_daily_write_bytes, settings.max_queue, models)


@get("/admin/stats", guards=[require_admin], sync_to_thread=True)
def admin_stats(request: Request) -> dict:
    """Built from snapshots only: the per-layer outcome counters, the engine's, and each cache's stats()."""
    services = _services(request)
    store_errors = {
        "exact": services.responses.num_store_errors["exact"],
        "semantic": services.responses.num_store_errors["semantic"],
    }
    engine = services.engine.snapshot()
    engine_stats = asdict(engine.counters) | {
        "queue_depth": engine.queue_depth,
        "num_running": engine.num_running,
        "waiting_for_memory": engine.waiting_for_memory,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "last_step": asdict(engine.last_step),
    }
    return {
        **services.counters.snapshot(),
        "engine": engine_stats,
        "engine_caches": services.engine.cache_stats(),
        "models": [asdict(status) for status in services.models.statuses()],
        "model_memory_limit_bytes": services.models.pool.limit_bytes,
        "response_caches": services.responses.stats(),
        "response_store_errors": store_errors,
        "sweeps": request.app.state.sweeper.snapshot(),
    }


async def _report_warm_up(engine: Engine, configured_context: int | None) -> None:
    """Log the end of the warm-up and the context a request may use; a failed warm-up leaves the
    server up, answering 503 with the reason on /health and /health/ready (and to requests), so a
    probe sees why."""
    try:
        await anyio.to_thread.run_sync(engine.worker.wait_warm)
        log.info("engine warm-up done: ready")
        log.info(context_line(engine, configured_context))
    except RuntimeError as exc:
        log.critical("%s", exc)


def context_line(engine: Engine, configured: int | None) -> str:
    """What a request may hold, and what bounds it: the setting or the model's config, and the KV budget."""
    limit = engine.context_tokens(configured)
    source = "STRATA_MAX_CONTEXT_TOKENS" if configured else "the model's own"
    bound = configured or engine.info.max_context_tokens
    held = f"; the KV budget holds {limit}" if limit < bound else ""
    return f"model {engine.info.name!r}: context {limit} tokens per request ({source}: {bound}{held})"


def create_app(settings: Settings, engine: Engine | None = None, embedder: Embedder | None = None) -> Litestar:
    """The app for `settings`. Pass a started `engine` (and an `embedder`) to share them across apps
    (tests); otherwise the lifespan loads the model and MiniLM, starts the worker, and stops it."""
    registry = CollectorRegistry()  # GET /metrics: the request metrics, the state collector, HTTP counts
    block_trace = BlockTrace(settings.trace_file, settings.kv_block_size) if settings.trace_file else None
    response_log = ResponseLog(registry, settings.log_format == "json", settings.metrics_enabled, block_trace)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        owned = engine is None
        private_dir(settings.data_dir)
        live: Engine = engine if engine is not None else await anyio.to_thread.run_sync(_load_engine, settings)
        if owned:
            live.launch()  # serving starts now: requests queue until warm-up ends; /health/ready says when
        counters = LayerCounters()
        auth = Authenticator(
            settings.api_keys,
            settings.admin_key,
            load_server_secret(settings.secret_file or settings.data_dir / "server.secret"),
        )
        responses = await anyio.to_thread.run_sync(ResponseCaches, settings, embedder)
        entries = model_entries(settings)
        models = await anyio.to_thread.run_sync(ServedModels, settings, engine_config, entries, live)
        sessions = SessionClock(settings.session_ttl_s)
        request_metrics = RequestMetrics(registry, settings.metrics_tenant_label) if settings.metrics_enabled else None
        rules = load_rules(settings.normalize_rules_file or DEFAULT_RULES_FILE)
        normalizer = Normalizer(rules, settings.normalize_off_tenants)
        pipeline = Pipeline(models, responses, counters, sessions, request_metrics, normalizer)
        for declaration in load_file(settings.public_prefixes_file) if settings.public_prefixes_file else []:
            _declare_public(models.default.chat.public, declaration)
        conversations = ConversationStore(
            private_file(settings.data_dir / "conversations.db"), settings.conversation_ttl_s, keyring_for(settings)
        )
        embeddings = Embeddings(live, settings)
        app.state.services = Services(
            settings,
            live,
            models,
            auth,
            pipeline,
            counters,
            responses,
            embeddings,
            conversations,
            registry,
            keyring=keyring_for(settings),
        )
        if settings.redis_url:
            app.state.services.purge_feed = PurgeFeed(settings.redis_url, partial(purge_announced, app.state.services))
        if settings.metrics_enabled:
            registry.register(_state_collector(app.state.services))
        sweeper = Sweeper(
            {
                **responses.expiring(),
                "conversations": conversations.purge_expired,
                "sessions": partial(end_idle_sessions, app.state.services, sessions),
                "models": models.expire_idle,
            },
            settings.sweep_interval_s,
        )
        app.state.sweeper = sweeper
        app.state.history = History(registry, settings.dashboard_sample_s)
        _log_startup(settings, live, models)
        try:
            async with anyio.create_task_group() as background:
                background.start_soon(sweeper.run)
                if settings.metrics_enabled:
                    background.start_soon(app.state.history.run)
                if owned:
                    background.start_soon(_report_warm_up, live, settings.limits.max_context_tokens)
                yield
                background.cancel_scope.cancel()
        finally:
            if app.state.services.purge_feed is not None:
                app.state.services.purge_feed.close()
            responses.close()
            conversations.close()
            await anyio.to_thread.run_sync(models.close)  # the models loaded on demand
            if owned:
                await anyio.to_thread.run_sync(live.stop)
                log.info("engine stopped")

    return Litestar(
        route_handlers=[
            chat_completions,
            create_response,
            create_message,
            count_message_tokens,
            get_response,
            delete_response,
            create_embeddings,
            list_models,
            health,
            ready,
            metrics,
            admin_stats,
            *ADMIN_CACHE_ROUTES,
            *DASHBOARD_ROUTES,
        ],
        lifespan=[lifespan],
        middleware=[RequestStart()],
        before_send=[response_log.before_send],
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=settings.limits.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Strata", version=VERSION, path="/schema"),
        logging_config=None,  # the CLI configures logging once; Litestar must not replace it
    )


def _declare_public(public: PublicPrefixes, declaration) -> None:
    try:
        public.declare(declaration)
    except ApiError as exc:
        raise RuntimeError(f"STRATA_PUBLIC_PREFIXES_FILE: {exc.message}") from None


def _load_engine(settings: Settings) -> Engine:
    default = model_entries(settings)[0]
    return Engine(resolve_model_path(default.path, settings.data_dir), default.name, engine_config(settings))


def engine_config(settings: Settings) -> EngineConfig:
    budget = settings.kv_budget_bytes if settings.kv_budget_bytes is not None else default_budget_bytes(0.25)
    ssd = None
    if settings.ssd_capacity_bytes:
        admission = AdmissionPolicy(
            settings.ssd_min_hits,
            settings.ssd_min_prefix_tokens,
            settings.ssd_daily_write_bytes,
            settings.ssd_measured_admission,
        )
        ssd = SsdConfig(
            settings.ssd_dir or settings.data_dir / "kv",
            settings.ssd_capacity_bytes,
            settings.ssd_retention_s,
            admission=admission,
            writer=settings.ssd_writer,
            pin_budget_bytes=int(settings.ssd_capacity_bytes * settings.kv_pin_fraction),
            sealer=keyring_for(settings) if settings.encrypt_at_rest else None,
        )
    quant = (
        QuantConfig(settings.kv_quant_bits, min_tokens=settings.kv_quant_min_tokens) if settings.kv_quant_bits else None
    )
    caches = CacheConfig(
        budget,
        settings.vision_budget_bytes,
        settings.kv_block_size,
        ssd,
        quant,
        prefix_idle_s=settings.kv_ram_retention_s,
        pin_budget_bytes=int(budget * settings.kv_pin_fraction),
        vision_idle_s=settings.vision_retention_s,
        snapshot_blocks=settings.kv_snapshot_blocks,
    )
    return EngineConfig(
        settings.max_queue,
        settings.step_prompt_tokens,
        caches,
        settings.max_num_seqs,
        settings.max_verify_tokens,
        settings.step_budget_ms,
    )


def _log_startup(settings: Settings, engine: Engine, models: ServedModels) -> None:
    if settings.multi_tenant:
        log.info("multi-tenant: %d API keys; tenant comes from the key", len(settings.api_keys))
    else:
        log.warning("single-tenant mode: STRATA_API_KEYS is not set, so every caller is tenant 'default'")
    log.info("serving model %r (%s) on BLAS %s (%s)", engine.info.name, engine.info.path, blas_in_use(), core_in_use())
    if more := [status.name for status in models.statuses()[1:]]:
        limit = models.pool.limit_bytes
        log.info("also serving, loaded when first asked for: %s (memory limit %d MiB)", ", ".join(more), limit >> 20)
