"""The HTTP server around the app: uvicorn, with the connection limits a public port needs.

    serve(app, settings)

uvicorn's own settings bound idle keep-alive connections (`timeout_keep_alive`), open connections
(`limit_concurrency`: more are answered 503) and header size (`h11_max_incomplete_event_size`), but
nothing bounds the time a client takes to *send* a request: its keep-alive timer starts only after a
response, so a socket that connects and sends nothing, or half a header, or half a body, stays open
forever, and a few hundred of them fill the connection cap for everyone. `GuardedProtocol` adds:
- a header deadline: from the connection (or the first byte of a request on a kept-alive one) the
  headers must arrive within `http_header_timeout_s` (default 5 s; never more than the body's), else
  the connection is closed;
- a body deadline: headers and body together within `http_read_timeout_s` (default 30 s). Time spent
  answering is not counted: a long stream is never cut;
- a per-client cap: one client address may hold `max_connections_per_client` open connections; a
  connection past it is given OVER_CAP_HEADER_S to send its headers, then a health check is answered
  and anything else gets 429 and is closed, so a liveness probe from a host that also holds hundreds
  of slow connections is never refused (0: no cap, as behind a proxy, where every client is the
  proxy and the proxy caps each client itself);
- health checks whatever the cap: GET /health, /healthz and /health/ready are served even when the
  open connections exceed `limit_concurrency` (everything else then gets uvicorn's 503).
In front of several replicas HAProxy adds its own `timeout http-request` (deploy/haproxy).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..settings import Settings

MAX_HEADER_BYTES = 64 * 1024  # one request's headers; larger answer 400 (uvicorn's h11 bound)
GRACEFUL_SHUTDOWN_S = 10
HEALTH_PATHS = frozenset({"/health", "/healthz", "/health/ready"})
OVER_CAP_HEADER_S = 1.0  # a connection past its client's cap: a probe sends its request at once
_REQUEST_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR, h11.SWITCHED_PROTOCOL)
_TOO_MANY = (
    b'{"error": {"message": "too many open connections from this client", "type": "rate_limit_error", '
    b'"code": "too_many_connections", "param": null}}'
)


async def _too_many_connections(scope, receive, send) -> None:
    """The ASGI answer to a request (not a health check) on a connection past its client's cap."""
    headers = [(b"content-type", b"application/json"), (b"connection", b"close"), (b"retry-after", b"1")]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": _TOO_MANY})


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and caps above; the class attributes are set per
    server by `guarded_protocol`. Invariants: `per_client[host]` counts this server's open
    connections from `host` within the cap (one past it is never counted: it may only ask for a health
    check, answered or closed within OVER_CAP_HEADER_S); while a request is
    being received a deadline runs (`waiting_for` is set), and `request_started` is when its first
    byte came (on a kept-alive connection, not the connection's first request: its headers and body
    may arrive in one read or many)."""

    header_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_per_client: int = 32
    per_client: ClassVar[Counter[str]] = Counter()  # replaced per server by guarded_protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn types the base as BaseTransport
        super().connection_made(transport)
        self.read_deadline: asyncio.TimerHandle | None = None
        self.waiting_for: str | None = None  # "headers" or "body" while a deadline runs
        self.request_started = time.monotonic()
        self.host = self.client[0] if self.client else ""
        self.counted = not self.max_per_client or self.per_client[self.host] < self.max_per_client
        if not self.counted:  # past the cap: a health check only, and quickly
            # nor is it one of the open connections uvicorn's limit_concurrency counts: a flood from
            # one host must not turn every other client away with 503s
            self.connections.discard(self)
            self._arm(self.request_started + OVER_CAP_HEADER_S)
            return
        self.per_client[self.host] += 1
        self._arm()  # a connection that never sends anything is closed too

    def data_received(self, data: bytes) -> None:
        if self.waiting_for is None:  # no deadline runs: these are a new request's first bytes
            self.request_started = time.monotonic()
        super().data_received(data)
        state = self.conn.their_state
        if state in _REQUEST_RECEIVED:
            self._disarm()
        elif state is h11.SEND_BODY:
            if self.waiting_for != "body":  # the headers are in: the body's deadline, from the request's start
                self._arm(self.request_started + self.read_timeout_s, "body")
        elif self.waiting_for is None:  # a new request's headers began on a kept-alive connection
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.counted:
            self.counted = False
            self.per_client[self.host] -= 1
            if self.per_client[self.host] <= 0:
                del self.per_client[self.host]
        super().connection_lost(exc)

    @property  # uvicorn's plain attribute, read where a request's headers are in
    def app(self):
        """The app, but for a connection past its client's cap: a health check or a 429."""
        scope = getattr(self, "scope", None)
        if getattr(self, "counted", True) or (scope is not None and scope.get("path") in HEALTH_PATHS):
            return self._app
        return _too_many_connections

    @app.setter
    def app(self, value) -> None:
        self._app = value

    @property  # uvicorn's plain attribute, read where a request's headers are in
    def limit_concurrency(self) -> int | None:
        """uvicorn answers 503 past this many connections or tasks; never to a health check."""
        scope = getattr(self, "scope", None)
        return None if scope is not None and scope.get("path") in HEALTH_PATHS else self._limit_concurrency

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._limit_concurrency = value

    def _arm(self, at: float | None = None, waiting_for: str = "headers") -> None:
        """The deadline: `at` (monotonic), or the headers' from the request's start."""
        self._disarm()
        due = at if at is not None else self.request_started + min(self.header_timeout_s, self.read_timeout_s)
        self.read_deadline = self.loop.call_later(max(0.0, due - time.monotonic()), self._read_timed_out)
        self.waiting_for = waiting_for

    def _disarm(self) -> None:
        deadline = getattr(self, "read_deadline", None)  # None too before connection_made
        if deadline is not None:
            deadline.cancel()
        self.read_deadline = None
        self.waiting_for = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        self.waiting_for = None
        if self.conn.their_state not in _REQUEST_RECEIVED and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(settings: Settings) -> type[GuardedProtocol]:
    """A protocol class for one server: its deadlines, its cap, its own per-client counts."""
    attributes = {
        "header_timeout_s": settings.http_header_timeout_s,
        "read_timeout_s": settings.http_read_timeout_s,
        "max_per_client": settings.max_connections_per_client,
        "per_client": Counter(),
    }
    return type("GuardedProtocol", (GuardedProtocol,), attributes)


def serve(app, settings: Settings, log_level: str) -> None:
    """With JSON logs, uvicorn's loggers go through the root's JSON handler and its own access lines
    give way to Strata's (one per request, with the cache layers' outcomes)."""
    json_logs = settings.log_format == "json"
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        log_config=None if json_logs else uvicorn.config.LOGGING_CONFIG,
        access_log=not json_logs,
        http=guarded_protocol(settings),
        timeout_keep_alive=settings.keep_alive_s,
        limit_concurrency=settings.max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
