"""The engine's own request types: a chat as the model runs it. The HTTP edge (gateway/requests/schemas.py)
validates OpenAI bodies into these; nothing here knows HTTP."""

from __future__ import annotations

from dataclasses import dataclass

from .constraint import CompiledGrammar


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """Where an image (or a video) stands in a message. The engine takes the decoded images and
    videos separately, in order; `url` is the client's reference, kept for the edge that loads it."""

    url: str
    video: bool = False  # a video_url part: its frames go through the family's video processing


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the assistant made, as the conversation history carries it back."""

    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system | developer | user | assistant | tool
    parts: tuple[TextPart | ImagePart, ...]
    tool_calls: tuple[ToolCall, ...] = ()  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    reasoning: str = ""  # assistant messages: the thinking the answer came with, as the client sent it back


@dataclass(frozen=True, slots=True)
class Switches:
    """What a request asks of the chat template's switches; None: the template's default. The prompt
    builder sets the variables the model's template has (Qwen3's enable_thinking, gpt-oss's
    reasoning_effort) and says which asks found none."""

    thinking: bool | None = None  # think before answering (Anthropic `thinking`)
    effort: str | None = None  # none | minimal | low | medium | high | xhigh | max (OpenAI and Anthropic effort)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: its JSON-schema parameters, as canonical JSON text."""

    name: str
    description: str
    parameters: str


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float  # 0: greedy (top_p, top_k, min_p and seed then change nothing)
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    # OpenAI's penalties over the tokens generated so far: each logit loses presence_penalty once the
    # token has appeared and frequency_penalty per appearance (greedy decoding too).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    top_k: int = 0  # 0: off; else sample among the k most likely
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    # An llguidance grammar every generated token must follow (structured output, forced tool calls);
    # the row ends once the grammar is complete. None: free text.
    grammar: str | CompiledGrammar | None = None  # compiled before admission (Engine.compile_grammar)
    top_logprobs: int | None = None  # None: no logprobs; else the chosen token's and this many alternatives


@dataclass(frozen=True, slots=True)
class Pin:
    """Keep the full KV blocks of the prompt's first `num_tokens` tokens for ttl_s seconds: LRU does not
    evict them meanwhile (within the tenant's pin budget); past the TTL they are ordinary blocks.
    In RAM (Anthropic cache_control), or on the SSD tier (OpenAI prompt_cache_retention "24h")."""

    num_tokens: int
    ttl_s: float
    on_ssd: bool = False  # pinned on the SSD tier (written there now) rather than held in RAM
