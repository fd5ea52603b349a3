"""`strata what-if`: what other RAM and SSD sizes would have given a recorded trace.

The trace (STRATA_TRACE_FILE) is replayed once through Mattson's LRU stack (kvcache.mrc: exact up
to EXACT_UP_TO block lookups, then sampled); the stack distances give the token hit rate at every
size. RAM alone: a hit is a distance below the RAM's blocks. RAM + SSD: the SSD tier taking every
block RAM evicts, least recently used out first, and giving a block back to RAM on a read - one LRU
stack of RAM + SSD blocks whose first RAM blocks are in RAM. The production tier admits only blocks
worth writing (kvcache.ssd's admission) and keeps a file after it is read, so the SSD columns are
what a tier of that size can give at most. TTFT is the tokens recomputed (and read from SSD) per
request times the per-token costs the server logs at start-up ("SSD tier: reading a token's KV
takes R us, computing it C us"), prefill taken as linear in the tokens.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from kvcache.blocktrace import read_trace
from kvcache.mrc import SAMPLE_RATE, Distances, stack_distances

EXACT_UP_TO = 5_000_000  # block lookups: past this the curve is sampled (kvcache.mrc: its SAMPLE_RATE past each head)
RAM_SHARES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)  # of the trace's distinct blocks
GRID_RAM = (0.01, 0.05, 0.1, 0.2, 0.5)
GRID_SSD = (0.0, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class Costs:
    block_bytes: int = 0  # one block's KV bytes (admin stats): sizes in GiB when known
    prefill_us: float = 0.0  # computing a token's KV: TTFT when known
    ssd_read_us: float = 0.0  # reading a token's KV from the SSD tier


@dataclass(frozen=True, slots=True)
class Trace:
    distances: Distances
    requests: int
    lookups: int
    distinct: int
    block_tokens: int
    sampled: bool

    def blocks(self, share: float) -> int:
        return max(1, int(self.distinct * share))

    def per_request(self, rate: float) -> float:
        """Tokens per request that a token rate of the lookups stands for."""
        return rate * self.lookups * self.block_tokens / self.requests


def load(path: Path) -> Trace:
    records = [r for r in read_trace(path) if not r.answered]
    chains = [r.blocks for r in records]
    lookups = sum(map(len, chains))
    if not lookups:
        raise ValueError(f"{path} has no engine request with a full block")
    rate = 1.0 if lookups <= EXACT_UP_TO else SAMPLE_RATE
    distinct = len({b for c in chains for b in c})
    distances = stack_distances(chains, rate)
    return Trace(distances, len(records), lookups, distinct, records[0].block_tokens, rate < 1.0)


def ttft(trace: Trace, ram_blocks: int, ssd_blocks: int, costs: Costs) -> str:
    ram = trace.distances.hit_rate(ram_blocks)
    both = trace.distances.hit_rate(ram_blocks + ssd_blocks)
    seconds = trace.per_request(1 - both) * costs.prefill_us + trace.per_request(both - ram) * costs.ssd_read_us
    return f"{seconds / 1e6:.2f}s" if costs.prefill_us else ""


def size(blocks: int, costs: Costs) -> str:
    return f"{blocks * costs.block_bytes / 2**30:.2f} GiB" if costs.block_bytes else f"{blocks} blocks"


def report(trace: Trace, costs: Costs) -> None:
    kind = "sampled" if trace.sampled else "exact"
    print(f"{trace.requests} requests, {trace.lookups} block lookups, {trace.distinct} distinct blocks ({kind})")
    print("\nRAM alone (LRU)")
    print(f"{'RAM':>16} | {'token hit rate':>14} | {'recomputed tokens/request':>25} | {'TTFT':>7}")
    for blocks in sorted({trace.blocks(share) for share in RAM_SHARES}):  # a small trace repeats sizes
        rate = trace.distances.hit_rate(blocks)
        recomputed = trace.per_request(1 - rate)
        print(f"{size(blocks, costs):>16} | {rate:14.1%} | {recomputed:25.0f} | {ttft(trace, blocks, 0, costs):>7}")
    print("\nRAM + an SSD tier taking every block RAM evicts: token hit rate (and TTFT)")
    ssd_sizes = sorted({trace.blocks(share) if share else 0 for share in GRID_SSD})
    print(f"{'RAM / SSD':>16} | " + " | ".join(f"{size(s, costs) if s else 'none':>16}" for s in ssd_sizes))
    for ram in sorted({trace.blocks(share) for share in GRID_RAM}):
        cells = [f"{trace.distances.hit_rate(ram + ssd):6.1%} {ttft(trace, ram, ssd, costs):>9}" for ssd in ssd_sizes]
        print(f"{size(ram, costs):>16} | " + " | ".join(f"{cell:>16}" for cell in cells))


def what_if(path: Path, costs: Costs) -> int:
    try:
        trace = load(path)
    except (OSError, ValueError) as exc:
        print(f"strata: {exc}", file=sys.stderr)
        return 2
    report(trace, costs)
    return 0
