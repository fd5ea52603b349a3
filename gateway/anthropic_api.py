"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the body parsed
straight into the neutral ChatRequest, and the answer shaped as Anthropic's `message` or its SSE
events. Shaping and parsing only: the route is app.py's, the layers are the pipeline's.

    parse_messages_request(body, limits) -> ChatRequest
    message_body(id, model, completion, tools, usage) -> dict     the whole `message`
    MessageStream / stream_events(...) -> SSE bytes     message_start, content_block_start/delta/stop,
                                        message_delta, message_stop (the route sends PING while the
                                        prompt prefills)
    usage(completion, trace, pins) -> dict     input + cache_read + cache_creation tokens == the prompt

A conversation maps onto the chat form the engine renders: `system` first (its text blocks kept as
parts), `tool_use` blocks as the assistant's tool calls, each `tool_result` block as a tool message
in its place, images (base64 or URL) as image parts under the same limits and fetch rules as OpenAI's.
Earlier `thinking` blocks are not rendered again (as Anthropic drops them from earlier turns).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from .engine import Delta, Finished, ImagePart, Message, Pin, Sampling, TextPart, Tool, ToolCall, ToolFormat
from .errors import ApiError, anthropic_error, bad_request, echo
from .openai_format import Completion, sendable
from .schemas import (
    CacheBreakpoint,
    ChatRequest,
    checked_request,
    function_tool,
    is_int,
    number,
    parse_user,
    schema_json,
    typed,
    unique_tools,
)
from .settings import Limits
from .trace import Trace

# Fields that change an answer and that Strata does not implement, with the values that change nothing.
UNSUPPORTED_UNLESS: dict[str, tuple] = {
    "container": (None,),
    "mcp_servers": (None, []),
    "service_tier": (None, "auto", "standard_only"),
}
TTL_S = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # cache_control blocks per request, as Anthropic allows (each is a render of the prompt)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def parse_messages_request(body: dict[str, Any], limits: Limits) -> ChatRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: Field required (a string)", "invalid_type", "model")
    for field, neutral in UNSUPPORTED_UNLESS.items():
        if body.get(field) not in neutral:
            raise bad_request(f"{field}: not supported by this server (send it unset)", "unsupported_parameter", field)
    marks = _Breakpoints()
    tools = _tools(body.get("tools"), limits, marks)
    system = _system(body.get("system"), marks)
    conversation = _messages(body.get("messages"), limits, marks, len(system))
    if body.get("cache_control") is not None:  # the automatic form: a breakpoint after the last message
        marks.add(_ttl(body["cache_control"], "cache_control"), len(system) + len(conversation))
    metadata = typed(body, "metadata", dict, None) or {}
    return checked_request(
        limits,
        model=model,
        messages=(*system, *conversation),
        sampling=_sampling(body, limits),
        stream=typed(body, "stream", bool, False),
        include_usage=True,
        metadata={},
        user=_end_user(metadata.get("user_id"), limits),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        breakpoints=marks.sorted(),
        fit_max_tokens=True,
        thinking=_thinking(body.get("thinking")),
        response_format=_output_format(body.get("output_config"), limits),
    )


THINKING_TYPES = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}


def _thinking(raw: Any) -> bool | None:
    """The template's thinking switch: on for enabled/adaptive, off for disabled (templates without
    a switch answer as they always do; budget_tokens is counted within max_tokens, as Anthropic's)."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in THINKING_TYPES:
        raise bad_request(
            f"thinking.type: must be one of {', '.join(THINKING_TYPES)}; got {echo(kind)}", "invalid_value", "thinking"
        )
    return THINKING_TYPES[kind]


EFFORTS = (None, "low", "medium", "high", "xhigh", "max")


def _output_format(raw: Any, limits: Limits) -> dict | None:
    """output_config.format (a JSON schema the answer must follow) as the chat form's response
    format; `effort` is accepted and changes nothing (a local model has no effort setting)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("effort") not in EFFORTS:
        raise bad_request(
            "output_config: must be an object; effort one of low, medium, high, xhigh, max",
            "invalid_value",
            "output_config",
        )
    shape = raw.get("format")
    if shape is None:
        return None
    if not isinstance(shape, dict) or shape.get("type") != "json_schema":
        raise bad_request(
            'output_config.format: must be {"type": "json_schema", "schema": {...}}', "invalid_value", "output_config"
        )
    return {"type": "json_schema", "schema": schema_json("output_config.format.schema", shape.get("schema"), limits)}


