"""Cut a token sequence into fixed-size blocks and hash them as a chain.

Extra keys (image content hashes) enter only the blocks that hold the image's tokens: a system
prompt before an image stays shareable, and, through the chain, every block after a different image
differs. Only full blocks are hashed: a partial tail block is never cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .keys import BlockHash, block_hash, rejoin, token_bytes


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


@dataclass(frozen=True, slots=True)
class Roots:
    """Where a prompt's chain starts: blocks [0, num_public) chain from the public root (a declared
    public prefix, shared by every tenant); the rest from the tenant's root, joined to the last public
    block (keys.rejoin). num_public == 0: the whole chain is the tenant's.
    Invariant: the public blocks lie wholly inside the declared text and before any image."""

    tenant: BlockHash
    public: BlockHash
    num_public: int = 0

    def parent(self, index: int, hashes: Sequence[BlockHash]) -> BlockHash:
        """The parent hash of block `index` given the hashes before it."""
        if index == 0:
            return self.public if self.num_public else self.tenant
        if index == self.num_public:
            return rejoin(self.tenant, hashes[index - 1])
        return hashes[index - 1]

    def hash_blocks(self, token_ids: Sequence[int], block_size: int, spans: Sequence[ExtraSpan]) -> list[BlockHash]:
        public = hash_blocks(token_ids[: self.num_public * block_size], block_size, self.public)
        return public + hash_blocks(token_ids, block_size, self.parent(len(public), public), spans, len(public))


def public_blocks(public_tokens: int, spans: Sequence[ExtraSpan], block_size: int) -> int:
    """How many leading blocks lie wholly inside the first `public_tokens` tokens and before any image."""
    first_image = min((span.start for span in spans), default=public_tokens)
    return min(public_tokens, first_image) // block_size
