"""Anthropic's cache diagnostics: a request on /v1/messages that carries `diagnostics:
{previous_message_id}` is told why it could not reuse the prompt of that earlier message's request.

    PromptPrint.of(request, model_fingerprint, key, num_prompt_tokens)   what a request's prompt was made of
    PromptPrints(capacity).remember(tenant, message_id, print) / .recall(tenant, message_id)
    cache_miss(previous, request, current, num_cached_tokens) -> dict | None    the `cache_miss_reason`

A print is content-free: keyed digests (HMAC-SHA256 under the tenant's salt) of the model, the
system prompt, the tools, the conversation and the other prompt-shaping parameters, and counts. The
first part that differs names the reason, in Anthropic's order: model_changed, system_changed,
tools_changed, messages_changed (an earlier message differs, rather than messages only appended),
unavailable (the same prompt with other parameters, e.g. thinking), previous_message_not_found (no
print of that id for this tenant: another tenant's id, or one forgotten). No divergence: None. A
message is remembered only when its request asked for diagnostics (`previous_message_id: null` opts in
on a first turn), in this process (replicas do not share them), the latest `capacity` of them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..engine import ImagePart, Message
from ..requests.schemas import ChatRequest


@dataclass(frozen=True, slots=True)
class PromptPrint:
    model: bytes
    system: bytes
    tools: bytes
    params: bytes
    num_messages: int  # the conversation's messages (after the system prompt)
    messages: bytes  # the conversation, chained message by message
    num_prompt_tokens: int

    @classmethod
    def of(cls, request: ChatRequest, model_fingerprint: str, key: bytes, num_prompt_tokens: int) -> PromptPrint:
        system, conversation = _split(request.messages)
        params = [request.tool_choice, request.response_format, request.switches.thinking, request.switches.effort]
        return cls(
            _digest(key, model_fingerprint),
            _digest(key, [_message(m) for m in system]),
            _digest(key, [[t.name, t.description, t.parameters] for t in request.tools]),
            _digest(key, params),
            len(conversation),
            chained(key, conversation, len(conversation)),
            num_prompt_tokens,
        )


def _split(messages: tuple[Message, ...]) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
    """(the system prompt: the leading system messages, the conversation after it)."""
    count = 0
    while count < len(messages) and messages[count].role in ("system", "developer"):
        count += 1
    return messages[:count], messages[count:]


def chained(key: bytes, conversation: tuple[Message, ...], count: int) -> bytes:
    """A digest of the first `count` messages, each folded into the one before."""
    digest = b""
    for message in conversation[:count]:
        digest = _digest(key, [digest.hex(), _message(message)])
    return digest


def _message(message: Message) -> list:
    parts = [p.url if isinstance(p, ImagePart) else p.text for p in message.parts]
    calls = [[c.id, c.name, c.arguments] for c in message.tool_calls]
    return [message.role, parts, calls, message.tool_call_id, message.reasoning]


def _digest(key: bytes, value: object) -> bytes:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).digest()[:16]


class PromptPrints:
    """The prints of the latest `capacity` messages whose requests asked for diagnostics, by
    (tenant, message id). `lock` guards `prints`: requests remember and recall on the event loop."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self.prints: OrderedDict[tuple[str, str], PromptPrint] = OrderedDict()
        self.lock = threading.Lock()

    def remember(self, tenant: str, message_id: str, print_: PromptPrint) -> None:
        with self.lock:
            self.prints[(tenant, message_id)] = print_
            while len(self.prints) > self.capacity:
                self.prints.popitem(last=False)

    def recall(self, tenant: str, message_id: str) -> PromptPrint | None:
        with self.lock:
            return self.prints.get((tenant, message_id))


def cache_miss(
    previous: PromptPrint | None, request: ChatRequest, current: PromptPrint, key: bytes, num_cached_tokens: int
) -> dict | None:
    """The `cache_miss_reason` of `current` against the previous message's request; None when the
    prompt continued it (whatever the cache then held)."""
    if previous is None:
        return {"type": "previous_message_not_found"}
    missed = max(0, min(previous.num_prompt_tokens, current.num_prompt_tokens) - num_cached_tokens)
    conversation = _split(request.messages)[1]
    for kind, same in (
        ("model_changed", previous.model == current.model),
        ("system_changed", previous.system == current.system),
        ("tools_changed", previous.tools == current.tools),
        (
            "messages_changed",
            previous.num_messages <= current.num_messages
            and chained(key, conversation, previous.num_messages) == previous.messages,
        ),
    ):
        if not same:
            return {"type": kind, "cache_missed_input_tokens": missed}
    return None if previous.params == current.params else {"type": "unavailable"}
