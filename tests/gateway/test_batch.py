"""Sequences decoding together (DecodeBatch, and the worker's batch) give each sequence the tokens it
gets alone: greedy output must not depend on what else is in the batch. Every family's tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import mlx.core as mx
import pytest

from gateway.checkpoints import RECIPES, BuildSpec
from gateway.engine import Draw, ImagePart, Message, Sampler, Sampling, TextPart, decode_alone, draw_all
from gateway.engine.batch import DecodeBatch
from gateway.engine.caching import CacheConfig
from gateway.engine.runner import ModelRunner
from kvcache import TenantSalt
from tests.conftest import TINY, built_model
from tests.gateway.test_live_server import ADMIN, LiveServer, _admin_stats, _health

SALT = TenantSalt(b"T" * 32)
STEPS = 16


def _prompts(runner, count=8):
    """Prompts of different lengths (so rows carry different left padding), past Gemma's window."""
    texts = [
        f"Request {i}: " + "tell me about the harbour, the boats and the tide. " * (1 + 3 * i) for i in range(count)
    ]
    return [runner.prompts.build((Message("user", (TextPart(t),)),), []) for t in texts]


def _alone(runner, prompt) -> list[int]:
    prefill = runner.prefill(prompt, SALT, 64, lambda: False)
    tokens = list(decode_alone(runner, prefill, Sampling(STEPS, 0.0, 1.0, None, ()), lambda: False))
    runner.finish(prefill, tokens)
    return tokens


def _together(runner, prompts) -> list[list[int]]:
    """Greedy decode in one DecodeBatch; rows join one by one and the shortest answers leave early."""
    batch, tokens = DecodeBatch(runner), []
    for prompt in prompts:
        prefill = runner.prefill(prompt, SALT, 64, lambda: False)
        batch.join(prefill)
        tokens.append([int(mx.argmax(prefill.logits).item())])
    live = list(range(len(prompts)))  # live[i]: the prompt of batch row i
    for _ in range(STEPS - 1):
        for row in reversed(range(len(live))):
            if tokens[live[row]][-1] in runner.eos_ids:
                runner.finish(batch.leave(row), tokens[live[row]])
                live.pop(row)
        if not live:
            break
        logits = batch.step([tokens[p][-1] for p in live])
        for row, prompt_index in enumerate(live):
            tokens[prompt_index].append(int(mx.argmax(logits[row]).item()))
    for row in reversed(range(len(live))):  # the rows still decoding store their blocks as they leave
        runner.finish(batch.leave(row), tokens[live[row]])
    return [_until_eos(t, runner.eos_ids) for t in tokens]


def _until_eos(tokens, eos):
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[:index]
    return tokens


@pytest.mark.parametrize("family", sorted(RECIPES))
def test_eight_sequences_decoded_together_equal_each_decoded_alone(family):
    runner = ModelRunner(built_model(BuildSpec(family, "tiny")), CacheConfig(0, 0, 16), "fp")
    prompts = _prompts(runner)
    alone = [_alone(runner, p) for p in prompts]
    assert _together(runner, prompts) == alone


def _mixed(runner, prompts, chunk_tokens=32, admit_per_step=2) -> list[list[int]]:
    """Greedy decode where prompts come in while others decode, in one model call per step: the
    decode rows and up to `admit_per_step` prompts' next chunks (batched admissions) packed together."""
    batch, tokens, live = DecodeBatch(runner), [[] for _ in prompts], []  # live[i]: the prompt of row i
    waiting = list(range(len(prompts)))
    admitting: dict[int, object] = {}
    computed: dict[int, int] = {}  # tokens each admission's cache holds
    while waiting or admitting or live:
        while waiting and len(admitting) < admit_per_step:
            index = waiting.pop(0)
            admitting[index] = runner.open_prefill(prompts[index], SALT)
            computed[index] = admitting[index].first
        for row in reversed(range(len(live))):  # rows that ended leave before the step
            done = tokens[live[row]][-1] in runner.eos_ids or len(tokens[live[row]]) == STEPS
            if done:
                runner.finish(batch.leave(row), tokens[live[row]])
                live.pop(row)
        parts = [batch.part([[tokens[p][-1]] for p in live])] if live else []
        for index, admission in admitting.items():
            begin = computed[index]
            end = min(begin + chunk_tokens, admission.prompt.num_tokens)
            parts += runner.chunk_parts(admission, begin, end)
            computed[index] = end
        if not parts:
            continue
        logits = runner.run_step(parts)
        if live:
            batch.took_step()  # as the worker does after each step (a hybrid row's snapshots)
        for row, prompt_index in enumerate(live):
            tokens[prompt_index].append(int(mx.argmax(logits[0][row]).item()))
        for index, admission in list(admitting.items()):
            if admission.done:
                del admitting[index]
                prefill = admission.result()
                batch.join(prefill)
                live.append(index)
                tokens[index].append(int(mx.argmax(prefill.logits).item()))
    return [_until_eos(t, runner.eos_ids) for t in tokens]


