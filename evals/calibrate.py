"""Refit the semantic layer's false-hit calibration and write semantic/calibration.json.

    python -m evals calibrate [--seed 2026] [--dataset FILE.jsonl ...] [--out FILE]

The evidence is the PAWS pairs the calibrated verifier's training run (`python -m evals.train_verifier
--calibrated`, semantic/verifier_calibrated.safetensors) set apart for calibration
(evals.train_verifier.set_apart: 15% of its PAWS pairs, in whole groups sharing a sentence, so none
holds a sentence the verifier was trained on), run through the rule guards and the shipped verifier
as SemanticCache.lookup runs them: each pair becomes (group, P(same answer), right); a pair a fact
guard refuses becomes ("refused", 0, right): never served, but counted (a look-alike refused is one
of the look-alikes the bound's share is taken of). Neither reported set (`dev.jsonl`, the PAWS
sample) nor the fresh split is in it.
Deterministic for a seed: the split is the training run's own. Prints, for the bounds 1%, 2%, 5% and
10%, the cut, the share of look-alikes it serves (the bounded false-hit rate) and its 95% upper bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from semantic import MiniLMEmbedder, SemanticCache, SemanticSettings, SqliteEntries
from semantic.calibration import BASE_EVIDENCE_FILE, Calibration, Evidence
from semantic.verifier import CALIBRATED_FILE, Verifier

from .false_hits import load_pairs
from .train_verifier import Example, guard_outcomes, pair_cosines, parts

BOUNDS = (0.01, 0.02, 0.05, 0.10)


def calibration_pairs(seed: int) -> list[Example]:
    """The PAWS pairs the verifier's training run set apart for calibration (no trained sentence)."""
    return parts(seed, apart=True)["calibration"]


def dataset_examples(paths: list[Path]) -> list[Example]:
    """Pairs of false-hits datasets as training-style examples (same scope only)."""
    return [
        Example(pair.cached_prompt, pair.query_prompt, int(pair.expect == "hit"), "dataset")
        for pair in load_pairs(paths)
        if pair.cached_scope == pair.query_scope
    ]


def evidence(examples: list[Example]) -> list[Evidence]:
    """Each pair as SemanticCache.lookup judges it: the guards' outcome (as the training run reports
    it), then, past the fact guards, the calibrated verifier's probability."""
    embedder = MiniLMEmbedder()
    verifier = Verifier.load(embedder, CALIBRATED_FILE)
    cache = SemanticCache(embedder, SqliteEntries(":memory:"), SemanticSettings())
    cosines = pair_cosines(embedder, examples)
    outcomes = guard_outcomes(examples, cosines, cache.word_similarity)
    cache.close()
    return [
        Evidence(
            outcome,
            0.0
            if outcome == "refused"
            else round(verifier.probability(example.query, example.cached, cosines[example]), 6),
            bool(example.label),
        )
        for example, outcome in zip(examples, outcomes, strict=True)
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals calibrate")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, default=BASE_EVIDENCE_FILE)
    parser.add_argument("--dataset", type=Path, action="append", default=[], help="labelled pairs to add (repeatable)")
    args = parser.parse_args(argv)
    examples = calibration_pairs(args.seed) + dataset_examples(args.dataset)
    found = evidence(examples)
    rows = [[e.group, e.probability, e.right] for e in found]
    args.out.write_text(
        json.dumps(
            {"seed": args.seed, "datasets": [p.name for p in args.dataset], "pairs": len(examples), "evidence": rows}
        )
        + "\n"
    )
    past = sum(e.group != "refused" for e in found)
    print(f"{len(examples)} calibration pairs, {past} past the fact guards; wrote {args.out}")
    for bound in BOUNDS:
        fitted = Calibration.fit(found, bound)
        cut = "uncalibrated" if fitted.cut is None else "cut {:.3f} / {:.3f}".format(*fitted.cut)
        print(
            f"bound {bound:>5.0%}: {cut:<16} look-alikes served {fitted.lookalikes_served:.2%} of {fitted.lookalikes} "
            f"(95% upper {fitted.lookalikes_served_upper:.2%}); wrong share of hits {fitted.hits_wrong:.1%}"
        )
    return 0
