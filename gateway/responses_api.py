"""OpenAI's Responses API (`POST /v1/responses`) over the chat-completions pipeline.

A Responses body is parsed straight into the neutral ChatRequest (input items -> messages,
`instructions` -> a system message first, function tools and `text.format` -> tools and response
format) and ends in the checks every front end shares, so every layer applies unchanged and the same
conversation sent as chat completions shares its cache entries. The conversation is stored in chat
form (the messages it renders from). `previous_response_id` puts the
stored conversation before the new input (the same tenant's only); the earlier turns render to the
same prompt tokens, so the prefix cache serves them. Instructions are not carried over, as OpenAI's.

    parse_request(body, history, limits) -> (ChatRequest, conversation to store)
    response_object(...) -> dict                    the `response` object
    stream_events(...) -> SSE bytes                 response.created ... response.completed
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from .engine import Delta, Sampling, Tool, ToolFormat
from .errors import ApiError, bad_request, echo
from .openai_format import Completion, assistant_message, sendable
from .schemas import (
    ChatRequest,
    checked_request,
    function_tool,
    is_int,
    number,
    parse_messages,
    parse_metadata,
    parse_retention,
    parse_user,
    refuse_unsupported,
    schema_json,
    typed,
    unique_tools,
)
from .settings import Limits
from .trace import Trace

# Responses fields Strata does not implement, with the values that change nothing (else a 400).
UNSUPPORTED_UNLESS = {
    "include": (None, []),
    "top_logprobs": (None, 0),
    "background": (None, False),
    "reasoning": (None,),
    "prompt": (None,),
    "conversation": (None,),
}


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def parse_request(body: dict[str, Any], history: list[dict] | None, limits: Limits) -> tuple[ChatRequest, list[dict]]:
    """The neutral request, and the conversation to store with the response (chat-shaped messages,
    without the instructions). Errors name the Responses API's own parameters."""
    refuse_unsupported(body, UNSUPPORTED_UNLESS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "invalid_type", "model")
    conversation = (history or []) + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "invalid_type", "instructions")
    chat = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    try:
        messages = parse_messages(chat, limits)
        tools = _tools(body.get("tools"), limits)
        request = checked_request(
            limits,
            model=model,
            messages=messages,
            sampling=_sampling(body, limits),
            stream=typed(body, "stream", bool, False),
            include_usage=False,
            metadata=parse_metadata(body.get("metadata")),
            user=parse_user(body.get("user"), limits, "user"),
            tools=tools,
            tool_choice=_tool_choice(body.get("tool_choice"), tools),
            response_format=_format(body.get("text"), limits),
            breakpoints=parse_retention(body, len(messages)),
        )
    except ApiError as exc:
        if exc.param and exc.param.startswith("messages"):
            exc.param = "input"  # the conversation is the Responses API's input
        raise
    return request, conversation


def _sampling(body: dict[str, Any], limits: Limits) -> Sampling:
    max_tokens = body.get("max_output_tokens")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    if not is_int(max_tokens) or not 1 <= max_tokens <= limits.max_output_tokens:
        raise bad_request(
            f"'max_output_tokens' must be an integer from 1 to {limits.max_output_tokens}",
            "invalid_value",
            "max_output_tokens",
        )
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", "invalid_value", "top_p")
    return Sampling(max_tokens, number(body, "temperature", 1.0, 0.0, 2.0), top_p, None, ())


def input_messages(raw: Any) -> list[dict]:
    """Responses input (a string, or message / function_call / function_call_output items) as chat messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty array of items", "invalid_type", "input")
    messages: list[dict] = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"input[{index}] must be an object", "invalid_type", f"input[{index}]")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(index, item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    # a string, or content parts (input_text, input_image) as the Responses API allows
                    "content": _content(index, output) if isinstance(output, list) else _tool_output(output),
                }
            )
        else:
            raise bad_request(
                f"input[{index}].type {echo(kind)} is not supported (message, function_call, function_call_output)",
                "unsupported_content_type",
                f"input[{index}]",
            )
    return messages


def _tool_output(output: Any) -> str:
    """A function's output that is not content parts: a string as it is, anything else as JSON."""
    return output if isinstance(output, str) else json.dumps(output)


