"""OpenAI response shapes: a whole `chat.completion` body, or SSE `chat.completion.chunk`s ending in
`data: [DONE]`. Shaping only: no counting, no storing, no model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import Delta
from .errors import ApiError
from .trace import Trace


@dataclass(slots=True)
class Completion:
    """What one request produced, filled in as its events arrive."""

    id: str
    created: int
    prompt_tokens: int
    cached_tokens: int
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str = "stop"
    whole: bool = False  # Finished arrived: the text is the complete answer


@dataclass(frozen=True, slots=True)
class ModelStamp:
    name: str  # the "model" field
    fingerprint: str  # its first 16 hex digits are the "system_fingerprint"


def usage(completion: Completion, trace: Trace) -> dict:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
        "strata": trace.summary(),
    }


def response_body(completion: Completion, trace: Trace, stamp: ModelStamp) -> dict:
    message = {"role": "assistant", "content": completion.text}
    return {
        **_base(completion, "chat.completion", stamp),
        "choices": [{"index": 0, "message": message, "finish_reason": completion.finish_reason, "logprobs": None}],
        "usage": usage(completion, trace),
    }


async def sse(events: AsyncIterator, completion: Completion, trace: Trace, stamp: ModelStamp,
              include_usage: bool) -> AsyncIterator[bytes]:
    """SSE chunks of a request's events (already applied to `completion`). An error mid-stream ends
    it with an error event; closing this generator early closes `events` (which cancels the job)."""
    yield _chunk(completion, {"role": "assistant", "content": ""}, None, stamp)
    try:
        async for event in events:
            if isinstance(event, Delta):
                yield _chunk(completion, {"content": event.text}, None, stamp)
    except ApiError as exc:
        yield _sse(exc.body())
        return
    finally:
        await events.aclose()
    summary = usage(completion, trace)
    yield _chunk(completion, {}, completion.finish_reason, stamp, None if include_usage else summary)
    if include_usage:
        yield _sse({**_base(completion, "chat.completion.chunk", stamp), "choices": [], "usage": summary})
    yield b"data: [DONE]\n\n"


def _base(completion: Completion, kind: str, stamp: ModelStamp) -> dict:
    return {"id": completion.id, "object": kind, "created": completion.created, "model": stamp.name,
            "system_fingerprint": stamp.fingerprint[:16]}


def _chunk(completion: Completion, delta: dict, finish_reason: str | None, stamp: ModelStamp,
           summary: dict | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    body = {**_base(completion, "chat.completion.chunk", stamp), "choices": [choice]}
    if summary is not None:
        body["usage"] = summary
    return _sse(body)


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