def _end_user(raw: Any, limits: Limits) -> str | None:
    """metadata.user_id as the end user; one longer than the limit (agents put JSON with device,
    account and session ids there) stands as its digest rather than being refused."""
    if isinstance(raw, str) and len(raw) > limits.max_user_chars:
        return "sha256:" + hashlib.sha256(raw.encode()).hexdigest()[:32]
    return parse_user(raw, limits, "metadata.user_id")


class _Breakpoints:
    """`cache_control` marks found while parsing, as (messages through, TTL)."""

    def __init__(self) -> None:
        self.marks: dict[int, float] = {}
        self.num_blocks = 0  # blocks that carried a cache_control

    def add(self, ttl_s: float, num_messages: int) -> None:
        self.marks[num_messages] = max(ttl_s, self.marks.get(num_messages, 0.0))

    def add_block(self, ttl_s: float, num_messages: int) -> None:
        """A block's cache_control: at most MAX_BREAKPOINTS of them per request, as Anthropic's."""
        self.num_blocks += 1
        if self.num_blocks > MAX_BREAKPOINTS:
            raise bad_request(
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {self.num_blocks}.",
                "invalid_value",
                "cache_control",
            )
        self.add(ttl_s, num_messages)

    def sorted(self) -> tuple[CacheBreakpoint, ...]:
        return tuple(CacheBreakpoint(count, ttl) for count, ttl in sorted(self.marks.items()))


def _ttl(raw: Any, param: str) -> float:
    if not isinstance(raw, dict) or raw.get("type") != "ephemeral":
        raise bad_request(f'{param}: must be {{"type": "ephemeral", "ttl": "5m" | "1h"}}', "invalid_value", param)
    ttl = raw.get("ttl", "5m")
    if ttl not in TTL_S:
        raise bad_request(f"{param}.ttl: must be '5m' or '1h'; got {echo(ttl)}", "invalid_value", param)
    return TTL_S[ttl]


def _mark(block: dict, param: str, marks: _Breakpoints, num_messages: int) -> None:
    if block.get("cache_control") is not None:
        marks.add_block(_ttl(block["cache_control"], f"{param}.cache_control"), num_messages)


def _system(raw: Any, marks: _Breakpoints) -> tuple[Message, ...]:
    if raw is None or raw == "" or raw == []:
        return ()
    if isinstance(raw, str):
        return (Message("system", (TextPart(raw),)),)
    if not isinstance(raw, list):
        raise bad_request("system: must be a string or an array of text blocks", "invalid_type", "system")
    parts = []
    for index, block in enumerate(raw):
        param = f"system.{index}"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{param}: must be a text block", "invalid_type", param)
        _mark(block, param, marks, 1)
        parts.append(TextPart(block["text"]))
    return (Message("system", tuple(parts)),)


