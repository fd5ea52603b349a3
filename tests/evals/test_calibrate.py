"""`python -m evals calibrate`: the shipped evidence counts every calibration pair (the refused ones
as never served look-alikes or paraphrases); an operator's labelled pairs in the false-hits format
join it, those across two scopes left out (they never reach the judge)."""

from __future__ import annotations

import json

from evals.calibrate import dataset_examples, evidence
from semantic.calibration import BASE_EVIDENCE_FILE, load_evidence


def test_the_shipped_evidence_holds_every_calibration_pair_refused_ones_included():
    shipped = json.loads(BASE_EVIDENCE_FILE.read_text())
    rows = load_evidence()
    assert len(rows) == shipped["pairs"] > 900
    refused = [e for e in rows if e.group == "refused"]
    assert refused and all(e.probability == 0.0 for e in refused)
    assert sum(not e.right for e in refused) > 0.5 * len(refused)  # mostly look-alikes a fact guard caught


def test_a_dataset_joins_the_evidence_without_its_cross_scope_pairs(tmp_path):
    pairs = [
        {"id": "p", "category": "paraphrase", "cached_prompt": "How do I reset my password?",
         "query_prompt": "What is the way to reset my password?", "expect": "hit"},
        {"id": "n", "category": "numbers", "cached_prompt": "Is 5 mg of melatonin safe?",
         "query_prompt": "Is 50 mg of melatonin safe?", "expect": "miss"},
        {"id": "s", "category": "scope_tenant", "cached_prompt": "How do I reset my password?",
         "query_prompt": "How do I reset my password?", "expect": "miss", "query_scope": {"tenant": "other"}},
    ]  # fmt: skip
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    examples = dataset_examples([path])
    assert [(e.query, e.label) for e in examples] == [
        ("What is the way to reset my password?", 1),
        ("Is 50 mg of melatonin safe?", 0),
    ]
    paraphrase, number = evidence(examples)
    assert paraphrase.group in ("pass", "structural") and paraphrase.right and paraphrase.probability > 0.5
    assert number == number.__class__("refused", 0.0, False)  # a fact guard refuses 5 mg vs 50 mg
