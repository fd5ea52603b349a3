"""The cache simulator: it drives the production pool, its optimum is Belady's on hand-made traces,
and the LRU curve from stack distances agrees with the replayed pool. (That a server's trace holds
no text: tests/gateway/test_at_rest.py.)"""

from __future__ import annotations

import pytest

from evals.cache_sim import SsdModel, compare, optimum, rate, replay, working_set
from evals.trace_gen import chain, generate
from kvcache import BlockHash
from kvcache.blocktrace import TraceRecord, read_trace
from kvcache.mrc import stack_distances
from kvcache.pool import Block
from kvcache.segment import SEGMENT_BLOCKS
from kvcache.ssd import AdmissionPolicy


def _trace(*chains: list[str]) -> list[TraceRecord]:
    return [TraceRecord(float(i), "t", tuple(blocks), 32) for i, blocks in enumerate(chains)]


def test_the_optimum_on_single_blocks_is_beladys():
    trace = _trace(["aa"], ["bb"], ["aa"], ["cc"], ["aa"])
    assert optimum(trace, 1) == [0, 0, 1, 0, 1]  # keeps aa: bb and cc are never used again
    assert replay(trace, 1, segmented=False) == [0, 0, 0, 0, 0]  # LRU lets each evict aa


def test_the_optimum_on_a_prefix_tree_keeps_the_shared_root():
    trace = _trace(["aa", "bb"], ["aa", "cc"], ["aa", "bb"], ["aa", "dd"])
    assert optimum(trace, 2) == [0, 1, 2, 1]  # cc and dd are not worth a place; aa and bb are
    assert rate(trace, optimum(trace, 2)) == 4 / 8


def test_the_held_optimum_keeps_the_running_request_in_the_budget():
    """An ideal cache skips cc and dd (never used again) and keeps aa, bb; the engine must hold the
    running request's KV, so the best it can do loses aa and bb to them."""
    trace = _trace(["aa", "bb"], ["cc", "dd"], ["aa", "bb"])
    assert optimum(trace, 2) == [0, 0, 2]
    assert optimum(trace, 2, hold_running=True) == [0, 0, 0]
    assert optimum(trace, 3, hold_running=True) == [0, 0, 1]  # room for aa beside the running request
    records = generate("agent")[:400]
    budget = working_set(records) // 20
    assert rate(records, optimum(records, budget, hold_running=True)) <= rate(records, optimum(records, budget))


def test_a_scan_evicts_the_hot_prompt_from_one_lru_queue_but_not_from_the_segmented_pool():
    hot = chain("t", "system", 10)
    flood = [chain("t", f"scan-{i}", 20) for i in range(10)]
    trace = _trace(hot, hot, *flood, hot)
    assert replay(trace, 100, segmented=False)[-1] == 0  # the policy before: the flood pushed it out
    assert replay(trace, 100, segmented=True)[-1] == 10


