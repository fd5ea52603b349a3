"""What a budget buys: the prefix cache's hit-rate curve over every size from one pass over a trace.

    stack_distances(chains, sample_rate=1.0) -> Distances      Mattson's stack algorithm (LRU), sampled
    Distances.hit_rate(num_blocks) -> float                    block (= full-block token) hit rate at that size

The pool is an LRU of blocks: a request's blocks are looked up first, then released last block first
when it ends, so a chain's first block is its most recently used. Replaying that order through an
LRU stack gives every lookup its stack distance (how many other blocks were used since its last use):
it hits in any pool of more blocks than that. A block's ancestors are used whenever it is, and later
in the release order, so their distances are never larger: the prefix rule (a hit needs every block
before it) holds at every size. Distances are counted with a Fenwick tree over use times, O(n log n).

Sampling (SHARDS, Waldspurger et al., FAST'15, adapted to prefix trees): a chain's first HEAD blocks
are always kept, and a deeper block only when its hash falls below `sample_rate` of the hash space.
A kept block stands for 1 / (its keep rate) blocks, both in the distances it adds to and in the hit
rate (Horvitz-Thompson weights). Plain SHARDS samples every block alike and is off by up to 5.5
points on a RAG trace at 10%: a handful of shared system-prompt blocks carry a quarter of all lookups,
and whether 1 or 3 of them fall in the sample swings the curve. The head holds exactly those blocks
(every block of a chain's start is as shared as a block can be), so with it the sampled curve stays
within 1.5 points of the exact one on every synthetic trace (evals.cache_sim) while the long chains
of agents are still sampled at the rate.
Blocks that were evicted while in use, pins and the SSD tier are not modelled: the curve is LRU's,
which the simulator (evals.cache_sim) checks against a replay of the pool itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

HEAD = 64  # a chain's first blocks, always kept when sampling
SAMPLE_RATE = 0.1  # past the head, when a curve is sampled: the rate evals.cache_sim checks it at
COLD = np.inf  # a first use: a miss at every size


@dataclass(frozen=True, slots=True)
class Distances:
    distances: np.ndarray  # per kept lookup: its stack distance in blocks (estimated), COLD for a first use
    weights: np.ndarray  # per kept lookup: the lookups it stands for (1 / its keep rate)

    def hit_rate(self, num_blocks: int) -> float:
        total = float(self.weights.sum())
        return float(self.weights[self.distances < num_blocks].sum()) / total if total else 0.0


class _Fenwick:
    def __init__(self, size: int):
        self.tree = [0.0] * (size + 1)

    def add(self, index: int, delta: float) -> None:
        index += 1
        while index < len(self.tree):
            self.tree[index] += delta
            index += index & -index

    def prefix(self, index: int) -> float:
        """Sum of positions [0, index)."""
        total = 0.0
        while index > 0:
            total += self.tree[index]
            index -= index & -index
        return total


def sampled(block: str | bytes, sample_rate: float) -> bool:
    """The hash filter for blocks past the head: a block is in the sample when its hash (hex, or
    the raw digest) falls below the rate; both forms of one hash give the same answer."""
    prefix = int(block[:8], 16) if isinstance(block, str) else int.from_bytes(block[:4], "big")
    return sample_rate >= 1.0 or prefix < sample_rate * 0x100000000


def kept(chain: Sequence, sample_rate: float) -> list:
    """The blocks of a chain the sample keeps, in order: the first HEAD, then the sampled ones."""
    if sample_rate >= 1.0:
        return list(chain)
    return list(chain[:HEAD]) + [b for b in chain[HEAD:] if sampled(b, sample_rate)]


def stack_distances(chains: Iterable[Sequence], sample_rate: float = 1.0, presampled: bool = False) -> Distances:
    """Each request's chain of block hashes (hex strings; any hashable when `presampled`), in order.
    Lookups are the chain's blocks in order; uses (for recency) are the same blocks released last
    first when the request ends. `presampled`: the chains are `kept()` at `sample_rate` already (a
    live window keeps no more): their first HEAD entries are the chain's head."""
    requests = [list(chain) if presampled else kept(chain, sample_rate) for chain in chains]
    deep = 1 / min(sample_rate, 1.0)  # what a sampled block past the head stands for
    uses = sum(len(chain) for chain in requests)
    tree, last_use = _Fenwick(uses), dict[object, int]()
    distances, weights = np.empty(uses), np.empty(uses)
    now = 0
    for chain in requests:
        weight = [1.0 if depth < HEAD else deep for depth in range(len(chain))]
        for depth, block in enumerate(chain):
            previous = last_use.get(block)
            # the weight of the blocks whose latest use lies after this one's: used since
            distances[now + depth] = COLD if previous is None else tree.prefix(now) - tree.prefix(previous + 1)
            weights[now + depth] = weight[depth]
        for depth in range(len(chain) - 1, -1, -1):
            block = chain[depth]
            previous = last_use.get(block)
            if previous is not None:
                tree.add(previous, -weight[depth])
            tree.add(now, weight[depth])
            last_use[block] = now
            now += 1
    return Distances(distances, weights)
