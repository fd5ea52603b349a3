"""OpenAI's Responses API (`POST /v1/responses`) over the chat-completions pipeline.

A Responses body is parsed straight into the neutral ChatRequest (input items -> messages,
`instructions` -> a system message first, tools and `text.format` -> tools and response format) and
ends in the checks every front end shares, so every layer applies unchanged and the same
conversation sent as chat completions shares its cache entries. The conversation is stored in chat
form (the messages it renders from). `previous_response_id` puts the stored conversation before the
new input (the same tenant's only); the earlier turns render to the same prompt tokens, so the prefix
cache serves them. Instructions are not carried over, as OpenAI's.

What Codex CLI and other clients send is accepted (see RESPONSE_FIELDS): `developer` and `system`
messages anywhere (rendered where they stand), `reasoning` (its effort sets the template's switch; a
reply that opens with <think> comes back as a `reasoning` item, its text as content, a summary when
asked; `include: ["reasoning.encrypted_content"]` gets no encrypted content: there is nothing to
encrypt), `parallel_tool_calls` and `max_tool_calls`, function tools grouped in a `namespace` (offered
by their own names; calls come back with their namespace), `custom` tools (offered as a function
taking one string, `input`; calls come back as custom_tool_call items), `additional_tools` items (the
tools a conversation offers from where the item stands: rendered there as a system turn, so the
prompt before them keeps its cached prefix). Tools the model cannot call
here (web search, file search, computer use, MCP, local shell) are not offered; input items of those
kinds are left out. Both are named in X-Strata-Ignored.

    parse_request(body, history, limits) -> (ChatRequest, conversation to store)
    ToolKinds.of(body)                              which offered names are custom tools or namespaced
    output(completion, tools, kinds) -> (items, message)   the output items; the message to store
    response_object(...) -> dict                    the `response` object
    stream_events(...) -> SSE bytes                 response.created ... response.completed
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from ..engine import Delta, Sampling, Switches, Tool, ToolFormat, tools_text
from ..observability.trace import Trace
from ..requests.errors import ApiError, bad_request, echo
from ..requests.schemas import (
    ChatRequest,
    checked_request,
    function_tool,
    ignored_fields,
    not_offered,
    number,
    output_tokens,
    parallel_calls,
    parse_effort,
    parse_messages,
    parse_metadata,
    parse_retention,
    parse_user,
    schema_json,
    shown_name,
    typed,
    unique_tools,
)
from ..requests.shapes import ANY, BOOL, INT, NUM, OBJECT, STR, Checked, Either, List, Obj, Tagged, check
from ..settings import Limits
from .openai_format import (
    THINK_CLOSE,
    THINK_OPEN,
    Completion,
    assistant_message,
    partial_suffix,
    sendable,
    split_thinking,
)

# Fields acted on (previous_response_id and store by the route); the others' values that change nothing.
RESPONSE_FIELDS = frozenset(
    (
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "store",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "text",
        "stream",
        "metadata",
        "user",
        "prompt_cache_key",
        "prompt_cache_retention",
        "include",
        "reasoning",
        "parallel_tool_calls",
        "max_tool_calls",
    )
)
RESPONSE_NEUTRAL: dict[str, tuple] = {
    "background": (False,),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
    "client_metadata": (),  # Codex's ids for OpenAI's logs: nothing here reads them
}
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # honoured: reasoning items carry none (nothing to encrypt)
SUMMARIES = ("auto", "concise", "detailed")
CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
# Input items of kinds the model here did not produce and cannot take: left out (and named).
SKIPPED_ITEMS = ("web_search_call", "file_search_call", "computer_call", "item_reference", "compaction")


# The type of every field and item the parser reads (gateway/requests/shapes.py checks them first).
TEXT_PART = Obj({"text": STR})
PART = Tagged(
    {
        "input_text": TEXT_PART,
        "output_text": TEXT_PART,
        "text": TEXT_PART,
        "input_image": Obj({"image_url": Either((STR, Obj({"url": STR})))}),
    }
)
FUNCTION_TOOL = Obj({"name": STR, "description": STR, "parameters": OBJECT})
CUSTOM_TOOL = Obj({"name": STR, "description": STR})
TOOL = Tagged(
    {
        "function": FUNCTION_TOOL,
        "custom": CUSTOM_TOOL,
        "namespace": Obj({"name": STR, "tools": List(Tagged({"function": FUNCTION_TOOL, "custom": CUSTOM_TOOL}))}),
    }
)
OUTPUT = Either((STR, List(PART), ANY))  # a string, content parts, or any JSON (sent as its text)
ITEM = Tagged(
    {
        "message": Obj({"role": STR, "content": Either((STR, List(PART)))}),
        "function_call": Obj({"call_id": STR, "name": STR, "arguments": STR, "namespace": STR}),
        "custom_tool_call": Obj({"call_id": STR, "name": STR, "input": STR}),
        "function_call_output": Obj({"call_id": STR, "output": OUTPUT}),
        "custom_tool_call_output": Obj({"call_id": STR, "output": OUTPUT}),
        "reasoning": Obj({"content": List(TEXT_PART), "summary": List(TEXT_PART), "encrypted_content": STR}),
        "additional_tools": Obj({"tools": List(TOOL)}),
    },
    missing="message",
)
RESPONSE_SHAPE = Checked(
    Obj(
        {
            "model": STR,
            "input": Either((STR, List(ITEM))),
            "instructions": STR,
            "previous_response_id": STR,
            "store": BOOL,
            "max_output_tokens": INT,
            "temperature": NUM,
            "top_p": NUM,
            "tools": List(TOOL),
            "tool_choice": Either((STR, Obj({"type": STR, "name": STR}))),
            "text": Obj({"format": Obj({"type": STR, "name": STR, "schema": OBJECT}), "verbosity": STR}),
            "stream": BOOL,
            "metadata": Obj(values=STR),
            "user": STR,
            "prompt_cache_key": STR,
            "prompt_cache_retention": STR,
            "include": List(STR),
            "reasoning": Obj({"effort": STR, "summary": STR, "generate_summary": STR}),
            "parallel_tool_calls": BOOL,
            "max_tool_calls": INT,
        }
    )
)


def check_shape(body: dict[str, Any]) -> None:
    """Every field's type, before the route reads previous_response_id and store, and the parser the rest."""
    check(body, RESPONSE_SHAPE, "openai")


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def parse_request(body: dict[str, Any], history: list[dict] | None, limits: Limits) -> tuple[ChatRequest, list[dict]]:
    """The neutral request, and the conversation to store with the response (chat-shaped messages,
    without the instructions). Errors name the Responses API's own parameters."""
    check_shape(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "invalid_type", "model")
    ignored = ignored_fields(body, RESPONSE_FIELDS, RESPONSE_NEUTRAL)
    ignored += _ignored_includes(body.get("include"))
    conversation = (history or []) + input_messages(body.get("input"), ignored)
    inline = _additional_tools(conversation, limits, ignored)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "invalid_type", "instructions")
    chat = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    max_tokens, asked = output_tokens(body.get("max_output_tokens"), "max_output_tokens", limits)
    try:
        messages = parse_messages(chat, limits, ignored)
        tools = _tools(body.get("tools"), limits, ignored)
        request = checked_request(
            limits,
            model=model,
            messages=messages,
            sampling=_sampling(body, max_tokens),
            stream=typed(body, "stream", bool, False),
            include_usage=False,
            metadata=parse_metadata(body.get("metadata")),
            user=parse_user(body.get("user"), limits, "user"),
            tools=tools,
            tool_choice=_tool_choice(body.get("tool_choice"), tools + inline),
            response_format=_format(body.get("text"), limits, ignored),
            breakpoints=parse_retention(body, len(messages)),
            max_tokens_asked=asked,
            switches=Switches(effort=_reasoning(body.get("reasoning"), ignored)[0]),
            max_tool_calls=_max_calls(body),
            inline_tools=inline,
            ignored=tuple(ignored),
        )
    except ApiError as exc:
        if exc.param and exc.param.startswith("messages"):
            exc.param = "input"  # the conversation is the Responses API's input
        raise
    return request, conversation