@pytest.mark.parametrize("family", sorted(RECIPES))
def test_mixed_steps_and_batched_admissions_give_each_sequence_its_lone_tokens(family):
    """Prompt chunks of two admissions ride in the decode rows' model call (one packed call per
    step): every sequence gets the greedy tokens it gets alone."""
    runner = ModelRunner(built_model(BuildSpec(family, "tiny")), CacheConfig(0, 0, 16), "fp")
    prompts = _prompts(runner, 5)
    if runner.family.image_placeholder:  # images in chunks that share a call: features, mRoPE, deepstack
        from tests.gateway.test_families import _image

        for seed in (1, 2):
            message = Message("user", (ImagePart("x"), TextPart(f"What is in picture {seed}? " * seed)))
            prompts.insert(seed, runner.prompts.build((message,), [_image(seed)]))
    alone = [_alone(runner, p) for p in prompts]
    assert _mixed(runner, prompts) == alone
    # Gemma 4's attention hands its keys and offsets on to later layers: not cut per segment
    assert runner.packable is (family != "gemma4")


def test_a_family_whose_calls_cannot_be_packed_runs_each_part_alone(monkeypatch):
    """A packed call that meets an attention argument it cannot cut (NotImplementedError, raised
    before any cache changes) falls back to one call per part, for good, with the same tokens."""
    runner = ModelRunner(built_model(BuildSpec("llama", "tiny")), CacheConfig(0, 0, 16), "fp")
    prompts = _prompts(runner, 4)
    alone = [_alone(runner, p) for p in prompts]

    def cannot_pack(parts):
        raise NotImplementedError("a packed call cannot cut this layer's mask per segment")

    monkeypatch.setattr(runner, "_call_packed", cannot_pack)
    assert _mixed(runner, prompts) == alone and runner.packable is False


def test_a_row_that_leaves_stores_its_prompt_and_reply_blocks():
    runner = ModelRunner(built_model(BuildSpec("llama", "tiny")), CacheConfig(64 << 20, 0, 16), "fp")
    prompts = _prompts(runner, 3)
    _together(runner, prompts)
    again = runner.prefill(prompts[1], SALT, 64, lambda: False)
    assert again.prefix.status == "hit" and again.prefix.num_cached_tokens == (prompts[1].num_tokens - 1) // 16 * 16
    runner.finish(again, [])


