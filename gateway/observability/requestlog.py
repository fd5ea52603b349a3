"""Every response's request id and status count, and, with STRATA_LOG_FORMAT=json, one JSON log line;
with STRATA_TRACE_FILE, one block-trace record per request that ran the cache layers (BlockTrace).

    RequestStart                     (middleware, routed requests) the request id and start time
    before_send(message, scope)      (every response: errors and 404s too) X-Request-Id on its start;
                                     at its last body message, strata:http_requests_total and the log line
    JsonFormatter                    log records as one JSON object a line

The request id is the client's X-Request-Id when it is a plain token of at most 128 characters,
else a new one. Handlers that ran the cache layers leave their Turn in the scope's state
(`request.state.turn`): the line then says the tenant, who answered, every layer's outcome and
the timings. Nothing of the prompt or the answer is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path

from litestar.datastructures import MutableScopeHeaders
from litestar.middleware import ASGIMiddleware
from prometheus_client import CollectorRegistry, Counter

from kvcache.blocktrace import TraceRecord, short_hash

from .trace import LAYERS

HEADER = "x-request-id"
PLAIN_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
access_log = logging.getLogger("strata.access")


class RequestStart(ASGIMiddleware):
    async def handle(self, scope, receive, send, next_app) -> None:
        _begin(scope)
        await next_app(scope, receive, send)


def _begin(scope) -> dict:
    """The request's id and start time in its scope state (once)."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        sent = dict(scope.get("headers") or ()).get(HEADER.encode(), b"").decode("latin-1")
        state["request_id"] = sent if PLAIN_ID.fullmatch(sent) else uuid.uuid4().hex
        state["started"] = time.perf_counter()
    return state


class BlockTrace:
    """STRATA_TRACE_FILE: one kvcache.blocktrace record per request that ran the cache layers (no
    text: the tenant as a digest, the prompt's blocks as short salted hashes), appended 0600."""

    def __init__(self, path: Path, block_tokens: int):
        self.block_tokens = block_tokens
        self.lock = threading.Lock()
        self.file = os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", buffering=1)

    def write(self, tenant: str, chain: tuple[bytes, ...], answered: bool) -> None:
        tenant_id = hashlib.sha256(b"strata-trace-tenant|" + tenant.encode()).hexdigest()[:12]
        blocks = tuple(short_hash(h) for h in chain)
        line = TraceRecord(time.time(), tenant_id, blocks, self.block_tokens, answered).line()
        with self.lock:
            self.file.write(line + "\n")


class ResponseLog:
    def __init__(
        self, registry: CollectorRegistry, json_lines: bool, counted: bool, block_trace: BlockTrace | None = None
    ):
        self.block_trace = block_trace
        self.json_lines = json_lines
        self.counted = counted  # count responses in strata:http_requests_total (STRATA_METRICS)
        self.http_requests = Counter(
            "strata:http_requests",
            "HTTP responses, by route template and status",
            ["route", "method", "status"],
            registry=registry,
        )

    async def before_send(self, message, scope) -> None:
        if scope.get("type") != "http":
            return
        state = _begin(scope)
        if message["type"] == "http.response.start":
            MutableScopeHeaders.from_message(message)["X-Request-Id"] = state["request_id"]
            state["status"] = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self._end(scope, state)

    def _end(self, scope, state: dict) -> None:
        route = scope.get("path_template") or "unmatched"
        if self.counted:
            self.http_requests.labels(route, scope.get("method", ""), str(state.get("status", 0))).inc()
        if self.json_lines:
            access_log.info("request", extra={"fields": _fields(scope, state, route)})
        turn = state.get("turn")
        if self.block_trace is not None and turn is not None:
            answered = turn.trace.served_by != "engine"
            self.block_trace.write(turn.ctx.tenant, () if answered else turn.trace.chain, answered)


def _fields(scope, state: dict, route: str) -> dict:
    fields = {
        "request_id": state["request_id"],
        "method": scope.get("method"),
        "route": route,
        "status": state.get("status"),
        "duration_ms": round((time.perf_counter() - state["started"]) * 1000, 2),
    }
    turn = state.get("turn")
    if turn is not None:
        trace = turn.trace
        fields |= {
            "tenant": turn.ctx.tenant,
            "served_by": trace.served_by,
            "cache": {layer: trace.outcomes[layer].header_value() for layer in LAYERS},
            "timings_ms": {step: round(ms, 2) for step, ms in trace.timings_ms.items()},
            "prompt_tokens": turn.completion.prompt_tokens,
            "completion_tokens": sum(c.completion_tokens for c in turn.completions),
        }
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and a record's `fields` when it has them."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line |= getattr(record, "fields", {})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)
