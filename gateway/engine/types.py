"""The engine's own request types: a chat as the model runs it. The HTTP edge (gateway/schemas.py)
validates OpenAI bodies into these; nothing here knows HTTP."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """Where an image stands in a message. The engine takes the decoded images separately, in order;
    `url` is the client's reference, kept for the edge that loads it."""

    url: str


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system | developer | user | assistant | tool
    parts: tuple[TextPart | ImagePart, ...]


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float  # 0: greedy (top_p and seed then change nothing)
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
