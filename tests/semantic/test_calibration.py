"""The false-hit bound: calibration on synthetic scores with a known truth keeps the share of
look-alikes it serves under the bound on fresh draws, and so the false hits per lookup under any mix; too little evidence refuses; each tenant runs at its
own bound with its own verdicts; an approved entry keeps being served at the level it was approved;
and the real layer (MiniLM, the shipped verifier and calibration) says `uncalibrated` when it is."""

from __future__ import annotations

import random
import uuid

import pytest

from semantic import Answer, Scope, SemanticCache, SemanticSettings, SqliteEntries
from semantic.calibration import (
    Calibration,
    Calibrator,
    Evidence,
    SqliteJournal,
    least_certifiable,
    load_evidence,
    upper_bound,
)
from semantic.redis_calibration import RedisJournal
from semantic.store import StoreUnavailable


def _draws(count: int, seed: int) -> list[Evidence]:
    """A verifier whose probability is miscalibrated: P(right | p) = p ** 0.3 ("pass") and p ** 2
    ("structural": the word-order cases it overrates); a tenth refused by a fact guard, mostly wrong."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        group = rng.choices(["pass", "structural", "refused"], [0.6, 0.3, 0.1])[0]
        probability = rng.random()
        truth = {"pass": probability**0.3, "structural": probability**2, "refused": 0.1}[group]
        out.append(Evidence(group, 0.0 if group == "refused" else probability, rng.random() < truth))
    return out


def _interval_low(wrong: int, total: int) -> float:
    """The lower end of the two-sided 95% Clopper-Pearson interval of wrong / total."""
    return 1 - upper_bound(total - wrong, total, 0.975)


@pytest.mark.parametrize("bound", [0.02, 0.05, 0.10, 0.20])
def test_the_share_of_lookalikes_served_stays_under_the_bound_on_fresh_draws(bound):
    calibration = Calibration.fit(_draws(4000, seed=1), bound)
    assert calibration.cut is not None and calibration.lookalikes_served_upper <= bound
    fresh = _draws(40_000, seed=2)
    served = [e for e in fresh if calibration.decide(e.group, e.probability)]
    lookalikes = sum(not e.right for e in fresh)
    wrong = sum(not e.right for e in served)
    assert len(served) > 0.05 * len(fresh)  # it serves: the bound is not met by serving nothing
    assert not any(e.group == "refused" for e in served)
    assert _interval_low(wrong, lookalikes) <= bound, (wrong, lookalikes)


def test_false_hits_per_lookup_stay_under_the_bound_whatever_the_mix_of_lookalikes():
    """Traffic with nine look-alikes in ten lookups (the evidence has about half): the false hits per
    lookup still stay under the bound, as the share of look-alikes served bounds them."""
    calibration = Calibration.fit(_draws(4000, seed=7), 0.10)
    fresh = _draws(60_000, seed=8)
    right = [e for e in fresh if e.right]
    traffic = [e for e in fresh if not e.right] + right[: len(fresh) // 20]
    wrong = sum(not e.right and calibration.decide(e.group, e.probability) for e in traffic)
    assert sum(not e.right for e in traffic) > 0.85 * len(traffic)
    assert _interval_low(wrong, len(traffic)) <= 0.10, (wrong, len(traffic))


def test_a_looser_bound_serves_more():
    draws, fresh = _draws(4000, seed=3), _draws(20_000, seed=4)
    fitted = [Calibration.fit(draws, bound) for bound in (0.05, 0.1, 0.2)]
    served = [sum(calibration.decide(e.group, e.probability) for e in fresh) for calibration in fitted]
    assert served[0] < served[1] < served[2]


def test_too_few_lookalikes_is_uncalibrated_and_serves_nothing():
    few = [Evidence("pass", 0.99, True)] * 500 + [Evidence("refused", 0.0, False)] * (least_certifiable(0.02) - 1)
    calibration = Calibration.fit(few, 0.02)
    assert calibration.cut is None and not calibration.decide("pass", 0.999)
    calibrator = Calibrator(few, 0.02, {}, SqliteJournal(":memory:"))
    assert calibrator.decide("tenant-a", 1, "pass", 0.999) == "uncalibrated"
    assert Calibration.fit([*few, Evidence("refused", 0.0, False)], 0.02).cut is not None  # one more, and it is


def test_each_tenant_runs_at_its_own_bound():
    calibrator = Calibrator(_draws(4000, seed=5), 0.20, {"billing": 0.02}, SqliteJournal(":memory:"))
    loose, strict = calibrator.calibration("faq").cut, calibrator.calibration("billing").cut
    assert loose is not None and strict is not None and strict > loose
    middle = next(p / 100 for p in range(100) if calibrator.calibration("faq").decide("pass", p / 100))
    assert calibrator.decide("faq", 1, "pass", middle) == ""
    assert calibrator.decide("billing", 1, "pass", middle) == "bound"
    assert calibrator.stats()["billing"]["bound"] == 0.02 and calibrator.stats()["*"]["bound"] == 0.20


@pytest.fixture(params=["sqlite", "redis"])
def journal(request):
    """Each journal: one replica's SQLite, and a real redis-server (a fresh prefix per test)."""
    if request.param == "redis":
        journal = RedisJournal(request.getfixturevalue("redis_server").url, prefix=f"test-{uuid.uuid4().hex}:")
    else:
        journal = SqliteJournal(":memory:")
    yield journal
    journal.close()


