"""The false-hit regression run: labelled pairs through the real semantic layer.

    python -m evals false-hits --dataset FILE.jsonl [--dataset ...] [--json OUT]
        [--max-false-hit-rate R] [--min-hit-rate R] [--threshold T]

Each line: {"id", "category", "cached_prompt", "query_prompt", "expect": "hit"|"miss",
"cached_scope"?: {...}, "query_scope"?: {...}} (scope keys: tenant, prompt_version, policy_version,
data_version, locale). All cached prompts are stored first (one entry per distinct scope + prompt),
then every query runs through SemanticCache.lookup, the gateway's own code path. A hit on any entry
other than the pair's own is a false hit. Rates: hit rate = own hits / expect-hit pairs;
false-hit rate = false hits / all pairs. Exits 1 when a gate fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from semantic import Answer, MiniLMEmbedder, Scope, SemanticCache, SemanticSettings, SqliteEntries

MODEL = "eval-model"
CONTEXT = "eval-context"


@dataclass(frozen=True, slots=True)
class Pair:
    id: str
    category: str
    cached_prompt: str
    query_prompt: str
    expect: str
    cached_scope: Scope
    query_scope: Scope


def load_pairs(paths: list[Path]) -> list[Pair]:
    pairs = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("expect") not in ("hit", "miss"):
                raise ValueError(f"{path}:{number}: expect must be 'hit' or 'miss'")
            pairs.append(Pair(str(row["id"]), row["category"], row["cached_prompt"], row["query_prompt"], row["expect"],
                              _scope(row.get("cached_scope")), _scope(row.get("query_scope"))))
    return pairs


def _scope(raw: dict | None) -> Scope:
    raw = raw or {}
    return Scope(tenant=raw.get("tenant", "eval-tenant"), model=MODEL, prompt_version=raw.get("prompt_version", ""),
                 policy_version=raw.get("policy_version", ""), data_version=raw.get("data_version", ""),
                 locale=raw.get("locale", ""))


def run(pairs: list[Pair], cache: SemanticCache) -> dict:
    now = time.time()
    own: dict[str, int] = {}
    for pair in pairs:
        own[pair.id] = cache.insert(pair.cached_prompt, Answer(f"answer for {pair.id}"), pair.cached_scope, CONTEXT, now)
    outcomes = []
    for pair in pairs:
        result = cache.lookup(pair.query_prompt, pair.query_scope, CONTEXT, now)
        hit_id = result.entry.id if result.entry else None
        outcome = "miss" if hit_id is None else ("hit" if hit_id == own[pair.id] and pair.expect == "hit" else "false_hit")
        outcomes.append({"id": pair.id, "category": pair.category, "expect": pair.expect, "outcome": outcome,
                         "score": result.score, "reason": result.reason})
    return summarise(outcomes)


def summarise(outcomes: list[dict]) -> dict:
    by_category: dict[str, list[dict]] = defaultdict(list)
    for outcome in outcomes:
        by_category[outcome["category"]].append(outcome)
    categories = {name: _rates(rows) for name, rows in sorted(by_category.items())}
    return {"overall": _rates(outcomes), "categories": categories, "outcomes": outcomes}


def _rates(rows: list[dict]) -> dict:
    expect_hit = [r for r in rows if r["expect"] == "hit"]
    hits = sum(r["outcome"] == "hit" for r in expect_hit)
    false_hits = sum(r["outcome"] == "false_hit" for r in rows)
    return {"pairs": len(rows), "expect_hit": len(expect_hit), "hits": hits, "false_hits": false_hits,
            "hit_rate": hits / len(expect_hit) if expect_hit else None,
            "false_hit_rate": false_hits / len(rows) if rows else 0.0}


def print_report(summary: dict) -> None:
    print(f"{'category':<22} {'pairs':>5} {'hit rate':>9} {'false hits':>10} {'false-hit rate':>14}")
    for name, rates in [*summary["categories"].items(), ("OVERALL", summary["overall"])]:
        hit_rate = "-" if rates["hit_rate"] is None else f"{rates['hit_rate']:.1%}"
        print(f"{name:<22} {rates['pairs']:>5} {hit_rate:>9} {rates['false_hits']:>10} {rates['false_hit_rate']:>14.2%}")


def gates(summary: dict, max_false_hit_rate: float | None, min_hit_rate: float | None) -> list[str]:
    failures = []
    overall = summary["overall"]
    if max_false_hit_rate is not None and overall["false_hit_rate"] > max_false_hit_rate:
        failures.append(f"false-hit rate {overall['false_hit_rate']:.2%} > {max_false_hit_rate:.2%}")
    if min_hit_rate is not None and overall["hit_rate"] is not None and overall["hit_rate"] < min_hit_rate:
        failures.append(f"hit rate {overall['hit_rate']:.2%} < {min_hit_rate:.2%}")
    scope_false = sum(r["false_hits"] for name, r in summary["categories"].items() if name.startswith("scope"))
    if scope_false:
        failures.append(f"{scope_false} false hits across scopes (must be 0)")
    return failures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals false-hits")
    parser.add_argument("--dataset", type=Path, action="append", required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--max-false-hit-rate", type=float)
    parser.add_argument("--min-hit-rate", type=float)
    parser.add_argument("--threshold", type=float, default=SemanticSettings().threshold)
    args = parser.parse_args(argv)
    pairs = load_pairs(args.dataset)
    with tempfile.TemporaryDirectory() as folder:
        cache = SemanticCache(MiniLMEmbedder(), SqliteEntries(Path(folder) / "semantic.db"), SemanticSettings(threshold=args.threshold))
        summary = run(pairs, cache)
        cache.close()
    print_report(summary)
    failures = gates(summary, args.max_false_hit_rate, args.min_hit_rate)
    if args.json:
        args.json.write_text(json.dumps({**summary, "gate_failures": failures}, indent=1))
    for failure in failures:
        print(f"GATE FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0
