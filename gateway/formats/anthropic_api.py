"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the body parsed
straight into the neutral ChatRequest, and the answer shaped as Anthropic's `message` or its SSE
events. Shaping and parsing only: the route is app.py's, the layers are the pipeline's.

    parse_messages_request(body, limits) -> ChatRequest
    diagnostics_asked(body) -> (asked, previous message id)   cache diagnostics (cache_diagnostics.py)
    message_body(stream, usage) -> dict     the whole `message`
    MessageStream / stream_events(...) -> SSE bytes     message_start, content_block_start/delta/stop,
                                        message_delta, message_stop (the route sends PING while the
                                        prompt prefills)
    usage(completion, trace, pins) -> dict     input + cache_read + cache_creation tokens == the prompt

A conversation maps onto the chat form the engine renders: `system` first (its text blocks kept as
parts), system messages inside `messages` where they stand (Claude Code sends its environment block
there; the template renders them in place or folds them into a neighbouring user turn), `tool_use`
blocks as the assistant's tool calls, each `tool_result` block as a tool message in its place, images
(base64 or URL) as image parts under the same limits and fetch rules as OpenAI's. Earlier `thinking`
blocks go to the template as the turn's reasoning (templates that render it decide where; a
clear_thinking edit drops all but the latest). Fields and blocks with no meaning here are accepted and
named in X-Strata-Ignored, never refused.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from ..engine import (
    Delta,
    Finished,
    ImagePart,
    Message,
    Pin,
    Sampling,
    Switches,
    TextPart,
    Tool,
    ToolCall,
    ToolFormat,
    tools_text,
)
from ..observability.trace import Trace
from ..requests.errors import ApiError, anthropic_error, bad_request, echo
from ..requests.schemas import (
    CacheBreakpoint,
    ChatRequest,
    checked_request,
    function_tool,
    ignored_fields,
    is_int,
    not_offered,
    number,
    output_tokens,
    parse_user,
    schema_json,
    shown_name,
    typed,
    unique_tools,
)
from ..requests.shapes import BOOL, INT, NUM, OBJECT, STR, Checked, Either, List, Obj, Tagged, check
from ..settings import Limits
from .openai_format import THINK_CLOSE, THINK_OPEN, Completion, partial_suffix, sendable, split_thinking

# Fields of the Messages API acted on here (see parse_messages_request); the others' values that change
# nothing. Any other field is ignored and named in X-Strata-Ignored (never a 400).
MESSAGE_FIELDS = frozenset(
    (
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "cache_control",
        "context_management",
        "diagnostics",
    )
)
MESSAGE_NEUTRAL: dict[str, tuple] = {
    "service_tier": ("auto", "standard_only"),
    "mcp_servers": ([],),
    "speed": ("standard",),
}
TTL_S = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # cache_control blocks per request, as Anthropic allows (each is a render of the prompt)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
THINKING_TYPES = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}
THINKING_DISPLAYS = ("summarized", "omitted")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
CLEAR_THINKING = "clear_thinking_20251015"  # the context-management edit that drops earlier thinking


