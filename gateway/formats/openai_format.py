"""OpenAI response shapes: a whole `chat.completion` body, or SSE `chat.completion.chunk`s ending in
`data: [DONE]`. Shaping only: no counting, no storing, no model."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from ..engine import Delta, Finished, ParsedCall, ToolFormat
from ..observability.trace import Trace
from ..requests.errors import ApiError


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
    logprobs: list[dict] | None = None  # OpenAI `logprobs.content` entries, when the request asked for them
    stop_sequence: str | None = None  # the client's stop sequence that ended the answer (the engine's)
    token_ids: tuple[int, ...] = ()  # the engine's answer as generated (none for a replay)
    written_tokens: int = 0  # prompt tokens this request put into the prefix cache (its new whole blocks)


@dataclass(frozen=True, slots=True)
class ModelStamp:
    name: str  # the "model" field
    fingerprint: str  # its first 16 hex digits are the "system_fingerprint"


def usage(completions: list[Completion], trace: Trace) -> dict:
    """The prompt counts once however many choices; each choice's own cached tokens are listed in
    `strata.choices_cached_tokens` when there are several (the later ones reuse the first's prefill)."""
    first = completions[0]
    completion_tokens = sum(c.completion_tokens for c in completions)
    summary = trace.summary()
    if len(completions) > 1:
        summary["choices_cached_tokens"] = [c.cached_tokens for c in completions]
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": first.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens, "cache_write_tokens": first.written_tokens},
        "strata": summary,
    }


def response_body(
    completions: list[Completion], trace: Trace, stamp: ModelStamp, tools: ToolFormat | None = None
) -> dict:
    """`tools`: the model's tool-call format when the request offered tools (calls are parsed out)."""
    return {
        **_base(completions[0], "chat.completion", stamp),
        "choices": [_choice(index, completion, tools) for index, completion in enumerate(completions)],
        "usage": usage(completions, trace),
    }


def _choice(index: int, completion: Completion, tools: ToolFormat | None) -> dict:
    message = assistant_message(completion.text, tools)
    finish_reason = "tool_calls" if "tool_calls" in message else completion.finish_reason
    logprobs = {"content": completion.logprobs} if completion.logprobs is not None else None
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def assistant_message(text: str, tools: ToolFormat | None) -> dict:
    """The reply as a chat message: with `tools`, its calls parsed out into `tool_calls` (the text
    left beside them is the content, None when empty)."""
    content, calls = tools.parse(text) if tools is not None else (text, [])
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls(calls)}


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_thinking(text: str) -> tuple[str | None, str]:
    """(the thinking, the answer) of a text that opens with <think>; (None, text) otherwise. An
    unclosed <think> (the answer was cut short) is all thinking."""
    opening = text.lstrip()
    if not opening.startswith(THINK_OPEN):
        return None, text
    thought, closed, answer = opening[len(THINK_OPEN) :].partition(THINK_CLOSE)
    return thought, answer.lstrip("\n") if closed else ""