def _sampling(body: dict[str, Any], max_tokens: int) -> Sampling:
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", "invalid_value", "top_p")
    return Sampling(max_tokens, number(body, "temperature", 1.0, 0.0, 2.0), top_p, None, ())


def _ignored_includes(raw: Any) -> list[str]:
    """`include` asks for extra output; reasoning.encrypted_content is answered (reasoning items carry
    no encrypted content), the others are named."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
        raise bad_request("'include' must be an array of strings", "invalid_type", "include")
    return [f"include.{shown_name(item)}" for item in raw if item != ENCRYPTED_REASONING]


def _reasoning(raw: Any, ignored: list[str] | None = None) -> tuple[str | None, str | None]:
    """`reasoning`: (effort, for the template's switches; summary: auto | concise | detailed, or None)."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise bad_request("'reasoning' must be an object", "invalid_type", "reasoning")
    if ignored is not None:
        handled = ("effort", "summary", "generate_summary")
        ignored.extend(f"reasoning.{name}" for name in ignored_fields(raw, handled, {}))
    summary = raw.get("summary", raw.get("generate_summary"))
    if summary is not None and (not isinstance(summary, str) or summary not in SUMMARIES):
        raise bad_request(
            f"'reasoning.summary' must be one of {', '.join(SUMMARIES)}; got {echo(summary)}",
            "invalid_value",
            "reasoning",
        )
    return parse_effort(raw.get("effort"), "reasoning.effort"), summary


def wants_summary(body: dict[str, Any]) -> bool:
    """Whether reasoning items carry the thinking as a summary too (reasoning.summary set)."""
    return _reasoning(body.get("reasoning"))[1] is not None


def _max_calls(body: dict[str, Any]) -> int | None:
    """The calls one answer may make: one with parallel_tool_calls false, at most max_tool_calls."""
    limit = body.get("max_tool_calls")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise bad_request("'max_tool_calls' must be an integer of at least 1", "invalid_value", "max_tool_calls")
    bounds = [
        bound for bound in (parallel_calls(body.get("parallel_tool_calls"), "parallel_tool_calls"), limit) if bound
    ]
    return min(bounds) if bounds else None


def input_messages(raw: Any, ignored: list[str]) -> list[dict]:
    """Responses input (a string, or items: messages, function and custom tool calls and their
    outputs, reasoning) as chat messages; items of other kinds are left out, named in `ignored`."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty array of items", "invalid_type", "input")
    messages: list[dict] = []
    reasoning: list[str] = []  # thinking from reasoning items, for the assistant turn that follows
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"input[{index}] must be an object", "invalid_type", f"input[{index}]")
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning += _reasoning_texts(item, index, ignored)
        elif kind == "message":
            messages.append({"role": item.get("role"), "content": _content(index, item.get("content"), ignored)})
        elif kind in ("function_call", "custom_tool_call"):
            _call(messages, item, kind)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(_call_output(index, item, ignored))
        elif kind == "additional_tools":  # tools offered from here on: a system turn in place (see _additional_tools)
            messages.append({"role": "system", "content": "", ADDITIONAL_TOOLS: item.get("tools")})
        elif isinstance(kind, str):
            ignored.append(f"input[{index}] ({shown_name(kind)})")
        else:
            raise bad_request(f"input[{index}].type must be a string", "invalid_type", f"input[{index}]")
        if reasoning and messages and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
    return messages


ADDITIONAL_TOOLS = "additional_tools"  # a chat message's key for the tools an additional_tools item offered


def _additional_tools(conversation: list[dict], limits: Limits, ignored: list[str]) -> tuple[Tool, ...]:
    """The tools `additional_tools` items offer (a stored conversation's too), each item's system turn
    given their text: the prompt before them stays as it was, so its prefix stays cached."""
    offered: list[Tool] = []
    for index, message in enumerate(conversation):
        if ADDITIONAL_TOOLS not in message:
            continue
        tools = _tools(message[ADDITIONAL_TOOLS], limits, ignored, f"input[{index}].tools")
        message["content"] = tools_text(tools)
        offered += tools
    return unique_tools(offered, "input") if offered else ()


def _reasoning_texts(item: dict, index: int, ignored: list[str]) -> list[str]:
    """A reasoning item's own text (its content; else its summary). One with encrypted content only
    (another server's) cannot be read here."""
    content = item.get("content") or item.get("summary") or []
    if not isinstance(content, list):
        raise bad_request(f"input[{index}].content must be an array", "invalid_type", f"input[{index}]")
    texts = [part.get("text") for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    if not texts and item.get("encrypted_content"):
        ignored.append(f"input[{index}] (reasoning: encrypted_content)")
    return [text for text in texts if isinstance(text, str)]


def _call(messages: list[dict], item: dict, kind: str) -> None:
    """A function or custom tool call, added to the assistant turn it belongs to."""
    arguments = item.get("arguments") if kind == "function_call" else _custom_arguments(item.get("input"))
    call = {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": arguments},
    }
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
        messages[-1]["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _custom_arguments(raw: Any) -> Any:
    return json.dumps({"input": raw}, ensure_ascii=False) if isinstance(raw, str) else raw


def _call_output(index: int, item: dict, ignored: list[str]) -> dict:
    output = item.get("output")
    return {
        "role": "tool",
        "tool_call_id": item.get("call_id"),
        # a string, or content parts (input_text, input_image) as the Responses API allows
        "content": _content(index, output, ignored) if isinstance(output, list) else _tool_output(output),
    }


def _tool_output(output: Any) -> str:
    """A function's output that is not content parts: a string as it is, anything else as JSON."""
    return output if isinstance(output, str) else json.dumps(output)


def _content(index: int, raw: Any, ignored: list[str]) -> Any:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad_request(
            f"input[{index}].content must be a string or an array of parts", "invalid_type", f"input[{index}]"
        )
    parts = []
    for position, part in enumerate(raw):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"input[{index}].content[{position}]"
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.text must be a string", "invalid_type", f"{where}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            parts.append({"type": "image_url", "image_url": {"url": url.get("url") if isinstance(url, dict) else url}})
        elif isinstance(kind, str):
            ignored.append(f"{where} ({shown_name(kind)})")  # refusal, input_file, input_audio
        else:
            raise bad_request(f"{where} must be a content part with a type", "invalid_type", f"input[{index}]")
    return parts


def _tools(raw: Any, limits: Limits, ignored: list[str], field: str = "tools") -> tuple[Tool, ...]:
    """Function tools (`namespace` groups' too, by their own names) and custom tools (as functions
    taking one string, `input`); other kinds are not offered."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > limits.max_tools:
        raise bad_request(f"'{field}' must be an array of at most {limits.max_tools} tools", "invalid_type", field)
    tools: list[Tool] = []
    for index, item in enumerate(raw):
        param = f"{field}[{index}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(kind, str):
            raise bad_request(f"{param} must be a tool object with a type", "invalid_type", param)
        if kind == "namespace":
            members = item.get("tools")
            if not isinstance(members, list):
                raise bad_request(f"{param}.tools must be an array", "invalid_type", param)
            tools += _namespace_tools(param, members, limits, ignored)
        elif kind in ("function", "custom"):
            tools.append(_tool(param, item, limits))
        else:
            ignored.append(not_offered(param, kind))
    if len(tools) > limits.max_tools:
        raise bad_request(f"'{field}' offers more than {limits.max_tools} functions", "invalid_value", field)
    return unique_tools(tools, field)


def _namespace_tools(param: str, members: list, limits: Limits, ignored: list[str]) -> list[Tool]:
    tools = []
    for index, member in enumerate(members):
        where = f"{param}.tools[{index}]"
        kind = member.get("type") if isinstance(member, dict) else None
        if isinstance(member, dict) and kind in ("function", "custom"):
            tools.append(_tool(where, member, limits))
        elif isinstance(kind, str):
            ignored.append(not_offered(where, kind))
        else:
            raise bad_request(f"{where} must be a tool object with a type", "invalid_type", param)
    return tools


def _tool(param: str, item: dict, limits: Limits) -> Tool:
    if item.get("type") == "custom":  # free text in, as the one string argument of a function
        return function_tool(param, param, {**item, "parameters": CUSTOM_INPUT}, "parameters", limits)
    return function_tool(param, param, item, "parameters", limits)


@dataclass(frozen=True, slots=True)
class ToolKinds:
    """The offered tools that are not plain functions: how their calls go back to the client."""

    custom: frozenset[str] = frozenset()  # names of custom tools: calls are custom_tool_call items
    namespaces: dict[str, str] = field(default_factory=dict)  # a namespaced function's name -> its namespace

    @classmethod
    def of(cls, body: dict[str, Any]) -> ToolKinds:
        """From a body parse_request accepted (so its tools are well formed): its `tools` and the
        tools its additional_tools items offer."""
        custom, namespaces = set(), {}
        raw = body.get("input")
        items: list = raw if isinstance(raw, list) else []
        offered = [item.get("tools") or [] for item in items if item.get("type") == ADDITIONAL_TOOLS]
        for item in [*(body.get("tools") or []), *(tool for tools in offered for tool in tools)]:
            members = item.get("tools", []) if item.get("type") == "namespace" else [item]
            for member in members:
                if member.get("type") == "custom":
                    custom.add(member.get("name"))
                if item.get("type") == "namespace" and member.get("type") in ("function", "custom"):
                    namespaces[member.get("name")] = item.get("name")
        return cls(frozenset(custom), namespaces)


def _tool_choice(raw: Any, tools: tuple[Tool, ...]) -> str:
    """auto | none | required | {"type": "function" or "custom", "name": ...} (that call is forced)."""
    if raw is None:
        return "auto"
    name = raw.get("name") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and raw.get("type") in ("function", "custom") and isinstance(name, str):
        if name in {t.name for t in tools}:
            return name
    elif isinstance(raw, str) and (raw in ("auto", "none") or (raw == "required" and tools)):
        return raw
    raise bad_request(
        "'tool_choice' must be 'auto', 'none', 'required' (with tools) or "
        f'{{"type": "function", "name": ...}} naming one of the tools; got {echo(raw)}',
        "invalid_value",
        "tool_choice",
    )


def _format(text: Any, limits: Limits, ignored: list[str]) -> dict | None:
    """text.format as the response format: None for text, json_object, or json_schema with its
    schema; text.verbosity has no meaning here."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object ({\"format\": ...})", "invalid_type", "text")
    ignored.extend(f"text.{name}" for name in ignored_fields(text, ("format",), {"verbosity": ("medium",)}))
    shape = text.get("format")
    kind = shape.get("type") if isinstance(shape, dict) else None
    if shape is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(shape, dict):
        return {"type": "json_schema", "schema": schema_json("text.format.schema", shape.get("schema"), limits)}
    raise bad_request(
        "'text.format.type' must be 'text', 'json_object' or 'json_schema'", "invalid_value", "text.format"
    )


# -- the response ------------------------------------------------------------------------------


def output(
    completion: Completion, tools: ToolFormat | None, kinds: ToolKinds, summary: bool
) -> tuple[list[dict], dict]:
    """The response's output items (a reasoning item first when the reply thought), and the
    assistant message to store in the conversation (its thinking as reasoning_content)."""
    thought, answer = split_thinking(completion.text)
    message = assistant_message(answer, tools)
    calls = message.get("tool_calls", [])
    items = [reasoning_item(thought, summary)] if thought is not None else []
    items += [_message_item(message["content"] or "")] if message["content"] or not calls else []
    items += [_call_item(call, kinds) for call in calls]
    if thought:
        message["reasoning_content"] = thought
    return items, message


def reasoning_item(thought: str, summary: bool, item_id: str | None = None) -> dict:
    return {
        "type": "reasoning",
        "id": item_id or f"rs_{uuid.uuid4().hex[:24]}",
        "status": "completed",
        "content": [{"type": "reasoning_text", "text": thought}],
        "summary": [{"type": "summary_text", "text": thought}] if summary else [],
        "encrypted_content": None,
    }


def _call_item(call: dict, kinds: ToolKinds) -> dict:
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    if name in kinds.custom:
        return {
            "type": "custom_tool_call",
            "id": f"ctc_{uuid.uuid4().hex[:24]}",
            "call_id": call["id"],
            "name": name,
            "input": _custom_input(arguments),
            "status": "completed",
        }
    item = {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex[:24]}",
        "call_id": call["id"],
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }
    if name in kinds.namespaces:
        item["namespace"] = kinds.namespaces[name]
    return item


def _custom_input(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def _message_item(text: str, item_id: str | None = None) -> dict:
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex[:24]}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def response_object(
    response_id: str,
    body: dict,
    completion: Completion | None,
    trace: Trace | None,
    items: list[dict],
    previous_id: str | None,
) -> dict:
    """The `response` object; `completion` None: still in progress (the stream's first events)."""
    done = completion is not None and completion.whole
    incomplete = completion is not None and done and completion.finish_reason == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "output": items,
        "instructions": body.get("instructions"),
        "previous_response_id": previous_id,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "store": body.get("store", True),
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning"),
        "usage": _usage(completion, trace) if completion is not None and trace is not None and done else None,
    }


def _usage(completion: Completion, trace: Trace) -> dict:
    return {
        "input_tokens": completion.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": completion.cached_tokens,
            "cache_write_tokens": completion.written_tokens,
        },
        "output_tokens": completion.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        "strata": trace.summary(),
    }


@dataclass(slots=True)
class _Stream:
    """The SSE events of one answer. A reply that opens with <think> streams its thinking as a
    reasoning item (reasoning_text deltas; summary deltas too when asked) before the message; the text
    goes out as output_text deltas while no tool call may have started; every item is announced
    (output_item.added) and finished (output_item.done) in output order; response.completed repeats
    them all."""

    completion: Completion
    tools: ToolFormat | None
    summary: bool
    sequence: int = 0
    phase: str = "undecided"  # until the text shows whether it opens with <think>; then thinking, text
    sent: int = 0  # characters of the text sent (thinking and answer)
    answer_start: int = 0  # where the answer begins in the text (after the thinking)
    items: list[dict] = field(default_factory=list)  # the items announced so far, in output order

    def event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        return _event(kind, self.sequence - 1, **fields)

    def added(self, item: dict) -> bytes:
        self.items.append(item)
        out = self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out += self.event("response.content_part.added", **self._at(), content_index=0, part=part)
        return out

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def delta(self, final: bool = False) -> bytes:
        text = self.completion.text
        if self.phase == "undecided":
            opening = text.lstrip()
            if THINK_OPEN.startswith(opening) and not final:
                return b""  # may still become <think>
            self.phase = "thinking" if opening.startswith(THINK_OPEN) else "text"
            if self.phase == "thinking":
                self.sent = text.index(THINK_OPEN) + len(THINK_OPEN)
                reasoning = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [], "content": []}
                return self.added(reasoning) + self._thinking(text, final)
            return self.added(_in_progress_message()) + self._text(text)
        return self._thinking(text, final) if self.phase == "thinking" else self._text(text)

    def _thinking(self, text: str, final: bool) -> bytes:
        close = text.find(THINK_CLOSE, self.sent)
        end = close if close >= 0 else (len(text) if final else len(text) - partial_suffix(text, THINK_CLOSE))
        out = b""
        if end > self.sent:
            piece = text[self.sent : end]
            out += self.event("response.reasoning_text.delta", **self._at(), content_index=0, delta=piece)
            if self.summary:
                out += self.event("response.reasoning_summary_text.delta", **self._at(), summary_index=0, delta=piece)
            self.sent = end
        if close < 0 and not final:
            return out
        thought = split_thinking(text)[0] or ""
        done = reasoning_item(thought, self.summary, self.items[-1]["id"])
        out += self.event("response.output_item.done", output_index=len(self.items) - 1, item=done)
        self.items[-1] = done
        rest = close + len(THINK_CLOSE) if close >= 0 else len(text)
        self.answer_start = self.sent = rest + len(text[rest:]) - len(text[rest:].lstrip("\n"))
        self.phase = "text"
        return out + self.added(_in_progress_message())

    def _text(self, text: str) -> bytes:
        end = self.answer_start + sendable(text[self.answer_start :], self.tools)
        if end <= self.sent:
            return b""
        piece, self.sent = text[self.sent : end], end
        return self.event("response.output_text.delta", **self._at(), content_index=0, delta=piece)

    def finish(self, kinds: ToolKinds) -> tuple[bytes, list[dict], dict]:
        """The events that close the answer; the output items and the message to store."""
        out = self.delta(final=True)
        items, message = output(self.completion, self.tools, kinds, self.summary)
        text = message["content"] or ""
        out += self.event("response.output_text.done", **self._at(), content_index=0, text=text)
        final_message = _message_item(text, self.items[-1]["id"])
        out += self.event("response.output_item.done", output_index=len(self.items) - 1, item=final_message)
        self.items[-1] = final_message
        for call in [item for item in items if item["type"] not in ("message", "reasoning")]:
            out += self.added(call) + self.event(
                "response.output_item.done", output_index=len(self.items) - 1, item=call
            )
        return out, self.items, message  # the message item stays, empty beside calls: it was announced