# The type of every field and block the parser reads (gateway/requests/shapes.py checks them first).
CACHE_CONTROL = Obj({"type": STR, "ttl": STR})
TEXT_BLOCK = Obj({"text": STR, "cache_control": CACHE_CONTROL})
TEXT_ONLY = Obj({"text": STR})
SOURCE = Obj({"type": STR, "media_type": STR, "data": STR, "url": STR})
RESULT_BLOCK = Tagged(  # what a tool result, or a user message, may hold
    {
        "text": TEXT_BLOCK,
        "image": Obj({"source": SOURCE, "cache_control": CACHE_CONTROL}),
        "document": Obj(
            {
                "source": Obj({"type": STR, "data": STR, "content": List(TEXT_ONLY)}),
                "title": STR,
                "cache_control": CACHE_CONTROL,
            }
        ),
        "search_result": Obj({"title": STR, "source": STR, "content": List(TEXT_ONLY), "cache_control": CACHE_CONTROL}),
        "tool_reference": Obj({"tool_name": STR, "cache_control": CACHE_CONTROL}),
    },
    other=Obj({"cache_control": CACHE_CONTROL}),
)
BLOCK = Tagged(
    {
        **RESULT_BLOCK.kinds,
        "tool_use": Obj({"id": STR, "name": STR, "input": OBJECT, "cache_control": CACHE_CONTROL}),
        "tool_result": Obj(
            {
                "tool_use_id": STR,
                "content": Either((STR, List(RESULT_BLOCK))),
                "is_error": BOOL,
                "cache_control": CACHE_CONTROL,
            }
        ),
        "thinking": Obj({"thinking": STR, "signature": STR}),
    },
    other=Obj({"cache_control": CACHE_CONTROL}),
)
CUSTOM_TOOL = Obj(
    {"name": STR, "description": STR, "input_schema": OBJECT, "defer_loading": BOOL, "cache_control": CACHE_CONTROL}
)
MESSAGE_SHAPE = Checked(
    Obj(
        {
            "model": STR,
            "messages": List(Obj({"role": STR, "content": Either((STR, List(BLOCK)))})),
            "max_tokens": INT,
            "system": Either((STR, List(TEXT_BLOCK))),
            "stop_sequences": List(STR),
            "stream": BOOL,
            "temperature": NUM,
            "top_p": NUM,
            "top_k": INT,
            "metadata": Obj({"user_id": STR}),
            "tools": List(Tagged({"custom": CUSTOM_TOOL}, missing="custom")),
            "tool_choice": Obj({"type": STR, "name": STR, "disable_parallel_tool_use": BOOL}),
            "thinking": Obj({"type": STR, "display": STR, "budget_tokens": INT}),
            "output_config": Obj({"effort": STR, "format": Obj({"type": STR, "schema": OBJECT})}),
            "cache_control": CACHE_CONTROL,
            "context_management": Obj(
                {"edits": List(Obj({"type": STR, "keep": Either((STR, Obj({"type": STR, "value": INT})))}))}
            ),
            "diagnostics": Obj({"previous_message_id": STR}),
        }
    ),
    codes={"messages": "invalid_messages"},
)


def parse_messages_request(body: dict[str, Any], limits: Limits) -> ChatRequest:
    """The Messages API body as the neutral request. Honoured beyond the plain fields: system messages
    inside `messages` (kept where they stand), `thinking` (the template's switch; display "omitted"),
    `output_config` (effort, format), `context_management` edits that clear earlier thinking,
    `defer_loading` tools (offered once a tool_reference loads them), `tool_choice`'s
    disable_parallel_tool_use, and Claude Code's `metadata.user_id` JSON (its session id is the session)."""
    check(body, MESSAGE_SHAPE, "anthropic")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: Field required (a string)", "invalid_type", "model")
    ignored = ignored_fields(body, MESSAGE_FIELDS, MESSAGE_NEUTRAL)
    marks = _Breakpoints()
    tools, deferred = _tools(body.get("tools"), limits, marks, ignored)
    system = _system(body.get("system"), marks)
    keep_thinking = _kept_thinking_turns(body.get("context_management"), ignored)
    turns = _Turns(limits, marks, len(system), {tool.name: tool for tool in (*tools, *deferred)}, ignored)
    conversation = _keep_thinking(turns.parse(body.get("messages")), keep_thinking)
    loaded = tuple(tool for tool in deferred if tool.name in turns.loaded)
    if body.get("cache_control") is not None:  # the automatic form: a breakpoint after the last message
        marks.add(_ttl(body["cache_control"], "cache_control"), len(system) + len(conversation))
    end_user, session = _user_and_session(typed(body, "metadata", dict, None) or {}, limits, ignored)
    thinking, show_thinking = _thinking(body.get("thinking"))
    effort, response_format = _output_config(body.get("output_config"), limits, ignored)
    tool_choice, max_calls = _tool_choice(body.get("tool_choice"), tools, deferred)
    if body.get("max_tokens") is None:  # required by the Messages API (chat completions have a default)
        raise bad_request("max_tokens: Field required (an integer of at least 1)", "invalid_value", "max_tokens")
    max_tokens, asked = output_tokens(body["max_tokens"], "max_tokens", limits)
    return checked_request(
        limits,
        model=model,
        messages=(*system, *conversation),
        sampling=_sampling(body, limits, max_tokens),
        stream=typed(body, "stream", bool, False),
        include_usage=True,
        metadata={"session_id": session} if session else {},
        user=end_user,
        tools=tools,
        inline_tools=loaded + tuple(tool for tool in deferred if tool.name == tool_choice and tool not in loaded),
        tool_choice=tool_choice,
        breakpoints=marks.sorted(),
        max_tokens_asked=asked,
        switches=Switches(thinking=thinking, effort=effort),
        max_tool_calls=max_calls,
        show_thinking=show_thinking,
        response_format=response_format,
        ignored=tuple(ignored),
    )


