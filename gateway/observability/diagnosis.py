"""Why the caches miss: a recent window of requests summarised in numbers and plain words.

    diagnose(records, window_s, now, ssd_enabled, ram) -> dict     what GET /admin/diagnosis answers

Each request that looked up the prefix cache leaves its prompt tokens, the tokens it reused and, when
reuse stopped short, why (cold, diverged and where — with the first 40 characters of the line it
diverged on —, evicted / expired / purged and from which tier, after how long). The tokens a request recomputed count against that cause. A cause holding at least
FINDING_SHARE of all recomputed tokens is a finding; the actionable finding with the largest share
names the bottleneck. New content (a prompt seen for the first time, or a conversation's latest
message) is reported but never advised against: no setting makes the unseen cached.

What more RAM would buy: each record also keeps a sample of its prompt's block chain (its first
kvcache.mrc.HEAD blocks, and the deeper blocks whose hash falls in the first kvcache.mrc.SAMPLE_RATE
of the hash space, as 64-bit ints); the window's chains give the LRU hit-rate curve (kvcache.mrc),
read at the RAM budget and at 1, 4 and 16 GiB more: "with 4 GiB more RAM the prefix token hit rate would have
been ~Y% (now ~Z% by the same estimate)". An estimate from a sample (within 1.5 points of the exact
curve on the simulator's traces), of the RAM tier alone, for full blocks.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvcache.mrc import SAMPLE_RATE, kept, stack_distances

from .trace import LAYERS, PrefixFacts

FINDING_SHARE = 0.2
RECENT_REQUESTS = 50_000  # requests kept for the window (a deque: memory stays bounded)
MORE_RAM_GIB = (1, 4, 16)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    at: float  # time.time() when it ended
    statuses: tuple[str, ...]  # per LAYERS: hit | miss | bypass
    prefix: PrefixFacts | None
    chain: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))  # sampled blocks, as ints


def sampled_chain(chain: Iterable[bytes]) -> np.ndarray:
    """The blocks of a chain (block hashes) that the what-if sample keeps (its head, and the sampled
    blocks past it: kvcache.mrc), as 64-bit ints."""
    return np.array([int.from_bytes(h[:8], "big") for h in kept(list(chain), SAMPLE_RATE)], dtype=np.uint64)


@dataclass(frozen=True, slots=True)
class RamBudget:
    """The prefix cache's RAM now: its budget and what one block takes."""

    budget_bytes: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class Cause:
    name: str
    actionable: bool
    words: str  # completes "<share> of missed prefix tokens ..."
    advice: str


CAUSES = {
    "ram_budget": Cause(
        "ram_budget",
        True,
        "were evicted from RAM within {lived} of being stored",
        "the RAM budget is the bottleneck; raise STRATA_KV_BUDGET_BYTES",
    ),
    "ssd_capacity": Cause(
        "ssd_capacity",
        True,
        "were evicted from the SSD tier within {lived} of being written",
        "the SSD capacity is the bottleneck; raise STRATA_SSD_CAPACITY_BYTES",
    ),
    "ram_retention": Cause(
        "ram_retention",
        True,
        "expired from RAM {lived} after being stored",
        "the RAM retention is the bottleneck; raise STRATA_KV_RAM_RETENTION_S",
    ),
    "ssd_retention": Cause(
        "ssd_retention",
        True,
        "expired from the SSD tier {lived} after being written",
        "the SSD retention is the bottleneck; raise STRATA_SSD_RETENTION_S",
    ),
    "system_prompt": Cause(
        "system_prompt",
        True,
        "follow a change in the system prompt",
        "keep the system prompt byte-identical across requests and move what varies (dates, "
        "names, retrieved text) after it, to the end of the conversation",
    ),
    "earlier_turns": Cause(
        "earlier_turns",
        True,
        "follow a change in an earlier turn of the conversation",
        "send the conversation's history unchanged: no trimming, summarising or re-rendering of old turns",
    ),
    "images": Cause(
        "images",
        True,
        "follow an image whose pixels changed",
        "send the same image bytes each turn: no re-encoding or resizing on the client",
    ),
    "purges": Cause(
        "purges", False, "were purged (admin purges and ended sessions)", "expected after purges; nothing to tune"
    ),
    "new_content": Cause(
        "new_content",
        False,
        "are new content (first sight of a prompt, or a conversation's latest message)",
        "nothing to tune: the unseen cannot be cached",
    ),
}


def cause_of(facts: PrefixFacts) -> str:
    if facts.why in ("evicted", "expired"):
        kind = (
            "budget"
            if facts.why == "evicted" and facts.tier == "ram"
            else ("capacity" if facts.why == "evicted" else "retention")
        )
        return f"{facts.tier or 'ram'}_{kind}"
    if facts.why == "purged":
        return "purges"
    if facts.why == "diverged":
        return {"system": "system_prompt", "earlier_turn": "earlier_turns", "image": "images"}.get(
            facts.where, "new_content"
        )
    return "new_content"


