"""Speculative decoding never changes an answer: a step verifies several tokens per row, and with
drafts that are the model's own greedy tokens (all kept), always wrong (all rejected, their KV trimmed
per row) or right on every other row, every answer equals plain decoding, for every family, alone and
in a batch. Sampled rows keep the model's distribution (a chi-square test against plain sampling)
and a seeded answer is the same draw with drafts or without."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest
from scipy.stats import chi2_contingency

from gateway.checkpoints import RECIPES, BuildSpec
from gateway.engine import (
    CacheConfig,
    Engine,
    EngineConfig,
    Message,
    Sampling,
    TextPart,
    decode_alone,
)
from gateway.engine.runner import ModelRunner
from kvcache import TenantSalt
from tests.conftest import built_model
from tests.gateway.test_preemption import _answers

SALT = TenantSalt(b"V" * 32)
STEPS = 40
GREEDY = Sampling(STEPS, 0.0, 1.0, None, ())


class Fixed:
    """Drafts the next tokens of a fixed answer, whatever the row generated (k of them)."""

    name = "fixed"
    first_rate = 0.9

    def __init__(self, answer):
        self.answer = answer

    def propose(self, generated, k):
        return self.answer[len(generated) : len(generated) + k]


def _messages(count: int):
    return [
        (Message("user", (TextPart(f"Note {i}: " + "the tide turns at the harbour wall. " * (1 + 2 * i)),)),)
        for i in range(count)
    ]


def _greedy_tokens(path, prompts) -> dict[tuple[int, ...], list[int]]:
    runner = ModelRunner(path, CacheConfig(0, 0, 16), "fp")
    expected = {}
    for prompt in prompts:
        prefill = runner.prefill(prompt, SALT, 64, lambda: False)
        expected[prompt.token_ids] = list(
            decode_alone(runner, prefill, Sampling(STEPS, 0.0, 1.0, None, ()), lambda: False)
        )
    return expected


def _engine(family: str, max_num_seqs: int = 4) -> Engine:
    path = built_model(BuildSpec(family, "tiny"))
    engine = Engine(path, "tiny", EngineConfig(16, 64, CacheConfig(0, 0, 16), max_num_seqs=max_num_seqs))
    engine.start()
    return engine


@pytest.mark.parametrize("family", sorted(RECIPES))
def test_drafts_right_wrong_or_half_right_leave_every_answer_as_plain_decoding(family):
    engine = _engine(family)
    try:
        prompts = [engine.prepare(m, []) for m in _messages(4)]
        expected = _greedy_tokens(engine.info.path, prompts)
        vocab = engine.runner.vocab_size

        def own_tokens(sequence):
            return [Fixed(expected[sequence.job.prompt.token_ids])]

        def wrong_tokens(sequence):
            return [Fixed([(token + 1) % vocab for token in expected[sequence.job.prompt.token_ids]])]

        def every_other_row_right(sequence):  # rows keep different numbers of tokens: per-row trims
            right = sequence.job.prompt.token_ids in {p.token_ids for p in prompts[::2]}
            return own_tokens(sequence) if right else wrong_tokens(sequence)

        engine.worker.proposers = None
        plain = _answers(engine, prompts, [GREEDY] * len(prompts))
        plain_steps = engine.snapshot().counters.num_decode_steps
        runs = {}
        for name, proposers in (("right", own_tokens), ("wrong", wrong_tokens), ("half", every_other_row_right)):
            engine.worker.proposers = proposers
            before = engine.snapshot().counters
            # queued together: no row decodes alone (a hybrid's lone row drafts) while others start
            batched = _answers(engine, prompts, [GREEDY] * len(prompts), together=True)
            middle = engine.snapshot().counters
            alone = [_answers(engine, [prompt], [GREEDY])[0] for prompt in prompts[:2]]
            runs[name] = (batched, alone, (before, middle, engine.snapshot().counters))
    finally:
        engine.stop()
    assert [n for _, n in plain] == [len(expected[p.token_ids]) for p in prompts]
    for batched, alone, _ in runs.values():
        assert batched == plain and alone == plain[:2]
    before, middle, after = runs["right"][2]
    assert after.num_accepted_drafts - middle.num_accepted_drafts > STEPS  # alone: most tokens from drafts
    if engine.runner.recurrent and not engine.runner.batch_drafts:  # a lone row only (a rejection replays the row)
        assert middle.num_drafted_tokens == before.num_drafted_tokens
    else:
        assert middle.num_decode_steps - before.num_decode_steps < plain_steps / 2  # the batch too
    before, _, after = runs["wrong"][2]
    assert after.num_drafted_tokens > before.num_drafted_tokens  # verified, and none kept
    assert after.num_accepted_drafts == before.num_accepted_drafts


@pytest.mark.parametrize("family, per_token", [("qwen3_5", True), ("lfm2_vl", False)])
def test_a_hybrid_row_that_rejects_drafts_runs_its_kept_tokens_again_only_without_states_per_token(family, per_token):
    """Qwen3.5's recurrent layers keep a state after each fed token (mlx-vlm's speculative
    transaction): a row that rejects drafts takes the state after its last kept token, and the
    engine calls the model once a step. LFM2's short convolutions keep none (its cache could, its
    layers do not record them): the row goes back and runs its kept tokens again (a second call).
    Either way the answer is plain decoding's."""
    engine = _engine(family)
    calls = []
    run_step = engine.runner.run_step
    engine.runner.run_step = lambda parts: calls.append(len(parts)) or run_step(parts)

    def calls_beyond_steps(proposers) -> tuple[int, int, int]:
        """Model calls beyond decode steps (prompt chunks, replays), drafted and kept tokens."""
        engine.worker.proposers = proposers
        calls.clear()
        before = engine.snapshot().counters
        assert _answers(engine, [prompt], [GREEDY])[0][1] == len(expected)
        after = engine.snapshot().counters
        steps = after.num_decode_steps - before.num_decode_steps
        drafted = after.num_drafted_tokens - before.num_drafted_tokens
        return len(calls) - steps, drafted, after.num_accepted_drafts - before.num_accepted_drafts

    try:
        assert engine.runner.draft_states is per_token
        prompt = engine.prepare(_messages(1)[0], [])
        expected = _greedy_tokens(engine.info.path, [prompt])[prompt.token_ids]
        vocab = engine.runner.vocab_size
        plain = calls_beyond_steps(None)
        wrong = calls_beyond_steps(lambda sequence: [Fixed([(token + 1) % vocab for token in expected])])
    finally:
        engine.stop()
    assert plain[1] == 0 and wrong[1] > 0 and wrong[2] == 0  # drafts fed, none kept
    if per_token:
        assert wrong[0] == plain[0]  # no call but the steps and the prompt's (the same both times)
    else:
        assert wrong[0] > plain[0]


