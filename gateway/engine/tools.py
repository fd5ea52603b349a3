"""Tool calls in one model's own format: how tools and calls enter the prompt, the grammar that forces
a well-formed call, and the calls parsed back out of the reply.

The format comes from the chat template, as mlx-vlm's servers pick it (`mlx_vlm.tools`: a template
that writes `<tool_call>` and `tool_call.name` is Hermes-style JSON, one with `[TOOL_CALLS]` is
Mistral's, ...), and so does the parser. A template that does not render `tools` at all gets them
from Strata in the Hermes style: a system block listing the functions, earlier calls as
`<tool_call>` text, results as `<tool_response>` user turns.

Forced calls (tool_choice "required" or a named function) are decoded under a grammar of the
format's markers around JSON that matches {"name": <one of the tools>, "arguments": <its parameter
schema>}, so the call is well formed whatever the weights are.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from .constraint import JSON_OPTIONS, GrammarError, lark_grammar
from .types import Tool

HERMES = "json_tools"
CONSTRAINABLE = (HERMES, "mistral")  # formats whose call can be forced by a grammar

HERMES_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class ToolFormat:
    def __init__(self, chat_template: str | None):
        from mlx_vlm.tools import _infer_tool_parser, load_tool_module

        inferred = _infer_tool_parser(chat_template) if chat_template else None
        self.native = inferred is not None and "tools" in (chat_template or "")
        self.kind = inferred if self.native else HERMES
        self.module = load_tool_module(self.kind)
        self.start = self.module.tool_call_start
        self.end = self.module.tool_call_end
        self.max_calls: int | None = None  # calls parse() keeps at most (None: all)

    def limited(self, max_calls: int | None) -> ToolFormat:
        """The same format keeping at most `max_calls` calls of a reply (parallel tool calls off)."""
        if max_calls is None:
            return self
        limited = copy.copy(self)
        limited.max_calls = max_calls
        return limited

    # -- the prompt ------------------------------------------------------------------------------

    def template_messages(self, messages: list[dict], tools: tuple[Tool, ...]) -> tuple[list[dict], list[dict] | None]:
        """The template's messages and its `tools` argument. Natively the template renders both;
        otherwise the tools become a system block and calls and results become plain text."""
        specs = [tool_spec(tool) for tool in tools]
        if self.native:
            return messages, specs or None
        if not specs and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return messages, None
        return _as_text(messages, specs), None

    # -- the reply -------------------------------------------------------------------------------

    def grammar(self, tools: tuple[Tool, ...], name: str | None) -> str:
        """A grammar for exactly one call: of the function `name`, or of any of `tools`."""
        if self.kind not in CONSTRAINABLE:
            raise GrammarError(f"this model's tool-call format ({self.kind}) cannot be forced; use tool_choice 'auto'")
        chosen = [tool for tool in tools if name is None or tool.name == name]
        calls, defs = zip(*(_call_schema(tool, f"tool{index}") for index, tool in enumerate(chosen)))
        call = {"anyOf": list(calls)} if len(calls) > 1 else calls[0]
        shared = {"$defs": {k: v for tool_defs in defs for k, v in tool_defs.items()}} if any(defs) else {}
        if self.kind == "mistral":
            body = {"type": "array", "items": call, "minItems": 1, "maxItems": 1, **shared}
            lark = f"start: {json.dumps(self.start)} call\ncall: %json {json.dumps(_with_options(body))}\n"
        else:
            lark = (
                f"start: {json.dumps(self.start + chr(10))} call {json.dumps(chr(10) + self.end)}\n"
                f"call: %json {json.dumps(_with_options({**call, **shared}))}\n"
            )
        return lark_grammar(lark)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The reply's text outside the calls, and the calls (those that parse; others stay text)."""
        from mlx_vlm.tools import process_tool_calls

        result = process_tool_calls(text, self.module, None)
        if not result.calls:
            return text, []
        calls = [ParsedCall(c["function"]["name"], c["function"]["arguments"]) for c in result.calls]
        return result.remaining_text, calls[: self.max_calls]

    def may_start_call(self, text: str) -> int:
        """Where in `text` a call starts or may start (its marker, or a prefix of it at the very end);
        len(text) when none can: streaming holds back everything from there."""
        at = text.find(self.start) if self.start else -1
        if at >= 0:
            return at
        for size in range(min(len(self.start), len(text)), 0, -1):
            if text.endswith(self.start[:size]):
                return len(text) - size
        return len(text)


