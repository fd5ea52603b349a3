"""Admin routes over the response caches (admin key required): review and purge what is served.

    GET    /admin/semantic/entries?tenant=&status=&limit=   provenance of stored answers
    POST   /admin/semantic/entries/{id}/approve | /reject   validation status (rejected: never served)
    DELETE /admin/semantic/entries/{id}
    DELETE /admin/exact?tenant=T                            purge one tenant's exact entries
    DELETE /admin/exact/{key}                               one stored answer (X-Strata-Exact-Key)
    POST   /admin/purge {tenant, session?, user?, layers?}  what a tenant, session or end user stored
    POST   /admin/sessions/{id}/end?tenant=T                the same for one session, in every layer
    GET    /admin/diagnosis?window_s=900                    why the caches missed lately, and what to change

With STRATA_REDIS_URL, a purge reaches every replica: the exact and semantic entries are shared in
Redis, and the replica that takes the purge announces it on the purge feed (gateway/operations/purge_feed.py),
so every other replica purges its own layers too (`"announced": true` in the answer).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict

import anyio
from litestar import Request, delete, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery

from kvcache.chain import public_blocks
from kvcache.sealing import Keyring
from semantic import Selector

from ..observability.diagnosis import RamBudget, diagnose
from ..requests.errors import ApiError, bad_request, echo
from ..requests.schemas import parse_json_body
from ..tenancy.keyring import UNAVAILABLE, at_rest, unkeyed
from ..tenancy.sessions import SessionClock

log = logging.getLogger("strata")
ADMIN_PAGE_SIZE = 1000  # the most entries one list call returns


def require_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A route guard: Litestar runs guards before it parses parameters, so a caller without the key
    learns nothing about the route's parameters (401, never 400)."""
    connection.app.state.services.auth.require_admin(connection.headers.get("authorization"))


def _semantic(request: Request):
    services = request.app.state.services
    if services.responses.semantic is None:
        raise ApiError(404, "the semantic cache is disabled on this server", "semantic_disabled")
    return services.responses.semantic


# Routes that call a store are plain functions Litestar runs on its worker threads (sync_to_thread):
# a slow store (Redis, SQLite on a slow disk) never stalls the event loop.


@get("/admin/semantic/entries", guards=[require_admin], sync_to_thread=True)
def list_entries(
    request: Request,
    tenant: FromQuery[str | None] = None,
    status: FromQuery[str | None] = None,
    limit: FromQuery[int] = 100,
) -> dict:
    cache = _semantic(request)
    if status is not None and status not in ("unreviewed", "approved", "rejected"):
        raise bad_request("status must be unreviewed, approved or rejected", "invalid_value", "status")
    entries = cache.list_entries(tenant, status, max(1, min(limit, ADMIN_PAGE_SIZE)))
    return {"object": "list", "data": [asdict(e) for e in entries]}


def _set_status(request: Request, entry_id: int, status: str) -> dict:
    cache = _semantic(request)
    if not cache.set_status(entry_id, status):
        raise ApiError(404, f"no semantic entry {entry_id}", "entry_not_found")
    return asdict(cache.get(entry_id))


@post("/admin/semantic/entries/{entry_id:int}/approve", status_code=200, guards=[require_admin], sync_to_thread=True)
def approve_entry(request: Request, entry_id: FromPath[int]) -> dict:
    return _set_status(request, entry_id, "approved")


@post("/admin/semantic/entries/{entry_id:int}/reject", status_code=200, guards=[require_admin], sync_to_thread=True)
def reject_entry(request: Request, entry_id: FromPath[int]) -> dict:
    return _set_status(request, entry_id, "rejected")


@delete("/admin/semantic/entries/{entry_id:int}", status_code=200, guards=[require_admin], sync_to_thread=True)
def delete_entry(request: Request, entry_id: FromPath[int]) -> dict:
    if not _semantic(request).delete(entry_id):
        raise ApiError(404, f"no semantic entry {entry_id}", "entry_not_found")
    return {"id": entry_id, "deleted": True}


