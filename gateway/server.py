"""The HTTP server around the app: uvicorn, with the connection limits a public port needs.

    serve(app, settings)

uvicorn's own settings bound idle keep-alive connections (`timeout_keep_alive`), open connections
(`limit_concurrency`: more are answered 503) and header size (`h11_max_incomplete_event_size`), but
nothing bounds the time a client takes to *send* a request: its keep-alive timer starts only after a
response, so a socket that connects and sends nothing, or half a header, or half a body, stays open
forever. `ReadDeadlineProtocol` adds that bound: from the first byte a connection may send (or from
the connection itself), the request's headers and body must all arrive within `http_read_timeout_s`,
or the connection is closed. Time spent answering is not counted: a long stream is never cut.
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import Settings

MAX_HEADER_BYTES = 64 * 1024  # one request's headers; larger answer 400 (uvicorn's h11 bound)
GRACEFUL_SHUTDOWN_S = 10
_REQUEST_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR, h11.SWITCHED_PROTOCOL)


class ReadDeadlineProtocol(H11Protocol):
    read_timeout_s: float = 30.0  # set per server by `protocol_with_read_timeout`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn types the base as BaseTransport
        super().connection_made(transport)
        self.read_deadline: asyncio.TimerHandle | None = None
        self._arm()  # a connection that never sends anything is closed too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _REQUEST_RECEIVED:
            self._disarm()
        else:  # a request is arriving (or a new one began on a kept-alive connection)
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.read_deadline is None:
            self.read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        if self.conn.their_state not in _REQUEST_RECEIVED and not self.transport.is_closing():
            self.transport.close()


def protocol_with_read_timeout(read_timeout_s: float) -> type[ReadDeadlineProtocol]:
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), {"read_timeout_s": read_timeout_s})


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
        http=protocol_with_read_timeout(settings.http_read_timeout_s),
        timeout_keep_alive=settings.keep_alive_s,
        limit_concurrency=settings.max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