def test_the_lru_curve_from_stack_distances_is_the_replayed_pool():
    records = generate("chat")
    chains = [r.blocks for r in records]
    exact, sampled = stack_distances(chains), stack_distances(chains, 0.1)
    size = working_set(records)
    for budget in (size // 20, size // 5, size // 2, size):
        replayed = rate(records, replay(records, budget, segmented=False))
        assert abs(exact.hit_rate(budget) - replayed) < 1e-9, budget
        assert abs(sampled.hit_rate(budget) - replayed) < 0.02, budget


@pytest.mark.parametrize("kind", ["rag", "mix"])
def test_the_sampled_curve_stays_within_two_points_where_plain_shards_did_not(kind):
    """rag: a few system-prompt blocks carry a quarter of the lookups (plain SHARDS at 10%: 5.5 points
    off); mix: an agent's cliff at 5% of the working set (2.8 points off)."""
    records = generate(kind)
    chains = [r.blocks for r in records]
    exact, sampled = stack_distances(chains), stack_distances(chains, 0.1)
    if kind == "mix":  # the agents' long chains are sampled past their heads (rag's chains are mostly head)
        assert len(sampled.weights) < 0.5 * len(exact.weights)
    size = working_set(records)
    for budget in (size // 20, size // 5, size // 2):
        assert abs(sampled.hit_rate(budget) - exact.hit_rate(budget)) < 0.02, budget


def test_the_segmented_pool_is_not_worse_than_lru_and_never_beats_the_optimum():
    records = generate("scan")[:3000]
    result = compare(records, working_set(records) // 10)
    assert result["lru"] <= result["strata"] <= result["optimum"]


def test_a_trace_round_trips(tmp_path):
    records = generate("mix")[:50]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(r.line() + "\n" for r in records))
    assert [r.line() for r in read_trace(path)] == [r.line() for r in records]


def test_the_ssd_tier_takes_what_ram_evicts_once_reused_and_gives_it_back():
    trace = _trace(["aa"], ["aa"], ["bb"], ["aa"], ["cc"], ["dd"], ["cc"])
    ssd = SsdModel(4)
    assert replay(trace, 1, segmented=True, ssd=ssd) == [0, 1, 0, 1, 0, 0, 0]  # cc was never reused: not written
    assert ssd.written == 1 and replay(trace, 1, segmented=True) == [0, 1, 0, 0, 0, 0, 0]


def test_the_ssd_model_drops_whole_segments_by_their_last_read_as_the_tier_does():
    """One request's evictions land as one segment; past capacity the least recently read segment
    goes whole (the production rule, kvcache.ssd.segments_to_remove), and a read keeps a segment."""
    ssd = SsdModel(SEGMENT_BLOCKS + 1, AdmissionPolicy(min_hits=0), measured=False)
    first = [Block(BlockHash(bytes([1, i])), nbytes=1) for i in range(SEGMENT_BLOCKS)]
    for block in first:
        ssd.spill(block)
    ssd.write(now=1.0)
    ssd.spill(Block(BlockHash(b"\x02\x00"), nbytes=1))
    ssd.write(now=2.0)  # 17 blocks fit
    assert ssd.read(first[0].block_hash, now=3.0) and ssd.index.counts()[:2] == (2, SEGMENT_BLOCKS + 1)
    ssd.spill(Block(BlockHash(b"\x03\x00"), nbytes=1))
    ssd.write(now=4.0)  # past capacity: the segment read least recently goes (not the older one read at 3)
    assert ssd.read(first[-1].block_hash, now=3.5) and not ssd.read(BlockHash(b"\x02\x00"), now=3.5)
    ssd.spill(Block(BlockHash(b"\x04\x00"), nbytes=1))
    ssd.write(now=6.0)  # one block too many: the 16-block segment, read at 3.5, goes whole
    assert not any(ssd.read(block.block_hash, now=7.0) for block in first)
    assert ssd.read(BlockHash(b"\x03\x00"), now=7.0) and ssd.index.counts()[:2] == (2, 2)
    assert ssd.written == SEGMENT_BLOCKS + 3


def test_a_block_is_sampled_alike_as_hex_and_as_raw_bytes():
    from kvcache.mrc import sampled

    blocks = [b for r in generate("rag")[:200] for b in r.blocks]
    assert any(sampled(b, 0.1) for b in blocks) and not all(sampled(b, 0.1) for b in blocks)
    assert all(sampled(b, 0.1) == sampled(bytes.fromhex(b), 0.1) for b in blocks)


def test_a_recorded_trace_replays_at_the_budgets_given(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from evals import cache_sim

    records = generate("rag")[:300]
    path, out = tmp_path / "trace.jsonl", tmp_path / "result.json"
    path.write_text("".join(r.line() + "\n" for r in records))
    monkeypatch.setattr(sys, "argv", ["cache_sim", "--trace", str(path), "--budgets", "40", "--json", str(out)])
    cache_sim.main()
    row = json.loads(out.read_text())["trace"]["given 1"]
    assert row["lru"] == rate(records, replay(records, 40, segmented=False))
    assert row["strata"] <= row["optimum_held"] <= row["optimum"]
    assert "given 1 40" in capsys.readouterr().out
