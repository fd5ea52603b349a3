"""Prompts kept cacheable: rules that remove volatile lines from system messages before any cache
key or prompt token is computed, so two requests that differ only there share every layer.

    Normalizer(rules, off_tenants).apply(request, tenant) -> (request, changed)

The rules are data (`normalize_rules.json` beside this module is the default and documents the
format): RE2 patterns, linear in the text whatever the pattern, matched in system and developer
messages only; the user's own words are never rewritten.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import re2

from ..engine import ImagePart, Message, TextPart
from .schemas import ChatRequest

DEFAULT_RULES_FILE = Path(__file__).with_name("normalize_rules.json")
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    pattern: str
    replace: str


def load_rules(path: Path = DEFAULT_RULES_FILE) -> tuple[Rule, ...]:
    """Read and compile-check a rules file; ValueError names the bad rule."""
    raw = json.loads(Path(path).read_text())
    rules = tuple(Rule(item["name"], item["pattern"], item.get("replace", "")) for item in raw["rules"])
    for rule in rules:
        try:
            re2.compile(rule.pattern)
        except re2.error as exc:
            raise ValueError(f"normalisation rule {rule.name!r}: {rule.pattern!r} is not valid RE2: {exc}") from None
    return rules


class Normalizer:
    def __init__(self, rules: tuple[Rule, ...], off_tenants: tuple[str, ...] = ()):
        self.rules = [(re2.compile("(?m)" + rule.pattern), rule.replace) for rule in rules]  # ^ $ at line ends
        self.off_tenants = frozenset(off_tenants)

    def apply(self, request: ChatRequest, tenant: str) -> tuple[ChatRequest, bool]:
        """The request with its system messages' volatile lines removed; True when one was."""
        if not self.rules or tenant in self.off_tenants:
            return request, False
        messages = tuple(self._message(m) if m.role in SYSTEM_ROLES else m for m in request.messages)
        if messages == request.messages:
            return request, False
        return replace(request, messages=messages), True

    def _message(self, message: Message) -> Message:
        parts: list[TextPart | ImagePart] = []
        for part in message.parts:
            if isinstance(part, TextPart):
                text = self._text(part.text)
                if text or not part.text:
                    parts.append(TextPart(text))
            else:
                parts.append(part)
        return replace(message, parts=tuple(parts) or (TextPart(""),))

    def _text(self, text: str) -> str:
        for pattern, replacement in self.rules:
            text = pattern.sub(replacement, text)
        return text
