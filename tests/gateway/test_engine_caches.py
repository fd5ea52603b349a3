"""Engine caches on the real tiny model: warm output equals cold output, tenants and images stay apart.

Tolerance: logits of a warm run match a cold run within 1e-4 absolute (fp32; the cached path sums
attention over the same keys in a different order), and greedy tokens are identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from gateway.engine import ImagePart, Message, Sampling, TextPart, decode_alone
from gateway.engine.caching import CacheConfig
from gateway.engine.runner import Cancelled, ModelRunner
from kvcache import TenantSalt
from tests.conftest import png_data_url
from vision import ImageLimits, decode_data_url

TENANT_A, TENANT_B = TenantSalt(b"A" * 32), TenantSalt(b"B" * 32)
GREEDY = Sampling(12, 0.0, 1.0, None, ())
ATOL = 1e-4
CHUNK = 64


@pytest.fixture(scope="module")
def cold(tiny_model_path):
    return ModelRunner(tiny_model_path, CacheConfig(0, 0, 16), "tiny")


@pytest.fixture
def warm(tiny_model_path):
    return ModelRunner(tiny_model_path, CacheConfig(64 << 20, 16 << 20, 16), "tiny")


def _image(seed: int):
    return decode_data_url(png_data_url(120, 90, seed=seed), ImageLimits(10**7, 10**8))


def _prompt(runner, turns, images=()):
    return runner.prompts.build(tuple(turns), list(images))


def _run(runner, prompt, salt=TENANT_A, sampling=GREEDY):
    prefill = runner.prefill(prompt, salt, CHUNK, lambda: False)
    logits = np.array(prefill.logits)
    generated = list(decode_alone(runner, prefill, sampling, lambda: False))
    runner.finish(prefill, generated)
    return logits, generated, prefill


def _user(text, image=False):
    parts = (ImagePart("x"), TextPart(text)) if image else (TextPart(text),)
    return Message("user", parts)


LONG = "The committee met in the old library to discuss the river crossing, the budget and the bridge. " * 12


def _reusable(num_tokens: int, block_size: int = 16) -> int:
    """Full blocks of the prompt, but never the last token: it is always recomputed."""
    return min(num_tokens // block_size * block_size, num_tokens - 1)


def _assert_same(cold_result, warm_result):
    np.testing.assert_allclose(warm_result[0], cold_result[0], atol=ATOL, rtol=0)
    assert warm_result[1] == cold_result[1]


def test_text_prompt_warm_equals_cold(cold, warm):
    prompt = _prompt(warm, [_user(LONG)])
    assert prompt.num_tokens > 2 * CHUNK  # crosses chunk boundaries
    reference = _run(cold, prompt)
    first = _run(warm, prompt)
    second = _run(warm, prompt)
    assert first[2].prefix.num_cached_tokens == 0
    assert second[2].prefix.num_cached_tokens == _reusable(prompt.num_tokens)
    _assert_same(reference, first)
    _assert_same(reference, second)


def test_longer_prompt_reuses_prefix_across_chunk_boundaries(cold, warm):
    short = _prompt(warm, [_user(LONG)])
    longer = _prompt(warm, [_user(LONG + " And then, what happened to the ferry after the flood of that year?" * 3)])
    _run(warm, short)
    result = _run(warm, longer)
    assert result[2].prefix.num_cached_tokens >= (short.num_tokens - 16) // 16 * 16 - 16
    _assert_same(_run(cold, longer), result)


def test_image_prompt_warm_equals_cold_and_skips_the_encoder(cold, warm):
    prompt = _prompt(warm, [_user("What is in this picture?", image=True)], [_image(1)])
    reference = _run(cold, prompt)
    first = _run(warm, prompt)
    calls = warm.num_encoder_calls
    second = _run(warm, prompt)
    assert warm.num_encoder_calls == calls  # the whole image lies in the reused prefix
    assert second[2].vision.num_skipped == 1
    _assert_same(reference, first)
    _assert_same(reference, second)


def test_vision_cache_skips_the_encoder_when_the_prefix_differs(warm):
    image = _image(2)
    _run(
        warm, _prompt(warm, [Message("system", (TextPart("You are terse."),)), _user("Describe.", image=True)], [image])
    )
    calls = warm.num_encoder_calls
    result = _run(
        warm,
        _prompt(
            warm, [Message("system", (TextPart("You are verbose and kind."),)), _user("Describe.", image=True)], [image]
        ),
    )
    assert warm.num_encoder_calls == calls
    assert (result[2].vision.num_hits, result[2].vision.num_misses) == (1, 0)


def test_multi_turn_with_image_in_turn_one(cold, warm):
    image = _image(3)
    turn1 = [_user("Look at this image and remember it.", image=True)]
    _, reply_tokens, _ = _run(warm, _prompt(warm, turn1, [image]))
    reply = warm.tokenizer.decode(reply_tokens, skip_special_tokens=True)
    turn2 = turn1 + [Message("assistant", (TextPart(reply),)), _user("Now tell me more about its colours.")]
    prompt2 = _prompt(warm, turn2, [image])
    result = _run(warm, prompt2)
    first_prompt = _prompt(warm, turn1, [image]).num_tokens
    assert result[2].prefix.num_cached_tokens >= first_prompt // 16 * 16
    assert result[2].vision.num_skipped == 1
    _assert_same(_run(cold, prompt2), result)


def test_other_tenant_reuses_nothing(warm):
    image = _image(4)
    prompt = _prompt(warm, [_user("Same words, same picture.", image=True)], [image])
    _run(warm, prompt, TENANT_A)
    calls = warm.num_encoder_calls
    result = _run(warm, prompt, TENANT_B)
    assert result[2].prefix.num_cached_tokens == 0
    assert result[2].vision.num_misses == 1 and warm.num_encoder_calls == calls + 1


def test_different_image_reuses_only_blocks_before_it(warm):
    system = Message("system", (TextPart("You are a careful assistant who describes pictures in detail. " * 3),))
    first = _prompt(warm, [system, _user("Describe.", image=True)], [_image(5)])
    second = _prompt(warm, [system, _user("Describe.", image=True)], [_image(6)])
    _run(warm, first)
    result = _run(warm, second)
    image_start = second.images[0].token_start
    assert result[2].prefix.num_cached_tokens == image_start // 16 * 16 > 0


def test_same_image_in_a_later_turn_reuses_past_it(warm):
    image = _image(7)
    turn1 = [_user("Here is a picture.", image=True)]
    _run(warm, _prompt(warm, turn1, [image]))
    turn2 = turn1 + [Message("assistant", (TextPart("ok"),)), _user("And again.")]
    result = _run(warm, _prompt(warm, turn2, [image]))
    assert result[2].prefix.num_cached_tokens > turn1_image_end(warm, turn1, image)


def turn1_image_end(runner, turns, image):
    image_part = _prompt(runner, turns, [image]).images[0]
    return image_part.token_start + image_part.num_tokens


def test_cancelled_prefill_keeps_the_chunks_it_finished(warm):
    prompt = _prompt(warm, [_user(LONG + " cancelled variant")])
    checks = iter([False, False, True])  # two chunks run, then the client is gone
    with pytest.raises(Cancelled):
        warm.prefill(prompt, TENANT_A, CHUNK, lambda: next(checks, True))
    result = _run(warm, prompt)
    assert result[2].prefix.num_cached_tokens == 2 * CHUNK
    warm.caches.prefix.pool.check()


def test_failed_generation_keeps_prompt_blocks(warm):
    prompt = _prompt(warm, [_user(LONG + " failure variant")])
    prefill = warm.prefill(prompt, TENANT_A, CHUNK, lambda: False)
    warm.finish(prefill, [])  # as the worker does when decoding raised
    again = _run(warm, prompt)
    assert again[2].prefix.num_cached_tokens == _reusable(prompt.num_tokens)
    assert all(b.ref_count == 0 for b in warm.caches.prefix.pool.by_hash.values())


def test_block_aligned_prompt_recomputes_only_its_last_token(cold, warm):
    ids = warm.tokenizer.encode(LONG, add_special_tokens=False)[:64]
    from gateway.engine.prompt import PreparedPrompt

    prompt = PreparedPrompt(tuple(ids), ())
    _run(warm, prompt)
    result = _run(warm, prompt)
    assert result[2].prefix.num_cached_tokens == 63
    _assert_same(_run(cold, prompt), result)


def test_every_prefix_miss_says_why(warm):
    """cold, diverged (and where), evicted, expired, purged; and another tenant's cached copy of the
    same prompt is still only cold for this one."""
    system = Message("system", (TextPart(LONG),))
    first = _prompt(warm, [system, _user("What did they decide about the bridge?")])
    other = _prompt(warm, [system, _user("Who chaired the meeting that day?")])
    assert _run(warm, first)[2].prefix.miss_reason == "cold"
    report = _run(warm, other)[2].prefix
    assert report.miss_reason == "diverged" and report.num_cached_tokens > 0
    first_difference = next(i for i, (x, y) in enumerate(zip(first.token_ids, other.token_ids)) if x != y)
    assert report.num_cached_tokens < first_difference  # within the first block after the shared ones ...
    assert report.miss_at_token == first_difference  # ... the very token where the user's questions part
    assert not report.miss_in_image
    assert _run(warm, first, salt=TENANT_B)[2].prefix.miss_reason == "cold"  # A's blocks are not B's business
    assert _run(warm, first)[2].prefix.miss_reason == ""  # a whole hit: nothing missed
    warm.caches.prefix.pool.expire(idle_s=0, now=float("inf"))
    assert _run(warm, first)[2].prefix.miss_reason == "expired"
    warm.caches.prefix.purge()
    assert _run(warm, first)[2].prefix.miss_reason == "purged"
    pool = warm.caches.prefix.pool
    pool.budget_bytes = pool.num_bytes  # full: the next prompt's blocks push these out
    _run(warm, _prompt(warm, [_user(LONG[::-1])]))
    evicted = _run(warm, first)[2].prefix
    assert (evicted.miss_reason, evicted.miss_tier, evicted.miss_at_token) == ("evicted", "ram", 0)
    assert 0 < evicted.miss_lived_s < 60  # stored by the run just before
    reasons = warm.caches.stats()["prefix"]["miss_reasons"]
    assert {"cold", "diverged", "expired", "purged", "evicted"} <= set(reasons)


def test_a_pinned_prefix_survives_a_storm_of_other_prompts_then_expires(tiny_model_path):
    """Through the runner: a request's breakpoint pins its prompt's blocks when it ends; prompts that
    fill the RAM budget many times over evict the unpinned twin, not the pinned one, until the
    pin's TTL passes on the injected clock."""
    from gateway.engine import Pin

    runner = ModelRunner(tiny_model_path, CacheConfig(4 << 20, 0, 16, pin_budget_bytes=1 << 20), "tiny")
    clock = [0.0]
    runner.caches.prefix.pool.clock = lambda: clock[0]
    pinned = _prompt(runner, [Message("system", (TextPart("Pinned. " + LONG),)), _user("one")])
    unpinned = _prompt(runner, [Message("system", (TextPart("Loose. " + LONG),)), _user("one")])
    for prompt, pins in ((pinned, (Pin(pinned.num_tokens // 16 * 16, 300.0),)), (unpinned, ())):
        prefill = runner.prefill(prompt, TENANT_A, CHUNK, lambda: False, pins=pins)
        runner.finish(prefill, [])
    assert runner.caches.prefix.pool.pins
    for i in range(12):  # each prompt holds 640 KiB of blocks: twice the budget in all
        _run(runner, _prompt(runner, [_user(f"Storm {i}. " + LONG)]), sampling=Sampling(1, 0.0, 1.0, None, ()))

    def cached(prompt):
        plan, report = runner.caches.open_prefix(prompt, TENANT_A, runner.new_cache())
        plan.session.close()
        return report.num_cached_tokens

    assert cached(pinned) == _reusable(pinned.num_tokens) and cached(unpinned) == 0
    clock[0] += 301
    runner.caches.expire()
    assert not runner.caches.prefix.pool.pins  # the pin ended: the prefix is an ordinary reused block now
    for i in range(12):  # prompts asked twice: reused blocks, which compete with it (one-off ones would not)
        storm = _prompt(runner, [_user(f"Second storm {i}. " + LONG)])
        for _ in range(2):
            _run(runner, storm, sampling=Sampling(1, 0.0, 1.0, None, ()))
    assert cached(pinned) == 0
    runner.caches.prefix.pool.check()