def _messages(raw: Any, limits: Limits, marks: _Breakpoints, offset: int) -> tuple[Message, ...]:
    """Anthropic turns as chat messages; `offset`: messages before them (the system message)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty array", "invalid_messages", "messages")
    if len(raw) > limits.max_messages:
        raise bad_request(f"messages: at most {limits.max_messages} messages", "too_many_messages", "messages")
    out: list[Message] = []
    for index, item in enumerate(raw):
        param = f"messages.{index}"
        role = item.get("role") if isinstance(item, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{param}.role: must be 'user' or 'assistant'; got {echo(role)}", "invalid_role", param)
        blocks = _blocks(item.get("content"), param, limits)
        if role == "assistant":
            out.append(_assistant(blocks, param))
        else:
            out.extend(_user(blocks, param))
        for position, block in enumerate(blocks):
            _mark(block, f"{param}.content.{position}", marks, offset + len(out))
    if out[-1].role == "assistant":
        raise bad_request(
            "messages: the last message must be the user's (a final assistant message, a response "
            "prefill, is not supported)",
            "invalid_messages",
            "messages",
        )
    return tuple(out)


def _blocks(raw: Any, param: str, limits: Limits) -> list[dict]:
    if isinstance(raw, str):
        return [{"type": "text", "text": raw}]
    if not isinstance(raw, list) or not all(isinstance(block, dict) for block in raw):
        raise bad_request(f"{param}.content: must be a string or an array of blocks", "invalid_type", param)
    if len(raw) > limits.max_parts_per_message:
        raise bad_request(f"{param}.content: at most {limits.max_parts_per_message} blocks", "too_many_parts", param)
    return raw


def _assistant(blocks: list[dict], param: str) -> Message:
    parts, calls = [], []
    for position, block in enumerate(blocks):
        where, kind = f"{param}.content.{position}", block.get("type")
        if kind == "text":
            parts.append(_text(block, where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind not in ("thinking", "redacted_thinking"):
            raise _unsupported_block(kind, where, "text, tool_use, thinking")
    return Message("assistant", tuple(parts) or (TextPart(""),), tuple(calls))


def _user(blocks: list[dict], param: str) -> list[Message]:
    """Tool results become tool messages where they stand; the other blocks one user message after them."""
    results, parts = [], []
    for position, block in enumerate(blocks):
        where, kind = f"{param}.content.{position}", block.get("type")
        if kind == "tool_result":
            results.append(_tool_result(block, where))
        elif kind in ("text", "image"):
            parts.append(_text(block, where) if kind == "text" else _image(block, where))
        else:
            raise _unsupported_block(kind, where, "text, image, tool_result")
    return results + ([Message("user", tuple(parts))] if parts or not results else [])


def _text(block: dict, param: str) -> TextPart:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{param}.text: must be a string", "invalid_type", param)
    return TextPart(block["text"])


def _image(block: dict, param: str) -> ImagePart:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_TYPES or not isinstance(data, str) or not data:
            raise bad_request(
                f"{param}.source: base64 images need 'data' and a 'media_type' of {', '.join(IMAGE_TYPES)}",
                "invalid_value",
                param,
            )
        return ImagePart(f"data:{media_type};base64,{data}")
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str) and source["url"]:
        return ImagePart(source["url"])
    raise bad_request(f"{param}.source: must be a base64 or url image source", "invalid_value", param)


def _tool_use(block: dict, param: str) -> ToolCall:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad_request(f"{param}: tool_use needs an 'id', a 'name' and an 'input' object", "invalid_type", param)
    return ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False))


def _tool_result(block: dict, param: str) -> Message:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{param}.tool_use_id: must be a string", "invalid_type", param)
    if isinstance(content, str):
        parts: tuple = (TextPart(content),)
    elif isinstance(content, list) and all(isinstance(part, dict) for part in content):
        parts = tuple(
            _image(part, f"{param}.content.{n}") if part.get("type") == "image" else _text(part, f"{param}.content.{n}")
            for n, part in enumerate(content)
        )
    else:
        raise bad_request(
            f"{param}.content: must be a string or an array of text and image blocks", "invalid_type", param
        )
    if block.get("is_error") is True:
        parts = (TextPart("Error: "), *parts)
    return Message("tool", parts or (TextPart(""),), tool_call_id=call_id)


def _unsupported_block(kind: Any, param: str, allowed: str) -> ApiError:
    return bad_request(
        f"{param}.type: {echo(kind)} is not supported here ({allowed})", "unsupported_content_type", param
    )


def _tools(raw: Any, limits: Limits, marks: _Breakpoints) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > limits.max_tools:
        raise bad_request(f"tools: must be an array of at most {limits.max_tools} tools", "invalid_type", "tools")
    tools = []
    for index, item in enumerate(raw):
        param = f"tools.{index}"
        if not isinstance(item, dict) or item.get("type", "custom") != "custom":
            kind = item.get("type") if isinstance(item, dict) else None
            raise bad_request(f"{param}: only custom tools are supported; got {echo(kind)}", "unsupported_tool", param)
        tools.append(function_tool(param, param, item, "input_schema", limits))
        _mark(item, param, marks, 0)
    return unique_tools(tools, "tools")


def _tool_choice(raw: Any, tools: tuple[Tool, ...]) -> str:
    """auto | any (a call to some tool) | tool (that one) | none, as the chat form says them."""
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any" and tools:
        return "required"
    if kind == "tool" and isinstance(raw, dict) and raw.get("name") in {tool.name for tool in tools}:
        return raw["name"]
    raise bad_request(
        'tool_choice: must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...} '
        f"naming one of the tools; got {echo(raw)}",
        "invalid_value",
        "tool_choice",
    )


def _sampling(body: dict[str, Any], limits: Limits) -> Sampling:
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or not is_int(max_tokens) or max_tokens < 1:
        raise bad_request("max_tokens: Field required (an integer of at least 1)", "invalid_value", "max_tokens")
    top_k = body.get("top_k", 0)
    if not is_int(top_k) or top_k < 0:
        raise bad_request("top_k: must be an integer of at least 0", "invalid_value", "top_k")
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("top_p: must be greater than 0", "invalid_value", "top_p")
    return Sampling(
        min(max_tokens, limits.max_output_tokens),
        number(body, "temperature", 1.0, 0.0, 1.0),
        top_p,
        None,
        _stop_sequences(body.get("stop_sequences"), limits),
        top_k=top_k,
    )


def _stop_sequences(raw: Any, limits: Limits) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise bad_request("stop_sequences: must be an array of non-empty strings", "invalid_type", "stop_sequences")
    if len(raw) > limits.max_stop_sequences:
        raise bad_request(f"stop_sequences: at most {limits.max_stop_sequences}", "invalid_value", "stop_sequences")
    return tuple(raw)


# -- the answer --------------------------------------------------------------------------------


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(completion: Completion, trace: Trace, pins: tuple[Pin, ...]) -> dict:
    """Anthropic's usage: tokens read from any cache tier (a whole prompt for a stored answer),
    tokens newly cached up to the last breakpoint (split by TTL), and the rest; the three add up to
    the prompt."""
    prompt = completion.prompt_tokens
    read = completion.cached_tokens if trace.served_by == "engine" else prompt
    cacheable = trace.served_by == "engine" and trace.outcomes["prefix"].status != "bypass"
    pinned: dict[float, int] = {}  # TTL -> the furthest prompt token its breakpoints reach
    for pin in pins if cacheable else ():
        pinned[pin.ttl_s] = max(pinned.get(pin.ttl_s, 0), min(pin.num_tokens, prompt))
    created: dict[float, int] = {}
    floor = read
    for ttl in sorted(pinned, reverse=True):  # 1h breakpoints come before 5m ones in a prompt
        created[ttl] = max(0, pinned[ttl] - floor)
        floor = max(floor, pinned[ttl])
    creation = sum(created.values())
    return {
        "input_tokens": prompt - read - creation,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": creation,
        "cache_creation": {
            "ephemeral_5m_input_tokens": created.get(TTL_S["5m"], 0),
            "ephemeral_1h_input_tokens": created.get(TTL_S["1h"], 0),
        },
        "output_tokens": completion.completion_tokens,
        "strata": trace.summary(),
    }


def content_blocks(completion: Completion, tools: ToolFormat | None) -> list[dict]:
    thought, answer = split_thinking(completion.text)
    text, calls = tools.parse(answer) if tools is not None else (answer, [])
    blocks: list[dict] = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought is not None else []
    blocks += [{"type": "text", "text": text}] if text or not (calls or blocks) else []
    return blocks + [_tool_use_block(call.name, call.arguments) for call in calls]


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_thinking(text: str) -> tuple[str | None, str]:
    """(the thinking, the answer) of a text that opens with <think>; (None, text) otherwise. An
    unclosed <think> (the answer was cut short) is all thinking."""
    opening = text.lstrip()
    if not opening.startswith(THINK_OPEN):
        return None, text
    thought, closed, answer = opening[len(THINK_OPEN) :].partition(THINK_CLOSE)
    return thought, answer.lstrip("\n") if closed else ""


def _partial_suffix(text: str, marker: str) -> int:
    """How many of text's last characters are the start of `marker` (held back: they may become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _tool_use_block(name: str, arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = {}
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": value}