def _in_progress_message() -> dict:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }


def _event(kind: str, sequence: int, **fields: Any) -> bytes:
    body = {"type": kind, "sequence_number": sequence, **fields}
    return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def failed_events(error: ApiError, response_id: str, body: dict, previous_id: str | None) -> list[bytes]:
    """A stream that failed before its answer began (it waited in the queue with keep-alive pings):
    `response.created`, then `error` and `response.failed`."""
    created = _event("response.created", 0, response=response_object(response_id, body, None, None, [], previous_id))
    return [created, *_failed(1, error, response_id, body, previous_id)]


def _failed(sequence: int, error: ApiError, response_id: str, body: dict, previous_id: str | None) -> list[bytes]:
    failed = response_object(response_id, body, None, None, [], previous_id)
    return [
        _event("error", sequence, **error.body()["error"]),
        _event(
            "response.failed", sequence + 1, response={**failed, "status": "failed", "error": error.body()["error"]}
        ),
    ]


async def stream_events(
    events: AsyncGenerator,
    completion: Completion,
    trace: Trace,
    response_id: str,
    body: dict,
    previous_id: str | None,
    tools: ToolFormat | None,
    finished,
) -> AsyncGenerator[bytes, None]:
    """Responses streaming events (see _Stream). `finished` is awaited with the assistant message and
    the response once the answer is whole (it stores them). An error mid-answer sends `error`, then
    `response.failed`."""
    stream = _Stream(completion, tools, wants_summary(body))
    yield stream.event("response.created", response=response_object(response_id, body, None, None, [], previous_id))
    try:
        async for _, event in events:
            if isinstance(event, Delta) and (chunk := stream.delta()):
                yield chunk
    except ApiError as exc:
        for chunk in _failed(stream.sequence, exc, response_id, body, previous_id):
            yield chunk
        return
    finally:
        await events.aclose()
    closing, items, message = stream.finish(ToolKinds.of(body))
    yield closing
    response = response_object(response_id, body, completion, trace, items, previous_id)
    await finished(message, response)
    yield stream.event("response.completed", response=response)