MAX_MESSAGE_ID_CHARS = 256


def diagnostics_asked(body: dict[str, Any]) -> tuple[bool, str | None]:
    """`diagnostics`: (whether the request asks for them, the previous message's id; None on a first
    turn, which opts in with `previous_message_id: null`)."""
    raw = body.get("diagnostics")
    if raw is None:
        return False, None
    previous = raw.get("previous_message_id") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or (
        previous is not None and (not isinstance(previous, str) or len(previous) > MAX_MESSAGE_ID_CHARS)
    ):
        raise bad_request(
            f'diagnostics: must be {{"previous_message_id": a message id of at most {MAX_MESSAGE_ID_CHARS} '
            "characters, or null}",
            "invalid_value",
            "diagnostics",
        )
    return True, previous


def _thinking(raw: Any) -> tuple[bool | None, bool]:
    """(The template's thinking switch: on for enabled/adaptive, off for disabled, None when not sent;
    whether thinking text goes out: display "omitted" sends thinking blocks empty). budget_tokens is
    counted within max_tokens, as Anthropic's."""
    if raw is None:
        return None, True
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in THINKING_TYPES:
        raise bad_request(
            f"thinking.type: must be one of {', '.join(THINKING_TYPES)}; got {echo(kind)}", "invalid_value", "thinking"
        )
    assert isinstance(raw, dict)
    display, budget = raw.get("display"), raw.get("budget_tokens")
    if display is not None and (not isinstance(display, str) or display not in THINKING_DISPLAYS):
        raise bad_request("thinking.display: must be 'summarized' or 'omitted'", "invalid_value", "thinking")
    if budget is not None and (not is_int(budget) or budget < 0):
        raise bad_request("thinking.budget_tokens: must be an integer", "invalid_value", "thinking")
    return THINKING_TYPES[kind], display != "omitted"


def _output_config(raw: Any, limits: Limits, ignored: list[str]) -> tuple[str | None, dict | None]:
    """output_config: (effort, the template's effort switch or thinking; format: a JSON schema the
    answer follows, as the chat form's response format)."""
    if raw is None:
        return None, None
    effort = raw.get("effort") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or (effort is not None and (not isinstance(effort, str) or effort not in EFFORTS)):
        raise bad_request(
            f"output_config: must be an object; effort one of {', '.join(EFFORTS)}", "invalid_value", "output_config"
        )
    ignored.extend(f"output_config.{name}" for name in ignored_fields(raw, ("effort", "format"), {}))
    shape = raw.get("format")
    if shape is None:
        return effort, None
    if not isinstance(shape, dict) or shape.get("type") != "json_schema":
        raise bad_request(
            'output_config.format: must be {"type": "json_schema", "schema": {...}}', "invalid_value", "output_config"
        )
    schema = schema_json("output_config.format.schema", shape.get("schema"), limits)
    return effort, {"type": "json_schema", "schema": schema}


def _user_and_session(metadata: dict[str, Any], limits: Limits, ignored: list[str]) -> tuple[str | None, str]:
    """metadata.user_id: the end user. Claude Code sends a JSON object there (its device and account
    ids and its session id): the session id is then the request's session (sessions are purged and
    expired as one) and the rest the end user, so one person's sessions stay one end user."""
    ignored.extend(f"metadata.{shown_name(name)}" for name in metadata if name != "user_id")
    raw = metadata.get("user_id")
    fields = _json_object(raw) or {}
    session = fields.get("session_id")
    if not isinstance(session, str) or not session:
        return _end_user(raw, limits), ""
    rest = {key: value for key, value in sorted(fields.items()) if key != "session_id" and value}
    return (_digest(json.dumps(rest)) if rest else None), _bounded(session, limits)


