"""One memory budget for running sequences and cached prefix blocks, on the real tiny model: admission
waits rather than overcommitting, cached blocks give way to running sequences (never the reverse),
and a request that could never fit is a 400 at once."""

from __future__ import annotations

import asyncio
import time

from litestar.testing import TestClient

from gateway.engine import CacheConfig, Engine, EngineConfig, Failed, Finished, Message, Sampling, TextPart
from gateway.http.app import create_app
from kvcache import TenantSalt
from tests.conftest import TINY

SALT = TenantSalt(b"M" * 32)
GREEDY = 24


def _engine(model_path, budget_bytes: int) -> Engine:
    engine = Engine(
        model_path,
        TINY,
        EngineConfig(max_queue=8, step_prompt_tokens=64, caches=CacheConfig(budget_bytes, 0, 16), max_num_seqs=8),
    )
    return engine


def _prompt(engine, index: int):
    text = f"Question {index}: " + "what do the tides do to the harbour and its boats? " * 6
    return engine.prepare((Message("user", (TextPart(text),)),), [])


def _run(engine, prompts, max_tokens=GREEDY) -> list[tuple[str, int]]:
    """Submit every prompt at once; each job's (text, completion tokens)."""

    async def one(prompt):
        job = engine.submit(prompt, Sampling(max_tokens, 0.0, 1.0, None, ()), SALT)
        text = ""
        async for event in engine.events(job):
            assert not isinstance(event, Failed), event.message
            if isinstance(event, Finished):
                return text, event.num_completion_tokens
            text += getattr(event, "text", "")

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in prompts))

    answers = asyncio.run(all_of_them())
    _wait_idle(engine)
    return answers


def _observe_steps(engine) -> list[int]:
    """Before start: after every step (the real one runs first: an observation only) the pool's
    blocks + reservations are checked against the budget; how many rows decoded at each step."""
    worker, pool, decoding_at_step = engine.worker, engine.runner.caches.prefix.pool, []
    step = worker.steps.run

    def observed_step(plan):
        step(plan)
        pool.check()  # blocks + reservations <= budget
        decoding_at_step.append(len(worker.rows))

    worker.steps.run = observed_step
    return decoding_at_step


def _wait_idle(engine) -> None:
    """Finished is sent before the row retires and stores its blocks: wait for the worker to be done."""
    deadline = time.monotonic() + 30
    while engine.snapshot().busy:
        assert time.monotonic() < deadline, "the worker stayed busy"
        time.sleep(0.01)


def test_admission_waits_for_memory_instead_of_overcommitting(tiny_model_path):
    """A budget for about three sequences' own KV: four jobs at once never hold more than the budget
    at any step, some wait, and each gets the answer it gets alone. Three decode at once and none is
    preempted: a running sequence's KV counts once (the prompt blocks it stored are cached copies
    that give way, not blocks it holds beside its own KV)."""
    engine = _engine(tiny_model_path, 1 << 30)
    engine.start()
    prompts = [_prompt(engine, i) for i in range(4)]
    need = engine.worker.kv_bytes(prompts[0], Sampling(GREEDY, 0.0, 1.0, None, ()))
    alone = [_run(engine, [p])[0] for p in prompts]
    engine.stop()

    engine = _engine(tiny_model_path, int(need * 3.2))
    worker, pool = engine.worker, engine.runner.caches.prefix.pool
    decoding_at_step = _observe_steps(engine)
    engine.start()
    try:
        together = _run(engine, prompts)
    finally:
        engine.stop()
    assert together == alone
    counters = worker.snapshot().counters
    assert counters.num_memory_waits >= 1, counters
    assert max(decoding_at_step) == 3, decoding_at_step
    # none had to give its place back: counted twice, the third one's growth preempted another
    assert counters.num_preemptions == 0, counters
    assert pool.reserved_bytes == 0
    pool.check()


