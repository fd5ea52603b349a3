"""Parse and validate an OpenAI chat-completions body into the neutral request type, ChatRequest.

ChatRequest is what every front end parses into (OpenAI chat here, Anthropic messages in
anthropic_api.py, both ending in `checked_request`); the caches' keys are computed from it, so the
same conversation sent through either API shares its exact, semantic and prefix entries.

Every rejection is an ApiError(400) naming the offending parameter; nothing here touches images'
bytes (decoding is CPU work done later, off the event loop). Cheap checks come first: nesting depth,
string encodability, counts of messages and parts, and the text's byte size, so an oversized prompt
is refused before anything tokenises it. Large bodies are parsed off the event loop (app.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from ..engine import ImagePart, Message, Sampling, Switches, TextPart, Tool, ToolCall
from ..settings import Limits
from .errors import bad_request, echo
from .shapes import BOOL, INT, NUM, OBJECT, STR, Checked, Either, List, Obj, Tagged, check

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    """A prefix the client asked to keep (Anthropic `cache_control`, OpenAI `prompt_cache_retention`):
    the prompt through its first `num_messages` messages (tools and system come first), for ttl_s."""

    num_messages: int
    ttl_s: float
    on_ssd: bool = False  # kept on the SSD tier, not in RAM


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    sampling: Sampling
    stream: bool
    include_usage: bool
    metadata: dict[str, str]
    uses_tools: bool = False  # tools offered, or tool results or tool calls in the conversation
    user: str | None = None  # the OpenAI `user` field: the end user, when the app names one
    num_text_bytes: int = 0  # UTF-8 bytes of all client text (parts, calls, tools): bounds the token count from below
    tools: tuple[Tool, ...] = ()
    # "auto" | "none" | "required" | a function's name (that call is forced)
    tool_choice: str = "auto"
    response_format: dict | None = None  # {"type": "json_object"} or {"type": "json_schema", ...}; None: text
    n: int = 1
    breakpoints: tuple[CacheBreakpoint, ...] = ()  # in prompt order: pinned prefixes, shortest first
    # A client's max_tokens is the most it takes, not a demand: sampling.max_tokens is it within the
    # server's output limit, lowered again to the context left (agents send 32,000 or 128,000 whatever
    # the model); this is what the client asked (0: it left max_tokens out), to say so when lowered.
    max_tokens_asked: int = 0
    switches: Switches = Switches()  # what the request asks of the template's thinking and effort switches
    max_tool_calls: int | None = None  # calls one answer may make (1: parallel calls off); None: any
    show_thinking: bool = True  # False: thinking blocks go out empty (Anthropic thinking.display "omitted")
    prediction: str | None = None  # the answer the client expects (OpenAI `prediction`): a draft to verify
    # Tools the conversation itself declares where it stands (Responses `additional_tools` items,
    # Anthropic tool_reference blocks): rendered there, callable like `tools`, kept out of the
    # template's tool list so the prompt before them stays the same
    inline_tools: tuple[Tool, ...] = ()
    ignored: tuple[str, ...] = ()  # the client's fields and parts no layer acts on (X-Strata-Ignored)

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        """Every tool the model may call: the template's and the conversation's own."""
        return self.tools + self.inline_tools

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.callable_tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function a call is forced to ("" for any of the tools); None when none is forced."""
        if not self.callable_tools or self.tool_choice in ("auto", "none"):
            return None
        return "" if self.tool_choice == "required" else self.tool_choice

    @property
    def num_images(self) -> int:
        return sum(isinstance(p, ImagePart) for m in self.messages for p in m.parts)