def test_a_hybrid_model_batches_rows_that_resume_from_snapshots():
    """qwen3_next's recurrent rows decode together and take chunks in mixed steps, with the prefix
    cache on: the second round resumes every prompt from its state snapshots, stores replies'
    snapshots as rows leave the batch, and each sequence still gets its lone greedy tokens."""
    cold = ModelRunner(built_model(BuildSpec("qwen3_next", "tiny")), CacheConfig(0, 0, 16), "fp")
    warm = ModelRunner(built_model(BuildSpec("qwen3_next", "tiny")), CacheConfig(64 << 20, 0, 16), "fp")
    assert warm.batchable and warm.recurrent
    # lengths that differ modulo the block size: rows cross block boundaries at different steps,
    # wherever they sit in the batch
    texts = [f"Request {i}: " + "the harbour and the tide. " * (2 + 3 * i) + "ferry " * (5 * i) for i in range(5)]
    prompts = [warm.prompts.build((Message("user", (TextPart(t),)),), []) for t in texts]
    assert len({p.num_tokens % 16 for p in prompts}) > 3
    alone = [_alone(cold, p) for p in prompts]
    assert _mixed(warm, prompts) == alone
    reused = warm.caches.prefix.counters.num_cached_tokens
    assert _mixed(warm, prompts) == alone and _together(warm, prompts) == alone
    assert warm.caches.prefix.counters.num_cached_tokens - reused >= sum((p.num_tokens - 1) // 16 * 16 for p in prompts)
    # the next turns continue each reply: they resume from the snapshot each row took as it decoded
    more = tuple(warm.tokenizer.encode(" And then?", add_special_tokens=False))
    turns = [dataclasses.replace(p, token_ids=p.token_ids + tuple(a) + more) for p, a in zip(prompts, alone)]
    reused = warm.caches.prefix.counters.num_cached_tokens
    assert _together(warm, turns) == [_alone(cold, t) for t in turns]
    past_prompts = sum((t.num_tokens - len(more) - 1) // 16 * 16 for t in turns)
    assert warm.caches.prefix.counters.num_cached_tokens - reused >= past_prompts


def test_the_server_runs_requests_together_and_each_gets_its_lone_answer(tiny_model_path, tmp_path):
    """Four long streams at once, two greedy and two seeded samples (a sampled row draws from its own
    row of the step's logits; greedy rows from one argmax over all): /healthz shows them running
    together, and each answer is the one the same request gets alone."""
    live = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {
            "STRATA_MODEL_NAME": TINY,
            "STRATA_SEMANTIC": "0",
            "STRATA_ADMIN_KEY": ADMIN,
            "STRATA_MAX_NUM_SEQS": "4",
            "STRATA_EXACT_STORE": "off",
        },
    )
    questions = [f"Tell a very long story about boat number {i}." for i in range(4)]

    def body(question):
        index = questions.index(question)
        sampling = {"temperature": 0} if index % 2 else {"temperature": 0.9, "seed": index}
        return {"model": TINY, "messages": [{"role": "user", "content": question}], "max_tokens": 200} | sampling

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            requests = [
                asyncio.ensure_future(client.post(live.url + "/v1/chat/completions", json=body(q))) for q in questions
            ]
            most = 0
            while not all(r.done() for r in requests):
                most = max(most, _health(live)["engine_running"])
                await asyncio.sleep(0.02)
            return most, [r.result() for r in requests]

    try:
        most, responses = asyncio.run(together())
        while _health(live)["engine_busy"]:  # the last rows retire after their answers went out
            time.sleep(0.01)
        time.sleep(0.1)
        engine = _admin_stats(live)["engine"]
        alone = [httpx.post(live.url + "/v1/chat/completions", json=body(q), timeout=120) for q in questions]
    finally:
        assert live.stop()
    assert most >= 2, "the requests never decoded together"
    assert engine["num_decoded_tokens"] > 1.5 * engine["num_decode_steps"], engine  # the mean batch size
    usage = [r.json()["usage"] for r in responses]
    prompt_tokens = sum(
        u["prompt_tokens"] - (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage
    )
    assert engine["num_prefilled_tokens"] == prompt_tokens and engine["num_prefill_chunks"] >= len(questions), engine
    assert engine["last_step"] == {"rows": 0, "prefill_tokens": 0} and engine["waiting_for_memory"] is False
    for pair in zip(responses, alone):
        assert [r.status_code for r in pair] == [200, 200]
        assert pair[0].json()["choices"][0]["message"] == pair[1].json()["choices"][0]["message"]


def test_running_streams_keep_flowing_while_a_long_prompt_is_prefilled(tiny_model_path):
    """A (short prompt) and B (1,000 tokens: ~16 chunks of 64) are queued together. A is admitted
    first and decodes; B's prefill then runs one chunk per step, each followed by a step of A, so A's
    text keeps coming before B starts (a prefill run in one go would let A take at most one step).
    Fixed 64-token chunks (no step budget: with one, the tiny model's ~5 ms steps would take B in two
    512-token chunks; test_step_costs.py and the scheduler's tests cover the budget)."""
    from gateway.engine import Engine, EngineConfig

    engine = Engine(tiny_model_path, TINY, EngineConfig(8, 64, CacheConfig(64 << 20, 0, 16), step_budget_ms=0))
    engine.start()
    salt = TenantSalt(b"F" * 32)
    story = engine.prepare((Message("user", (TextPart("Tell a very long story."),)),), [])
    long_text = "The committee met in the old library to discuss the river crossing and the budget. " * 60
    long_prompt = engine.prepare((Message("user", (TextPart(long_text),)),), [])
    assert long_prompt.num_tokens > 15 * 64

    async def scenario():
        a = engine.submit(story, Sampling(400, 0.0, 1.0, None, ()), salt)
        b = engine.submit(long_prompt, Sampling(4, 0.0, 1.0, None, ()), salt)
        order = []

        async def follow(name, job):
            async for event in engine.events(job):
                order.append((name, type(event).__name__))

        await asyncio.gather(follow("a", a), follow("b", b))
        return order

    try:
        order = asyncio.run(scenario())
    finally:
        engine.stop()
    b_started = order.index(("b", "Started"))
    a_deltas_before_b_started = sum(1 for name, kind in order[:b_started] if name == "a" and kind == "Delta")
    assert a_deltas_before_b_started >= 10, order[: b_started + 1]
    assert ("a", "Finished") in order and ("b", "Finished") in order


def test_the_worker_times_each_step_with_its_shape_for_the_step_budget(engine):
    """One row decoding while a long prompt comes in: the worker's step costs (StepCosts) get each
    step as (the tokens the row fed: its pending one and any drafts, the prompt tokens), each with
    the time it took; those set how many prompt tokens a step beside decode rows carries."""
    salt = TenantSalt(b"C" * 32)
    story = engine.prepare((Message("user", (TextPart("Tell a short story."),)),), [])
    long_text = "The ferry left the harbour at dawn with the mail, the doctor and two goats. " * 40
    long_prompt = engine.prepare((Message("user", (TextPart(long_text),)),), [])
    costs = engine.worker.costs
    costs.passes.clear()

    async def scenario():
        a = engine.submit(story, Sampling(30, 0.0, 1.0, None, ()), salt)
        decoding = asyncio.Event()

        async def follow_a():
            async for event in engine.events(a):
                if type(event).__name__ == "Delta":
                    decoding.set()  # A decodes: B's prompt comes in beside it

        following = asyncio.create_task(follow_a())
        await decoding.wait()
        b = engine.submit(long_prompt, Sampling(2, 0.0, 1.0, None, ()), salt)
        async for _ in engine.events(b):
            pass
        await following

    asyncio.run(scenario())
    passes = list(costs.passes)
    mixed = [(decode, tokens) for decode, tokens, _ in passes if decode and tokens]
    assert mixed and all(decode >= 1 for decode, _ in mixed), passes
    assert [tokens for decode, tokens, _ in passes if not decode] == [story.num_tokens]  # A's prompt, alone
    # B's chunks, every one beside A's row: all of B's prompt but the blocks it shares with A's (cached)
    assert 0 <= long_prompt.num_tokens - sum(tokens for _, tokens in mixed) < story.num_tokens
    assert any(decode == 1 and not tokens for decode, tokens, _ in passes), passes
    assert all(ms > 0 for _, _, ms in passes)


def test_a_flooding_tenant_cannot_starve_another(tiny_model_path, tmp_path):
    """One sequence on the model, four waiting places (two per tenant). Tenant A sends six long
    requests at once: one runs, two wait, three get 429 `tenant_share`. Tenant B, arriving last,
    still gets a place and is served before A's waiting requests (A had the last turn)."""
    from tests.gateway.test_live_server import KEYS

    live = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {
            "STRATA_MODEL_NAME": TINY,
            "STRATA_SEMANTIC": "0",
            "STRATA_EXACT_STORE": "off",
            "STRATA_API_KEYS": KEYS,
            "STRATA_ADMIN_KEY": ADMIN,
            "STRATA_MAX_QUEUE": "4",
            "STRATA_MAX_NUM_SEQS": "1",
        },
    )
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
        "max_tokens": 150,
        "temperature": 0,
    }
    done_order = []

    async def send(client, key, name, max_tokens=150):
        response = await client.post(
            live.url + "/v1/chat/completions",
            json=body | {"max_tokens": max_tokens},
            headers={"Authorization": f"Bearer {key}"},
        )
        done_order.append((name, response.status_code))
        return response

    async def flood():
        async with httpx.AsyncClient(timeout=120) as client:
            # a0 runs long enough (~5 s alone) that the flood and B arrive while it runs, however
            # loaded the machine (at 150 tokens, ~0.8 s alone, B once came after it had ended)
            first = asyncio.ensure_future(send(client, "key-a", "a0", max_tokens=1000))
            while not _health(live)["engine_busy"]:
                await asyncio.sleep(0.01)
            others = [asyncio.ensure_future(send(client, "key-a", f"a{i}")) for i in range(1, 6)]
            while _health(live)["queue_depth"] < 2:
                await asyncio.sleep(0.01)
            late = asyncio.ensure_future(send(client, "key-b", "b"))
            while _health(live)["queue_depth"] < 3 and not late.done():
                await asyncio.sleep(0.01)
            assert not first.done(), "B arrived after A's first request ended: the scenario did not happen"
            return await asyncio.gather(first, *others, late)

    try:
        responses = asyncio.run(flood())
    finally:
        assert live.stop()
    statuses = [r.status_code for r in responses]
    assert sorted(statuses[:6]) == [200, 200, 200, 429, 429, 429] and statuses[6] == 200, statuses
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == {"tenant_share"}
    served = [name for name, status in done_order if status == 200]
    assert served.index("b") == 1, served  # right after the running a0: A was served last