def tools_text(tools: tuple[Tool, ...]) -> str:
    """Tools offered in the middle of a conversation, as a system block in the Hermes style (the
    format most templates were trained near): their specs, and how to call them."""
    return HERMES_PREAMBLE.format(tools="\n".join(json.dumps(tool_spec(tool), ensure_ascii=False) for tool in tools))


def tool_spec(tool: Tool) -> dict:
    """A tool as chat templates take it (OpenAI's shape)."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": json.loads(tool.parameters)},
    }


def call_spec(call) -> dict:
    """An earlier call as chat templates take it: arguments as an object where they parse as one."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _call_schema(tool: Tool, prefix: str) -> tuple[dict, dict]:
    """One call's schema ({"name": const, "arguments": the parameters}) and the definitions its
    arguments refer to, to be placed at the root of the whole schema (see _rooted)."""
    arguments, defs = _rooted(json.loads(tool.parameters), prefix)
    schema = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return schema, defs


def _rooted(parameters: dict, prefix: str) -> tuple[dict, dict]:
    """A tool's parameters moved under a call's schema, whose root is no longer theirs: their
    `$defs` (or `definitions`) become root definitions named `{prefix}.{name}` (tools may use the same
    names), and every `$ref` is rewritten to match; a reference to the parameters' own root ("#",
    "#/properties/...") points at a copy of them kept as the definition `prefix`. Parameters without
    references are kept as they are."""
    if not _has_refs(parameters):
        return parameters, {}
    own = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    defs = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    renamed = {f"{prefix}.{name}": _rewrite_refs(schema, prefix) for name, schema in defs.items()}
    renamed[prefix] = _rewrite_refs(own, prefix)
    return {"$ref": f"#/$defs/{prefix}"}, renamed


def _has_refs(node: object) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_refs(value) for value in node.values())
    return isinstance(node, list) and any(_has_refs(value) for value in node)


def _rewrite_refs(node: object, prefix: str) -> object:
    if isinstance(node, list):
        return [_rewrite_refs(value, prefix) for value in node]
    if not isinstance(node, dict):
        return node
    out = {key: _rewrite_refs(value, prefix) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str):
        out["$ref"] = _rewritten(ref, prefix)
    return out


def _rewritten(ref: str, prefix: str) -> str:
    for defs in ("#/$defs/", "#/definitions/"):
        if ref.startswith(defs):
            name, _, rest = ref[len(defs) :].partition("/")
            return f"#/$defs/{prefix}.{name}" + (f"/{rest}" if rest else "")
    if ref == "#" or ref.startswith("#/"):
        return f"#/$defs/{prefix}" + ref[1:]
    return ref  # an external or anchor reference: llguidance says what it makes of it


def _with_options(schema: dict) -> dict:
    return {**schema, "x-guidance": JSON_OPTIONS}


def _as_text(messages: list[dict], specs: list[dict]) -> list[dict]:
    """Hermes-style tools for a template that knows none: a system block, calls and results as text."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{_text(message)}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = "\n".join(
                f"<tool_call>\n{json.dumps(_hermes_call(c), ensure_ascii=False)}\n</tool_call>"
                for c in message["tool_calls"]
            )
            text = _text(message)
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append(message)
    if specs:
        block = HERMES_PREAMBLE.format(tools="\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs))
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _hermes_call(call: dict) -> dict:
    function = call["function"]
    return {"name": function["name"], "arguments": function["arguments"]}


def _text(message: dict) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)
