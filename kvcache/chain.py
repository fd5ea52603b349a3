"""Cut a token sequence into fixed-size blocks and hash them as a chain.

Extra keys (image content hashes) enter only the blocks that hold the image's tokens: a system
prompt before an image stays shareable, and, through the chain, every block after a different image
differs. Only full blocks are hashed: a partial tail block is never cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .keys import BlockHash, block_hash, token_bytes


@dataclass(frozen=True, slots=True)
class ExtraSpan:
    """Tokens [start, end) carry `key` (e.g. an image's content hash) into their blocks' hashes."""

    start: int
    end: int
    key: bytes


def hash_blocks(
    token_ids: Sequence[int], block_size: int, root: BlockHash, spans: Sequence[ExtraSpan] = (), first_block: int = 0
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` from block `first_block` on; `root` is the
    parent of that block (the chain root for block 0, else the previous block's hash)."""
    raw = token_bytes(token_ids)
    width = block_size * 4
    hashes: list[BlockHash] = []
    parent = root
    for index in range(first_block, len(token_ids) // block_size):
        begin, end = index * block_size, (index + 1) * block_size
        extra = b"".join(s.key for s in spans if s.start < end and s.end > begin)
        parent = block_hash(parent, raw[index * width : (index + 1) * width], extra)
        hashes.append(parent)
    return hashes