def test_a_hybrid_batch_whose_drafted_step_fails_leaves_the_engine_answering_as_plain_decoding():
    """A drafted step of Qwen3.5 rows whose draws fail: the rows fail (their recurrent layers' open
    transactions go with their caches), and the next batch, drafting again, answers as plain decoding."""
    engine = _engine("qwen3_5")
    rows = engine.worker.decoding
    draw_rows, failures = rows._draw_rows, []

    def failing_once(ready):
        if not failures and len(rows.rows) > 1 and any(sequence.drafts for sequence in rows.rows):
            failures.append(len(rows.rows))
            raise RuntimeError("a broken draw")
        return draw_rows(ready)

    try:
        prompts = [engine.prepare(m, []) for m in _messages(3)]
        expected = _greedy_tokens(engine.info.path, prompts)
        engine.worker.proposers = None
        plain = _answers(engine, prompts, [GREEDY] * len(prompts))
        engine.worker.proposers = lambda sequence: [Fixed(expected[sequence.job.prompt.token_ids])]
        rows._draw_rows = failing_once
        with pytest.raises(AssertionError, match="generation failed: RuntimeError"):
            _answers(engine, prompts, [GREEDY] * len(prompts), together=True)
        before = engine.snapshot().counters
        again = _answers(engine, prompts, [GREEDY] * len(prompts), together=True)
        after = engine.snapshot().counters
    finally:
        engine.stop()
    assert failures and failures[0] > 1  # the failure hit a drafted batch step
    assert again == plain
    assert after.num_accepted_drafts > before.num_accepted_drafts  # the batch drafted again