def _content(index: int, raw: Any) -> Any:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad_request(
            f"input[{index}].content must be a string or an array of parts", "invalid_type", f"input[{index}]"
        )
    parts = []
    for position, part in enumerate(raw):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                param = f"input[{index}].content[{position}].text"
                raise bad_request(f"{param} must be a string", "invalid_type", param)
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            parts.append({"type": "image_url", "image_url": {"url": url.get("url") if isinstance(url, dict) else url}})
        else:
            raise bad_request(
                f"input[{index}]: content part type {echo(kind)} is not supported (input_text, input_image)",
                "unsupported_content_type",
                f"input[{index}]",
            )
    return parts


def _tools(raw: Any, limits: Limits) -> tuple[Tool, ...]:
    """Function tools ({"type": "function", "name", "description", "parameters"})."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > limits.max_tools:
        raise bad_request(f"'tools' must be an array of at most {limits.max_tools} functions", "invalid_type", "tools")
    tools = []
    for index, tool in enumerate(raw):
        param = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{param}: only function tools are supported", "unsupported_tool", param)
        tools.append(function_tool(param, param, tool, "parameters", limits))
    return unique_tools(tools, "tools")


def _tool_choice(raw: Any, tools: tuple[Tool, ...]) -> str:
    """auto | none | required | {"type": "function", "name": ...} (that call is forced)."""
    if raw is None:
        return "auto"
    if isinstance(raw, dict) and raw.get("type") == "function" and raw.get("name") in {t.name for t in tools}:
        return raw["name"]
    if raw in ("auto", "none") or (raw == "required" and tools):
        return raw
    raise bad_request(
        "'tool_choice' must be 'auto', 'none', 'required' (with tools) or "
        f'{{"type": "function", "name": ...}} naming one of the tools; got {echo(raw)}',
        "invalid_value",
        "tool_choice",
    )


def _format(text: Any, limits: Limits) -> dict | None:
    """text.format as the response format: None for text, json_object, or json_schema with its schema."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object ({\"format\": ...})", "invalid_type", "text")
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


def output(completion: Completion, tools: ToolFormat | None) -> tuple[list[dict], dict]:
    """The response's output items, and the assistant message to store in the conversation."""
    message = assistant_message(completion.text, tools)
    calls = message.get("tool_calls", [])
    items = [_message_item(message["content"] or "")] if message["content"] or not calls else []
    items += [
        {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex[:24]}",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        for call in calls
    ]
    return items, message


def _message_item(text: str) -> dict:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex[:24]}",
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
        "usage": _usage(completion, trace) if completion is not None and trace is not None and done else None,
    }


def _usage(completion: Completion, trace: Trace) -> dict:
    return {
        "input_tokens": completion.prompt_tokens,
        "input_tokens_details": {"cached_tokens": completion.cached_tokens},
        "output_tokens": completion.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        "strata": trace.summary(),
    }


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
    """Responses streaming events. Text goes out as `response.output_text.delta` while no tool call
    may have started; the final items (calls included) come with `response.completed`. `finished`
    is awaited with the assistant message and the response once the answer is whole (it stores them)."""
    stream = _Events()
    yield stream.event("response.created", response=response_object(response_id, body, None, None, [], previous_id))
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}
    yield stream.event("response.output_item.added", output_index=0, item=item)
    yield stream.event(
        "response.content_part.added",
        item_id=message_id,
        output_index=0,
        content_index=0,
        part={"type": "output_text", "text": "", "annotations": []},
    )
    sent = 0
    try:
        async for _, event in events:
            if isinstance(event, Delta):
                end = sendable(completion.text, tools)
                if end > sent:
                    yield stream.event(
                        "response.output_text.delta",
                        item_id=message_id,
                        output_index=0,
                        content_index=0,
                        delta=completion.text[sent:end],
                    )
                    sent = end
    except ApiError as exc:
        yield stream.event("error", **exc.body()["error"])
        failed = response_object(response_id, body, None, None, [], previous_id)
        yield stream.event("response.failed", response={**failed, "status": "failed", "error": exc.body()["error"]})
        return
    finally:
        await events.aclose()
    items, message = output(completion, tools)
    if items and items[0]["type"] == "message":
        items[0]["id"] = message_id
    text = message["content"] or ""
    yield stream.event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text)
    yield stream.event(
        "response.output_item.done",
        output_index=0,
        item=items[0] if items[0]["type"] == "message" else {**item, "status": "completed", "content": []},
    )
    response = response_object(response_id, body, completion, trace, items, previous_id)
    await finished(message, response)
    yield stream.event("response.completed", response=response)


class _Events:
    def __init__(self):
        self.sequence = 0

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
