"""The false-hit regression run: labelled pairs through the real semantic layer.

    python -m evals false-hits --dataset FILE.jsonl [--dataset ...] [--json OUT]
        [--max-false-hit-rate R] [--min-hit-rate R] [--threshold T] [--isolate]
        [--verifier WEIGHTS | --without-verifier]
    python -m evals false-hits --bound 0.01 --bound 0.02 --bound 0.05 --bound 0.10 [--json OUT]

Each line: {"id", "category", "cached_prompt", "query_prompt", "expect": "hit"|"miss",
"cached_scope"?: {...}, "query_scope"?: {...}} (scope keys: tenant, prompt_version, policy_version,
data_version, locale). All cached prompts are stored first (one entry per distinct scope + prompt),
then every query runs through SemanticCache.lookup, the gateway's own code path. A hit on any entry
other than the pair's own is a false hit. Rates: hit rate = own hits / expect-hit pairs;
false-hit rate = false hits / all pairs. Exits 1 when a gate fails.

The set runs twice on the same vectors: with the rule guards alone, and with the learned verifier
after them (semantic/verifier.py; the gateway's default). Both are reported per category; the gates
judge the run with the verifier (or the rules alone, with --without-verifier). --isolate puts every
pair in its own partition, so a query meets only its own pair's cached prompt (PAWS pairs share
source sentences, so in one partition a query also meets other pairs' rewordings, unlabelled).

--bound B runs the layer as the gateway does under STRATA_SEMANTIC_MAX_FALSE_HIT_RATE=B (the shipped
calibration, semantic/calibration.json, fitted by `python -m evals calibrate` on pairs no reported set
holds) on the dev set, the PAWS sample (isolated) and the fresh PAWS split the verifier's training set
apart (isolated; nothing was trained or tuned on it: the gap to the sample is the sample's optimism).
The bound is on the share of look-alikes served (false hits / pairs expecting a miss), which bounds
the false-hit rate (false hits / all pairs) under any mix; it holds on a set when that share's two-sided
95% Clopper-Pearson interval reaches down to B or below. The wrong share of hits is printed too.
Also gated: the PAWS paraphrase hit rate at B = 10% must be at least 60%.
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

import numpy as np

from semantic import Answer, MiniLMEmbedder, Scope, SemanticCache, SemanticSettings, SqliteEntries
from semantic.calibration import upper_bound

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
            pairs.append(
                Pair(
                    str(row["id"]),
                    row["category"],
                    row["cached_prompt"],
                    row["query_prompt"],
                    row["expect"],
                    _scope(row.get("cached_scope")),
                    _scope(row.get("query_scope")),
                )
            )
    return pairs


def _scope(raw: dict | None) -> Scope:
    raw = raw or {}
    return Scope(
        tenant=raw.get("tenant", "eval-tenant"),
        model=MODEL,
        prompt_version=raw.get("prompt_version", ""),
        policy_version=raw.get("policy_version", ""),
        data_version=raw.get("data_version", ""),
        locale=raw.get("locale", ""),
    )


class RememberingEmbedder:
    """The real embedder, each text embedded once: both runs of one report share their vectors."""

    def __init__(self, embedder: MiniLMEmbedder) -> None:
        self.embedder = embedder
        self.dim, self.name = embedder.dim, embedder.name
        self.vectors: dict[str, np.ndarray] = {}

    def embed(self, texts: list[str]) -> np.ndarray:
        missing = [text for text in dict.fromkeys(texts) if text not in self.vectors]
        if missing:
            self.vectors.update(zip(missing, self.embedder.embed(missing)))
        return np.stack([self.vectors[text] for text in texts])

    def count_tokens(self, texts: list[str], truncated: bool = True) -> list[int]:
        return self.embedder.count_tokens(texts, truncated)


def run(pairs: list[Pair], cache: SemanticCache, isolate: bool = False) -> dict:
    now = time.time()
    own: dict[str, int] = {}
    context = {pair.id: pair.id if isolate else CONTEXT for pair in pairs}
    for pair in pairs:
        own[pair.id] = cache.insert(
            pair.cached_prompt, Answer(f"answer for {pair.id}"), pair.cached_scope, context[pair.id], now
        )
    outcomes = []
    for pair in pairs:
        result = cache.lookup(pair.query_prompt, pair.query_scope, context[pair.id], now)
        hit_id = result.entry.id if result.entry else None
        outcome = (
            "miss" if hit_id is None else ("hit" if hit_id == own[pair.id] and pair.expect == "hit" else "false_hit")
        )
        verdict = result.verdict
        outcomes.append(
            {
                "id": pair.id,
                "category": pair.category,
                "expect": pair.expect,
                "outcome": outcome,
                "score": result.score,
                "reason": result.reason,
                "verifier_p": verdict.probability if verdict else None,
                "overruled": ",".join(verdict.overruled) if verdict else "",
            }
        )
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
    return {
        "pairs": len(rows),
        "expect_hit": len(expect_hit),
        "hits": hits,
        "false_hits": false_hits,
        "hit_rate": hits / len(expect_hit) if expect_hit else None,
        "false_hit_rate": false_hits / len(rows) if rows else 0.0,
    }


def print_report(summaries: dict[str, dict]) -> None:
    """One row per category; for each run (e.g. "rules", "+verifier"): hit rate, false hits and their rate."""
    first = next(iter(summaries.values()))
    print(f"{'':<22} {'':>5}" + "".join(f" | {name:^32}" for name in summaries))
    print(f"{'category':<22} {'pairs':>5}" + f" | {'hit rate':>9} {'false hits':>10} {'rate':>9}" * len(summaries))
    for name in [*first["categories"], "OVERALL"]:
        row = f"{name:<22} {_pick(first, name)['pairs']:>5}"
        for summary in summaries.values():
            rates = _pick(summary, name)
            hit_rate = "-" if rates["hit_rate"] is None else f"{rates['hit_rate']:.1%}"
            row += f" | {hit_rate:>9} {rates['false_hits']:>10} {rates['false_hit_rate']:>9.2%}"
        print(row)


def _pick(summary: dict, name: str) -> dict:
    return summary["overall"] if name == "OVERALL" else summary["categories"][name]


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


DATA = Path(__file__).resolve().parent / "data"
BOUND_SETS = (
    ("dev", DATA / "dev.jsonl", False),
    ("paws (isolated)", DATA / "paws_sample.jsonl", True),
    ("paws fresh (iso.)", None, True),  # the split the verifier's training set apart, tuned on by nothing
)


def fresh_pairs() -> list[Pair]:
    from .train_verifier import parts

    scope = _scope(None)
    return [
        Pair(f"fresh-{i}", "paws_fresh", e.cached, e.query, "hit" if e.label else "miss", scope, scope)
        for i, e in enumerate(parts(2026, apart=True)["fresh"])
    ]


PAWS_HIT_RATE_AT_10 = 0.60  # the paraphrase hit rate the PAWS sample must keep at a 10% bound


def run_bounds(bounds: list[float], threshold: float) -> tuple[list[dict], list[str]]:
    """Each bound on the dev set (one partition), the PAWS sample and the fresh split (isolated), with
    the calibrator the gateway runs (semantic/calibration.json, a fresh journal): rows, and the failed
    checks. Each set is read once; every run stores its cached prompts anew."""
    from semantic.calibration import Calibrator, SqliteJournal, load_evidence
    from semantic.verifier import CALIBRATED_FILE, Verifier

    minilm = MiniLMEmbedder()
    embedder, verifier, base = RememberingEmbedder(minilm), Verifier.load(minilm, CALIBRATED_FILE), load_evidence()
    sets = [
        (name, fresh_pairs() if path is None else load_pairs([path]), isolate) for name, path, isolate in BOUND_SETS
    ]
    rows, failures = [], []
    for bound in bounds:
        for name, pairs, isolate in sets:
            with tempfile.TemporaryDirectory() as folder:
                calibrator = Calibrator(base, bound, {}, SqliteJournal(":memory:"))
                store = SqliteEntries(Path(folder) / "semantic.db")
                cache = SemanticCache(embedder, store, SemanticSettings(threshold=threshold), verifier, calibrator)
                overall = run(pairs, cache, isolate)["overall"]
                cache.close()
            row = {"bound": bound, "set": name, **overall} | _bound_columns(overall)
            row["holds"] = row["lookalikes_lower"] <= bound
            rows.append(row)
            if not row["holds"]:
                failures.append(
                    f"{name} at bound {bound:.0%}: {row['false_hits']} of {row['lookalikes']} look-alikes served"
                )
            if bound == 0.10 and name == "paws (isolated)" and (overall["hit_rate"] or 0) < PAWS_HIT_RATE_AT_10:
                failures.append(f"PAWS paraphrase hit rate {overall['hit_rate']:.1%} < 60% at a 10% bound")
    return rows, failures


def _bound_columns(overall: dict) -> dict:
    """The bounded quantity, false hits per look-alike lookup (pairs expecting a miss; a false hit on an
    expect-hit pair, possible in one partition, counts too), with its two-sided 95% Clopper-Pearson
    interval; and the wrong share of hits, for information."""
    lookalikes, wrong = overall["pairs"] - overall["expect_hit"], overall["false_hits"]
    served = overall["hits"] + wrong
    return {
        "lookalikes": lookalikes,
        "lookalikes_served": wrong / max(1, lookalikes),
        "lookalikes_lower": 1 - upper_bound(lookalikes - wrong, lookalikes, 0.975) if lookalikes else 0.0,
        "lookalikes_upper": upper_bound(wrong, lookalikes, 0.975),
        "served": served,
        "hits_wrong": wrong / max(1, served),
    }


def print_bounds(rows: list[dict]) -> None:
    print(
        f"{'bound':>6} {'set':<18} {'pairs':>5} {'hit rate':>9} {'false hits':>10} {'rate':>7} "
        f"{'look-alikes served':>19} {'95% interval':>16} {'holds':>6} {'wrong of hits':>14}"
    )
    for r in rows:
        print(
            f"{r['bound']:>6.0%} {r['set']:<18} {r['pairs']:>5} {r['hit_rate']:>9.1%} {r['false_hits']:>10} "
            f"{r['false_hit_rate']:>7.2%} {r['false_hits']:>5}/{r['lookalikes']:<4} {r['lookalikes_served']:>7.1%} "
            f"[{r['lookalikes_lower']:>5.1%}, {r['lookalikes_upper']:>5.1%}] {'yes' if r['holds'] else 'NO':>6} "
            f"{r['false_hits']:>5}/{r['served']:<4} {r['hits_wrong']:>4.1%}"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals false-hits")
    parser.add_argument("--dataset", type=Path, action="append")
    parser.add_argument(
        "--bound",
        type=float,
        action="append",
        help="run under this false-hit bound (repeatable) on the dev set, the PAWS sample and the fresh split",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--max-false-hit-rate", type=float)
    parser.add_argument("--min-hit-rate", type=float)
    parser.add_argument("--threshold", type=float, default=SemanticSettings().threshold)
    parser.add_argument("--isolate", action="store_true", help="every pair in its own partition")
    verifier = parser.add_mutually_exclusive_group()
    verifier.add_argument("--verifier", type=Path, help="the verifier's weights (default: the shipped ones)")
    verifier.add_argument("--without-verifier", action="store_true", help="the rule guards alone")
    args = parser.parse_args(argv)
    if args.bound:
        rows, failures = run_bounds(args.bound, args.threshold)
        print_bounds(rows)
        if args.json:
            args.json.write_text(json.dumps({"bounds": rows, "gate_failures": failures}, indent=1))
        for failure in failures:
            print(f"GATE FAILED: {failure}", file=sys.stderr)
        return 1 if failures else 0
    if not args.dataset:
        parser.error("--dataset is required (or --bound)")
    summaries = run_both(load_pairs(args.dataset), args)
    print_report(summaries)
    summary = summaries["+verifier"] if "+verifier" in summaries else summaries["rules"]
    failures = gates(summary, args.max_false_hit_rate, args.min_hit_rate)
    if args.json:
        args.json.write_text(
            json.dumps({**summary, "rules_only": summaries["rules"], "gate_failures": failures}, indent=1)
        )
    for failure in failures:
        print(f"GATE FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def run_both(pairs: list[Pair], args) -> dict[str, dict]:
    """{"rules": summary} and, unless --without-verifier, {"+verifier": summary}, on shared vectors."""
    from semantic.verifier import WEIGHTS_FILE, Verifier

    minilm = MiniLMEmbedder()
    embedder = RememberingEmbedder(minilm)
    verifiers: dict[str, Verifier | None] = {"rules": None}
    if not args.without_verifier:
        verifiers["+verifier"] = Verifier.load(minilm, args.verifier or WEIGHTS_FILE)
    summaries = {}
    for name, verifier in verifiers.items():
        with tempfile.TemporaryDirectory() as folder:
            cache = SemanticCache(
                embedder,
                SqliteEntries(Path(folder) / "semantic.db"),
                SemanticSettings(threshold=args.threshold),
                verifier,
            )
            summaries[name] = run(pairs, cache, args.isolate)
            cache.close()
    return summaries