def _json_object(raw: Any) -> dict | None:
    if not isinstance(raw, str) or not raw.startswith("{"):
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _end_user(raw: Any, limits: Limits) -> str | None:
    """metadata.user_id as the end user; one longer than the limit stands as its digest rather than
    being refused."""
    if isinstance(raw, str) and len(raw) > limits.max_user_chars:
        return _digest(raw)
    return parse_user(raw, limits, "metadata.user_id")


def _bounded(text: str, limits: Limits) -> str:
    return text if len(text) <= limits.max_user_chars else _digest(text)


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _kept_thinking_turns(raw: Any, ignored: list[str]) -> int | None:
    """How many of the latest assistant turns keep their thinking, by a clear_thinking edit (keep
    "all", or {"type": "thinking_turns", "value": N}; 1 when it says nothing); None: every turn keeps
    it (the template decides what it renders). Other edits (clearing tool results) are not done here."""
    if raw is None:
        return None
    edits = raw.get("edits", []) if isinstance(raw, dict) else None
    if not isinstance(edits, list) or not all(isinstance(edit, dict) for edit in edits):
        raise bad_request("context_management.edits: must be an array of edits", "invalid_type", "context_management")
    kept = None
    for index, edit in enumerate(edits):
        if edit.get("type") != CLEAR_THINKING:
            ignored.append(f"context_management.edits.{index} ({shown_name(edit.get('type'))})")
            continue
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all":
            continue
        value = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad_request(
                'context_management: keep must be "all" or {"type": "thinking_turns", "value": N}',
                "invalid_value",
                "context_management",
            )
        kept = value
    return kept


def _keep_thinking(messages: tuple[Message, ...], keep: int | None) -> tuple[Message, ...]:
    """The conversation with thinking left only on the latest `keep` assistant turns that have it."""
    if keep is None:
        return messages
    thinking = [i for i, m in enumerate(messages) if m.reasoning]
    dropped = set(thinking[: max(len(thinking) - keep, 0)])
    return tuple(replace(m, reasoning="") if i in dropped else m for i, m in enumerate(messages))


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
    ttl = raw.get("ttl", "5m") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "ephemeral":
        raise bad_request(f'{param}: must be {{"type": "ephemeral", "ttl": "5m" | "1h"}}', "invalid_value", param)
    if not isinstance(ttl, str) or ttl not in TTL_S:
        raise bad_request(f"{param}.ttl: must be '5m' or '1h'; got {echo(ttl)}", "invalid_value", param)
    return TTL_S[ttl]


def _mark(block: dict, param: str, marks: _Breakpoints, num_messages: int) -> None:
    if block.get("cache_control") is not None:
        marks.add_block(_ttl(block["cache_control"], f"{param}.cache_control"), num_messages)


def _system(raw: Any, marks: _Breakpoints) -> tuple[Message, ...]:
    if raw is None or raw == "" or raw == []:
        return ()
    return (_system_message(raw, "system", marks, 1),)


def _system_message(raw: Any, param: str, marks: _Breakpoints, num_messages: int) -> Message:
    """A system prompt (a string or text blocks); its blocks' cache_control marks the prompt through
    its first `num_messages` messages."""
    if isinstance(raw, str):
        return Message("system", (TextPart(raw),))
    if not isinstance(raw, list):
        raise bad_request(f"{param}: must be a string or an array of text blocks", "invalid_type", param)
    parts = []
    for index, block in enumerate(raw):
        where = f"{param}.{index}"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}: must be a text block", "invalid_type", where)
        _mark(block, where, marks, num_messages)
        parts.append(TextPart(block["text"]))
    return Message("system", tuple(parts) or (TextPart(""),))


