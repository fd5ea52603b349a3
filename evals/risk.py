"""How well the personal-data rule tells a user's own data from general questions.

    python -m evals risk [--dataset evals/data/personal.jsonl] [--patterns FILE] [--min-recall R]
        [--max-general-flagged R]

Each line: {"id", "text", "label": "personal"|"general"}. Recall: personal questions the rule flags
(those are scoped to their end user or bypass the semantic layer); general flagged: general questions
it flags too (they lose the semantic layer, not correctness). Exits 1 when a gate fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from semantic.risk import DEFAULT_PATTERNS_FILE, PERSONAL_DATA, RiskPolicy, load_risk_patterns

DEFAULT_DATASET = Path(__file__).parent / "data" / "personal.jsonl"


def evaluate(rows: list[dict], policy: RiskPolicy) -> dict:
    flagged = {row["id"]: policy.category(row["text"]) == PERSONAL_DATA for row in rows}
    personal = [r for r in rows if r["label"] == "personal"]
    general = [r for r in rows if r["label"] == "general"]
    return {
        "num_personal": len(personal),
        "num_general": len(general),
        "recall": sum(flagged[r["id"]] for r in personal) / len(personal),
        "general_flagged": sum(flagged[r["id"]] for r in general) / len(general),
        "missed": [r["text"] for r in personal if not flagged[r["id"]]],
        "over_flagged": [r["text"] for r in general if flagged[r["id"]]],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals risk")
    parser.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    parser.add_argument("--patterns", type=Path, default=DEFAULT_PATTERNS_FILE)
    parser.add_argument("--min-recall", type=float)
    parser.add_argument("--max-general-flagged", type=float)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.dataset.read_text().splitlines() if line.strip()]
    result = evaluate(rows, RiskPolicy(load_risk_patterns(args.patterns)))
    print(f"personal questions flagged: {result['recall']:.1%} of {result['num_personal']}")
    print(f"general questions flagged:  {result['general_flagged']:.1%} of {result['num_general']}")
    for text in result["missed"]:
        print(f"  missed:       {text}")
    for text in result["over_flagged"]:
        print(f"  over-flagged: {text}")
    failures = []
    if args.min_recall is not None and result["recall"] < args.min_recall:
        failures.append(f"recall {result['recall']:.1%} < {args.min_recall:.1%}")
    if args.max_general_flagged is not None and result["general_flagged"] > args.max_general_flagged:
        failures.append(f"general flagged {result['general_flagged']:.1%} > {args.max_general_flagged:.1%}")
    for failure in failures:
        print(f"GATE FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0
