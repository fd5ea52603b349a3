"""Scope: what must be identical for a cached answer to be served at all.

Every stored entry and every lookup carries one. The exact cache folds it into its key; the
semantic cache uses it (plus a context fingerprint) as the partition of its vector index, so a
search can never even see another tenant's or another version's entries.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

VERSION_FIELDS = ("prompt_version", "policy_version", "data_version", "locale")


@dataclass(frozen=True, slots=True)
class Scope:
    tenant: str
    model: str  # model fingerprint
    prompt_version: str = ""
    policy_version: str = ""
    data_version: str = ""
    locale: str = ""

    def partition(self, context_fingerprint: str) -> str:
        """The semantic index partition: scope plus the conversation's context."""
        return digest("partition", {**asdict(self), "context": context_fingerprint})

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def context_fingerprint(system_and_history: list, image_hashes: list[str]) -> str:
    """Digest of everything but the last user message: system prompt, tools, earlier turns, images."""
    return digest("context", {"messages": system_and_history, "images": image_hashes})


def digest(kind: str, payload: dict) -> str:
    """SHA-256 of canonical JSON (sorted keys, no spaces), domain-separated by `kind`."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"strata-{kind}-v1|".encode() + canonical.encode()).hexdigest()