class _Turns:
    """The Messages API's turns as chat messages: `tool_use` blocks as the assistant's calls, each
    `tool_result` as a tool message in its place (a tool_reference in it loads the tool it names),
    thinking as the assistant message's reasoning, system messages where they stand. Blocks of a
    kind the model cannot take (server tools' results, PDF documents) are left out and named."""

    def __init__(self, limits: Limits, marks: _Breakpoints, offset: int, tools: dict[str, Tool], ignored: list[str]):
        self.limits = limits
        self.marks = marks
        self.offset = offset  # messages before the conversation (the system prompt)
        self.tools = tools  # every tool by name, deferred ones too (a tool_reference renders its definition)
        self.ignored = ignored
        self.loaded: set[str] = set()  # tools a tool_reference named: deferred ones are callable from there

    def parse(self, raw: Any) -> tuple[Message, ...]:
        if not isinstance(raw, list) or not raw:
            raise bad_request("messages: must be a non-empty array", "invalid_messages", "messages")
        if len(raw) > self.limits.max_messages:
            raise bad_request(f"messages: at most {self.limits.max_messages} messages", "too_many_messages", "messages")
        out: list[Message] = []
        for index, item in enumerate(raw):
            self._turn(index, item, out)
        if out[-1].role == "assistant" or all(message.role == "system" for message in out):
            raise bad_request(
                "messages: the last message must be the user's (a final assistant message, a response "
                "prefill, is not supported)",
                "invalid_messages",
                "messages",
            )
        return tuple(out)

    def _turn(self, index: int, item: Any, out: list[Message]) -> None:
        param = f"messages.{index}"
        role = item.get("role") if isinstance(item, dict) else None
        if not isinstance(role, str) or role not in ("user", "assistant", "system"):
            raise bad_request(
                f"{param}.role: must be 'user', 'assistant' or 'system'; got {echo(role)}", "invalid_role", param
            )
        assert isinstance(item, dict)
        if role == "system":  # Claude Code's mid-conversation system messages, kept where they stand
            out.append(_system_message(item.get("content"), f"{param}.content", self.marks, self.offset + len(out) + 1))
            return
        blocks = _blocks(item.get("content"), param, self.limits)
        out.extend(self._assistant(blocks, param) if role == "assistant" else self._user(blocks, param))
        for position, block in enumerate(blocks):
            _mark(block, f"{param}.content.{position}", self.marks, self.offset + len(out))

    def _assistant(self, blocks: list[dict], param: str) -> list[Message]:
        parts, calls, thoughts = [], [], []
        for position, block in enumerate(blocks):
            where, kind = f"{param}.content.{position}", block.get("type")
            if kind == "text":
                parts.append(_text(block, where))
            elif kind == "tool_use":
                calls.append(_tool_use(block, where))
            elif kind == "thinking":
                thoughts.append(_string(block, "thinking", where))
            elif kind != "redacted_thinking":
                self._skip(kind, where)
        return [Message("assistant", tuple(parts) or (TextPart(""),), tuple(calls), reasoning="".join(thoughts))]

    def _user(self, blocks: list[dict], param: str) -> list[Message]:
        """Tool results become tool messages where they stand; the other blocks one user message after them."""
        results, parts = [], []
        for position, block in enumerate(blocks):
            where, kind = f"{param}.content.{position}", block.get("type")
            if kind == "tool_result":
                results.append(self._tool_result(block, where))
            elif (part := self._content(block, where)) is not None:
                parts.append(part)
        return results + ([Message("user", tuple(parts))] if parts or not results else [])

    def _content(self, block: dict, where: str) -> TextPart | ImagePart | None:
        """A user block (or a block of a tool result) as a part; None when it is left out."""
        kind = block.get("type")
        if kind == "text":
            return _text(block, where)
        if kind == "image":
            return _image(block, where)
        if kind == "document":
            return self._document(block, where)
        if kind == "search_result":
            texts = [_text(part, where).text for part in _text_blocks(block.get("content"), where)]
            heading = [str(block.get(key)) for key in ("title", "source") if isinstance(block.get(key), str)]
            return TextPart("\n".join(heading + texts))
        if kind == "tool_reference":
            return self._tool_reference(block, where)
        self._skip(kind, where)
        return None

    def _document(self, block: dict, where: str) -> TextPart | None:
        """A plain-text document as text (its title first); a PDF or a URL cannot be read here."""
        source = block.get("source")
        if not isinstance(source, dict) or not isinstance(source.get("type"), str):
            raise bad_request(f"{where}.source: must be a document source with a type", "invalid_value", where)
        title = block.get("title") if isinstance(block.get("title"), str) else ""
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            return TextPart(f"{title}\n{source['data']}" if title else source["data"])
        if source.get("type") == "content":
            texts = [_text(part, where).text for part in _text_blocks(source.get("content"), where)]
            return TextPart("\n".join(([title] if title else []) + texts))
        self.ignored.append(f"{where} (document: {shown_name(source.get('type'))} source)")
        return None

    def _tool_reference(self, block: dict, where: str) -> TextPart | None:
        """A tool search's result: the tool's definition, where it stands (the prompt before it is
        unchanged, so its prefix stays cached; a deferred tool is offered from here on)."""
        name = block.get("tool_name")
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            self.ignored.append(f"{where} (tool_reference to a tool not in tools)")
            return None
        self.loaded.add(tool.name)
        return TextPart(tools_text((tool,)))

    def _tool_result(self, block: dict, where: str) -> Message:
        call_id, content = block.get("tool_use_id"), block.get("content", "")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.tool_use_id: must be a string", "invalid_type", where)
        if isinstance(content, str):
            parts: tuple = (TextPart(content),)
        elif isinstance(content, list) and all(isinstance(part, dict) for part in content):
            found = (self._content(part, f"{where}.content.{n}") for n, part in enumerate(content))
            parts = tuple(part for part in found if part is not None)
        else:
            raise bad_request(f"{where}.content: must be a string or an array of content blocks", "invalid_type", where)
        if block.get("is_error") is True:
            parts = (TextPart("Error: "), *parts)
        return Message("tool", parts or (TextPart(""),), tool_call_id=call_id)

    def _skip(self, kind: Any, where: str) -> None:
        if not isinstance(kind, str):
            raise bad_request(f"{where}.type: must be a string", "invalid_type", where)
        self.ignored.append(f"{where} ({shown_name(kind)})")


