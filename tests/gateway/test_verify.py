"""A step verifies several tokens per row (the speculative-decoding seam): drafts that are the model's
own greedy tokens are all accepted, drafts that are always wrong are all rejected (their KV trimmed
per row), and in both cases every answer equals plain decoding, rows of different lengths together."""

from __future__ import annotations

import pytest

from gateway.checkpoints import BuildSpec
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
DRAFTS = 4


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


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2_5_vl"])
def test_drafts_all_accepted_or_all_rejected_leave_every_answer_as_plain_decoding(family):
    path = built_model(BuildSpec(family, "tiny"))
    engine = Engine(path, "tiny", EngineConfig(16, 64, CacheConfig(0, 0, 16), max_num_seqs=4))
    engine.start()
    try:
        prompts = [engine.prepare(m, []) for m in _messages(4)]
        expected = _greedy_tokens(path, prompts)
        vocab = engine.runner.vocab_size

        def own_tokens(sequence):
            done = len(sequence.generated)
            return expected[sequence.job.prompt.token_ids][done : done + DRAFTS]

        def wrong_tokens(sequence):
            return [(token + 1) % vocab for token in own_tokens(sequence)]

        def every_other_row_right(sequence):  # rows keep different numbers of tokens: per-row trims
            right = sequence.job.prompt.token_ids in {p.token_ids for p in prompts[::2]}
            return own_tokens(sequence) if right else wrong_tokens(sequence)

        plain = _answers(engine, prompts, [GREEDY] * len(prompts))
        plain_steps = engine.snapshot().counters.num_decode_steps
        engine.worker.proposer = own_tokens
        right = _answers(engine, prompts, [GREEDY] * len(prompts))
        after_right = engine.snapshot().counters
        engine.worker.proposer = wrong_tokens
        wrong = _answers(engine, prompts, [GREEDY] * len(prompts))
        after_wrong = engine.snapshot().counters
        engine.worker.proposer = every_other_row_right
        half = _answers(engine, prompts, [GREEDY] * len(prompts))
    finally:
        engine.stop()
    assert [n for _, n in plain] == [len(expected[p.token_ids]) for p in prompts]
    assert right == plain and wrong == plain and half == plain
    assert after_right.num_accepted_drafts > STEPS  # most tokens came from verified drafts ...
    assert after_right.num_decode_steps - plain_steps < plain_steps / 2  # ... in fewer steps
    assert after_wrong.num_accepted_drafts == after_right.num_accepted_drafts  # none of the wrong ones