def diagnose(
    records: Iterable[RequestRecord], window_s: float, now: float, ssd_enabled: bool, ram: RamBudget | None = None
) -> dict:
    recent = [r for r in records if r.at >= now - window_s]
    looked_up = [r.prefix for r in recent if r.prefix is not None]
    missed: dict[str, list[PrefixFacts]] = defaultdict(list)
    for facts in looked_up:
        if facts.num_prompt_tokens > facts.num_cached_tokens:
            missed[cause_of(facts)].append(facts)
    tokens = {name: sum(f.num_prompt_tokens - f.num_cached_tokens for f in group) for name, group in missed.items()}
    total = sum(tokens.values())
    causes = {
        name: _cause_summary(group, tokens[name], total)
        for name, group in sorted(missed.items(), key=lambda item: -tokens[item[0]])
    }
    findings = [
        _finding(name, summary, ssd_enabled) for name, summary in causes.items() if summary["share"] >= FINDING_SHARE
    ]
    actionable = [
        name for name, summary in causes.items() if CAUSES[name].actionable and summary["share"] >= FINDING_SHARE
    ]
    what_if = _more_ram(recent, ram) if ram is not None and ram.block_bytes else None
    if what_if is not None and what_if["more"]:
        findings.append(_what_if_finding(what_if))
    return {
        "window_s": window_s,
        "requests": len(recent),
        "hit_rate": _hit_rates(recent, looked_up),
        "missed_prefix_tokens": total,
        "causes": causes,
        "bottleneck": actionable[0] if actionable else "none",
        "findings": findings or [_quiet(len(recent), total)],
        "more_ram": what_if,
    }


def _more_ram(recent: list[RequestRecord], ram: RamBudget) -> dict:
    """The LRU token hit rate the window's sampled chains give at the budget and with more RAM."""
    chains = [r.chain.tolist() for r in recent if len(r.chain)]
    if not chains:
        return {"estimated_now": None, "more": {}}
    curve = stack_distances(chains, SAMPLE_RATE, presampled=True)
    blocks = ram.budget_bytes // ram.block_bytes
    more = {f"{gib}GiB": round(curve.hit_rate(blocks + (gib << 30) // ram.block_bytes), 4) for gib in MORE_RAM_GIB}
    return {"estimated_now": round(curve.hit_rate(blocks), 4), "more": more}


def _what_if_finding(what_if: dict) -> str:
    best = max(what_if["more"].values())
    gib, rate = next((name, value) for name, value in what_if["more"].items() if value >= best - 0.01)  # smallest step
    return (
        f"with {gib.removesuffix('GiB')} GiB more RAM the prefix token hit rate would have been ~{rate:.0%} "
        f"(now ~{what_if['estimated_now']:.0%} by the same estimate: LRU over a sample of the window's blocks)."
    )


def _hit_rates(recent: list[RequestRecord], looked_up: list[PrefixFacts]) -> dict:
    rates: dict = {}
    for index, layer in enumerate(LAYERS):
        hits = sum(r.statuses[index] == "hit" for r in recent)
        misses = sum(r.statuses[index] == "miss" for r in recent)
        rates[layer] = round(hits / (hits + misses), 4) if hits + misses else None
    prompt = sum(f.num_prompt_tokens for f in looked_up)
    rates["prefix_tokens"] = round(sum(f.num_cached_tokens for f in looked_up) / prompt, 4) if prompt else None
    return rates


def _cause_summary(group: list[PrefixFacts], tokens: int, total: int) -> dict:
    summary: dict = {"requests": len(group), "tokens": tokens, "share": round(tokens / total, 4) if total else 0.0}
    lived = [f.lived_s for f in group if f.why in ("evicted", "expired")]
    if lived:
        summary["median_lived_s"] = round(statistics.median(lived), 1)
    lines = Counter(f.line for f in group if f.line)
    if lines:  # where prompts diverged: the lines to look at (a volatile one is a normalisation rule to add)
        summary["diverging_lines"] = [{"line": line, "requests": count} for line, count in lines.most_common(5)]
    return summary


def _finding(name: str, summary: dict, ssd_enabled: bool) -> str:
    cause = CAUSES[name]
    words = cause.words.format(lived=_duration(summary.get("median_lived_s", 0.0)))
    advice = cause.advice
    if name == "ram_budget" and not ssd_enabled:
        advice += " or enable the SSD tier (STRATA_SSD_CAPACITY_BYTES)"
    return f"{summary['share']:.0%} of missed prefix tokens {words}: {advice}."


def _quiet(num_requests: int, total: int) -> str:
    if not num_requests:
        return "no requests in the window: nothing to diagnose."
    if not total:
        return "no prefix tokens were missed in the window."
    return f"no single cause holds {FINDING_SHARE:.0%} of the missed prefix tokens: nothing stands out."


def _duration(seconds: float) -> str:
    if seconds < 1.5:
        return "a second"
    if seconds < 90:
        return f"{round(seconds)} seconds"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} minutes"
    return f"{round(seconds / 3600)} hours"