def _blocks(raw: Any, param: str, limits: Limits) -> list[dict]:
    if isinstance(raw, str):
        return [{"type": "text", "text": raw}]
    if not isinstance(raw, list) or not all(isinstance(block, dict) for block in raw):
        raise bad_request(f"{param}.content: must be a string or an array of blocks", "invalid_type", param)
    if len(raw) > limits.max_parts_per_message:
        raise bad_request(f"{param}.content: at most {limits.max_parts_per_message} blocks", "too_many_parts", param)
    return raw


def _text_blocks(raw: Any, param: str) -> list[dict]:
    if not isinstance(raw, list) or not all(isinstance(block, dict) for block in raw):
        raise bad_request(f"{param}.content: must be an array of text blocks", "invalid_type", param)
    return raw


def _text(block: dict, param: str) -> TextPart:
    return TextPart(_string(block, "text", param))


def _string(block: dict, key: str, param: str) -> str:
    if not isinstance(block.get(key), str):
        raise bad_request(f"{param}.{key}: must be a string", "invalid_type", param)
    return block[key]


def _image(block: dict, param: str) -> ImagePart:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or media_type not in IMAGE_TYPES or not isinstance(data, str) or not data:
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


def _tools(
    raw: Any, limits: Limits, marks: _Breakpoints, ignored: list[str]
) -> tuple[tuple[Tool, ...], tuple[Tool, ...]]:
    """(The tools the prompt offers, the deferred ones: `defer_loading` tools stay out of the prompt
    until a tool_reference loads them). Server tools (web search, code execution...) and Anthropic's
    schema-less client tools are not offered: they are named in `ignored`."""
    if raw is None:
        return (), ()
    if not isinstance(raw, list) or len(raw) > limits.max_tools:
        raise bad_request(f"tools: must be an array of at most {limits.max_tools} tools", "invalid_type", "tools")
    offered: list[Tool] = []
    deferred: list[Tool] = []
    for index, item in enumerate(raw):
        param = f"tools.{index}"
        kind = item.get("type", "custom") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(kind, str):
            raise bad_request(f"{param}: must be a tool object", "invalid_type", param)
        if kind != "custom":
            ignored.append(not_offered(param, kind))
            continue
        tool = function_tool(param, param, item, "input_schema", limits)
        (deferred if item.get("defer_loading") is True else offered).append(tool)
        _mark(item, param, marks, 0)
    unique_tools([*offered, *deferred], "tools")
    return tuple(offered), tuple(deferred)