def test_review_verdicts_move_their_own_tenant_and_their_own_entry(journal):
    """Tenant a's rejections raise a's cut above 0.9 (b's stays); an entry a approved at 0.9 is still
    served there (its own history); the others at 0.9 are not."""
    calibrator = Calibrator(_draws(3000, seed=6), 0.10, {}, journal)
    assert calibrator.decide("a", 1, "pass", 0.9) == ""
    calibrator.served("a", 1, "pass", 0.9)
    assert calibrator.reviewed("a", 1, right=True) == 1  # entry 1 approved at 0.9
    for entry in range(2, 22):  # twenty wrong entries, each served at 0.9 eight times
        for _ in range(8):
            calibrator.served("a", entry, "pass", 0.9)
        calibrator.reviewed("a", entry, right=False)
    assert calibrator.decide("a", 99, "pass", 0.9) == "bound"  # a's evidence moved a's cut
    assert calibrator.decide("a", 1, "pass", 0.9) == ""  # the approved entry: its own floor
    assert calibrator.decide("a", 1, "pass", 0.85) == "bound"  # ... and no lower
    assert calibrator.decide("b", 99, "pass", 0.9) == ""  # b never saw a's verdicts
    assert calibrator.stats()["a"]["evidence"] == 3000 + 161


def test_the_layer_says_uncalibrated_and_serves_under_the_shipped_calibration(embedder, tmp_path):
    from semantic.verifier import CALIBRATED_FILE, Verifier

    verifier = Verifier.load(embedder, CALIBRATED_FILE)  # the one the shipped evidence was measured with
    scope = Scope("tenant-a", "model")
    caches = {
        "few": Calibrator([Evidence("pass", 0.99, True)] * 10, 0.05, {}, SqliteJournal(":memory:")),
        "shipped": Calibrator(load_evidence(), 0.10, {}, SqliteJournal(":memory:")),
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


def test_a_purge_forgets_the_tenants_evidence_and_the_hits_awaiting_review(journal):
    calibrator = Calibrator(_draws(500, seed=9), 0.10, {}, journal)
    for tenant, entry in (("a", 1), ("a", 2), ("b", 3)):
        calibrator.served(tenant, entry, "pass", 0.9)
    calibrator.reviewed("a", 1, right=False)
    calibrator.reviewed("b", 3, right=False)
    calibrator.forget([2])  # a session's share: entry 2 goes, a's evidence stays
    assert calibrator.reviewed("a", 2, right=True) == 0
    assert calibrator.calibration("a").num_evidence == 501
    calibrator.forget([], tenant="a")  # the whole tenant
    assert calibrator.calibration("a").num_evidence == 500 and calibrator.calibration("b").num_evidence == 501
    calibrator.forget_all()
    assert calibrator.calibration("b").num_evidence == 500


def test_the_layer_purges_its_calibration_with_the_tenant(embedder, tmp_path):
    from semantic.owners import Selector
    from semantic.verifier import CALIBRATED_FILE, Verifier

    calibrator = Calibrator(load_evidence(), 0.10, {}, SqliteJournal(":memory:"))
    cache = SemanticCache(
        embedder,
        SqliteEntries(tmp_path / "s.db"),
        SemanticSettings(),
        Verifier.load(embedder, CALIBRATED_FILE),
        calibrator,
    )
    scope = Scope("tenant-a", "model")
    entry = cache.insert("How do I reset my password?", Answer("Open Settings."), scope, "ctx", 0.0)
    assert cache.lookup("What is the way to reset my password?", scope, "ctx", 1.0).status == "hit"
    assert cache.set_status(entry, "approved")
    assert calibrator.calibration("tenant-a").num_evidence == len(load_evidence()) + 1
    cache.purge_owned(Selector("tenant-a"))
    assert calibrator.calibration("tenant-a").num_evidence == len(load_evidence())
    cache.close()


def test_replicas_sharing_redis_learn_from_each_others_verdicts(redis_server):
    """Two replicas' calibrators on one Redis: a hit served on one and rejected on the other moves
    both replicas' cut for that tenant (each had fitted it before), and counts once."""
    prefix = f"test-{uuid.uuid4().hex}:"
    one, two = (
        Calibrator(_draws(3000, seed=6), 0.10, {}, RedisJournal(redis_server.url, prefix=prefix)) for _ in range(2)
    )
    assert one.decide("a", 99, "pass", 0.9) == two.decide("a", 99, "pass", 0.9) == ""
    for entry in range(2, 22):
        for _ in range(8):
            one.served("a", entry, "pass", 0.9)
        assert two.reviewed("a", entry, right=False) == 8
        assert one.reviewed("a", entry, right=False) == 0  # already moved: never counted twice
    assert one.decide("a", 99, "pass", 0.9) == two.decide("a", 99, "pass", 0.9) == "bound"
    assert one.stats()["a"]["evidence"] == two.stats()["a"]["evidence"] == 3000 + 160
    one.close()
    two.close()


def test_a_journal_out_of_reach_raises_store_unavailable_so_the_layer_bypasses():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here
    calibrator = Calibrator(_draws(500, seed=1), 0.10, {}, RedisJournal(f"redis://127.0.0.1:{port}/0"))
    with pytest.raises(StoreUnavailable):
        calibrator.decide("a", 1, "pass", 0.9)
    with pytest.raises(StoreUnavailable):
        calibrator.served("a", 1, "pass", 0.9)
    calibrator.close()


def test_any_tenant_name_and_exact_probabilities_survive_the_journal(journal):
    calibrator = Calibrator(_draws(500, seed=10), 0.10, {}, journal)
    tenant, probability = 'team\t"one"', 0.1 + 0.2  # a tab and quotes; a float with no short decimal
    calibrator.served(tenant, 7, "structural", probability)
    assert calibrator.reviewed(tenant, 7, right=True) == 1
    assert journal.floor(tenant, 7, "structural") == probability
    assert calibrator.decide(tenant, 7, "structural", probability) == ""  # served at its own floor
    assert journal.evidence(tenant) == [Evidence("structural", probability, True)]