def stop_reason(completion: Completion, blocks: list[dict]) -> tuple[str, str | None]:
    if any(block["type"] == "tool_use" for block in blocks):
        return "tool_use", None
    if completion.stop_sequence is not None:
        return "stop_sequence", completion.stop_sequence
    return STOP_REASONS.get(completion.finish_reason, "end_turn"), None


def message_body(message_id: str, model: str, completion: Completion, tools: ToolFormat | None, usage_: dict) -> dict:
    blocks = content_blocks(completion, tools)
    reason, sequence = stop_reason(completion, blocks)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_,
    }


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


PING = sse("ping", {"type": "ping"})


def error_event(exc: ApiError) -> bytes:
    return sse("error", anthropic_error(exc.status, exc.message))


class MessageStream:
    """The SSE events of one answer: a leading <think>...</think> as a thinking block, then the text
    as it comes (from where a tool call may start, held back with `tools`), then each parsed call as
    a tool_use block with its input as input_json_delta."""

    def __init__(self, message_id: str, model: str, completion: Completion, tools: ToolFormat | None):
        self.message_id = message_id
        self.model = model
        self.completion = completion
        self.tools = tools
        self.phase = "undecided"  # until the text shows whether it opens with <think>; then thinking, text
        self.answer_start = 0  # where the answer begins in the text (after the thinking)
        self.sent = 0  # characters of the text sent (thinking and answer)
        self.num_blocks = 0  # content blocks opened so far
        self.open_kind = ""  # the open block's type ("": none open)

    def start(self, usage_: dict) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage_, "output_tokens": 0},
        }
        return sse("message_start", {"type": "message_start", "message": message})

    def delta(self, final: bool = False) -> bytes:
        text = self.completion.text
        if self.phase == "undecided":
            opening = text.lstrip()
            if THINK_OPEN.startswith(opening) and not final:
                return b""  # may still become <think>
            self.phase = "thinking" if opening.startswith(THINK_OPEN) else "text"
            if self.phase == "thinking":
                self.sent = text.index(THINK_OPEN) + len(THINK_OPEN)
        out = self._thinking(text, final) if self.phase == "thinking" else b""
        if self.phase == "text":
            if self.answer_start and self.sent == self.answer_start:  # newlines after </think> are not the answer
                self.answer_start = self.sent = len(text) - len(text[self.sent :].lstrip("\n"))
            end = self.answer_start + sendable(text[self.answer_start :], self.tools)
            out += self._piece("text", text[self.sent : end]) if end > self.sent else b""
        return out

    def _thinking(self, text: str, final: bool) -> bytes:
        """Thinking deltas up to </think> (a part of it at the end held back); at </think>, the
        block closes and the answer starts after it."""
        close = text.find(THINK_CLOSE, self.sent)
        end = close if close >= 0 else (len(text) if final else len(text) - _partial_suffix(text, THINK_CLOSE))
        out = self._piece("thinking", text[self.sent : end]) if end > self.sent else b""
        if close < 0 and not final:
            return out
        out += self._piece("thinking", "") if not self.open_kind else b""
        out += self._close()
        rest = close + len(THINK_CLOSE) if close >= 0 else len(text)
        self.answer_start = self.sent = rest + len(text[rest:]) - len(text[rest:].lstrip("\n"))
        self.phase = "text"
        return out

    def _piece(self, kind: str, piece: str) -> bytes:
        out = b""
        if self.open_kind != kind:
            out += self._close()
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            out += sse(
                "content_block_start",
                {"type": "content_block_start", "index": self.num_blocks, "content_block": block},
            )
            self.open_kind = kind
            self.num_blocks += 1
        self.sent += len(piece)
        delta = (
            {"type": "text_delta", "text": piece} if kind == "text" else {"type": "thinking_delta", "thinking": piece}
        )
        return out + sse(
            "content_block_delta", {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta}
        )

    def _close(self) -> bytes:
        if not self.open_kind:
            return b""
        out = b""
        if self.open_kind == "thinking":  # a local model's thinking carries no signature
            signature = {"type": "signature_delta", "signature": ""}
            out += sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": signature},
            )
        self.open_kind = ""
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": self.num_blocks - 1})

    def finish(self, usage_: dict) -> bytes:
        """What was held back, the tool calls, then message_delta (stop reason, usage) and message_stop."""
        out = self.delta(final=True)
        text = self.completion.text
        answer = text[self.answer_start :]
        calls = self.tools.parse(answer)[1] if self.tools is not None and self.sent < len(text) else []
        end = self.answer_start + (sendable(answer, self.tools) if calls else len(answer))
        out += self._piece("text", text[self.sent : end]) if end > self.sent else b""
        if not self.num_blocks and not calls:
            out += self._piece("text", "")
        out += self._close()
        blocks = [_tool_use_block(call.name, call.arguments) for call in calls]
        for block in blocks:
            out += self._tool_use(block)
        reason, sequence = stop_reason(self.completion, blocks)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out += sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_})
        return out + sse("message_stop", {"type": "message_stop"})

    def _tool_use(self, block: dict) -> bytes:
        index, self.num_blocks = self.num_blocks, self.num_blocks + 1
        opened = {**block, "input": {}}
        partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        return (
            sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": opened})
            + sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": partial})
            + sse("content_block_stop", {"type": "content_block_stop", "index": index})
        )


async def stream_events(events: AsyncGenerator, stream: MessageStream, usage_of) -> AsyncGenerator[bytes, None]:
    """The answer's events as Anthropic SSE; `usage_of()` gives the usage once the answer is whole.
    An error mid-answer ends the stream with an `error` event; closing it early closes `events`."""
    try:
        async for _, event in events:
            if isinstance(event, Delta) and (chunk := stream.delta()):
                yield chunk
            elif isinstance(event, Finished):
                yield stream.finish(usage_of())
    except ApiError as exc:
        yield error_event(exc)
    finally:
        await events.aclose()