REPLY_TOKENS = 3


def test_sampled_rows_with_drafts_draw_from_the_model_distribution_and_seeded_rows_draw_the_same():
    """Plain sampling and sampling with drafts (the greedy reply: kept only as often as the model
    draws it) give the same distribution of the reply's last token (a chi-square test of homogeneity
    over two sets of seeds), and a seed gives the same reply with drafts as without."""
    engine = _engine("llama", max_num_seqs=16)
    sampled = Sampling(REPLY_TOKENS, 0.5, 1.0, None, (), top_k=3, top_logprobs=0)
    draws = 300
    try:
        prompt = engine.prepare(_messages(1)[0], [])
        engine.worker.proposers = None
        plain = _replies(engine, prompt, sampled, range(draws))
        greedy = _replies(engine, prompt, replace(sampled, temperature=0.0), [0])[0]
        engine.worker.proposers = lambda sequence: [Fixed(greedy)]
        # one row at a time: a lone row's drafts are fed whenever they may pay (a batch's, rarely here)
        drafted = _replies(engine, prompt, sampled, range(draws, 2 * draws), at_once=1)
        same_seeds = _replies(engine, prompt, sampled, range(32), at_once=1)
        counters = engine.snapshot().counters
    finally:
        engine.stop()
    assert counters.num_drafted_tokens > draws and 0 < counters.num_accepted_drafts < counters.num_drafted_tokens
    assert same_seeds == plain[:32]
    last = [Counter(reply[-1] for reply in replies) for replies in (plain, drafted)]
    tokens = sorted(set(last[0]) | set(last[1]))
    table = [[counts[token] for token in tokens] for counts in last]
    assert len(tokens) > 3  # enough spread for the test to mean something
    assert chi2_contingency(table).pvalue > 0.001, table


def _replies(engine, prompt, sampling, seeds, at_once: int = 8) -> list[tuple[int, ...]]:
    """Each seed's reply as token ids (from its logprobs), `at_once` requests at a time (at most one
    tenant's share of the queue)."""

    async def one(seed):
        tokens = []
        async for event in engine.events(engine.submit(prompt, replace(sampling, seed=seed), SALT)):
            tokens += [entry.token for entry in getattr(event, "logprobs", ())]
        return tuple(tokens)

    async def wave(some):
        return await asyncio.gather(*(one(seed) for seed in some))

    seeds = list(seeds)
    waves = [seeds[start : start + at_once] for start in range(0, len(seeds), at_once)]
    return [reply for some in waves for reply in asyncio.run(wave(some))]


def test_with_drafting_off_rows_decode_one_token_a_step():
    path = built_model(BuildSpec("llama", "tiny"))
    config = EngineConfig(16, 64, CacheConfig(0, 0, 16), max_num_seqs=4, max_verify_tokens=0)
    engine = Engine(path, "tiny", config)
    engine.start()
    try:
        prompts = [engine.prepare(m, []) for m in _messages(3)]
        answers = _answers(engine, prompts, [GREEDY] * len(prompts))
        counters = engine.snapshot().counters
    finally:
        engine.stop()
    expected = _greedy_tokens(path, prompts)
    assert [n for _, n in answers] == [len(expected[p.token_ids]) for p in prompts]
    assert counters.num_drafted_tokens == 0 and engine.worker.proposers is None
