"""The proposers, the adaptive draft length and the batch's draft width (gateway/engine/speculative.py),
without a model."""

from __future__ import annotations

from gateway.engine.speculative import (
    FED_TOKEN_COST,
    MAX_DRAFT,
    MAX_PAUSE_STEPS,
    Acceptance,
    Drafter,
    NgramIndex,
    PromptLookup,
    ReferenceLookup,
    SpeculativeReport,
    batch_width,
    default_proposers,
)


def test_an_ngram_continues_from_its_latest_earlier_occurrence_and_never_matches_the_tail_itself():
    index = NgramIndex((2,))
    index.extend([1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    assert index.continuation([1, 2], 3) == [4, 5, 1]  # the later of the two earlier occurrences
    assert index.continuation([7, 8], 3) == []
    lone = NgramIndex((2,))
    lone.extend([5, 6])
    assert lone.continuation([5, 6], 2) == []  # the tail is not followed by anything yet


def test_prompt_lookup_drafts_what_followed_the_reply_tail_in_the_prompt_and_in_the_reply():
    lookup = PromptLookup([10, 11, 12, 13, 14, 15, 16])
    assert lookup.propose([11, 12], 3) == [13, 14, 15]  # the prompt's tokens after "11 12"
    assert lookup.propose([11, 12, 13, 14, 15, 16], 3) == [11, 12, 13]  # the prompt's end led into the reply
    # the reply repeats itself: its own earlier tokens are drafts
    assert lookup.propose([11, 12, 13, 14, 15, 16, 40, 41, 42, 16, 40], 2) == [41, 42]
    assert PromptLookup([10, 11, 12]).propose([20, 21], 4) == []


def test_a_reference_is_followed_from_its_start_and_rejoined_after_a_divergence():
    lookup = ReferenceLookup([1, 2, 3, 4, 5, 6, 7, 8])
    assert lookup.propose([], 3) == [1, 2, 3]
    assert lookup.propose([1, 2], 3) == [3, 4, 5]
    assert lookup.propose([1, 2, 99, 5], 2) == [6, 7]  # diverged at 99; rejoined after 5
    assert lookup.propose([1, 2, 3, 4, 5, 6, 7, 8], 2) == []  # the reference is used up


def test_k_doubles_on_a_whole_draft_kept_and_shrinks_to_what_was_kept_plus_one():
    drafter = Drafter([ReferenceLookup(list(range(100)))])
    first = drafter.draft([], 100)
    assert len(first) == drafter.k == 4
    drafter.verified(4, 4)
    assert drafter.k == 8
    drafter.verified(8, 8)
    assert drafter.k == MAX_DRAFT
    drafter.verified(8, 2)
    assert drafter.k == 3
    assert len(drafter.draft(list(range(20)), 2)) == 2  # never past the room the row has
    assert drafter.counts["cache"].num_drafted == 20 and drafter.counts["cache"].num_accepted == 14


def test_a_failing_row_pauses_longer_after_each_miss():
    drafter = Drafter([ReferenceLookup([3] + [7] * 100)])
    fed = []
    for step in range(70):
        if drafter.draft([1, 2, 3], 100):  # the reply left the reference: a guess from its last token
            drafter.verified(1, 0)
            fed.append(step)
    assert fed == [0, 2, 6, 14, 30, 62]  # paused 1, 3, 7, 15, 31 steps


def test_every_row_tries_once_then_the_engine_record_of_the_proposer_decides_until_it_fades():
    shared = Acceptance()
    for _ in range(40):
        shared.record("cache", 1, 0)  # other rows' drafts from this proposer failed
    newcomer = Drafter([ReferenceLookup([3] + [7] * 100)], shared=shared)
    draft = newcomer.draft([1, 2, 3], 100)
    assert batch_width([draft], [newcomer.rate], 8) > 0  # its first draft: what the proposer promises
    newcomer.verified(2, 0)
    for _ in range(1 + MAX_PAUSE_STEPS):
        draft = newcomer.draft([1, 2, 3], 100) or draft
    assert batch_width([draft], [newcomer.rate], 8) == 0  # then the engine's record: not worth it
    for _ in range(6000):  # a few minutes of decoding
        shared.fade()
    assert batch_width([draft], [newcomer.rate], 8) > 0


def test_the_batch_width_pays_for_the_tokens_fed_to_every_row():
    sure, unsure = [1] * 8, [1] * 8
    assert batch_width([sure], [0.95], 8) == 8  # one row, nearly always right: the longest draft
    assert batch_width([unsure], [FED_TOKEN_COST / 2], 8) == 0  # cheaper to decode plainly
    # one drafting row among sixteen pays for sixteen rows' extra tokens: none at this rate
    assert batch_width([sure] + [[]] * 15, [0.9] + [0.5] * 15, 8) == 0
    assert batch_width([sure] * 16, [0.95] * 16, 8) > 0  # every row drafting well does
    assert batch_width([sure], [0.95], 3) == 3  # never past the width allowed
    assert batch_width([sure], [0.95], -1) == batch_width([], [], 8) == 0  # no room (drafting off), no rows


def test_references_come_before_prompt_lookup_and_the_report_counts_each_proposer():
    proposers = default_proposers([1, 2, 3], [(5, 6), ()])
    assert [p.name for p in proposers] == ["cache", "prompt"]
    drafter = Drafter(proposers)
    assert drafter.draft([], 4) == [5, 6] and drafter.last.name == "cache"
    drafter.verified(2, 2)
    assert drafter.draft([5, 6, 1, 2], 4) == [3, 5, 6, 1] and drafter.last.name == "prompt"  # the context repeats
    drafter.verified(1, 0)
    report = SpeculativeReport.of(drafter)
    assert report.counts == (("cache", 2, 2), ("prompt", 1, 0))
    assert (report.num_drafted, report.num_accepted) == (3, 2)
    assert SpeculativeReport.of(None).counts == ()
