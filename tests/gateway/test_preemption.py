"""KV that grows and can be preempted, on the real tiny models: a sequence preempted and resumed gives
the tokens it gets when never preempted (greedy and seeded, attention and sliding-window families),
and sequences asking for far more tokens than they use run together under a budget their worst
cases would not fit."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager, nullcontext

import pytest

from gateway.checkpoints import BuildSpec
from gateway.engine import CacheConfig, Engine, EngineConfig, Failed, Finished, Message, Sampling, TextPart
from kvcache import TenantSalt
from kvcache.ssd import SsdConfig
from tests.conftest import built_model

SALT = TenantSalt(b"P" * 32)
KIB = 1024


def _engine(model_path, budget_bytes: int, ssd_root=None) -> Engine:
    ssd = SsdConfig(ssd_root) if ssd_root else None
    engine = Engine(model_path, "tiny", EngineConfig(16, 64, CacheConfig(budget_bytes, 0, 16, ssd), max_num_seqs=8))
    engine.start()
    return engine


def _prompts(engine, count: int):
    texts = [f"Story {i}: tell a very long story about the harbour." for i in range(count)]
    return [engine.prepare((Message("user", (TextPart(t),)),), []) for t in texts]


def _answers(engine, prompts, samplings, together: bool = False) -> list[tuple[str, int]]:
    """Every prompt at once; each one's (text, completion tokens). `together`: queued while the
    worker waits between two steps, so one scheduling pass admits them all (otherwise the worker
    may start the first before the others are queued)."""

    async def one(job):
        text = ""
        async for event in engine.events(job):
            assert not isinstance(event, Failed), event.message
            if isinstance(event, Finished):
                return text, event.num_completion_tokens
            text += getattr(event, "text", "")

    async def all_of_them():
        with _worker_held(engine) if together else nullcontext():
            jobs = [engine.submit(p, s, SALT) for p, s in zip(prompts, samplings)]
        return await asyncio.gather(*(one(job) for job in jobs))

    return asyncio.run(all_of_them())


@contextmanager
def _worker_held(engine):
    """The engine's worker waits between two steps until the block ends."""
    entered, release = threading.Event(), threading.Event()
    engine.worker.call(lambda: (entered.set(), release.wait(60)))
    assert entered.wait(60), "the worker never ran the call"
    try:
        yield
    finally:
        release.set()


# the tiny models' end tokens (llama's and gemma3's, then qwen3_next's): answers run to max_tokens
NO_EOS = ((8184, -100.0), (8186, -100.0), (8189, -100.0), (8191, -100.0))


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next"])
def test_a_preempted_sequence_resumes_with_the_tokens_it_would_have_drawn(family, tmp_path):
    """Three long answers under a budget that holds one whole sequence: they start together, the
    newest are preempted as the others grow, come back from their blocks (written to the SSD tier
    at preemption: RAM this tight evicts them while the others grow; a hybrid model's recurrent
    state from the snapshot its decoding took last), and every answer (greedy, seeded sampling)
    equals the one it gets alone."""
    path = built_model(BuildSpec(family, "tiny"))
    samplings = [
        Sampling(160, 0.0, 1.0, None, ()),
        Sampling(160, 0.8, 0.95, 42, (), logit_bias=NO_EOS),
        Sampling(160, 0.0, 1.0, None, (), logit_bias=NO_EOS),
    ]
    roomy = _engine(path, 64 << 20)
    try:
        prompts = _prompts(roomy, 3)
        alone = [_answers(roomy, [p], [s])[0] for p, s in zip(prompts, samplings)]
        per_token, state_bytes = roomy.runner.kv_bytes_per_token, roomy.runner.state_bytes
    finally:
        roomy.stop()
    assert [tokens for _, tokens in alone] == [160] * 3  # long enough to need growing

    # a hybrid's sequences each hold their recurrent state besides (70 tokens' KV on the tiny model)
    tight = _engine(path, (prompts[0].num_tokens + 160 + 40) * per_token + 3 * state_bytes, tmp_path / "kv")
    try:
        together = _answers(tight, prompts, samplings)
        counters = tight.snapshot().counters
        tight.runner.caches.prefix.pool.check()
    finally:
        tight.stop()
    assert together == alone
    assert counters.num_preemptions >= 1 and counters.peak_running == 3, counters
    prompt_blocks = prompts[0].num_tokens // 16 * 16
    # resumed from its blocks (prompt *and* the reply so far), not recomputed
    assert counters.num_resumed_tokens > counters.num_preemptions * prompt_blocks, counters


def test_sequences_asking_for_4096_tokens_run_together_under_a_small_budget(tiny_model_path):
    """Eight requests with max_tokens 4,096 whose answers end early (at a stop sequence): worst-case
    reservations ((prompt + 4,096) x 2 KiB, ~8.4 MB each) would run them one at a time under 10 MB;
    holding what they use, all eight run at once."""
    engine = _engine(tiny_model_path, 10_000 * KIB)
    try:
        prompts = _prompts(engine, 8)
        worst_case = engine.worker.kv_bytes(prompts[0], Sampling(4096, 0.0, 1.0, None, ()))
        assert 2 * worst_case > 10_000 * KIB
        openings = _answers(engine, prompts, [Sampling(12, 0.0, 1.0, None, ())] * 8)
        stops = [Sampling(4096, 0.0, 1.0, None, (text[-3:],)) for text, _ in openings]
        answers = _answers(engine, prompts, stops)
        counters = engine.snapshot().counters
    finally:
        engine.stop()
    assert counters.peak_running == 8 and counters.num_preemptions == 0, counters
    for (opening, _), (answer, num_tokens) in zip(openings, answers):
        assert opening.startswith(answer) and num_tokens <= 12
