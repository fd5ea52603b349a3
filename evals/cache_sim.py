"""The prefix cache's eviction replayed on block traces, against the best any policy could do.

    python -m evals.cache_sim --all [--json FILE]               every synthetic trace, three budgets each
    python -m evals.cache_sim --trace FILE --budgets N [N ...]  a recorded trace (STRATA_TRACE_FILE), budgets in blocks

Each trace (evals.trace_gen) is replayed through kvcache's own BlockPool — the production class, not
a re-implementation — the way a PrefixSession drives it: a request looks its chain up block by block
until the first miss (acquiring what it finds), stores the rest (a block already cached is acquired,
not stored again), and releases everything last block first when it ends. Twice: `lru` (one LRU
queue, the policy before) and `strata` (the segmented LRU the pool runs now). Then the offline
optimum: Belady's MIN on the prefix tree — on a miss the block is cached and, past the budget, the
cached block whose next use is farthest goes; a block is used whenever a later block of its chain is,
so its children's next uses are never nearer and ties go to the deeper block: leaves leave first. A
block never used again need not be cached at all. And the same optimum holding each running
request's blocks (`held`): the engine keeps a running request's KV under the same budget, so no
policy of this engine can skip them while it runs; the plain optimum is an ideal cache's bound.
With an SSD tier (SsdModel: the production admission rule, segment index and capacity rule), the
optimum is MIN over RAM and SSD together. Budgets are in blocks, relative to the trace's
working set (its distinct blocks): small 5%, medium 20%, large 50%. Rates are token hit rates over
full-block tokens (every block holds the same tokens): lookups that reused a cached block.

Also printed: the hot traffic's hit rate on the scan trace (its chat requests, not the flood) beside
the same chat traffic without the flood, and the LRU curve from stack distances (kvcache.mrc) beside
the replayed LRU at each budget, exact and sampled (kvcache.mrc: each chain's head and 10% of the
rest), beside the segmented pool's replayed rate.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvcache import BlockHash
from kvcache.blocktrace import TraceRecord, read_trace
from kvcache.mrc import SAMPLE_RATE, stack_distances
from kvcache.pool import Block, BlockPool
from kvcache.segment import SEGMENT_BLOCKS
from kvcache.ssd import AdmissionPolicy, ReuseMeter, segments_to_remove, spill_admits
from kvcache.ssd_index import SegmentIndex

from .trace_gen import KINDS, generate

BUDGETS = {"small": 0.05, "medium": 0.20, "large": 0.50}  # of the working set's blocks
BLOCK_BYTES = 1  # every block costs the same: budgets are in blocks
SSD_TIMES_RAM = 4  # the SSD tier's capacity beside each RAM budget


class SsdModel:
    """The SSD tier as the simulator keeps it, from the production parts: the admission rule
    (AdmissionPolicy, with the ReuseMeter's measured reuse unless `measured` is False), the segment
    index (SegmentIndex, in a temporary folder) and the capacity rule (segments_to_remove: whole
    segments out, least recently read first). Blocks spilled while one request runs are written
    together, in segments of up to SEGMENT_BLOCKS, as the tier's writer batches a burst of evictions;
    times are the trace's. No files: a segment is its index entry. `written` counts blocks written."""

    def __init__(self, capacity_blocks: int, admission: AdmissionPolicy | None = None, measured: bool = True):
        self.folder = tempfile.TemporaryDirectory(prefix="strata-cache-sim-")
        self.index = SegmentIndex(Path(self.folder.name) / "index.sqlite")
        self.index.db.execute("PRAGMA synchronous=OFF")  # a throwaway file: no fsync per segment
        self.index.db.execute("PRAGMA journal_mode=MEMORY")
        self.capacity_bytes = capacity_blocks * BLOCK_BYTES
        self.admission = admission or AdmissionPolicy()  # the server's defaults
        self.reuse = ReuseMeter() if measured else None
        self.queued: dict[str, int] = {}  # spilled while the current request runs: hex hash -> bytes
        self.written = 0

    def asked_again(self, key: BlockHash) -> None:
        """A block absent from RAM was asked for (PrefixSession._new_block tells the meter)."""
        if self.reuse is not None:
            self.reuse.asked_again(key)

    def spill(self, block: Block) -> None:
        """PrefixCache's on_evict: an admitted block the tier lacks is queued for the writer."""
        hex_hash = block.block_hash.hex()
        if spill_admits(self.admission, self.reuse, block) and not self.index.contains(hex_hash):
            self.queued[hex_hash] = BLOCK_BYTES

    def write(self, now: float) -> None:
        """The writer's turn: the queued blocks as segments, then the capacity rule."""
        blocks = list(self.queued.items())
        self.queued.clear()
        for start in range(0, len(blocks), SEGMENT_BLOCKS):
            sizes = dict(blocks[start : start + SEGMENT_BLOCKS])
            self.index.add(f"seg-{uuid.uuid4().hex}", sum(sizes.values()), now, sizes)
            self.written += len(sizes)
        for name, _ in segments_to_remove(self.index, self.capacity_bytes, math.inf, set(), now):
            self.index.forget(name)

    def read(self, key: BlockHash, now: float) -> bool:
        """Whether the tier holds the block (a read refreshes its segment)."""
        name = self.index.segments_of([key.hex()])[0]
        if name is not None:
            self.index.touch(name, now)
        return name is not None


def replay(
    records: Sequence[TraceRecord], budget_blocks: int, segmented: bool, ssd: SsdModel | None = None
) -> list[int]:
    """Blocks each request reused, replayed through the production pool (and the SSD tier's rule)."""
    pool = BlockPool(budget_blocks * BLOCK_BYTES, on_evict=ssd.spill if ssd else None, segmented=segmented)
    reused = []
    for record in records:
        held: list[Block] = []
        hits, parent = 0, None
        for index, hex_hash in enumerate(record.blocks):
            key = BlockHash(bytes.fromhex(hex_hash))
            block = pool.get(key)
            matching = hits == len(held)  # every block before it was a hit
            if block is not None:
                pool.acquire(block)
            else:
                end = (index + 1) * record.block_tokens
                if ssd is not None:
                    ssd.asked_again(key)
                block = pool.insert(Block(key, nbytes=BLOCK_BYTES, parent_hash=parent, end_token=end))
                if block is None:
                    break  # the budget is all held by this request: the rest is not stored
                if not (matching and ssd is not None and ssd.read(key, record.t)):
                    matching = False  # computed, not reused (a block promoted from SSD is reused)
            if matching:
                block.num_hits += 1
                hits += 1
            held.append(block)
            parent = key
        reused.append(hits)
        for block in reversed(held):
            pool.release(block)
        if ssd is not None:
            ssd.write(record.t)
    return reused


def optimum(records: Sequence[TraceRecord], budget_blocks: int, hold_running: bool = False) -> list[int]:
    """Blocks each request reused under Belady's MIN on the prefix tree. `hold_running`: a request's
    blocks (up to the budget) are all cached while it runs, as the engine holds a running request's
    KV under the same budget, and only the others may leave to make room - the best any policy of
    this engine could do; without it, the bound of an ideal cache that may skip any block."""
    next_use = _next_uses(records)
    cached: dict[str, float] = {}  # block -> its next use (request index; inf: none; HELD: running)
    heap: list[tuple[float, int, str]] = []  # (-next use, -depth, block); stale entries skipped
    reused = []
    for index, record in enumerate(records):
        chain = record.blocks[:budget_blocks] if hold_running else record.blocks
        hits = _hits(chain, cached)
        if hold_running:
            cached.update(dict.fromkeys(chain, HELD))  # their heap entries go stale: none can leave now
            _evict(cached, heap, budget_blocks)
        for depth, (block, following) in enumerate(zip(chain, next_use[index])):
            if block in cached or following != math.inf:
                cached[block] = following
                heapq.heappush(heap, (-following, -depth, block))
            _evict(cached, heap, budget_blocks)
        reused.append(hits)
    return reused


HELD = -1.0  # a running request's block: no heap entry matches it


def _hits(chain: Sequence[str], cached: dict[str, float]) -> int:
    hits = 0
    while hits < len(chain) and chain[hits] in cached:
        hits += 1
    return hits


def _evict(cached: dict[str, float], heap: list[tuple[float, int, str]], budget_blocks: int) -> None:
    """Past the budget, the cached block used farthest ahead goes (ties: the deepest)."""
    while len(cached) > budget_blocks:
        far, _, victim = heapq.heappop(heap)
        if cached.get(victim) == -far:
            del cached[victim]


def _next_uses(records: Sequence[TraceRecord]) -> list[list[float]]:
    """For each request's blocks: the index of the next request that uses the block (inf: none)."""
    following: dict[str, float] = {}
    result: list[list[float]] = [[] for _ in records]
    for index in range(len(records) - 1, -1, -1):
        result[index] = [following.get(block, math.inf) for block in records[index].blocks]
        for block in records[index].blocks:
            following[block] = index
    return result


def rate(records: Sequence[TraceRecord], reused: Sequence[int], only=None) -> float:
    chosen = [i for i in range(len(records)) if only is None or only(records[i])]
    total = sum(len(records[i].blocks) for i in chosen)
    return sum(reused[i] for i in chosen) / total if total else 0.0


def working_set(records: Sequence[TraceRecord]) -> int:
    return len({block for record in records for block in record.blocks})


def compare(records: Sequence[TraceRecord], budget_blocks: int) -> dict:
    """Token hit rates of the RAM tier alone, and with an SSD tier SSD_TIMES_RAM times its size
    (the optimum then: MIN over both together; `written`: blocks the SSD tier wrote)."""
    records = [r for r in records if not r.answered]
    result: dict = {
        "lru": rate(records, replay(records, budget_blocks, segmented=False)),
        "strata": rate(records, replay(records, budget_blocks, segmented=True)),
        "optimum": rate(records, optimum(records, budget_blocks)),
        "optimum_held": rate(records, optimum(records, budget_blocks, hold_running=True)),
    }
    with_ssd: dict = {}
    for name, segmented, measured in (("lru", False, False), ("strata", True, True)):
        ssd = SsdModel(budget_blocks * SSD_TIMES_RAM, measured=measured)
        with_ssd[name] = rate(records, replay(records, budget_blocks, segmented, ssd))
        with_ssd[f"{name}_written"] = ssd.written
    with_ssd["optimum"] = rate(records, optimum(records, budget_blocks * (1 + SSD_TIMES_RAM)))
    tokens = sum(len(r.blocks) * r.block_tokens for r in records)
    recomputed = {name: round((1 - result[name]) * tokens) for name in ("lru", "strata", "optimum")}
    return result | {"with_ssd": with_ssd, "recomputed_tokens": recomputed}


def curve_check(records: Sequence[TraceRecord], budgets: Sequence[int]) -> dict[str, dict[int, float]]:
    """LRU's hit rate at each budget: replayed, and from stack distances (exact and sampled); and the
    segmented pool's, replayed (what the server runs: the curve estimates it)."""
    records = [r for r in records if not r.answered]
    chains = [r.blocks for r in records]
    exact, sampled = stack_distances(chains), stack_distances(chains, SAMPLE_RATE)
    return {
        "replayed": {b: rate(records, replay(records, b, segmented=False)) for b in budgets},
        "exact": {b: exact.hit_rate(b) for b in budgets},
        "sampled": {b: sampled.hit_rate(b) for b in budgets},
        "segmented": {b: rate(records, replay(records, b, segmented=True)) for b in budgets},
    }


def hot_traffic(seed: int, budget_blocks: int) -> dict[str, float]:
    """The chat requests' hit rate with the scan's flood mixed in and without it (same requests)."""
    steady = generate("chat", seed)
    mixed = generate("scan", seed)
    hot = {(r.t, r.blocks) for r in steady}
    is_hot = lambda record: (record.t, record.blocks) in hot
    result = {"without scan": rate(steady, replay(steady, budget_blocks, segmented=True))}
    for name, segmented in (("with scan, lru", False), ("with scan, strata", True)):
        result[name] = rate(mixed, replay(mixed, budget_blocks, segmented), is_hot)
    return result


def run_all(seed: int) -> dict:
    results: dict = {"traces": {}, "curves": {}, "hot": {}}
    for kind in KINDS:
        records = generate(kind, seed)
        size = working_set(records)
        budgets = {name: max(1, int(size * share)) for name, share in BUDGETS.items()}
        results["traces"][kind] = {
            name: compare(records, blocks) | {"blocks": blocks} for name, blocks in budgets.items()
        }
        results["curves"][kind] = curve_check(records, list(budgets.values()))
        if kind == "chat":
            results["hot"] = hot_traffic(seed, budgets["medium"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--all", action="store_true", help="every synthetic trace at three budgets")
    parser.add_argument("--trace", type=Path, help="a recorded trace (JSON lines)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[], help="with --trace: budgets in blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.trace:
        records = list(read_trace(args.trace))
        size = working_set(records)
        budgets = {f"given {i + 1}": b for i, b in enumerate(args.budgets)} or {
            name: max(1, int(size * share)) for name, share in BUDGETS.items()
        }
        results = {"traces": {"trace": {name: compare(records, b) | {"blocks": b} for name, b in budgets.items()}}}
    elif args.all:
        results = run_all(args.seed)
    else:
        parser.error("give --all or --trace FILE")
    report(results)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    t: {
                        b: {k: r[k] for k in ("lru", "strata", "optimum", "optimum_held", "recomputed_tokens")}
                        for b, r in rows.items()
                    }
                    for t, rows in results["traces"].items()
                }
            )
        )


def _share(rate: float, best: float) -> float:
    return rate / best if best else 1.0


def report(results: dict) -> None:
    print("token hit rate by policy (full-block tokens); budget in blocks, relative to the working set")
    print("optimum: MIN with any block skippable; held: MIN holding each running request's blocks, as the engine must")
    print(
        f"{'trace':<6} | {'budget':<13} | {'lru':>6} | {'strata':>6} | {'optimum':>7} | {'held':>6} | "
        f"{'strata/opt':>10} | {'strata/held':>11} | {'lru/opt':>7} | {'recomputed M tokens lru':>23} | {'strata':>6}"
    )
    worst, worst_held = 1.0, 1.0
    for trace, rows in results["traces"].items():
        for budget, row in rows.items():
            share, held = _share(row["strata"], row["optimum"]), _share(row["strata"], row["optimum_held"])
            worst, worst_held = min(worst, share), min(worst_held, held)
            print(
                f"{trace:<6} | {budget + ' ' + str(row['blocks']):<13} | {row['lru']:6.1%} | {row['strata']:6.1%} | "
                f"{row['optimum']:7.1%} | {row['optimum_held']:6.1%} | {share:10.2f} | {held:11.2f} | "
                f"{_share(row['lru'], row['optimum']):7.2f} | {row['recomputed_tokens']['lru'] / 1e6:23.2f} | "
                f"{row['recomputed_tokens']['strata'] / 1e6:6.2f}"
            )
    print(f"target: strata >= 90% of the optimum everywhere: worst {worst:.1%} (of the held optimum: {worst_held:.1%})")
    print(
        f"\nwith an SSD tier {SSD_TIMES_RAM}x the RAM budget; lru: admitting blocks reused once in RAM "
        "(the rule before), strata: segmented RAM and admission by measured reuse"
    )
    print(
        f"{'trace':<6} | {'budget':<13} | {'lru':>6} | {'strata':>6} | {'optimum':>7} | {'strata/opt':>10} | "
        f"{'blocks written lru':>18} | {'strata':>7}"
    )
    for trace, rows in results["traces"].items():
        for budget, row in rows.items():
            ssd = row["with_ssd"]
            print(
                f"{trace:<6} | {budget + ' ' + str(row['blocks']):<13} | {ssd['lru']:6.1%} | {ssd['strata']:6.1%} | "
                f"{ssd['optimum']:7.1%} | {ssd['strata'] / ssd['optimum'] if ssd['optimum'] else 1:10.2f} | "
                f"{ssd['lru_written']:>18} | {ssd['strata_written']:>7}"
            )
    if results.get("hot"):
        hot = results["hot"]
        print(
            f"scan resistance (chat requests' hit rate, medium budget): without the scan {hot['without scan']:.1%}, "
            f"with it: lru {hot['with scan, lru']:.1%}, strata {hot['with scan, strata']:.1%} "
            f"(target: within 5 points of without: {abs(hot['without scan'] - hot['with scan, strata']) * 100:.1f})"
        )
    for trace, curve in results.get("curves", {}).items():
        cells = [
            f"{b}: replayed {curve['replayed'][b]:.1%}, exact {curve['exact'][b]:.1%}, sampled {curve['sampled'][b]:.1%}"
            f" (segmented pool {curve['segmented'][b]:.1%})"
            for b in curve["replayed"]
        ]
        print(f"LRU curve, {trace}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
