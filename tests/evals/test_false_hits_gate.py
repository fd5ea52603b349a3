"""The false-hit gate, as CI runs it: the dev set through the real semantic layer."""

import json
import subprocess
import sys
from pathlib import Path

from evals.false_hits import gates, load_pairs, run
from semantic import SemanticCache, SemanticSettings, SqliteEntries

DATA = Path(__file__).resolve().parents[2] / "evals" / "data"


def test_dev_set_passes_the_release_gate(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "evals",
            "false-hits",
            "--dataset",
            str(DATA / "dev.jsonl"),
            "--max-false-hit-rate",
            "0.01",
            "--min-hit-rate",
            "0.85",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["overall"]["pairs"] >= 400
    assert report["categories"]["paraphrase"]["hit_rate"] >= 0.85
    scope = [rates for name, rates in report["categories"].items() if name.startswith("scope")]
    assert len(scope) == 5 and sum(r["false_hits"] for r in scope) == 0
    assert report["rules_only"]["overall"]["pairs"] == report["overall"]["pairs"]  # both runs reported
    assert "+verifier" in done.stdout and "OVERALL" in done.stdout
    assert any(o["verifier_p"] is not None for o in report["outcomes"])


def test_paws_lookalikes_stay_at_or_below_the_measured_rate(tmp_path, embedder):
    """A regression guard near the measured level (20.6% on this sample since the entity-order guard
    reads names after a question opener; 28.9% before), not a target: the threshold alone serves 99.4%."""
    cache = SemanticCache(embedder, SqliteEntries(tmp_path / "s.db"), SemanticSettings())
    summary = run(load_pairs([DATA / "paws_sample.jsonl"]), cache)
    assert summary["categories"]["paws_lookalike"]["false_hit_rate"] <= 0.24


def test_the_verifier_holds_paws_lookalikes_to_the_target(tmp_path, embedder):
    """Issue 14's target, on the PAWS sample (never trained on), each pair alone: look-alikes served
    <= 10% at >= 60% paraphrase hits (measured 5.6% at 66.7%; the rules alone: 16.1% at 52.5%)."""
    from semantic.verifier import Verifier

    cache = SemanticCache(embedder, SqliteEntries(tmp_path / "s.db"), SemanticSettings(), Verifier.load(embedder))
    summary = run(load_pairs([DATA / "paws_sample.jsonl"]), cache, isolate=True)
    assert summary["categories"]["paws_lookalike"]["false_hit_rate"] <= 0.10
    assert summary["categories"]["paws_paraphrase"]["hit_rate"] >= 0.60


def test_gate_fails_when_a_target_is_missed(tmp_path, embedder):
    cache = SemanticCache(embedder, SqliteEntries(tmp_path / "s.db"), SemanticSettings())
    summary = run(load_pairs([DATA / "dev.jsonl"]), cache)
    assert gates(summary, max_false_hit_rate=0.01, min_hit_rate=0.999)  # 94.8% < 99.9%
    summary["categories"]["scope_tenant"]["false_hits"] = 1
    assert any("across scopes" in failure for failure in gates(summary, None, None))
