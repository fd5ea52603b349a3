"""What a budget buys: the prefix cache's hit-rate curve over every size from one pass over a trace.

    stack_distances(chains, sample_rate=1.0) -> Distances      Mattson's stack algorithm (LRU), SHARDS sampling
    Distances.hit_rate(num_blocks) -> float                    block (= full-block token) hit rate at that size

The pool is an LRU of blocks: a request's blocks are looked up first, then released last block first
when it ends, so a chain's first block is its most recently used. Replaying that order through an
LRU stack gives every lookup its stack distance (how many other blocks were used since its last use):
it hits in any pool of more blocks than that. A block's ancestors are used whenever it is, and later
in the release order, so their distances are never larger: the prefix rule (a hit needs every block
before it) holds at every size. Distances are counted with a Fenwick tree over use times, O(n log n).

SHARDS (Waldspurger et al., FAST'15): only blocks whose hash falls below `sample_rate` of the hash
space are replayed, their distances scaled by 1 / sample_rate — the curve from a fraction of the work.
Blocks that were evicted while in use, pins and the SSD tier are not modelled: the curve is LRU's,
which the simulator (evals.cache_sim) checks against a replay of the pool itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

COLD = -1  # a first use: a miss at every size


@dataclass(frozen=True, slots=True)
class Distances:
    distances: np.ndarray  # per sampled lookup: its stack distance in blocks (scaled), COLD for a first use
    scale: float  # lookups each sampled lookup stands for (1 / sample rate)

    def hit_rate(self, num_blocks: int) -> float:
        if not len(self.distances):
            return 0.0
        warm = self.distances[self.distances != COLD]
        return float(np.count_nonzero(warm < num_blocks)) / len(self.distances)


class _Fenwick:
    def __init__(self, size: int):
        self.tree = [0] * (size + 1)

    def add(self, index: int, delta: int) -> None:
        index += 1
        while index < len(self.tree):
            self.tree[index] += delta
            index += index & -index

    def prefix(self, index: int) -> int:
        """Sum of positions [0, index)."""
        total = 0
        while index > 0:
            total += self.tree[index]
            index -= index & -index
        return total


def sampled(block: str | bytes, sample_rate: float) -> bool:
    """SHARDS' spatial filter: a block is in the sample when its hash (hex, or the raw digest)
    falls below the rate; both forms of one hash give the same answer."""
    prefix = int(block[:8], 16) if isinstance(block, str) else int.from_bytes(block[:4], "big")
    return sample_rate >= 1.0 or prefix < sample_rate * 0x100000000


def stack_distances(chains: Iterable[Sequence], sample_rate: float = 1.0, presampled: bool = False) -> Distances:
    """Each request's chain of block hashes (hex strings; any hashable when `presampled`), in order.
    Lookups are the chain's blocks in order; uses (for recency) are the same blocks released last
    first when the request ends. `presampled`: the chains hold only the blocks `sampled()` kept at
    `sample_rate` already (a live window keeps no more)."""
    requests = [list(chain) if presampled else [b for b in chain if sampled(b, sample_rate)] for chain in chains]
    uses = sum(len(chain) for chain in requests)
    tree, last_use = _Fenwick(uses), dict[str, int]()
    distances: list[float] = []
    now = 0
    for chain in requests:
        for block in chain:
            previous = last_use.get(block)
            if previous is None:
                distances.append(COLD)
            else:  # blocks whose latest use lies after this one's: used since
                distances.append((tree.prefix(now) - tree.prefix(previous + 1)) / min(sample_rate, 1.0))
        for block in reversed(chain):
            previous = last_use.get(block)
            if previous is not None:
                tree.add(previous, -1)
            tree.add(now, 1)
            last_use[block] = now
            now += 1
    return Distances(np.asarray(distances, dtype=np.float64), 1 / min(sample_rate, 1.0))