def test_a_seeded_sampled_sequence_draws_the_same_tokens_alone_and_in_a_batch():
    """Each row samples with its own seeded key from its own logits, which do not depend on the batch:
    the exact cache's rule (a seeded request is deterministic) holds under batching."""

    runner = ModelRunner(built_model(BuildSpec("qwen2_5_vl", "tiny")), CacheConfig(0, 0, 16), "fp")
    prompts = _prompts(runner, 4)
    seeded = Sampling(STEPS, 0.9, 0.95, 1234, ())
    prefill = runner.prefill(prompts[2], SALT, 64, lambda: False)
    alone = list(decode_alone(runner, prefill, seeded, lambda: False))
    batch, samplers, logits = DecodeBatch(runner), [], []
    generated: list[list[int]] = [[] for _ in prompts]
    for index, prompt in enumerate(prompts):
        prefill = runner.prefill(prompt, SALT, 64, lambda: False)
        batch.join(prefill)
        samplers.append(Sampler(seeded if index == 2 else Sampling(STEPS, 0.9, 0.95, index, ())))
        logits.append(prefill.logits)
    for _ in range(len(alone)):
        tokens = [sampler(row_logits, row) for sampler, row_logits, row in zip(samplers, logits, generated)]
        for row, token in zip(generated, tokens):
            row.append(token)
        step = batch.step(tokens)
        logits = [step[row] for row in range(len(tokens))]
    assert generated[2] == alone


