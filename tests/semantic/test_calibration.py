"""The false-hit bound: calibration on synthetic scores with a known truth keeps the wrong share of
what it serves under the bound on fresh draws; too little evidence refuses; each tenant runs at its
own bound with its own verdicts; an approved entry keeps being served at the level it was approved;
and the real layer (MiniLM, the shipped verifier and calibration) says `uncalibrated` when it is."""

from __future__ import annotations

import random

import pytest

from semantic import Answer, Scope, SemanticCache, SemanticSettings, SqliteEntries
from semantic.calibration import Calibration, Calibrator, Evidence, least_certifiable, load_evidence, upper_bound


def _draws(count: int, seed: int) -> list[Evidence]:
    """A verifier whose probability is miscalibrated: P(right | p) = p ** 0.3 ("pass") and p ** 2
    ("structural": the word-order cases it overrates)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        group = "pass" if rng.random() < 0.7 else "structural"
        probability = rng.random()
        truth = probability**0.3 if group == "pass" else probability**2
        out.append(Evidence(group, probability, rng.random() < truth))
    return out


@pytest.mark.parametrize("bound", [0.05, 0.10, 0.20])
def test_the_wrong_share_of_what_is_served_stays_under_the_bound_on_fresh_draws(bound):
    calibration = Calibration.fit(_draws(4000, seed=1), bound)
    assert calibration.cut is not None and calibration.served_wrong_upper <= bound
    fresh = _draws(40_000, seed=2)
    served = [e for e in fresh if calibration.decide(e.group, e.probability)]
    wrong = sum(not e.right for e in served)
    assert len(served) > 0.05 * len(fresh)  # it serves: the bound is not met by serving nothing
    lower = 1 - upper_bound(len(served) - wrong, len(served), 0.975)  # two-sided 95% interval of the share
    assert lower <= bound, (wrong, len(served))


def test_a_looser_bound_serves_more():
    draws, fresh = _draws(4000, seed=3), _draws(20_000, seed=4)
    fitted = [Calibration.fit(draws, bound) for bound in (0.05, 0.1, 0.2)]
    served = [sum(calibration.decide(e.group, e.probability) for e in fresh) for calibration in fitted]
    assert served[0] < served[1] < served[2]


def test_too_little_evidence_is_uncalibrated_and_serves_nothing():
    few = [Evidence("pass", 0.99, True)] * (least_certifiable(0.02) - 1)
    calibration = Calibration.fit(few, 0.02)
    assert calibration.cut is None and not calibration.decide("pass", 0.999)
    calibrator = Calibrator(few, 0.02, {}, ":memory:")
    assert calibrator.decide("tenant-a", 1, "pass", 0.999) == "uncalibrated"
    assert Calibration.fit([*few, Evidence("pass", 0.99, True)], 0.02).cut is not None  # one more, and it is


def test_each_tenant_runs_at_its_own_bound():
    calibrator = Calibrator(_draws(4000, seed=5), 0.20, {"billing": 0.02}, ":memory:")
    loose, strict = calibrator.calibration("faq").cut, calibrator.calibration("billing").cut
    assert loose is not None and strict is not None and strict > loose
    middle = next(p / 100 for p in range(100) if calibrator.calibration("faq").calibrated("pass", p / 100) >= loose)
    assert calibrator.decide("faq", 1, "pass", middle) == ""
    assert calibrator.decide("billing", 1, "pass", middle) == "bound"
    assert calibrator.stats()["billing"]["bound"] == 0.02 and calibrator.stats()["*"]["bound"] == 0.20


def test_review_verdicts_move_their_own_tenant_and_their_own_entry():
    """Tenant a's rejections raise a's cut above 0.9 (b's stays); an entry a approved at 0.9 is still
    served there (its own history); the others at 0.9 are not."""
    calibrator = Calibrator(_draws(3000, seed=6), 0.10, {}, ":memory:")
    assert calibrator.decide("a", 1, "pass", 0.9) == ""
    calibrator.served("a", 1, "pass", 0.9)
    assert calibrator.reviewed("a", 1, right=True) == 1  # entry 1 approved at 0.9
    for entry in range(2, 12):  # ten wrong entries, each served at 0.9 eight times
        for _ in range(8):
            calibrator.served("a", entry, "pass", 0.9)
        calibrator.reviewed("a", entry, right=False)
    assert calibrator.decide("a", 99, "pass", 0.9) == "bound"  # a's evidence moved a's cut
    assert calibrator.decide("a", 1, "pass", 0.9) == ""  # the approved entry: its own floor
    assert calibrator.decide("a", 1, "pass", 0.85) == "bound"  # ... and no lower
    assert calibrator.decide("b", 99, "pass", 0.9) == ""  # b never saw a's verdicts
    assert calibrator.stats()["a"]["evidence"] == 3000 + 81


def test_the_layer_says_uncalibrated_and_serves_under_the_shipped_calibration(embedder, tmp_path):
    from semantic.verifier import CALIBRATED_FILE, Verifier

    verifier = Verifier.load(embedder, CALIBRATED_FILE)  # the one the shipped evidence was measured with
    scope = Scope("tenant-a", "model")
    caches = {
        "few": Calibrator([Evidence("pass", 0.99, True)] * 10, 0.05, {}, ":memory:"),
        "shipped": Calibrator(load_evidence(), 0.10, {}, ":memory:"),
    }
    outcomes = {}
    for name, calibrator in caches.items():
        cache = SemanticCache(
            embedder, SqliteEntries(tmp_path / f"{name}.db"), SemanticSettings(), verifier, calibrator
        )
        entry = cache.insert("How do I reset my password?", Answer("Open Settings."), scope, "ctx", 0.0)
        outcomes[name] = cache.lookup("What is the way to reset my password?", scope, "ctx", 1.0)
        if name == "shipped":
            assert cache.set_status(entry, "approved") and calibrator.stats()["tenant-a"]["evidence"] > 0
        cache.close()
    assert outcomes["few"].status == "miss" and "uncalibrated" in outcomes["few"].reason
    assert outcomes["shipped"].status == "hit" and outcomes["shipped"].verdict.probability is not None