@delete("/admin/exact", status_code=200, guards=[require_admin], sync_to_thread=True)
def purge_exact(request: Request, tenant: FromQuery[str]) -> dict:
    services = request.app.state.services
    if services.responses.exact is None:
        raise ApiError(404, "the exact cache is disabled on this server", "exact_disabled")
    return {"tenant": tenant, "purged": services.responses.exact.purge_tenant(tenant)}


@delete("/admin/exact/{key:str}", status_code=200, guards=[require_admin], sync_to_thread=True)
def delete_exact_entry(request: Request, key: FromPath[str]) -> dict:
    """One stored answer, by the key its response carried in X-Strata-Exact-Key."""
    services = request.app.state.services
    if services.responses.exact is None:
        raise ApiError(404, "the exact cache is disabled on this server", "exact_disabled")
    if not services.responses.exact.store.delete(key):
        raise ApiError(404, f"no exact entry {key[:80]!r}", "entry_not_found")
    return {"key": key, "deleted": True}


RESPONSE_LAYERS = ("exact", "semantic", "conversations")
ENGINE_LAYERS = ("vision", "prefix", "ssd")  # purged on the engine's worker thread, between two steps
PURGEABLE = RESPONSE_LAYERS + ENGINE_LAYERS
ENGINE_PURGE_TIMEOUT_S = 120.0  # the SSD tier first lets queued spills land, then rewrites files


@post("/admin/purge", status_code=200, guards=[require_admin])
async def purge(request: Request) -> dict:
    """{"tenant", "session"?, "user"?, "layers"?: [...]} -> what each layer and tier removed: every
    layer unless `layers` names some (exact, semantic, conversations, vision, prefix, ssd)."""
    services = request.app.state.services
    body = parse_json_body(await request.body(), services.settings.limits.max_json_depth)
    selector = _selector(services, body)
    layers = body.get("layers", list(PURGEABLE))
    if not isinstance(layers, list) or not layers or any(layer not in PURGEABLE for layer in layers):
        raise bad_request(f"'layers' must be a non-empty array of {', '.join(PURGEABLE)}", "invalid_value", "layers")
    removed = await anyio.to_thread.run_sync(purge_layers, services, selector, layers)
    return removed | {"session": body.get("session"), "user": body.get("user")}  # as named, not as kept


@post("/admin/sessions/{session:str}/end", status_code=200, guards=[require_admin])
async def end_session(request: Request, session: FromPath[str], tenant: FromQuery[str]) -> dict:
    """End a session: what it stored goes from every layer (shared entries stay for their other owners)."""
    services = request.app.state.services
    selector = _selector(services, {"tenant": tenant, "session": session})
    removed = await anyio.to_thread.run_sync(purge_layers, services, selector, list(PURGEABLE))
    return removed | {"session": session}


def end_idle_sessions(services, clock: SessionClock, now: float) -> int:
    """The sweep's part: end every session idle past the TTL, in every layer. How many ended."""
    idle = clock.idle(now)
    for tenant, session in idle:
        purge_layers(services, Selector(tenant, session), list(PURGEABLE))
    return len(idle)


def _selector(services, body: dict) -> Selector:
    """The tenant, session and end user a purge names; the ids as the layers keep them (keyed digests:
    `at_rest`, as requests' owners are recorded). A selector that already holds digests (the sweep's
    idle sessions, another replica's announced purge) is built directly, never digested twice."""
    fields = {name: body.get(name) for name in ("tenant", "session", "user")}
    for name, value in fields.items():
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 256):
            raise bad_request(f"'{name}' must be a string of 1 to 256 characters", "invalid_value", name)
    tenant = fields["tenant"]
    if tenant is None:
        raise bad_request("'tenant' is required: a purge never crosses tenants", "invalid_value", "tenant")
    session, user = (
        None if value is None else at_rest(services.keyring, tenant, kind, value)
        for kind, value in (("session", fields["session"]), ("end_user", fields["user"]))
    )
    if any(value is not None and unkeyed(value) for value in (session, user)):  # it would match nothing
        raise ApiError(
            503,
            "the key store cannot be reached, so the session or user cannot be matched: nothing was purged; retry",
            "store_unavailable",
        )
    return Selector(tenant, session, user)


AT_REST = {"exact", "semantic", "conversations", "ssd"}  # sealed under the tenant's key when stored


