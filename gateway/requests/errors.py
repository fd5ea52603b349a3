"""OpenAI-style errors: every 4xx/5xx body is {"error": {"message", "type", "code", "param"}};
on Anthropic's routes (/v1/messages...) Anthropic's {"type": "error", "error": {"type", "message"}}
with its types, so each client raises its own exception classes.

ApiError                      raised by our code with the status it should answer
litestar HTTPException        mapped (404 route, 405 method, 413 body too large, ...)
StoreUnavailable (semantic's, kvcache's) 503 store_unavailable (a shared store or the key store is down)
kvcache KeysRotated           503 key_store_rotated (the key store was rewrapped; the key file not yet)
the engine refusing a job     engine_refusal(): 503 engine_unavailable, 429 queue_full / tenant_share,
                              400 context_length_exceeded (its KV exceeds the whole memory budget)
anything else                 500 server_error, logged; the server keeps serving
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandler

from kvcache import sealing as kv_sealing
from kvcache.sealing import KeysRotated
from semantic import StoreUnavailable

from ..engine import EngineStopped, OverBudget, QueueFull

log = logging.getLogger("strata")

# As OpenAI answers: clients switch on `type`, so unknown models (404) and bad keys (401) are
# invalid_request_error too (with codes model_not_found and invalid_api_key).
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)


ECHO_CHARS = 100  # the most of a client's value an error message quotes


def echo(value: object) -> str:
    """A client's value as an error message quotes it: its repr, cut to ECHO_CHARS characters (a
    1 MB id must not come back as a 1 MB error)."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, code, param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


ANTHROPIC_PATH = "/v1/messages"  # this route and those under it answer errors in Anthropic's shape


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def anthropic_error_type(status: int) -> str:
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
        504: "timeout_error",
    }
    return kinds.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _error_response(request: Request, status: int, message: str, code: str, param=None, headers=None) -> Response:
    """The error in the shape of the API the request called."""
    path = request.url.path
    anthropic = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
    body = anthropic_error(status, message) if anthropic else error_body(status, message, code, param)
    return Response(body, status_code=status, headers=headers or {})


def _api_error_handler(request: Request, exc: ApiError) -> Response:
    return _error_response(request, exc.status, exc.message, exc.code, exc.param, exc.headers)


def _http_exception_handler(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code, "http_error")
    return _error_response(request, exc.status_code, str(exc.detail), code, headers=exc.headers)


def _store_unavailable_handler(request: Request, exc: Exception) -> Response:
    message = f"the cache store cannot be reached ({exc}); nothing was changed: retry"
    return _error_response(request, 503, message, "store_unavailable", headers={"Retry-After": "1"})


def _keys_rotated_handler(request: Request, exc: KeysRotated) -> Response:
    return _error_response(request, 503, str(exc), "key_store_rotated", headers={"Retry-After": "5"})


def _unexpected_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error_response(request, 500, "internal server error", "internal_error")


EXCEPTION_HANDLERS: dict[int | type[Exception], ExceptionHandler] = {
    ApiError: _api_error_handler,
    HTTPException: _http_exception_handler,
    KeysRotated: _keys_rotated_handler,
    StoreUnavailable: _store_unavailable_handler,
    kv_sealing.StoreUnavailable: _store_unavailable_handler,
    Exception: _unexpected_handler,
}


ENGINE_REFUSALS = (EngineStopped, QueueFull, OverBudget)  # what Engine.submit and submit_embedding raise


def engine_refusal(refused: Exception) -> ApiError:
    """The client's error for a job the engine would not take (one of ENGINE_REFUSALS)."""
    if isinstance(refused, QueueFull):
        message = (
            "this tenant holds its share of the engine queue; retry shortly"
            if refused.reason == "tenant_share"
            else "the engine queue is full; retry shortly"
        )
        return ApiError(429, message, refused.reason, headers={"Retry-After": "1"})
    if isinstance(refused, OverBudget):
        return bad_request(
            f"the prompt and max_tokens need {refused.need_bytes >> 10} KiB of KV cache, more than the "
            f"engine's memory budget ({refused.budget_bytes >> 10} KiB); send a shorter prompt or a "
            "lower max_tokens",
            "context_length_exceeded",
            "max_tokens",
        )
    return ApiError(503, f"the engine cannot take requests: {refused}", "engine_unavailable")


def refuse_unless_serving(engine, stuck_after_s: float) -> None:
    """503 at once while the engine is reported dead or stuck (what /health says): a new job would
    only wait in the queue until its deadline."""
    health = engine.health(stuck_after_s)
    if not health.alive:
        raise ApiError(
            503, f"the engine cannot take requests: {health.reason}", "engine_unavailable", headers={"Retry-After": "5"}
        )
