"""Block-level traces of prefix-cache traffic: what a cache policy is judged on, and nothing else.

    TraceRecord(t, tenant, blocks, block_tokens, answered)   one request
    record.line() -> str ; TraceRecord.parse(line) -> TraceRecord
    read_trace(path) -> [TraceRecord]                          JSON lines; a malformed line: ValueError with its number

A record holds when the request came (seconds), an opaque tenant id, the chain of its prompt's full
blocks as short hex hashes (the first 8 bytes of the salted block hashes: no text, and nothing that
links two tenants' blocks), how many tokens a block holds, and whether a response layer (exact or
semantic) answered it, in which case the engine never looked its blocks up (`blocks` is empty).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HASH_CHARS = 16  # 8 bytes of a block hash: collisions stay below one in a billion at 10^5 blocks


@dataclass(frozen=True, slots=True)
class TraceRecord:
    t: float
    tenant: str
    blocks: tuple[str, ...]
    block_tokens: int
    answered: bool = False

    def line(self) -> str:
        return json.dumps(
            {"t": round(self.t, 3), "tenant": self.tenant, "blocks": list(self.blocks), "bs": self.block_tokens}
            | ({"answered": True} if self.answered else {}),
            separators=(",", ":"),
        )

    @staticmethod
    def parse(line: str) -> TraceRecord:
        raw = json.loads(line)
        blocks = raw["blocks"]
        if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
            raise ValueError("'blocks' must be a list of hex strings")
        return TraceRecord(
            float(raw["t"]), str(raw["tenant"]), tuple(blocks), int(raw["bs"]), bool(raw.get("answered"))
        )


def short_hash(block_hash: bytes) -> str:
    return block_hash.hex()[:HASH_CHARS]


def read_trace(path: Path) -> Iterator[TraceRecord]:
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield TraceRecord.parse(line)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record ({exc})") from None