def partial_suffix(text: str, marker: str) -> int:
    """How many of text's last characters are the start of `marker` (held back: they may become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def sendable(text: str, tools: ToolFormat | None) -> int:
    """How much of a reply streaming may send now: all of it, or with `tools`, the text before where
    a call starts or may start."""
    return tools.may_start_call(text) if tools is not None else len(text)


def tool_calls(calls: list[ParsedCall]) -> list[dict]:
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


async def sse(
    events: AsyncGenerator,
    completions: list[Completion],
    trace: Trace,
    stamp: ModelStamp,
    include_usage: bool,
    tools: ToolFormat | None = None,
) -> AsyncGenerator[bytes, None]:
    """SSE chunks of a request's (choice index, event) pairs (already applied to `completions`). An
    error mid-stream ends it with an error event, then [DONE]; closing this generator early closes `events`
    (which cancels the jobs). With `tools`, text from where a call may start is held back; at the
    end the calls go out as `tool_calls` deltas (one whole call each) and anything held that was not
    a call as content."""
    streams = [ChoiceStream(index, completion, tools, completions[0]) for index, completion in enumerate(completions)]
    for choice in streams:
        yield _chunk(choice, {"role": "assistant", "content": ""}, None, stamp)
    try:
        async for index, event in events:
            if isinstance(event, Delta) and (chunk := streams[index].delta(stamp)):
                yield chunk
            if isinstance(event, Finished):
                for chunk in streams[index].finish(stamp, None if include_usage or len(streams) > 1 else trace):
                    yield chunk
    except ApiError as exc:  # the stream ends as every stream does: a client waiting for it stops
        for chunk in error_chunks(exc):
            yield chunk
        return
    finally:
        await events.aclose()
    if include_usage:
        yield _sse(
            {**_base(completions[0], "chat.completion.chunk", stamp), "choices": [], "usage": usage(completions, trace)}
        )
    yield b"data: [DONE]\n\n"


class ChoiceStream:
    """One choice's chunks: what of its text and logprobs has gone out. Every chunk carries the
    first choice's id and time (`head`): one stream, one id, as with OpenAI."""

    def __init__(self, index: int, completion: Completion, tools: ToolFormat | None, head: Completion):
        self.index = index
        self.completion = completion
        self.tools = tools
        self.head = head
        self.sent = 0  # characters of the text sent as content
        self.num_logprobs = 0  # logprob entries sent

    def delta(self, stamp: ModelStamp) -> bytes | None:
        text, tools = self.completion.text, self.tools
        end = sendable(text, tools)
        logprobs = self.completion.logprobs[self.num_logprobs :] if self.completion.logprobs is not None else None
        if end <= self.sent and not logprobs:
            return None
        chunk = _chunk(self, {"content": text[self.sent : end]}, None, stamp, logprobs=logprobs)
        self.sent, self.num_logprobs = max(self.sent, end), self.num_logprobs + len(logprobs or ())
        return chunk

    def finish(self, stamp: ModelStamp, trace: Trace | None) -> list[bytes]:
        """What streaming held back, then the finish chunk (carrying usage when `trace` is given: a
        lone choice without include_usage, as before)."""
        finish_reason = self.completion.finish_reason
        chunks = []
        for delta in _held_back(self.completion.text, self.sent, self.tools):
            chunks.append(_chunk(self, delta, None, stamp))
            finish_reason = "tool_calls" if "tool_calls" in delta else finish_reason
        summary = usage([self.completion], trace) if trace is not None else None
        return chunks + [_chunk(self, {}, finish_reason, stamp, summary)]


def _held_back(text: str, sent: int, tools: ToolFormat | None) -> list[dict]:
    """The deltas of what streaming held back: content before the first call, then the calls; or,
    when no call parsed, the rest as content."""
    if tools is None or sent >= len(text):
        return []
    _, calls = tools.parse(text)
    if not calls:
        return [{"content": text[sent:]}]
    end = sendable(text, tools)
    deltas = [{"content": text[sent:end]}] if end > sent else []
    return deltas + [{"tool_calls": [{"index": index, **call}]} for index, call in enumerate(tool_calls(calls))]


def _base(completion: Completion, kind: str, stamp: ModelStamp) -> dict:
    return {
        "id": completion.id,
        "object": kind,
        "created": completion.created,
        "model": stamp.name,
        "system_fingerprint": stamp.fingerprint[:16],
    }


def _chunk(
    choice: ChoiceStream,
    delta: dict,
    finish_reason: str | None,
    stamp: ModelStamp,
    summary: dict | None = None,
    logprobs: list[dict] | None = None,
) -> bytes:
    body = {
        **_base(choice.head, "chat.completion.chunk", stamp),
        "choices": [
            {
                "index": choice.index,
                "delta": delta,
                "finish_reason": finish_reason,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
            }
        ],
    }
    if summary is not None:
        body["usage"] = summary
    return _sse(body)


def error_chunks(error: ApiError) -> list[bytes]:
    """A stream's end on an error: the error's body as a data line (the client raises it), then [DONE]."""
    return [_sse(error.body()), b"data: [DONE]\n\n"]


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