def purge_layers(
    services, selector: Selector, layers: list[str], announce: bool = True, shred: bool | None = None
) -> dict:
    """Each named layer's purge, as {layer: {"entries", "bytes"}} ("blocks" for the KV tiers, and
    "files" for the SSD tier; a disabled layer: null); announced to the other replicas if asked.

    A whole tenant's purge of every layer kept at rest shreds its data key first: from that instant
    nothing it stored opens anywhere (any replica, any copy). The SSD tier's files are then rewritten
    off the worker thread (`"ssd": {"shredded": true, "reclaiming": true}`). `shred`: whether to
    (None: exactly when the purge is such a purge)."""
    shredded = (_shreds(selector, layers) if shred is None else shred) and _shred(services, selector.tenant)
    purges = {
        "exact": services.responses.exact.purge_owned if services.responses.exact else None,
        "semantic": services.responses.semantic.purge_owned if services.responses.semantic else None,
        "conversations": services.conversations.purge,
    }
    removed, unreachable = {}, []
    for layer in (layer for layer in layers if layer in RESPONSE_LAYERS):
        try:
            result = purges[layer](selector) if purges[layer] is not None else None
        except UNAVAILABLE:
            unreachable.append(layer)
            continue
        removed[layer] = {"entries": result.num_entries, "bytes": result.num_bytes} if result is not None else None
    engine_layers = [layer for layer in layers if layer in ENGINE_LAYERS and not (shredded and layer == "ssd")]
    if engine_layers:
        removed |= _purge_engine(services, selector, engine_layers)
    if shredded and "ssd" in layers:
        reclaims = [model.engine.reclaim_ssd(selector.selects) for model in services.models.loaded()]
        if any(reclaims):  # the models not loaded: on a thread of their own too, never the request's
            threading.Thread(target=services.models.purge_unloaded_ssd, args=(selector.selects,), daemon=True).start()
        removed["ssd"] = {"shredded": True, "reclaiming": True} if any(reclaims) else None
    if unreachable:
        raise ApiError(
            503,
            f"the {', '.join(unreachable)} store cannot be reached: nothing was purged there (the "
            f"other layers were: {sorted(removed)}); a purge can be repeated: retry",
            "store_unavailable",
        )
    log.info(
        "purged %s for tenant %r session %r user %r: %s",
        layers,
        selector.tenant,
        selector.session,
        selector.end_user,
        removed,
    )
    announced = announce and services.purge_feed is not None
    if announced:
        try:
            services.purge_feed.announce(selector.tenant, selector.session, selector.end_user, layers)
        except UNAVAILABLE:
            raise ApiError(
                503,
                f"purged on this replica ({sorted(removed)}), but the other replicas could not be "
                "told: Redis cannot be reached; a purge can be repeated: retry",
                "store_unavailable",
            ) from None
    return {
        "tenant": selector.tenant,
        "session": selector.session,
        "user": selector.end_user,
        "removed": removed,
        "shredded": shredded,
        "announced": announced,
    }


def _shreds(selector: Selector, layers: list[str]) -> bool:
    """A purge shreds the tenant's key when it is the whole tenant's, in every layer kept at rest."""
    return selector.whole_tenant and set(layers) >= AT_REST


def _shred(services, tenant: str) -> bool:
    """The tenant's data key out of the key store (True: encryption at rest is on, so it is gone)."""
    if not isinstance(services.keyring, Keyring):
        return False
    try:
        services.keyring.shred(tenant)
    except UNAVAILABLE:
        raise ApiError(
            503,
            "the key store (Redis) cannot be reached: nothing was purged; a purge can be repeated: retry",
            "store_unavailable",
        ) from None
    return True


SHARED_IN_REDIS = ("exact", "semantic")  # one replica's purge removed them for all


def purge_announced(services, tenant: str, session: str | None, user: str | None, layers: list[str]) -> None:
    """Another replica's purge, run on this one's own layers (the purge feed's follower calls it)."""
    mine = [layer for layer in layers if layer in PURGEABLE and layer not in SHARED_IN_REDIS]
    selector = Selector(tenant, session, user)
    if mine:  # a shredding purge there: the key, shared, is gone; this replica forgets it too
        purge_layers(services, selector, mine, False, _shreds(selector, layers))