def parse_json_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"request body nests deeper than {max_depth} levels", "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer over Python's 4,300-digit limit
        raise bad_request(f"request body is not valid JSON: {_short(exc)}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    _check_values(body, max_depth)
    return body


def _check_values(body: dict[str, Any], max_depth: int) -> None:
    """Depth bound and no lone surrogates (JSON's \\ud800 escapes decode to strings UTF-8 cannot
    encode; they would fail later in the tokenizer or a store). Iterative: no recursion to exhaust."""
    pending: list[tuple[Any, int]] = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > max_depth:
            raise bad_request(f"request body nests deeper than {max_depth} levels", "invalid_json")
        if isinstance(value, dict):
            pending.extend((key, depth) for key in value)
            pending.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _utf8_size(value)


def _utf8_size(text: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise bad_request(
            "request body contains a lone UTF-16 surrogate (\\ud800-\\udfff)", "invalid_unicode"
        ) from None


def _short(exc: Exception) -> str:
    """A parser's complaint about the client's body, cut to 200 characters."""
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


# -- what no layer acts on ----------------------------------------------------------------------
# A field a real client sends is accepted: honoured where it means something here, otherwise ignored
# and named in the answer's X-Strata-Ignored header (OpenAI and Anthropic add fields every month;
# a client's new field must not turn into a 400). Malformed values of the fields acted on stay 400s.

FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def shown_name(name: object) -> str:
    """A client's field name as a header may show it: itself when plain, else a short digest."""
    if isinstance(name, str) and FIELD_NAME.fullmatch(name):
        return name
    return "?" + hashlib.sha256(repr(name).encode()).hexdigest()[:8]


def ignored_fields(body: dict[str, Any], handled: Collection[str], neutral: dict[str, tuple]) -> list[str]:
    """The body's fields that no layer acts on: those named in `neutral` sent with another value than
    the ones that change nothing (what a client sends when it means the default), and any field
    neither handled nor named there. Unset (null) fields are never listed."""
    return [
        shown_name(name)
        for name, value in body.items()
        if value is not None and name not in handled and not (name in neutral and _is_neutral(value, neutral[name]))
    ]


def _is_neutral(value: Any, neutral: tuple) -> bool:
    """None and booleans match by identity (True is not 1), anything else by value (0.0 is 0)."""
    if value is None or isinstance(value, bool):
        return any(value is allowed for allowed in neutral)
    return any(allowed is not None and not isinstance(allowed, bool) and value == allowed for allowed in neutral)


# Chat-completions fields Strata acts on; the others' values that change nothing. Honoured beyond
# the obvious: parallel_tool_calls false keeps one call; reasoning_effort sets the template's switch;
# prediction is a draft for speculative decoding.
CHAT_FIELDS = frozenset(
    (
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "top_k",
        "min_p",
        "n",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "stream",
        "stream_options",
        "metadata",
        "prompt_cache_key",
        "prompt_cache_retention",
        "user",
        "parallel_tool_calls",
        "reasoning_effort",
        "prediction",
    )
)
CHAT_NEUTRAL = {
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "verbosity": ("medium",),
    "repetition_penalty": (1,),
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# The type of every field and part the chat parser reads (gateway/requests/shapes.py checks them first).
IMAGE_REF = Either((STR, Obj({"url": STR, "detail": STR})))
CHAT_PART = Tagged(
    {"text": Obj({"text": STR}), "image_url": Obj({"image_url": IMAGE_REF}), "video_url": Obj({"video_url": IMAGE_REF})}
)
CHAT_CALL = Obj({"id": STR, "type": STR, "function": Obj({"name": STR, "arguments": STR})})
CHAT_MESSAGE = Obj(
    {
        "role": STR,
        "content": Either((STR, List(CHAT_PART))),
        "tool_calls": List(CHAT_CALL),
        "tool_call_id": STR,
        "name": STR,
        "reasoning_content": STR,
    }
)
FUNCTION = Obj({"name": STR, "description": STR, "parameters": OBJECT})
CHAT_SHAPE = Checked(
    Obj(
        {
            "model": STR,
            "messages": List(CHAT_MESSAGE),
            "max_tokens": INT,
            "max_completion_tokens": INT,
            "temperature": NUM,
            "top_p": NUM,
            "top_k": INT,
            "min_p": NUM,
            "seed": INT,
            "stop": Either((STR, List(STR))),
            "presence_penalty": NUM,
            "frequency_penalty": NUM,
            "logit_bias": Obj(values=NUM),
            "n": INT,
            "logprobs": BOOL,
            "top_logprobs": INT,
            "tools": List(Tagged({"function": Obj({"function": FUNCTION})})),
            "tool_choice": Either((STR, Obj({"type": STR, "function": Obj({"name": STR})}))),
            "functions": List(FUNCTION),
            "function_call": Either((STR, Obj({"name": STR}))),
            "response_format": Obj({"type": STR, "json_schema": Obj({"name": STR, "schema": OBJECT})}),
            "stream": BOOL,
            "stream_options": Obj({"include_usage": BOOL}),
            "metadata": Obj(values=STR),
            "user": STR,
            "prompt_cache_key": STR,
            "prompt_cache_retention": STR,
            "parallel_tool_calls": BOOL,
            "reasoning_effort": STR,
            "prediction": Obj({"type": STR, "content": Either((STR, List(Obj({"text": STR}))))}),
        }
    ),
    codes={"messages": "invalid_messages"},
)


def parse_chat_request(body: dict[str, Any], limits: Limits) -> ChatRequest:
    check(body, CHAT_SHAPE, "openai")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "invalid_type", "model")
    ignored = ignored_fields(body, CHAT_FIELDS, CHAT_NEUTRAL)
    messages = parse_messages(body.get("messages"), limits, ignored)
    tools = parse_tools(body, limits, ignored)
    stream = typed(body, "stream", bool, False)
    options = typed(body, "stream_options", dict, None) or {}
    n = body.get("n", 1) if body.get("n") is not None else 1
    if not is_int(n) or not 1 <= n <= limits.max_n:
        raise bad_request(f"'n' must be an integer from 1 to {limits.max_n}", "invalid_value", "n")
    sampling, asked = _parse_sampling(body, limits)
    _check_logprob_entries(sampling, n, limits)
    return checked_request(
        limits,
        model=model,
        messages=messages,
        sampling=sampling,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        metadata=parse_metadata(body.get("metadata")),
        user=parse_user(body.get("user"), limits, "user"),
        tools=tools,
        tool_choice=parse_tool_choice(body, tools),
        response_format=parse_response_format(body.get("response_format"), limits),
        n=n,
        breakpoints=parse_retention(body, len(messages)),
        max_tokens_asked=asked,
        switches=Switches(effort=parse_effort(body.get("reasoning_effort"), "reasoning_effort")),
        max_tool_calls=parallel_calls(body.get("parallel_tool_calls"), "parallel_tool_calls"),
        prediction=_prediction(body.get("prediction")),
        ignored=tuple(ignored + _ignored_stream_options(options)),
    )


def parse_effort(raw: Any, param: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or raw not in EFFORTS:
        raise bad_request(f"'{param}' must be one of {', '.join(EFFORTS)}; got {echo(raw)}", "invalid_value", param)
    return raw


def parallel_calls(raw: Any, param: str) -> int | None:
    """parallel_tool_calls: false keeps an answer to one call (None: as many as the model makes)."""
    if raw is None or raw is True:
        return None
    if raw is False:
        return 1
    raise bad_request(f"'{param}' must be true or false", "invalid_type", param)


def _prediction(raw: Any) -> str | None:
    """OpenAI's predicted output ({"type": "content", "content": text or text parts}) as one text."""
    if raw is None:
        return None
    content = raw.get("content") if isinstance(raw, dict) and raw.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request(
            '\'prediction\' must be {"type": "content", "content": a string or text parts}',
            "invalid_value",
            "prediction",
        )
    return content


def _ignored_stream_options(options: dict[str, Any]) -> list[str]:
    return [f"stream_options.{name}" for name in ignored_fields(options, ("include_usage",), {})]


RETENTION_24H_S = 24 * 3600.0


def parse_retention(body: dict[str, Any], num_messages: int) -> tuple[CacheBreakpoint, ...]:
    """OpenAI's prompt_cache_retention: "in_memory" (or "in-memory") is Strata's own caching; "24h"
    pins the whole prompt on the SSD tier for a day. `prompt_cache_key` is a routing hint for the
    proxy in front (it hashes on it first), checked here only for its type."""
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or len(key) > 1024):
        raise bad_request(
            "'prompt_cache_key' must be a string of at most 1024 characters", "invalid_type", "prompt_cache_key"
        )
    retention = body.get("prompt_cache_retention")
    if retention in (None, "in_memory", "in-memory"):
        return ()
    if retention != "24h":
        raise bad_request(
            f"'prompt_cache_retention' must be 'in_memory' or '24h'; got {echo(retention)}",
            "invalid_value",
            "prompt_cache_retention",
        )
    return (CacheBreakpoint(num_messages, RETENTION_24H_S, on_ssd=True),)


def checked_request(limits: Limits, **fields: Any) -> ChatRequest:
    """The neutral request, after the checks every front end shares (OpenAI chat, Anthropic
    messages): each tool result answers an earlier call, the image count, the text's byte size."""
    request = ChatRequest(**fields)
    request = replace(request, messages=_tool_images_out(request.messages))
    _check_tool_results(request.messages)
    if request.num_images > limits.max_images:
        raise bad_request(f"at most {limits.max_images} images per request", "too_many_images", "messages")
    num_text_bytes = _prompt_text_bytes(request.messages, request.tools)
    if num_text_bytes > limits.max_text_bytes:
        raise bad_request(
            f"the messages and tools hold {num_text_bytes} bytes of text; the limit is {limits.max_text_bytes}",
            "context_length_exceeded",
            "messages",
        )
    uses_tools = bool(request.callable_tools) or any(m.role == "tool" or m.tool_calls for m in request.messages)
    return replace(request, num_text_bytes=num_text_bytes, uses_tools=uses_tools)


# -- tools and structured output ----------------------------------------------------------------

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def parse_tools(body: dict[str, Any], limits: Limits, ignored: list[str]) -> tuple[Tool, ...]:
    """`tools` (or the older `functions`) -> Tools with canonical JSON parameter schemas; a tool of
    another type than function (custom, web search) is not offered to the model, named in `ignored`."""
    if body.get("tools") is not None and body.get("functions") is not None:
        raise bad_request("send 'tools' or the older 'functions', not both", "invalid_value", "functions")
    field, raw = (
        ("functions", body.get("functions")) if body.get("functions") is not None else ("tools", body.get("tools"))
    )
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > limits.max_tools:
        raise bad_request(f"'{field}' must be an array of at most {limits.max_tools} functions", "invalid_type", field)
    if field == "functions":
        raw = [{"type": "function", "function": item} for item in raw]
    tools = []
    for index, item in enumerate(raw):
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind != "function":
            ignored.append(not_offered(f"{field}[{index}]", kind))
        else:
            tools.append(_parse_tool(f"{field}[{index}]", item, limits))
    return unique_tools(tools, field)


def not_offered(param: str, kind: str) -> str:
    """The note for a tool the model is not offered (a kind it cannot call here)."""
    return f"{param} ({shown_name(kind)}: not offered)"


def unique_tools(tools: list[Tool], field: str) -> tuple[Tool, ...]:
    """The tools of every API, refused when two share a name."""
    if len({tool.name for tool in tools}) != len(tools):
        raise bad_request(f"'{field}' names a function twice", "invalid_value", field)
    return tuple(tools)


def function_tool(where: str, param: str, function: dict[str, Any], schema_field: str, limits: Limits) -> Tool:
    """A function's name, description and JSON-schema parameters (under `schema_field`), checked
    alike for every API; `where` starts the messages (tools[0].function, tools.0), `param` is the
    error's parameter."""
    name, description = function.get("name"), function.get("description", "")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, '_' or '-'", "invalid_value", param)
    if not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", "invalid_type", param)
    parameters = function.get(schema_field, EMPTY_PARAMETERS)
    return Tool(name, description, schema_json(f"{where}.{schema_field}", parameters, limits))


def _parse_tool(param: str, item: Any, limits: Limits) -> Tool:
    if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
        raise bad_request(f'{param} must be {{"type": "function", "function": {{...}}}}', "invalid_type", param)
    return function_tool(f"{param}.function", param, item["function"], "parameters", limits)


def schema_json(param: str, schema: Any, limits: Limits) -> str:
    """A JSON schema as canonical JSON text. That it compiles is checked where the model is known."""
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object", "invalid_type", param)
    text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
    if len(text.encode()) > limits.max_tool_schema_bytes:
        raise bad_request(f"{param} is larger than {limits.max_tool_schema_bytes} bytes", "invalid_value", param)
    return text


def parse_tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> str:
    field = "function_call" if body.get("function_call") is not None else "tool_choice"
    raw = body.get(field)
    if raw is None:
        return "auto"
    if isinstance(raw, dict):
        function = raw.get("function") if field == "tool_choice" else raw
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or (field == "tool_choice" and raw.get("type") != "function"):
            raise bad_request(
                f"'{field}' must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                "invalid_value",
                field,
            )
        if name not in {tool.name for tool in tools}:
            raise bad_request(f"'{field}' names {echo(name)}, which is not among the tools", "invalid_value", field)
        return name
    if raw not in ("none", "auto", "required"):
        raise bad_request(f"'{field}' must be 'none', 'auto', 'required' or a named function", "invalid_value", field)
    if raw == "required" and not tools:
        raise bad_request(f"'{field}' is 'required' but no tools were given", "invalid_value", field)
    return raw


def parse_response_format(raw: Any, limits: Limits) -> dict | None:
    """None for text; else {"type": "json_object"} or {"type": "json_schema", "schema": <canonical JSON>}."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise bad_request(
                "'response_format.json_schema' must be an object with a 'schema'", "invalid_type", "response_format"
            )
        return {
            "type": "json_schema",
            "schema": schema_json("response_format.json_schema.schema", spec.get("schema"), limits),
        }
    raise bad_request(
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'", "invalid_value", "response_format"
    )


def _prompt_text_bytes(messages: tuple[Message, ...], tools: tuple[Tool, ...]) -> int:
    """UTF-8 bytes of all client text the prompt will hold: message parts, earlier calls, tool definitions."""
    parts = sum(_utf8_size(p.text) for m in messages for p in m.parts if isinstance(p, TextPart))
    calls = sum(_utf8_size(c.name + c.arguments) for m in messages for c in m.tool_calls)
    definitions = sum(_utf8_size(t.name + t.description + t.parameters) for t in tools)
    return parts + calls + definitions


def parse_user(raw: Any, limits: Limits, param: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not 0 < len(raw) <= limits.max_user_chars:
        raise bad_request(
            f"'{param}' must be a string of 1 to {limits.max_user_chars} characters", "invalid_type", param
        )
    return raw


def parse_messages(raw: Any, limits: Limits, ignored: list[str]) -> tuple[Message, ...]:
    """Chat messages; content parts of a kind the model cannot take are left out and named in `ignored`."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "invalid_messages", "messages")
    if len(raw) > limits.max_messages:
        raise bad_request(f"at most {limits.max_messages} messages per request", "too_many_messages", "messages")
    return tuple(_parse_message(i, item, limits, ignored) for i, item in enumerate(raw))


TOOL_IMAGE = "[image: in the next user turn]"  # where a tool result's image stood


def _tool_images_out(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """Images in tool results (a screenshot, an image file read) moved to the user turn right after
    the run of tool results, first in it (or a user turn of their own): chat templates render a tool
    turn's text only. Each leaves TOOL_IMAGE where it stood. Later turns only append, so the prompt of
    one turn stays the prefix of the next."""
    out: list[Message] = []
    moved: list[ImagePart] = []
    for message in messages:
        if message.role == "tool" and any(isinstance(part, ImagePart) for part in message.parts):
            moved += [part for part in message.parts if isinstance(part, ImagePart)]
            parts = tuple(TextPart(TOOL_IMAGE) if isinstance(part, ImagePart) else part for part in message.parts)
            out.append(replace(message, parts=parts))
            continue
        if moved and message.role == "user":
            message = replace(message, parts=(*moved, *message.parts))
        elif moved and message.role != "tool":
            out.append(Message("user", tuple(moved)))
        if message.role != "tool":
            moved = []
        out.append(message)
    if moved:
        out.append(Message("user", tuple(moved)))
    return tuple(out)


def _check_tool_results(messages: tuple[Message, ...]) -> None:
    """Every tool message answers a call an earlier assistant message made."""
    calls: set[str] = set()
    for index, message in enumerate(messages):
        calls.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in calls:
            raise bad_request(
                f"messages[{index}] is a tool result for call {echo(message.tool_call_id)}, which no "
                "earlier assistant message made",
                "invalid_tool_message",
                f"messages[{index}]",
            )


def _parse_message(index: int, item: Any, limits: Limits, ignored: list[str]) -> Message:
    param = f"messages[{index}]"
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object", "invalid_type", param)
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}; got {echo(role)}", "invalid_role", param)
    content = item.get("content")
    if content is None and role == "assistant":
        content = ""
    calls = _parse_tool_calls(param, item.get("tool_calls"), role)
    call_id = item.get("tool_call_id")
    if role == "tool" and (not isinstance(call_id, str) or not call_id):
        raise bad_request(f"{param}: a tool message needs its 'tool_call_id'", "invalid_tool_message", param)
    if isinstance(content, str):
        return Message(role, (TextPart(content),), calls, call_id if role == "tool" else None)
    if not isinstance(content, list):
        raise bad_request(f"{param}.content must be a string or an array of parts", "invalid_type", param)
    if len(content) > limits.max_parts_per_message:
        raise bad_request(f"{param}: at most {limits.max_parts_per_message} content parts", "too_many_parts", param)
    kept = [(f"{param}.content[{j}]", part) for j, part in enumerate(content)]
    parts = tuple(parsed for where, part in kept if (parsed := _parse_part(where, part, ignored)) is not None)
    if role not in ("user", "tool") and any(isinstance(p, ImagePart) for p in parts):
        raise bad_request(f"{param}: images are only accepted in user and tool messages", "invalid_content", param)
    return Message(role, parts, calls, call_id if role == "tool" else None)


def _parse_tool_calls(param: str, raw: Any, role: str) -> tuple[ToolCall, ...]:
    if raw is None or raw == []:
        return ()
    if role != "assistant" or not isinstance(raw, list):
        raise bad_request(f"{param}.tool_calls must be an array, in an assistant message", "invalid_type", param)
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(call.get("id"), str)
            and call["id"]
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise bad_request(
                f"{param}.tool_calls[{j}] must have an 'id' and a 'function' with a 'name' and "
                "'arguments' (a JSON string)",
                "invalid_type",
                param,
            )
        calls.append(ToolCall(call["id"], function["name"], function["arguments"]))
    return tuple(calls)


def _parse_part(param: str, part: Any, ignored: list[str]) -> TextPart | ImagePart | None:
    """A text, image or video part; None for a part of another kind (audio, file, refusal), named in
    `ignored` (a part without a type is malformed: 400)."""
    if not isinstance(part, dict):
        raise bad_request(f"{param} must be an object", "invalid_type", param)
    kind = part.get("type")
    if isinstance(kind, str) and kind not in ("text", "image_url", "video_url"):
        ignored.append(f"{param} ({shown_name(kind)})")
        return None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.text must be a string", "invalid_type", param)
        return TextPart(part["text"])
    if kind in ("image_url", "video_url"):
        ref = part.get(kind)
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise bad_request(f"{param}.{kind}.url must be a string", "invalid_type", param)
        return ImagePart(url, video=kind == "video_url")
    raise bad_request(f"{param}.type must be a string such as 'text' or 'image_url'", "invalid_type", param)


def output_tokens(value: Any, param: str, limits: Limits) -> tuple[int, int]:
    """A client's max_tokens: (what may run: it within the server's output limit, or the default when
    it is left out; what it asked, 0 when left out). Not an integer of at least 1: 400."""
    if value is None:
        return min(limits.default_max_tokens, limits.max_output_tokens), 0
    if not is_int(value) or value < 1:
        raise bad_request(f"'{param}' must be an integer of at least 1", "invalid_value", param)
    return min(value, limits.max_output_tokens), value


def _parse_sampling(body: dict[str, Any], limits: Limits) -> tuple[Sampling, int]:
    """The decoding parameters, and the max_tokens the client asked (0: none)."""
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens, asked = output_tokens(body.get(param), param, limits)
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", "invalid_value", "top_p")
    seed = body.get("seed")
    if seed is not None and not (is_int(seed) and -(2**63) <= seed < 2**64):
        raise bad_request("'seed' must be a 64-bit integer", "invalid_type", "seed")
    top_k = body.get("top_k", 0)
    if not is_int(top_k) or top_k < -1:
        raise bad_request("'top_k' must be an integer: -1 or 0 for off, else at least 1", "invalid_value", "top_k")
    sampling = Sampling(
        max_tokens,
        temperature,
        top_p,
        seed,
        _parse_stop(body.get("stop"), limits),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_parse_logit_bias(body.get("logit_bias")),
        top_k=max(top_k, 0),
        min_p=number(body, "min_p", 0.0, 0.0, 1.0),
        top_logprobs=_parse_logprobs(body, limits),
    )
    return sampling, asked


def _parse_logprobs(body: dict[str, Any], limits: Limits) -> int | None:
    """None without logprobs; else how many alternatives each token reports (0: the chosen token only)."""
    wanted = typed(body, "logprobs", bool, False)
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= limits.max_top_logprobs):
        raise bad_request(
            f"'top_logprobs' must be an integer from 0 to {limits.max_top_logprobs}", "invalid_value", "top_logprobs"
        )
    if not wanted:
        if top:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "invalid_value", "top_logprobs")
        return None
    return top or 0