def _tool_choice(raw: Any, tools: tuple[Tool, ...], deferred: tuple[Tool, ...]) -> tuple[str, int | None]:
    """(auto | any (a call to some tool) | tool (that one) | none, as the chat form says them; 1 when
    disable_parallel_tool_use keeps the answer to one call, else None)."""
    if raw is None:
        return "auto", None
    kind = raw.get("type") if isinstance(raw, dict) else None
    name = raw.get("name") if isinstance(raw, dict) else None
    once = isinstance(raw, dict) and raw.get("disable_parallel_tool_use") is True
    names = {tool.name for tool in (*tools, *deferred)}
    if kind in ("auto", "none"):
        return str(kind), 1 if once else None
    if kind == "any" and tools:
        return "required", 1 if once else None
    if kind == "tool" and isinstance(name, str) and name in names:
        return name, 1 if once else None
    raise bad_request(
        'tool_choice: must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...} '
        f"naming one of the tools; got {echo(raw)}",
        "invalid_value",
        "tool_choice",
    )


def _sampling(body: dict[str, Any], limits: Limits, max_tokens: int) -> Sampling:
    top_k = body.get("top_k", 0)
    if not is_int(top_k) or top_k < 0:
        raise bad_request("top_k: must be an integer of at least 0", "invalid_value", "top_k")
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("top_p: must be greater than 0", "invalid_value", "top_p")
    return Sampling(
        max_tokens,
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


def content_blocks(completion: Completion, tools: ToolFormat | None, show_thinking: bool = True) -> list[dict]:
    thought, answer = split_thinking(completion.text)
    text, calls = tools.parse(answer) if tools is not None else (answer, [])
    shown = thought if show_thinking else ""
    blocks: list[dict] = [{"type": "thinking", "thinking": shown, "signature": ""}] if thought is not None else []
    blocks += [{"type": "text", "text": text}] if text or not (calls or blocks) else []
    return blocks + [_tool_use_block(call.name, call.arguments) for call in calls]


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


def message_body(stream: MessageStream, usage_: dict) -> dict:
    """The whole `message` of a finished answer (with `diagnostics` when the request asked for them)."""
    blocks = content_blocks(stream.completion, stream.tools, stream.show_thinking)
    reason, sequence = stop_reason(stream.completion, blocks)
    return stream.header() | {"content": blocks, "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


PING = sse("ping", {"type": "ping"})


def error_event(exc: ApiError) -> bytes:
    return sse("error", anthropic_error(exc.status, exc.message))


class MessageStream:
    """The SSE events of one answer: a leading <think>...</think> as a thinking block, then the text
    as it comes (from where a tool call may start, held back with `tools`), then each parsed call as
    a tool_use block with its input as input_json_delta."""

    def __init__(
        self,
        message_id: str,
        model: str,
        completion: Completion,
        tools: ToolFormat | None,
        show_thinking: bool = True,
        diagnostics: dict | None = None,
    ):
        self.message_id = message_id
        self.model = model
        self.completion = completion
        self.tools = tools
        self.show_thinking = show_thinking  # False: thinking blocks open and close with no text (display "omitted")
        self.diagnostics = diagnostics  # the `diagnostics` object, when the request asked for one
        self.phase = "undecided"  # until the text shows whether it opens with <think>; then thinking, text
        self.answer_start = 0  # where the answer begins in the text (after the thinking)
        self.sent = 0  # characters of the text sent (thinking and answer)
        self.num_blocks = 0  # content blocks opened so far
        self.open_kind = ""  # the open block's type ("": none open)

    def header(self) -> dict[str, Any]:
        """The message's fields that are known before its content."""
        header: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model}
        return header | ({"diagnostics": self.diagnostics} if self.diagnostics is not None else {})

    def start(self, usage_: dict) -> bytes:
        message = self.header() | {
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
        end = close if close >= 0 else (len(text) if final else len(text) - partial_suffix(text, THINK_CLOSE))
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
        if piece and kind == "thinking" and not self.show_thinking:
            return out
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