async def decoding(engine, jobs: list) -> list:
    """The jobs, once each has sent its first text (it decodes in the batch)."""
    from gateway.engine import Delta

    for job in jobs:
        events = engine.events(job)
        while not isinstance(await events.__anext__(), Delta):
            pass
    return jobs


def test_stopping_the_engine_mid_batch_retires_the_rows_and_releases_their_blocks(tiny_model_path):
    from gateway.engine import CacheConfig as Caches
    from gateway.engine import Engine, EngineConfig

    engine = Engine(tiny_model_path, "tiny", EngineConfig(8, 64, Caches(64 << 20, 0, 16)))
    engine.start()
    story = engine.prepare((Message("user", (TextPart("Tell a very long story."),)),), [])

    async def two_running():
        return await decoding(engine, [engine.submit(story, Sampling(500, 0.0, 1.0, None, ()), SALT) for _ in range(2)])

    asyncio.run(two_running())
    engine.stop()
    assert engine.worker.ended.is_set() and not engine.worker.running and not engine.worker.prefilling
    pool = engine.runner.caches.prefix.pool
    pool.check()
    assert len(pool.by_hash) >= story.num_tokens // 16
    assert all(block.ref_count == 0 for block in pool.by_hash.values())  # every row released its blocks


def test_the_last_place_in_the_batch_is_kept_for_another_tenant(tiny_model_path):
    """Three places; tenant B was served once. Tenant A then floods with long requests: it runs two
    sequences, never three, and B's next request starts at once in the kept place, while all of A's
    rows still decode (greedy, this prompt meets no EOS within 3000 tokens)."""
    from gateway.engine import CacheConfig as Caches
    from gateway.engine import Engine, EngineConfig, Finished, Started

    engine = Engine(tiny_model_path, "tiny", EngineConfig(16, 64, Caches(64 << 20, 0, 16), max_num_seqs=3))
    engine.start()
    tenant_a, tenant_b = TenantSalt(b"A" * 32), TenantSalt(b"B" * 32)
    story = engine.prepare((Message("user", (TextPart("Tell a very long story."),)),), [])
    hello = engine.prepare((Message("user", (TextPart("Hello there."),)),), [])

    async def scenario():
        async def until(job, kind):
            async for event in engine.events(job):
                if isinstance(event, kind):
                    return event

        await until(engine.submit(hello, Sampling(2, 0.0, 1.0, None, ()), tenant_b), Finished)
        flood = [engine.submit(story, Sampling(3000, 0.0, 1.0, None, ()), tenant_a) for _ in range(6)]
        ends = [asyncio.ensure_future(until(job, Finished)) for job in flood]
        most = 0
        for _ in range(50):  # A alone for a while: it never takes the third place
            most = max(most, engine.snapshot().num_running)
            await asyncio.sleep(0.02)
        b_events = engine.events(engine.submit(story, Sampling(200, 0.0, 1.0, None, ()), tenant_b))
        while not isinstance(await b_events.__anext__(), Started):  # kept open: closing it cancels the job
            pass
        a_ended = sum(task.done() for task in ends)
        for _ in range(100):  # Started is sent just before the row joins the batch
            if (running := engine.snapshot().num_running) == 3:
                break
            await asyncio.sleep(0.01)
        for task in ends:
            task.cancel()
        return most, running, a_ended

    try:
        most, running, a_ended = asyncio.run(scenario())
    finally:
        engine.stop()
    assert most == 2
    assert a_ended == 0 and running == 3  # B started beside A's two rows, none of which had ended