def _check_logprob_entries(sampling: Sampling, n: int, limits: Limits) -> None:
    if sampling.top_logprobs is None:
        return
    entries = n * sampling.max_tokens * (sampling.top_logprobs + 1)
    if entries > limits.max_logprob_entries:
        raise bad_request(
            f"n x max_tokens x (top_logprobs + 1) is {entries}; at most {limits.max_logprob_entries} log "
            "probabilities per request: lower n, max_tokens or top_logprobs",
            "invalid_value",
            "top_logprobs",
        )


MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def _parse_logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> sorted (id, bias) pairs. Ids beyond the model's
    vocabulary are refused where the model is known (chat.py)."""
    if raw is None:
        return ()
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "invalid_type", "logit_bias"
        )
    pairs = []
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise bad_request(f"'logit_bias' keys are token ids; got {echo(key)}", "invalid_value", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request("'logit_bias' values must be numbers from -100 to 100", "invalid_value", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _parse_stop(raw: Any, limits: Limits) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or an array of them", "invalid_type", "stop")
    if len(stops) > limits.max_stop_sequences:
        raise bad_request(f"at most {limits.max_stop_sequences} stop sequences", "invalid_value", "stop")
    return tuple(stops)


def parse_metadata(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > 16:
        raise bad_request("'metadata' must be an object of at most 16 string values", "invalid_type", "metadata")
    for key, value in raw.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512 or not key:
            raise bad_request(
                f"metadata[{echo(key)}] must be a string of at most 512 characters", "invalid_type", "metadata"
            )
    return dict(raw)


def typed(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is not None and value is not default and not isinstance(value, kind):
        raise bad_request(f"'{name}' must be of type {kind.__name__}", "invalid_type", name)
    return value


def number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", "invalid_type", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}", "invalid_value", name)
    return float(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
