"""The learned verifier: when it is asked, what it decides, the shipped weights, and its training."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from evals.false_hits import load_pairs
from semantic import Answer, Scope, SemanticCache, SemanticSettings, SqliteEntries
from semantic.guards import Verdict
from semantic.verifier import OVERRULABLE, WEIGHTS_FILE, Settings, Verifier

DATA = Path(__file__).resolve().parents[2] / "evals" / "data"


class FixedVerifier(Verifier):
    """The review policy with a chosen probability (no model): records the pairs it was asked about."""

    def __init__(self, probability: float, settings: Settings = Settings(accept=0.5, overrule=0.9)):
        self.fixed = probability
        self.settings = settings
        self.asked: list[tuple[str, str]] = []

    def probability(self, query, cached, cosine):
        self.asked.append((query, cached))
        return self.fixed


def test_pairs_below_the_threshold_or_refused_for_a_fact_are_never_scored():
    verifier = FixedVerifier(0.99)
    for reasons in (("below_threshold",), ("numbers",), ("order", "negation")):
        verdict = Verdict(False, 0.9, reasons)
        assert verifier.review("q", "c", verdict) is verdict
    assert verifier.asked == []


def test_an_unopposed_pair_is_served_only_at_the_accept_bar():
    unopposed = Verdict(True, 0.93)
    served = FixedVerifier(0.5).review("q", "c", unopposed)
    assert served == Verdict(True, 0.93, (), 0.5)
    refused = FixedVerifier(0.49).review("q", "c", unopposed)
    assert refused == Verdict(False, 0.93, ("verifier",), 0.49)


def test_word_order_objections_are_overruled_only_at_the_higher_bar():
    for reason in sorted(OVERRULABLE):
        opposed = Verdict(False, 0.95, (reason,))
        assert FixedVerifier(0.89).review("q", "c", opposed) == Verdict(False, 0.95, (reason, "verifier"), 0.89)
        assert FixedVerifier(0.9).review("q", "c", opposed) == Verdict(True, 0.95, (), 0.9, overruled=(reason,))


def test_the_cache_asks_the_verifier_about_candidates_and_reports_its_verdict(tmp_path, embedder):
    scope = Scope(tenant="t", model="m")
    for probability, status in ((0.1, "miss"), (0.8, "hit")):
        verifier = FixedVerifier(probability)
        cache = SemanticCache(embedder, SqliteEntries(tmp_path / f"{status}.db"), SemanticSettings(), verifier)
        cache.insert("How do I reset my password?", Answer("use the link"), scope, "ctx", 0.0)
        result = cache.lookup("What is the way to reset my password?", scope, "ctx", 1.0)
        assert verifier.asked == [("What is the way to reset my password?", "How do I reset my password?")]
        assert result.status == status and result.verdict.probability == probability
        assert result.reason == ("verifier" if status == "miss" else "")
        cache.close()


# -- the shipped weights -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped(embedder):
    return Verifier.load(embedder)


def test_shipped_weights_carry_their_bars_and_refuse_another_format(tmp_path, shipped, embedder):
    assert 0 < shipped.settings.accept <= shipped.settings.overrule <= 1.01
    from safetensors.torch import save_file

    stale = tmp_path / "old.safetensors"
    save_file({"x": torch.zeros(1)}, str(stale), metadata={"format_version": "0", "settings": "{}"})
    with pytest.raises(ValueError, match="format"):
        Verifier.load(embedder, stale)


# Written for this test, unlike any training pair: each swap changes who does what to whom.
UNSEEN_SWAPS = [
    ("Can the nurse override the surgeon's orders?", "Can the surgeon override the nurse's orders?"),
    (
        "Does the hospital pay the insurer when a claim is denied?",
        "Does the insurer pay the hospital when a claim is denied?",
    ),
    ("Is ethernet faster than wifi for gaming?", "Is wifi faster than ethernet for gaming?"),
    ("How do I forward emails from Gmail to Outlook?", "How do I forward emails from Outlook to Gmail?"),
    (
        "Who inherits the house if the husband outlives the wife?",
        "Who inherits the house if the wife outlives the husband?",
    ),
    ("Does the cat chase the mouse in the cartoon?", "Does the mouse chase the cat in the cartoon?"),
    ("Can a subsidiary own shares of its parent company?", "Can a parent company own shares of its subsidiary?"),
    (
        "How many miles is it from Denver to the coast if you drive?",
        "How many miles is it from the coast to Denver if you drive?",
    ),
]
UNSEEN_REWORDINGS = [
    ("How do I cook quinoa on the stove?", "What's the way to make quinoa on a stovetop?"),
    ("Why do my headphones keep disconnecting?", "What makes my headphones disconnect all the time?"),
    ("Can I use baking soda instead of baking powder?", "Is it possible to swap baking powder for baking soda?"),
    ("What is the capital of Australia?", "Which city is Australia's capital?"),
    ("How do I clean a cast iron pan?", "What's the right way to clean a cast-iron skillet?"),
    ("When was the Berlin Wall torn down?", "In which year did the Berlin Wall come down?"),
    ("How can I stop my dog from barking at night?", "How do I get my dog to stop barking at night?"),
    ("What are good exercises for lower back pain?", "Which exercises help with pain in the lower back?"),
]


def _probabilities(verifier, pairs, embedder) -> list[float]:
    vectors = embedder.embed([text for pair in pairs for text in pair])
    return [
        verifier.probability(query, cached, float(vectors[2 * i] @ vectors[2 * i + 1]))
        for i, (cached, query) in enumerate(pairs)
    ]


def test_shipped_verifier_tells_role_swaps_from_rewordings(shipped, embedder):
    swaps = _probabilities(shipped, UNSEEN_SWAPS, embedder)
    rewordings = _probabilities(shipped, UNSEEN_REWORDINGS, embedder)
    accept = shipped.settings.accept
    assert sum(p < accept for p in swaps) >= 6, swaps
    assert sum(p >= accept for p in rewordings) >= 6, rewordings
    assert sorted(rewordings)[len(rewordings) // 2] > sorted(swaps)[len(swaps) // 2]


def test_shipped_verifier_scores_a_pair_the_same_either_way_round(shipped):
    forward = shipped.probability("Is tea healthier than coffee?", "Is coffee healthier than tea?", 0.97)
    backward = shipped.probability("Is coffee healthier than tea?", "Is tea healthier than coffee?", 0.97)
    assert forward == pytest.approx(backward, abs=1e-5)


def test_the_verifier_and_the_embedder_share_the_tokenizer_safely_across_threads(shipped, embedder):
    """Lookups run on several threads, each embedding and verifying with the one shared tokenizer."""
    from concurrent.futures import ThreadPoolExecutor

    def work(number: int) -> float:
        text = f"Can a subsidiary own shares of its parent company number {number}?"
        embedder.embed([text * (1 + number % 3)])
        return shipped.probability(text, "Can a parent company own shares of its subsidiary?", 0.95)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(40)))
    assert len(results) == 40 and all(0.0 <= p <= 1.0 for p in results)


# -- training data and the training command ------------------------------------------------------


def test_no_reported_sentence_is_trained_on():
    """Neither the pairs the numbers are reported on nor any of their sentences (PAWS repeats
    pairs under other ids and builds several pairs from one sentence)."""
    sample = {json.loads(line)["id"].removeprefix("paws-") for line in (DATA / "paws_sample.jsonl").open()}
    with open(DATA / "paws_train.tsv", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert len(rows) > 6000 and not sample & {row[0] for row in rows}
    reported = set()
    for name in ("dev.jsonl", "paws_sample.jsonl"):
        for line in (DATA / name).open():
            row = json.loads(line)
            reported |= {row["cached_prompt"], row["query_prompt"]}
    import random

    from evals.train_verifier import paws_pairs, written_pairs

    trained = {text for e in paws_pairs() + written_pairs(random.Random(0)) for text in (e.cached, e.query)}
    assert len(trained) > 5000 and not trained & reported


def test_the_calibration_and_fresh_pairs_share_no_sentence_with_what_the_calibrated_verifier_trains_on():
    """The false-hit bound's evidence, and the split it is reported on, are text the calibrated
    verifier never saw: whole groups of PAWS pairs sharing a sentence are set apart together."""
    from evals.train_verifier import parts

    data = parts(2026, apart=True)
    trained = {text for e in data["train"] + data["held_out"] for text in (e.cached, e.query)}
    calibration = {text for e in data["calibration"] for text in (e.cached, e.query)}
    fresh = {text for e in data["fresh"] for text in (e.cached, e.query)}
    assert len(data["calibration"]) > 900 and len(data["fresh"]) > 600
    assert not trained & calibration and not trained & fresh and not calibration & fresh


def test_written_pairs_stay_away_from_the_reported_questions(embedder):
    """Not only unequal: no written question is within MiniLM cosine 0.88 of a dev or PAWS-sample one."""
    import random

    from evals.train_verifier import written_pairs

    reported = sorted(
        {
            text
            for pair in load_pairs([DATA / "dev.jsonl", DATA / "paws_sample.jsonl"])
            for text in (pair.cached_prompt, pair.query_prompt)
        }
    )
    written = sorted(
        {text for seed in range(3) for e in written_pairs(random.Random(seed)) for text in (e.cached, e.query)}
    )
    closest = (embedder.embed(written) @ embedder.embed(reported).T).max()
    assert closest < 0.88


def test_training_is_reproducible_for_a_seed(tmp_path):
    from safetensors.torch import load_file

    from evals.train_verifier import main

    outputs = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for out in outputs:
        assert main(["--epochs", "1", "--limit", "300", "--out", str(out)]) == 0
    first, second = (load_file(str(out)) for out in outputs)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert WEIGHTS_FILE.exists()