def test_penalties_and_logit_bias_shape_each_row_as_they_do_alone(tiny_model_path):
    """Per-row logits processing inside the batch: a logit bias of +100 makes a row repeat one token,
    negative penalties make a greedy answer repeat itself, and each row gets the tokens it gets alone."""
    runner = ModelRunner(tiny_model_path, CacheConfig(0, 0, 16), "fp")
    prompts = _prompts(runner, 3)
    plain = Sampling(STEPS, 0.0, 1.0, None, ())
    biased = Sampling(STEPS, 0.0, 1.0, None, (), logit_bias=((7, 100.0),))
    penalised = Sampling(STEPS, 0.0, 1.0, None, (), frequency_penalty=-2.0, presence_penalty=-2.0)  # repeat

    def alone(prompt, sampling):
        prefill = runner.prefill(prompt, SALT, 64, lambda: False)
        return list(decode_alone(runner, prefill, sampling, lambda: False))

    assert alone(prompts[0], biased) == [7] * STEPS
    assert alone(prompts[1], penalised) != alone(prompts[1], plain)
    samplings = [biased, penalised, plain]
    expected = [alone(p, s) for p, s in zip(prompts, samplings)]
    batch, samplers, logits, drawn = DecodeBatch(runner), [], [], [[], [], []]
    for prompt, sampling in zip(prompts, samplings):
        prefill = runner.prefill(prompt, SALT, 64, lambda: False)
        batch.join(prefill)
        samplers.append(Sampler(sampling))
        logits.append(prefill.logits)
    for _ in range(STEPS):
        tokens = [token for token, _ in draw_all([Draw(*row) for row in zip(samplers, logits, drawn)])]
        for row, token in enumerate(tokens):
            drawn[row].append(token)
        step = batch.step(tokens)
        logits = [step[row] for row in range(len(tokens))]
    assert [_until_eos(d, runner.eos_ids) for d in drawn] == expected


