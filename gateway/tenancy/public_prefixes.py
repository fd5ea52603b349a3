"""Public prefixes: texts an operator declares public (a system prompt, a tool list that a hundred
tenants' agents all send), whose KV blocks every tenant shares instead of each keeping its own copy.

    PublicPrefixes(prepare, limits).declare({"system"?, "tools"?}) -> PublicPrefix   400 on bad input
    .remove(id) -> bool ; .listed() -> [PublicPrefix]
    .match(token_ids) -> int      how many leading tokens of a prompt are a declared prefix (0: none)
    load_file(path) -> [dict]     the declarations of STRATA_PUBLIC_PREFIXES_FILE (a JSON list)

A declaration stands for the tokens the model's chat template makes of it: the common start of the
prompts [system, user "a"] and [system, user "b"] under its tools, i.e. the text and the template
tokens that follow it up to the first user message's content. A prompt qualifies only when it starts
with exactly those tokens; the engine then hashes the blocks wholly inside them from a public root
(kvcache.Roots) and everything after them from the tenant's own. What a public block holds is the
declared text's KV, which any tenant could compute: sharing it reveals nothing but that someone sent
the public text. Declarations live in memory (the file is read at start-up); the admin API changes
this replica only, so a cluster declares them in the file.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import Message, PreparedPrompt, TextPart
from ..requests.errors import bad_request
from ..requests.schemas import parse_tools
from ..settings import Limits

MAX_DECLARED = 64  # each is compared with every prompt's first tokens


@dataclass(frozen=True, slots=True)
class PublicPrefix:
    id: str  # a digest of the declaration
    declaration: dict[str, Any]  # as declared: {"system"?: str, "tools"?: [...]}
    token_ids: tuple[int, ...]

    def shown(self) -> dict[str, Any]:
        return {"id": self.id, "tokens": len(self.token_ids), **self.declaration}


class PublicPrefixes:
    """Invariant: `declared` maps id -> PublicPrefix, longest token prefix first (match takes the
    first that a prompt starts with, so the longest). Any thread: `lock` guards `declared`."""

    def __init__(self, prepare: Callable[..., PreparedPrompt], limits: Limits):
        self.prepare = prepare
        self.limits = limits
        self.lock = threading.Lock()
        self.declared: dict[str, PublicPrefix] = {}

    def declare(self, declaration: Any) -> PublicPrefix:
        checked = _checked(declaration)
        others: list[str] = []
        tools = parse_tools({"tools": checked.get("tools")}, self.limits, others)
        if others:
            raise bad_request(
                f"a public prefix offers function tools only; not {', '.join(others)}", "invalid_value", "tools"
            )
        system = (Message("system", (TextPart(checked["system"]),)),) if "system" in checked else ()
        first, second = (self.prepare((*system, Message("user", (TextPart(text),))), [], tools) for text in "ab")
        prefix = PublicPrefix(_digest(checked), checked, _common(first.token_ids, second.token_ids))
        with self.lock:
            if prefix.id not in self.declared and len(self.declared) >= MAX_DECLARED:
                raise bad_request(f"at most {MAX_DECLARED} public prefixes may be declared", "too_many", "system")
            declared = {**self.declared, prefix.id: prefix}
            self.declared = dict(sorted(declared.items(), key=lambda item: -len(item[1].token_ids)))
        return prefix

    def remove(self, prefix_id: str) -> bool:
        with self.lock:
            return self.declared.pop(prefix_id, None) is not None

    def listed(self) -> list[PublicPrefix]:
        with self.lock:
            return list(self.declared.values())

    def match(self, token_ids: tuple[int, ...]) -> int:
        with self.lock:
            declared = list(self.declared.values())
        for prefix in declared:
            size = len(prefix.token_ids)
            if len(token_ids) > size and token_ids[:size] == prefix.token_ids:
                return size
        return 0


def load_file(path: Path) -> list:
    """The declarations in a public-prefixes file; ValueError naming the file when it is not a JSON list."""
    try:
        declared = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"STRATA_PUBLIC_PREFIXES_FILE {path}: {exc}") from None
    if not isinstance(declared, list):
        raise ValueError(f"STRATA_PUBLIC_PREFIXES_FILE {path}: a JSON list of {{system, tools}} objects is expected")
    return declared


def _checked(declaration: Any) -> dict[str, Any]:
    if not isinstance(declaration, dict) or not declaration or set(declaration) - {"system", "tools"}:
        raise bad_request(
            "a public prefix is an object with 'system' (a string) and/or 'tools'", "invalid_value", "system"
        )
    system = declaration.get("system")
    if system is not None and (not isinstance(system, str) or not system):
        raise bad_request("'system' must be a non-empty string", "invalid_value", "system")
    return {key: value for key, value in declaration.items() if value is not None}


def _digest(declaration: dict[str, Any]) -> str:
    canonical = json.dumps(declaration, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(b"strata-public-prefix-v1|" + canonical.encode()).hexdigest()[:16]


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    size = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:size]
