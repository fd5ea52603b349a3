"""Refit the semantic layer's false-hit calibration and write semantic/calibration.json.

    python -m evals calibrate [--seed 2026] [--out FILE]

The evidence is the PAWS pairs the calibrated verifier's training run (`python -m evals.train_verifier
--calibrated`, semantic/verifier_calibrated.safetensors) set apart for calibration
(evals.train_verifier.set_apart: 15% of its PAWS pairs, in whole groups sharing a sentence, so none
holds a sentence the verifier was trained on), run through the rule guards and the shipped verifier
as SemanticCache.lookup runs them: each pair that no fact guard refuses becomes (group, P(same
answer), right). Neither reported set (`dev.jsonl`, the PAWS sample) nor the fresh split is in it.
Deterministic for a seed: the split is the training run's own. Prints the cut
and the certified wrong share for the bounds 1%, 2%, 5% and 10%.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from semantic import MiniLMEmbedder, SemanticCache, SemanticSettings, SqliteEntries
from semantic.calibration import BASE_EVIDENCE_FILE, Calibration, Evidence
from semantic.verifier import CALIBRATED_FILE, Verifier

from .train_verifier import Example, guard_outcomes, pair_cosines, parts

BOUNDS = (0.01, 0.02, 0.05, 0.10)


def calibration_pairs(seed: int) -> list[Example]:
    """The PAWS pairs the verifier's training run set apart for calibration (no trained sentence)."""
    return parts(seed, apart=True)["calibration"]


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
            round(verifier.probability(example.query, example.cached, cosines[example]), 6),
            bool(example.label),
        )
        for example, outcome in zip(examples, outcomes, strict=True)
        if outcome != "refused"
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals calibrate")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, default=BASE_EVIDENCE_FILE)
    args = parser.parse_args(argv)
    examples = calibration_pairs(args.seed)
    found = evidence(examples)
    rows = [[e.group, e.probability, e.right] for e in found]
    args.out.write_text(json.dumps({"seed": args.seed, "pairs": len(examples), "evidence": rows}) + "\n")
    print(f"{len(examples)} calibration pairs, {len(found)} past the fact guards; wrote {args.out}")
    for bound in BOUNDS:
        fitted = Calibration.fit(found, bound)
        cut = "uncalibrated" if fitted.cut is None else f"cut {fitted.cut:.3f}"
        print(
            f"bound {bound:>5.0%}: {cut:<16} served wrong share {fitted.served_wrong_share:.2%} "
            f"(95% upper {fitted.served_wrong_upper:.2%})"
        )
    return 0