def _purge_engine(services, selector: Selector, layers: list[str]) -> dict:
    """Every loaded model's engine caches, and the SSD blocks of the models not loaded (each model
    files its blocks in a folder of its own; one not loaded holds nothing in RAM)."""
    removed: dict = {}
    for model in services.models.loaded():
        try:
            results = model.engine.purge_caches(selector.selects, layers, ENGINE_PURGE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:
            raise ApiError(
                503,
                f"the caches of model {model.stamp.name!r} could not be purged now ({exc or 'timed out'}); "
                "a purge can be repeated: retry",
                "engine_unavailable",
            ) from None
        for layer, result in results.items():
            removed[layer] = _added(removed.get(layer), _engine_removed(layer, result))
    if "ssd" in layers:
        for result in services.models.purge_unloaded_ssd(selector.selects):
            removed["ssd"] = _added(removed.get("ssd"), _engine_removed("ssd", result))
    return removed


def _added(total: dict | None, more: dict | None) -> dict | None:
    if total is None or more is None:
        return total or more
    return {key: total[key] + more[key] for key in total}


def _engine_removed(layer: str, result) -> dict | None:
    if result is None:
        return None
    if layer == "vision":
        return {"entries": result.num_entries, "bytes": result.num_bytes}
    shown = {"blocks": result.num_entries, "bytes": result.num_bytes}
    return shown | {"files": result.num_files} if layer == "ssd" else shown


DIAGNOSIS_WINDOW_S = 900.0


@get("/admin/diagnosis", guards=[require_admin])
async def diagnosis(request: Request, window_s: FromQuery[float] = DIAGNOSIS_WINDOW_S) -> dict:
    """The last window_s seconds of requests: hit rates, missed prefix tokens by cause, the bottleneck."""
    if not 0 < window_s <= 7 * 24 * 3600:
        raise bad_request("window_s must be between 0 and 604800 seconds", "invalid_value", "window_s")
    services = request.app.state.services
    records = list(services.counters.recent)
    caches = services.engine.cache_stats()
    block_bytes = services.engine.snapshot().kv_bytes_per_token * services.settings.kv_block_size
    ram = RamBudget(caches["prefix"]["budget_bytes"], block_bytes) if "prefix" in caches else None
    # off the event loop: the what-if curve walks every kept block of the window (seconds at 50,000 requests)
    return await anyio.to_thread.run_sync(diagnose, records, window_s, time.time(), "ssd" in caches, ram)


@get("/admin/public-prefixes", guards=[require_admin])
async def list_public_prefixes(request: Request) -> dict:
    """The declared public prefixes: id, tokens (what a prompt must start with), the declaration."""
    return {"data": [prefix.shown() for prefix in request.app.state.services.models.default.chat.public.listed()]}


@post("/admin/public-prefixes", status_code=201, guards=[require_admin])
async def declare_public_prefix(request: Request) -> dict:
    """{"system"?: text, "tools"?: [...]} -> the prefix: its blocks are shared by every tenant whose
    prompt starts with exactly its tokens (this replica; a cluster declares them in the file)."""
    services = request.app.state.services
    body = parse_json_body(await request.body(), services.settings.limits.max_json_depth)
    prefix = await anyio.to_thread.run_sync(services.models.default.chat.public.declare, body)
    block_size = services.settings.kv_block_size
    return prefix.shown() | {"shared_tokens": public_blocks(len(prefix.token_ids), (), block_size) * block_size}


@delete("/admin/public-prefixes/{prefix_id:str}", status_code=200, guards=[require_admin])
async def remove_public_prefix(request: Request, prefix_id: FromPath[str]) -> dict:
    if not request.app.state.services.models.default.chat.public.remove(prefix_id):
        raise ApiError(404, f"no public prefix {echo(prefix_id)}", "public_prefix_not_found")
    return {"id": prefix_id, "deleted": True}


ADMIN_CACHE_ROUTES = [
    list_public_prefixes,
    declare_public_prefix,
    remove_public_prefix,
    list_entries,
    approve_entry,
    reject_entry,
    delete_entry,
    purge_exact,
    delete_exact_entry,
    purge,
    end_session,
    diagnosis,
]
