"""The personal-data rule, measured as `python -m evals risk` runs it: on the set the rules were
written against, and on questions written after them (held out: never used to tune)."""

import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent.parent.parent / "evals" / "data"


def _gate(dataset: str, min_recall: float, max_general: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "evals",
            "risk",
            "--dataset",
            str(DATA / dataset),
            "--min-recall",
            str(min_recall),
            "--max-general-flagged",
            str(max_general),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_personal_questions_are_flagged_and_general_ones_are_not():
    done = _gate("personal.jsonl", 0.95, 0.05)
    assert done.returncode == 0, done.stdout + done.stderr


def test_held_out_questions_stay_near_the_measured_rates():
    """Measured 90% recall and 0% general flagged on the held-out 20 + 20; a regression bar below it."""
    done = _gate("personal_holdout.jsonl", 0.85, 0.10)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_gate_fails_when_a_target_is_missed():
    assert _gate("personal.jsonl", 1.01, 0.05).returncode == 1
