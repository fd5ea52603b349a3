"""KV held once: a decoding row reads its prompt's cached blocks in place (PrefixSession.map, RowsKV's
shared segments) and drops its own copy; its reservation gives those bytes back (Scheduler.share).
A prompt coming in reads its cached prefix in place too (MappedKV layers), and a row leaving copies
out only its own tokens.

Checked: attention over shared segments equals a plain computation and never writes a cached block
(the partly filled last block is the row's own copy); in a live engine, after every step, each byte
is counted once and every row's tables read the blocks of its own chain (worker.steps.check()); rows of two
tenants with one prompt keep their lone tokens; a block shared by several rows and the cache is
freed once; a purged tenant's shared blocks leave the pool with its last row; under a budget that
fits three whole prompts, rows sharing a long prefix run twice as many at once, arriving one after
another or together; prompts under way share exactly the blocks their layers read; warm answers
equal cold ones, the partly filled last block of a mapped prefix copied."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from gateway.engine import CacheConfig, Engine, EngineConfig, Finished, Message, Sampling, TextPart
from gateway.engine.mapped_kv import first_own_token
from gateway.engine.rows_kv import rows_kernel
from gateway.engine.runner import cache_offset
from kvcache import PrefixSession, TenantSalt
from tests.conftest import TINY
from tests.gateway.test_batch import decoding
from tests.gateway.test_rows_kv import BLOCK, KV_HEADS, LAYERS, Rows

pytestmark = pytest.mark.skipif(rows_kernel() is None, reason="no C compiler here: rows keep the library's cache")

TENANT_A, TENANT_B = TenantSalt(b"A" * 32), TenantSalt(b"B" * 32)
GREEDY = Sampling(32, 0.0, 1.0, None, ())
# ~330 tokens, the same for every request below but its last line
SHARED_TEXT = "The harbour master logs every boat, its cargo and the tide at which it came in. " * 16


def _add_shared(rows: Rows, length: int, num_blocks: int) -> list[tuple]:
    """A row whose first num_blocks blocks are cached blocks (per layer (keys, values) MLX arrays)."""
    caches = [KVCache() for _ in range(LAYERS)]
    blocks: list[tuple] = [[] for _ in range(num_blocks)]
    for cache in caches:
        keys, values = rows._array(1, KV_HEADS, length), rows._array(1, KV_HEADS, length)
        cache.update_and_fetch(keys, values)
        for index in range(num_blocks):
            span = slice(index * BLOCK, (index + 1) * BLOCK)
            blocks[index].append((mx.contiguous(keys[:, :, span]), mx.contiguous(values[:, :, span])))
    shared = [tuple(layers) for layers in blocks]
    mx.eval([array for kv in shared for pair in kv for array in pair], [c.keys for c in caches])
    rows.kv.add(caches, shared)
    rows.full.append([(np.array(c.keys)[0, :, :length], np.array(c.values)[0, :, :length]) for c in caches])
    return shared


def test_a_row_reads_its_cached_blocks_in_place_and_never_writes_them():
    rows = Rows(seed=7)
    rows.add(21)
    shared = _add_shared(rows, 3 * BLOCK + 5, 3)  # a partly filled fourth block: the row's own copy
    exact = _add_shared(rows, 2 * BLOCK, 2)  # ends on a block boundary: its next token opens a block of its own
    before = [[np.array(a) for pair in kv for a in pair] for kv in shared + exact]
    row = rows.kv.rows[1]
    assert row.num_shared == 3 * BLOCK and rows.kv.rows[2].num_shared == 2 * BLOCK
    assert row.segments[0].keys[0].ctypes.data == np.asarray(shared[0][0][0]).ctypes.data  # read in place
    for num_tokens in (1, 3, 12, 1):  # 12: past the partly filled block
        rows.step(num_tokens)
    rows.trim([0, 2, 1])
    rows.step(2)
    after = [[np.array(a) for pair in kv for a in pair] for kv in shared + exact]
    for old, new in zip(before, after):
        for x, y in zip(old, new):
            np.testing.assert_array_equal(x, y)
    length = rows.kv.lengths[2]
    own = rows.kv.remove(2, 2 * BLOCK)  # leaving: its tokens past the cached blocks it read in place
    assert own[0].offset == length - 2 * BLOCK
    np.testing.assert_array_equal(np.array(own[0].keys)[0], rows.full[2][0][0][:, 2 * BLOCK :])
    caches = rows.kv.remove(1)
    keys, values = rows.full[1][0]
    np.testing.assert_array_equal(np.array(caches[0].keys)[0], keys)
    np.testing.assert_array_equal(np.array(caches[0].values)[0], values)


def _prompt(engine: Engine, last_line: str):
    return engine.prepare((Message("user", (TextPart(SHARED_TEXT + last_line),)),), [])


def _checked(engine: Engine) -> dict:
    """Run worker.steps.check() after every step (on the worker's thread); what it saw."""
    worker = engine.worker
    seen = {"steps": 0, "shared_rows": 0, "max_rows": 0, "lone": 0, "lone_in_segments": 0}
    seen |= {"max_running": 0, "mapped_prompts": 0, "mapped_chunks": 0}
    step = worker.steps.run

    def checked_step(plan):
        seen["mapped_chunks"] += sum(s.num_shared_tokens > 0 for s, _ in plan.chunks)
        step(plan)
        try:
            worker.steps.check()
        except AssertionError as exc:
            seen.setdefault("failed", repr(exc))
            raise
        seen["steps"] += 1
        seen["shared_rows"] = max(seen["shared_rows"], sum(s.num_shared_tokens > 0 for s in worker.rows))
        seen["max_rows"] = max(seen["max_rows"], len(worker.rows))
        seen["lone"] += len(worker.rows) == 1
        seen["lone_in_segments"] += len(worker.rows) == 1 and worker.decoding.batch.segments is not None
        seen["max_running"] = max(seen["max_running"], len(worker.running))
        seen["mapped_prompts"] = max(seen["mapped_prompts"], sum(s.num_shared_tokens > 0 for s in worker.prefilling))

    worker.steps.run = checked_step
    return seen


async def _tokens(engine: Engine, prompt, salt: TenantSalt, sampling: Sampling = GREEDY, owner=None) -> list[int]:
    async for event in engine.events(engine.submit(prompt, sampling, salt, owner)):
        if isinstance(event, Finished):
            return list(event.token_ids)
    raise AssertionError("no Finished event")


def _budget(model_path, whole_prompts: int, more_tokens: int, last_line: str = " Question 0?"):
    """The tests' prompt ending with `last_line`, and a KV budget in bytes for `whole_prompts` of it
    (each with its first block) and `more_tokens` (KV bytes per token measured on an engine that is
    not started)."""
    probe = Engine(model_path, TINY, EngineConfig(16, 64, CacheConfig(64 << 20, 0, 16)))
    prompt = _prompt(probe, last_line)
    probe.runner._measure_bytes()
    return prompt, (whole_prompts * (prompt.num_tokens + 16) + more_tokens) * probe.runner.kv_bytes_per_token


def test_rows_of_two_tenants_share_their_own_blocks_counted_once_and_freed_once(tiny_model_path):
    engine = Engine(tiny_model_path, TINY, EngineConfig(16, 64, CacheConfig(64 << 20, 0, 16), max_verify_tokens=0))
    engine.start()
    try:
        prompts = [_prompt(engine, f" Question {index}: which boat came first?") for index in range(3)]
        alone = [asyncio.run(_tokens(engine, prompt, TENANT_A)) for prompt in prompts]  # stores their blocks
        seen, left_with = _checked(engine), []
        store = engine.worker.steps.store

        def stored(prefill, sequence, to_ssd=False):  # what a leaving row's cache holds of its own, and in all
            tokens = sequence.num_tokens - 1  # its last drawn token was never fed
            left_with.append((first_own_token(prefill.cache), cache_offset(prefill.cache, -1), tokens))
            store(prefill, sequence, to_ssd)

        engine.worker.steps.store = stored

        async def together():  # replies of different lengths: rows leave one by one, the last alone
            jobs = [
                _tokens(engine, prompts[i % 3], salt, Sampling(8 + 3 * i + 2 * (salt is TENANT_B), 0.0, 1.0, None, ()))
                for i in range(6)
                for salt in (TENANT_A, TENANT_B)
            ]
            return await asyncio.gather(*jobs)

        results = asyncio.run(together())
        engine.worker.call(lambda: None).result()  # the last rows have retired
        pool = engine.runner.caches.prefix.pool
        assert "failed" not in seen, seen
        assert results == [alone[i % 3][: 8 + 3 * i + 2 * b] for i in range(6) for b in range(2)]
        assert seen["shared_rows"] >= 4, seen  # rows read cached blocks in place, checked after every step
        assert max(first for first, _, _ in left_with) >= 300, left_with  # rows leaving copied only what they own
        assert all(length == tokens for _, length, tokens in left_with), left_with
        # the row left alone goes back to a cache of its own (room reserved for the copy): faster there
        assert seen["lone"] > 0 and seen["lone_in_segments"] == 0, seen
        assert engine.worker.stats.num_failed == 0
        pool.check()
        assert pool.reserved_bytes == 0
        assert all(block.ref_count == 0 for block in pool.by_hash.values())  # every holder released once
    finally:
        engine.stop()


def test_a_purged_tenants_shared_blocks_leave_the_pool_with_its_last_row(tiny_model_path):
    engine = Engine(tiny_model_path, TINY, EngineConfig(16, 64, CacheConfig(64 << 20, 0, 16), max_verify_tokens=0))
    engine.start()
    try:
        prompt = _prompt(engine, " Which boat came last?")
        asyncio.run(_tokens(engine, prompt, TENANT_B, owner="tenant-b"))
        seen = _checked(engine)
        pool = engine.runner.caches.prefix.pool
        batch = engine.worker.decoding.batch

        def purge():
            purged = pool.purge_owned(lambda owner: owner == "tenant-b")
            return purged, [block for row in batch.rows for block in row.plan.session.mapped]

        async def purged_while_running():
            # rows that record no owner: the purge takes the blocks' last owner while they read them
            jobs = await decoding(
                engine, [engine.submit(prompt, Sampling(400, 0.0, 1.0, None, ()), TENANT_B) for _ in range(2)]
            )
            while seen["shared_rows"] < 2:
                await asyncio.sleep(0.01)
            return jobs, engine.worker.call(purge).result()

        jobs, (purged, mapped) = asyncio.run(purged_while_running())
        assert mapped and purged.num_entries >= len(set(map(id, mapped)))
        assert all(block.purged and block.ref_count >= 2 for block in mapped), (
            [(b.purged, b.ref_count, sorted(map(str, b.owners))) for b in mapped],
            [(len(r.plan.session.mapped)) for r in batch.rows],
            seen,
        )  # both rows still read them
        for job in jobs:
            job.cancelled.set()
        while engine.worker.rows or engine.worker.busy:
            engine.worker.call(lambda: None).result()
        assert not any(pool.get(block.block_hash) is block for block in mapped)  # gone with the last row
        assert "failed" not in seen, seen
        pool.check()
    finally:
        engine.stop()


@pytest.mark.parametrize("shared", [True, False])
def test_rows_sharing_a_long_prefix_fit_twice_as_many_under_one_budget(tiny_model_path, monkeypatch, shared):
    """A budget for three whole prompts (and their first block) and some room: rows arriving one after
    another while the others decode hold the shared prefix once, so six or more of eight decode at
    once; each new prompt holds its whole prompt only while it comes in. Without the sharing (each row
    its own copy, as before), at most four."""
    if not shared:
        monkeypatch.setattr(PrefixSession, "map", lambda self, num_tokens: [])
    prompt, budget = _budget(tiny_model_path, whole_prompts=3, more_tokens=8 * 40)
    engine = Engine(tiny_model_path, TINY, EngineConfig(16, 64, CacheConfig(budget, 0, 16), max_verify_tokens=0))
    engine.start()
    try:
        seen = _checked(engine)
        asyncio.run(_tokens(engine, _prompt(engine, " Question -1?"), TENANT_A))  # the prefix, cached

        async def eight_one_after_another():
            jobs = []
            for index in range(8):
                sampling = Sampling(240 - 24 * index, 0.0, 1.0, None, ())  # they end about together
                job = _tokens(engine, _prompt(engine, f" Question {index}?"), TENANT_A, sampling)
                jobs.append(asyncio.ensure_future(job))
                while seen["max_rows"] <= index and not jobs[-1].done():
                    await asyncio.sleep(0.01)
            return await asyncio.gather(*jobs)

        asyncio.run(eight_one_after_another())
        assert "failed" not in seen and engine.worker.stats.num_failed == 0, seen
        assert seen["max_rows"] >= 6 if shared else seen["max_rows"] <= 4, (seen, prompt.num_tokens)
    finally:
        engine.stop()


def test_a_row_left_alone_by_a_preemption_keeps_reading_its_cached_blocks(tiny_model_path):
    """Two rows of one preamble grow past the budget: the newer is preempted, and the row left alone
    stays in segments (a copy of its blocks would take back the memory the preemption freed: the
    budget is sized so the newer row's reply outgrows the preamble, and that copy would fit); both
    answer as they do alone, every step checked."""
    _, budget = _budget(tiny_model_path, whole_prompts=3, more_tokens=200)
    engine = Engine(tiny_model_path, TINY, EngineConfig(16, 64, CacheConfig(budget, 0, 16), max_verify_tokens=0))
    engine.start()
    try:
        long_reply = Sampling(700, 0.0, 1.0, None, ())
        prompts = [_prompt(engine, f" Question {index}?") for index in range(2)]
        alone = [asyncio.run(_tokens(engine, p, TENANT_A, long_reply)) for p in prompts]
        seen = _checked(engine)

        async def two():
            first = asyncio.ensure_future(_tokens(engine, prompts[0], TENANT_A, long_reply))
            while not seen["max_rows"]:  # decoding
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(_tokens(engine, prompts[1], TENANT_A, long_reply))
            return [await first, await second]

        assert asyncio.run(two()) == alone
        assert "failed" not in seen and engine.worker.scheduler.stats.num_preemptions >= 1, seen
        assert seen["lone_in_segments"] > 0, seen
    finally:
        engine.stop()


def test_a_prompt_reads_its_cached_prefix_in_place_as_it_comes_in(tiny_model_path):
    """A prompt whose prefix is cached maps those blocks (MappedKV layers) instead of copying them:
    its reservation holds only its own tokens, every step checked; a long question of its own runs
    in several chunks over them; the same prompt again reads all but its last token from the cache,
    its partly filled last block copied (its own); every answer is the one a cold cache gives."""
    engine = Engine(tiny_model_path, TINY, EngineConfig(16, 64, CacheConfig(64 << 20, 0, 16), max_verify_tokens=0))
    engine.start()
    try:
        long_question = " Which boat came in at which tide, and what did each carry? " * 45  # > 512 tokens
        prompts = [_prompt(engine, " Question 0?"), _prompt(engine, long_question)]
        cold = [asyncio.run(_tokens(engine, prompt, TENANT_B)) for prompt in prompts]  # tenant B: nothing shared
        first = _prompt(engine, " Question -1?")
        asyncio.run(_tokens(engine, first, TENANT_A))  # A's preamble, cached
        seen, admitted = _checked(engine), []
        admit = engine.worker.steps.admit

        def admitted_as(sequence):
            ok = admit(sequence)
            cache = sequence.admission.cache if ok else []
            admitted.append((sequence.num_shared_tokens, [type(layer).__name__ for layer in cache], _own(cache)))
            return ok

        engine.worker.steps.admit = admitted_as  # the scheduler calls its executor's admit()
        warm = [asyncio.run(_tokens(engine, prompt, TENANT_A)) for prompt in prompts]
        again = asyncio.run(_tokens(engine, prompts[1], TENANT_A))  # cached whole but its last token
        assert warm == cold and again == cold[1]
        # chunks that read mapped blocks: one of each short prompt (the question, the prompt again), two of the long one
        assert "failed" not in seen and seen["mapped_prompts"] == 1 and seen["mapped_chunks"] >= 4, seen
        block = 16
        preambles = [_common(first.token_ids, p.token_ids) // block * block for p in prompts]
        assert min(preambles) > 8 * block and {n for _, names, _ in admitted for n in names} == {"MappedKV"}, admitted
        assert [shared for shared, _, _ in admitted[:2]] == preambles and admitted[1][2] == 0, (admitted, preambles)
        assert prompts[1].num_tokens - preambles[1] > 512  # the long question: two chunks over the blocks at least
        # the prompt again: every whole block mapped, the last one's first tokens its own copy
        cached = prompts[1].num_tokens - 1
        assert admitted[2][0] == cached // block * block and admitted[2][2] == cached % block > 0, admitted
        pool = engine.runner.caches.prefix.pool
        engine.worker.call(lambda: None).result()
        pool.check()
        assert pool.reserved_bytes == 0 and all(b.ref_count == 0 for b in pool.by_hash.values())
    finally:
        engine.stop()


def _common(a: tuple, b: tuple) -> int:
    """How many first tokens the two prompts share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _own(cache: list) -> int:
    """Tokens a prompt's MappedKV layers held of their own when admitted (-1: not mapped)."""
    return cache[0].own.offset if cache and hasattr(cache[0], "own") else -1


@pytest.mark.parametrize("shared", [True, False])
def test_prompts_coming_in_together_hold_only_their_own_tokens(tiny_model_path, monkeypatch, shared):
    """Eight prompts of one cached preamble, each with a long question of its own, arrive at once
    under a budget for three whole prompts: read in place, the preamble is held once while they come
    in, so more of them run at once than whole copies would let; every step checked, every answer
    its lone one."""
    if not shared:
        monkeypatch.setattr(PrefixSession, "map", lambda self, num_tokens: [])
    questions = [f" Question {index}: " + "which boat came in first, and on which tide? " * 12 for index in range(8)]
    prompt, budget = _budget(tiny_model_path, whole_prompts=3, more_tokens=0, last_line=questions[0])
    engine = Engine(tiny_model_path, TINY, EngineConfig(16, 64, CacheConfig(budget, 0, 16), max_verify_tokens=0))
    engine.start()
    try:
        reply = Sampling(24, 0.0, 1.0, None, ())
        prompts = [_prompt(engine, question) for question in questions]
        alone = [asyncio.run(_tokens(engine, p, TENANT_B, reply)) for p in prompts]  # tenant B: A's cache cold
        asyncio.run(_tokens(engine, _prompt(engine, " Question -1?"), TENANT_A))  # A's preamble, cached
        seen = _checked(engine)

        async def together():
            return await asyncio.gather(*(_tokens(engine, p, TENANT_A, reply) for p in prompts))

        assert asyncio.run(together()) == alone
        assert "failed" not in seen and engine.worker.stats.num_failed == 0, seen
        assert seen["max_running"] >= 5 if shared else seen["max_running"] <= 3, (seen, prompt.num_tokens)
    finally:
        engine.stop()


def test_a_prompt_waiting_for_memory_hashes_its_chain_once(tiny_model_path):
    """The head of the line is looked up at every step while it waits for memory (the blocks it would
    read that others hold); its chain is hashed once (100,000 tokens take ~25 ms to hash)."""
    prompt, budget = _budget(tiny_model_path, whole_prompts=1, more_tokens=200)
    engine = Engine(tiny_model_path, TINY, EngineConfig(16, 64, CacheConfig(budget, 0, 16), max_verify_tokens=0))
    engine.start()
    try:
        chains, prefix_chain = [], engine.runner.prefix_chain

        def counted(prompt, salt):
            chains.append(prompt.num_tokens)
            return prefix_chain(prompt, salt)

        engine.runner.prefix_chain = counted
        seen = _checked(engine)

        async def two():
            first = asyncio.ensure_future(_tokens(engine, prompt, TENANT_A, Sampling(150, 0.0, 1.0, None, ())))
            while not seen["max_rows"]:
                await asyncio.sleep(0.01)
            steps = seen["steps"]
            second = await _tokens(engine, _prompt(engine, " Question 1?"), TENANT_B, Sampling(4, 0.0, 1.0, None, ()))
            return await first, second, seen["steps"] - steps

        _, _, steps_waited = asyncio.run(two())
        assert engine.worker.scheduler.stats.num_memory_waits >= 1 and steps_waited > 20, (seen, steps_waited)
        assert len(chains) == 2, chains  # each request's chain hashed once, however long the second waited
        assert "failed" not in seen, seen
    finally:
        engine.stop()