def test_cached_blocks_are_evicted_to_admit_a_running_sequence(tiny_model_path):
    engine = _engine(tiny_model_path, 1 << 30)
    engine.start()
    first, second = _prompt(engine, 1), _prompt(engine, 2)
    need = engine.worker.kv_bytes(second, Sampling(GREEDY, 0.0, 1.0, None, ()))
    engine.stop()

    engine = _engine(tiny_model_path, int(need * 1.5))  # one sequence and its blocks; not two sequences' blocks
    engine.start()
    try:
        _run(engine, [first])
        pool = engine.runner.caches.prefix.pool
        cached_after_first = len(pool.by_hash)
        assert cached_after_first and pool.num_bytes > need * 0.5  # the first conversation's blocks, free now
        _run(engine, [second])
        assert pool.counters.num_evicted_to_reserve > 0  # they gave way when the second was admitted
        assert engine.snapshot().counters.num_memory_waits == 0  # it never had to wait for them
    finally:
        engine.stop()


def test_a_request_larger_than_the_whole_budget_is_a_400(tiny_model_path, settings):
    """The budget bounds the context: a prompt past what it holds is refused; one that fits with
    little room left gets its max_tokens lowered to that room."""
    engine = _engine(tiny_model_path, 256 << 10)  # 128 tokens of the tiny model's KV
    engine.start()
    try:
        with TestClient(create_app(settings, engine=engine)) as client:
            response = client.post(
                "/v1/chat/completions",
                json={
                    "model": TINY,
                    "messages": [{"role": "user", "content": "Tell me about the sea " * 30}],
                    "max_tokens": 64,
                },
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
            assert f"context is {engine.context_tokens()} tokens" in error["message"]
            assert engine.context_tokens() <= 128
            lowered = client.post(
                "/v1/chat/completions",
                json={
                    "model": TINY,
                    "messages": [{"role": "user", "content": "Tell me about the sea " * 8}],
                    "max_tokens": 120,
                },
            )
            assert lowered.status_code == 200, lowered.text
            assert lowered.headers["x-strata-max-tokens"].endswith("by=context")
            small = client.post(
                "/v1/chat/completions",
                json={"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            )
            assert small.status_code == 200, small.text
    finally:
        engine.stop()


def test_a_decoding_sequences_cached_prompt_gives_way_to_the_next(tiny_model_path):
    """The prompt blocks a running sequence stored are cached copies, not held beside its own KV:
    while it decodes alone, the next request is admitted by evicting them, without waiting for the
    first to end or preempting it."""
    engine = _engine(tiny_model_path, 1 << 30)
    engine.start()
    first, second_prompt = _prompt(engine, 1), _prompt(engine, 2)
    sampling = Sampling(GREEDY, 0.0, 1.0, None, ())
    needs = [engine.worker.kv_bytes(p, sampling) for p in (first, second_prompt)]
    block_bytes = 16 * engine.worker.runner.kv_bytes_per_token
    engine.stop()

    # Two whole sequences and a block: the second's first reservation (its prompt, a block to grow
    # into and a block of room for the first) fits beside the first, not beside its prompt's blocks too
    engine = _engine(tiny_model_path, sum(needs) + block_bytes)
    pool, worker = engine.runner.caches.prefix.pool, engine.worker
    decoding_at_step = _observe_steps(engine)

    async def both() -> None:
        events = engine.events(engine.submit(first, sampling, SALT))
        async for event in events:  # the first decodes alone, its prompt's blocks stored
            if getattr(event, "text", ""):
                break
        second = engine.events(engine.submit(second_prompt, sampling, SALT))
        await asyncio.gather(_drain(second), _drain(events))

    engine.start()
    try:
        asyncio.run(both())
        _wait_idle(engine)
    finally:
        engine.stop()
    counters = worker.snapshot().counters
    assert pool.counters.num_evicted_to_reserve > 0, pool.counters  # the first one's cached prompt gave way
    assert (counters.num_memory_waits, counters.num_preemptions) == (0, 0), counters
    assert max(decoding_at_step) == 2, decoding_at_step


async def _drain(events) -> None:
    async for event in events:
        assert not isinstance(event, Failed), event.message