def test_greedy_rows_draw_with_one_argmax_and_keep_their_lone_tokens(tiny_model_path, monkeypatch):
    """Rows that draw greedily with nothing to adjust take their tokens from one argmax over the
    step's logits; a biased and a penalised row beside them keep their own draws. Each request gets
    the tokens it gets alone, and the one-argmax path did serve the plain rows."""
    from gateway.engine import Engine, EngineConfig, Finished
    from gateway.engine.decoding import DecodeRows

    served = []
    greedy_tokens = DecodeRows._greedy_tokens

    def watched(self, ready):
        tokens = greedy_tokens(self, ready)
        served.append(len(tokens))
        return tokens

    monkeypatch.setattr(DecodeRows, "_greedy_tokens", watched)
    engine = Engine(tiny_model_path, TINY, EngineConfig(max_verify_tokens=0, caches=CacheConfig(0, 0, 16)))
    engine.start()
    samplings = [
        Sampling(STEPS, 0.0, 1.0, None, ()),
        Sampling(STEPS, 0.0, 1.0, None, (), logit_bias=((7, 100.0),)),
        Sampling(STEPS, 0.0, 1.0, None, ()),
        Sampling(STEPS, 0.0, 1.0, None, (), frequency_penalty=-2.0, presence_penalty=-2.0),
    ]
    prompts = [
        engine.prepare((Message("user", (TextPart(f"Row {i}: the tide and the boats."),)),), []) for i in range(4)
    ]

    async def tokens_of(pairs):
        jobs = [engine.submit(prompt, sampling, SALT) for prompt, sampling in pairs]

        async def last(job):
            events = [event async for event in engine.events(job)]
            assert isinstance(events[-1], Finished), events[-1]
            return events[-1].token_ids

        return await asyncio.gather(*(last(job) for job in jobs))

    try:
        alone = [asyncio.run(tokens_of([pair]))[0] for pair in zip(prompts, samplings)]
        served.clear()
        together = asyncio.run(tokens_of(list(zip(prompts, samplings))))
    finally:
        engine.stop()
    assert together == alone and alone[1] == (7,) * STEPS
    assert max(served) == 2  # the two plain rows, in one argmax; the other two drew on their own


def test_a_later_segment_on_the_same_cache_gets_the_mask_of_the_cache_it_will_find():
    """One prompt's pieces in one packed call share its cache: the second piece's sliding-window
    mask is the one the cache makes once the first piece's tokens are in it."""
    from mlx_lm.models.cache import KVCache

    from gateway.engine.mixed import Segment, SegmentCache

    def cache_at(num_tokens: int) -> KVCache:
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 1, num_tokens, 4)), mx.zeros((1, 1, num_tokens, 4)))
        return cache

    shared = cache_at(10)
    packed = SegmentCache([Segment(shared, 0, 1, 8), Segment(shared, 8, 1, 6)])
    masks = packed.make_mask(14, window_size=12, return_array=False).masks
    for mask, expected in zip(
        masks,
        (
            cache_at(10).make_mask(8, window_size=12, return_array=False),
            cache_at(18).make_mask(6, window_size=12, return_array=False),
        ),
    ):
        assert isinstance(mask, mx.array) and mx.array_equal(mask, expected).item()
    assert shared.offset == 10  # making masks moves no cache
