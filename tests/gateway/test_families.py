"""Every supported family on its tiny model: warm output equals cold output with every cache on top.

One generic runner serves all families (gateway/engine/families.py holds their data). For each one:
a text chat crossing chunk boundaries (and, for Gemma 3, its sliding window), an image chat, a
multi-turn chat with an image in turn 1, tenant isolation, vision-encoder skipping, and a bfloat16
variant whose blocks go to SSD and come back equal after a restart. A 4-bit variant runs too.

Tolerance: fp32 logits within 1e-4 absolute of the cold run; bfloat16 and 4-bit weights within 0.05
(the cached path sums attention in another order, and bf16 rounds each step); greedy tokens equal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from gateway.checkpoints import RECIPES, SIZES, BuildSpec
from gateway.engine import ImagePart, Message, PromptError, Sampling, TextPart, decode_alone
from gateway.engine.caching import CacheConfig
from gateway.engine.families import VISION_FAMILIES, UnsupportedModel, family_of
from gateway.engine.runner import Cancelled, ModelRunner, token_embedding
from kvcache import TenantSalt
from kvcache.quant import QuantConfig
from kvcache.ssd import AdmissionPolicy, SsdConfig
from tests.conftest import built_model, png_data_url
from vision import ImageLimits, decode_data_url

TENANT_A, TENANT_B = TenantSalt(b"A" * 32), TenantSalt(b"B" * 32)
GREEDY = Sampling(12, 0.0, 1.0, None, ())
CHUNK, BLOCK = 64, 16
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "lfm2_vl")  # recurrent layers: reuse ends at a snapshot
FAMILIES = sorted(RECIPES)
VISION = sorted(set(FAMILIES) & set(VISION_FAMILIES))
LONG = (
    "The committee met in the old library to discuss the river crossing, the budget and the bridge, "
    "and then the ferry timetable for the winter months. "
) * 8


def _runner(path, prefix_bytes=64 << 20, vision_bytes=16 << 20, ssd=None) -> ModelRunner:
    return ModelRunner(path, CacheConfig(prefix_bytes, vision_bytes, BLOCK, ssd), "fp-" + path.name)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(family):
    return built_model(BuildSpec(family, "tiny"))


@pytest.fixture(scope="module")
def cold(model_path):
    return _runner(model_path, 0, 0)


@pytest.fixture
def warm(model_path):
    return _runner(model_path)


def _image(seed: int):
    return decode_data_url(png_data_url(120, 90, seed=seed), ImageLimits(10**7, 10**8))


def _user(text, image=False):
    return Message("user", ((ImagePart("x"), TextPart(text)) if image else (TextPart(text),)))


def _run(runner, turns, images=(), salt=TENANT_A):
    prompt = runner.prompts.build(tuple(turns), list(images))
    prefill = runner.prefill(prompt, salt, CHUNK, lambda: False)
    logits = np.array(prefill.logits.astype(mx.float32))
    generated = list(decode_alone(runner, prefill, GREEDY, lambda: False))
    runner.finish(prefill, generated)
    return logits, generated, prefill


def _assert_same(cold_result, warm_result, atol=1e-4):
    np.testing.assert_allclose(warm_result[0], cold_result[0], atol=atol, rtol=0)
    assert warm_result[1] == cold_result[1]


def _reusable(family, num_tokens: int) -> int:
    """What a repeated prompt of num_tokens reuses: all but its last token, for a hybrid model up to
    the block boundary before it (its state is snapshotted at block boundaries only)."""
    if family in HYBRID:
        return (num_tokens - 1) // BLOCK * BLOCK
    return min(num_tokens // BLOCK * BLOCK, num_tokens - 1)


def _vision_only(family):
    if family not in VISION_FAMILIES:
        pytest.skip(f"{family} is a text family")


def test_text_chat_warm_equals_cold_across_chunks_and_windows(family, cold, warm):
    turns = [_user(LONG)]
    reference = _run(cold, turns)
    first, second = _run(warm, turns), _run(warm, turns)
    num_tokens = second[2].prompt.num_tokens
    assert num_tokens > 2 * CHUNK and num_tokens > 2 * SIZES["tiny"].sliding_window
    assert first[2].prefix.num_cached_tokens == 0
    assert second[2].prefix.num_cached_tokens == _reusable(family, num_tokens)
    _assert_same(reference, first)
    _assert_same(reference, second)


def test_a_longer_prompt_reuses_the_earlier_one_past_the_window(family, cold, warm):
    """Gemma 3's local layers only see the last `sliding_window` tokens: a prefix longer than the
    window must still be reused exactly (full KV in blocks, the window applied as a mask)."""
    _run(warm, [_user(LONG)])
    turns = [_user(LONG + " What did they decide about the ferry? Answer in two sentences, please." * 2)]
    result = _run(warm, turns)
    assert result[2].prefix.num_cached_tokens > 2 * SIZES["tiny"].sliding_window
    _assert_same(_run(cold, turns), result)


def test_image_chat_warm_equals_cold_and_skips_the_encoder(family, cold, warm):
    _vision_only(family)
    turns, images = [_user("What is in this picture?", image=True)], [_image(1)]
    reference = _run(cold, turns, images)
    first = _run(warm, turns, images)
    calls = warm.num_encoder_calls
    second = _run(warm, turns, images)
    assert warm.num_encoder_calls == calls and second[2].vision.num_skipped == 1
    assert second[2].prefix.num_cached_tokens > second[2].prompt.images[0].token_start
    _assert_same(reference, first)
    _assert_same(reference, second)


def test_multi_turn_with_an_image_in_turn_one(family, cold, warm):
    _vision_only(family)
    image = _image(3)
    turn1 = [_user("Look at this image and remember it.", image=True)]
    _, reply_tokens, _ = _run(warm, turn1, [image])
    reply = warm.tokenizer.decode(reply_tokens, skip_special_tokens=True)
    turn2 = turn1 + [Message("assistant", (TextPart(reply),)), _user("Now tell me more about its colours.")]
    result = _run(warm, turn2, [image])
    image_end = result[2].prompt.images[0].token_start + result[2].prompt.images[0].num_tokens
    assert result[2].prefix.num_cached_tokens >= image_end and result[2].vision.num_skipped == 1
    _assert_same(_run(cold, turn2, [image]), result)


def test_the_vision_cache_serves_an_image_behind_another_prefix(family, warm):
    _vision_only(family)
    image = _image(2)
    _run(warm, [Message("system", (TextPart("You are terse."),)), _user("Describe.", image=True)], [image])
    calls = warm.num_encoder_calls
    result = _run(
        warm, [Message("system", (TextPart("You are verbose and kind."),)), _user("Describe.", image=True)], [image]
    )
    assert warm.num_encoder_calls == calls
    assert (result[2].vision.num_hits, result[2].vision.num_misses) == (1, 0)


def test_another_tenant_reuses_nothing(family, warm):
    with_image = family in VISION_FAMILIES
    turns, images = [_user("Same words, same picture.", image=with_image)], [_image(4)] if with_image else []
    _run(warm, turns, images, TENANT_A)
    calls = warm.num_encoder_calls
    result = _run(warm, turns, images, TENANT_B)
    assert result[2].prefix.num_cached_tokens == 0
    assert warm.num_encoder_calls == calls + len(images)


def test_a_text_family_refuses_images_with_a_reason(family, warm):
    if family in VISION_FAMILIES:
        pytest.skip(f"{family} takes images")
    with pytest.raises(PromptError) as refused:
        warm.prompts.build((_user("What is this?", image=True),), [_image(5)])
    assert refused.value.code == "images_unsupported"


# MLX's CPU gather_mm (a mixture of experts' expert matmul) takes float32 only: these families' bf16
# checkpoints cannot run on a machine without a GPU, so their SSD round trip is tested in float32.
MIXTURES_OF_EXPERTS = ("qwen3_next", "qwen3_5_moe", "gpt_oss")
FLOAT32_ONLY_ON_CPU = MIXTURES_OF_EXPERTS


def _half(family) -> str:
    return "float32" if family in FLOAT32_ONLY_ON_CPU else "bfloat16"


def test_bfloat16_blocks_go_to_ssd_and_come_back_equal_after_a_restart(family, tmp_path):
    path = built_model(BuildSpec(family, "tiny", dtype=_half(family)))
    ssd = SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0))
    turns = [_user(LONG)]
    reference = _run(_runner(path, 0, 0), turns)
    first = _runner(path, ssd=ssd)
    _run(first, turns)
    first.caches.shutdown(10)  # persists RAM blocks to SSD
    restarted = _runner(path, ssd=ssd)
    result = _run(restarted, turns)
    assert result[2].prefix.tier == "ssd" and result[2].prefix.num_ssd_tokens > 2 * CHUNK
    assert token_embedding(restarted.lm).weight.dtype == getattr(mx, _half(family))
    _assert_same(reference, result, atol=0.05)
    restarted.caches.shutdown(10)


def test_bfloat16_kv_quantised_to_8_bits_comes_back_from_ssd_within_its_drift(family, tmp_path):
    path = built_model(BuildSpec(family, "tiny", dtype=_half(family)))
    ssd = SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0))
    config = CacheConfig(64 << 20, 0, BLOCK, ssd, QuantConfig(8, min_tokens=0))
    turns = [_user(LONG)]
    reference = _run(_runner(path, 0, 0), turns)
    first = ModelRunner(path, config, "fp-bf16")
    _run(first, turns)
    first.caches.shutdown(10)
    restarted = ModelRunner(path, config, "fp-bf16")
    result = _run(restarted, turns)
    assert result[2].prefix.tier == "ssd" and result[2].prefix.num_cached_tokens > 2 * CHUNK
    # 8-bit KV of bf16 values is a drift, not equality: measured at most 0.085 over the families (greedy
    # tokens may then differ on these random models, whose top two logits are often within 0.02)
    np.testing.assert_allclose(result[0], reference[0], atol=0.15, rtol=0)
    assert _run(restarted, turns)[1] == result[1]  # the same stored blocks always decode alike
    restarted.caches.shutdown(10)


def test_a_4bit_model_runs_warm_equals_cold(family):
    path = built_model(BuildSpec(family, "tiny", quantize=4))
    turns = [_user(LONG)]
    warm = _runner(path)
    _run(warm, turns)
    _assert_same(_run(_runner(path, 0, 0), turns), _run(warm, turns), atol=0.05)


def test_a_vision_family_without_family_data_is_refused_at_start_up(tmp_path):
    config = '{"model_type": "made_up_vl", "vision_config": {}}'
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(UnsupportedModel, match=r"made_up_vl.*no family data.*image placeholder"):
        family_of(tmp_path)


def test_a_text_model_type_neither_library_knows_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "made_up_lm"}')
    with pytest.raises(UnsupportedModel, match="made_up_lm"):
        family_of(tmp_path)


@dataclass
class Library:
    """A stock load of the model folder by its own library: none of Strata's per-instance changes
    (CPU attention, last-position logits), so it is an independent reference."""

    family: object
    model: object
    processor: object
    lm: object
    cache_classes: object

    @classmethod
    def load(cls, path) -> Library:
        family = family_of(path)
        if family.library == "mlx_vlm":
            import mlx_vlm
            from mlx_vlm.models import cache as cache_classes

            model, processor = mlx_vlm.load(str(path))
            return cls(family, model, processor, model.language_model, cache_classes)
        import mlx_lm
        from mlx_lm.models import cache as cache_classes

        model, tokenizer = mlx_lm.load(str(path))
        return cls(family, model, tokenizer, model, cache_classes)

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)


@pytest.fixture(scope="module")
def library(model_path) -> Library:
    return Library.load(model_path)


def _library_logits(library, content: list[dict], images=(), videos=()) -> np.ndarray:
    """The last-position logits of the library's own one-shot forward, as mlx-vlm's generate runs it:
    its processor expands the whole rendered prompt (text and images at once), get_input_embeddings
    embeds it (and for the Qwen VL line computes positions), one language-model call runs it, and the
    library's own cache classes hold the KV (Gemma 3's sliding layers in a RotatingKVCache)."""
    text = library.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    if not images and not videos:
        ids = mx.array([library.tokenizer.encode(text, add_special_tokens=False)])
        out = library.lm(ids, cache=library.cache_classes.make_prompt_cache(library.lm))
        return ids, np.array(getattr(out, "logits", out)[0, -1].astype(mx.float32))
    visual = {"images": [i.image for i in images]} if images else {}
    if videos:  # each video as its sampled frames
        visual["videos"] = [[np.asarray(frame) for frame in video.frames] for video in videos]
    inputs = library.processor(text=[text], **visual, return_tensors="np")
    ids = mx.array(inputs.pop("input_ids"))
    extra = {k: mx.array(v) for k, v in inputs.items() if k not in ("attention_mask", "token_type_ids")}
    embedded = library.model.get_input_embeddings(ids, mask=mx.ones_like(ids), **extra).to_dict()
    embeds = embedded.pop("inputs_embeds")
    kwargs = {k: v for k, v in embedded.items() if v is not None}
    out = library.lm(ids, inputs_embeds=embeds, cache=library.cache_classes.make_prompt_cache(library.lm), **kwargs)
    return ids, np.array(out.logits[0, -1].astype(mx.float32))


def test_chunked_cold_prefill_equals_the_library_one_shot_forward(family, cold, library):
    """Strata's own steps (per-image expansion, chunked prefill, explicit positions, window as mask)
    give what the library itself computes in one call on a prompt longer than window and chunk, and
    the same greedy tokens as the library's own decode loop over its own caches (Gemma 3's local
    layers then attend through a RotatingKVCache trimmed to the window)."""
    ids, expected = _library_logits(library, [{"type": "text", "text": LONG}])
    result = _run(cold, [_user(LONG)])
    assert result[2].prompt.token_ids == tuple(ids[0].tolist())
    np.testing.assert_allclose(result[0], expected, atol=1e-4, rtol=0)
    assert result[1] == _library_greedy(library, ids, len(result[1]))


def _library_greedy(library, ids: mx.array, num_tokens: int) -> list[int]:
    cache = library.cache_classes.make_prompt_cache(library.lm)
    out = library.lm(ids, cache=cache)
    tokens = []
    for _ in range(num_tokens):
        token = int(mx.argmax(getattr(out, "logits", out)[0, -1]).item())
        tokens.append(token)
        out = library.lm(mx.array([[token]]), cache=cache)
    return tokens


def test_image_prompt_equals_the_library_one_shot_forward(family, cold, library):
    _vision_only(family)
    image = _image(6)
    ids, expected = _library_logits(
        library, [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}], [image]
    )
    result = _run(cold, [_user("What is in this picture?", image=True)], [image])
    assert result[2].prompt.token_ids == tuple(ids[0].tolist())
    np.testing.assert_allclose(result[0], expected, atol=1e-4, rtol=0)


def test_an_image_cut_by_a_cancelled_prefill_resumes_inside_its_tokens(family, cold, warm):
    """The first request stops after one chunk, inside the image; the retry reuses the image's first
    blocks and computes the rest of it (embeddings, and Qwen3-VL's deepstack rows, from the middle)."""
    _vision_only(family)
    image = decode_data_url(png_data_url(224, 224, seed=7), ImageLimits(10**7, 10**8))
    turns = [Message("system", (TextPart("Answer briefly."),)), _user("What is in this picture?", image=True)]
    prompt = warm.prompts.build(tuple(turns), [image])
    span = prompt.images[0]
    assert span.token_start < CHUNK < span.token_start + span.num_tokens, "the image must cross the first chunk's end"
    calls = iter([False, True])
    with pytest.raises(Cancelled):
        warm.prefill(prompt, TENANT_A, CHUNK, lambda: next(calls))
    result = _run(warm, turns, [image])
    assert span.token_start < result[2].prefix.num_cached_tokens < span.token_start + span.num_tokens
    _assert_same(_run(cold, turns, [image]), result)


def test_a_hybrid_model_reuses_a_conversation_from_its_reply_snapshot():
    """Turn 2 resumes from the recurrent state snapshotted at the last block boundary its reply's
    decoding passed, past turn 1's prompt, and equals a cold run."""
    path = built_model(BuildSpec("qwen3_next", "tiny"))
    warm, cold = _runner(path), _runner(path, 0, 0)
    turn1 = [_user(LONG)]
    long_reply = Sampling(40, 0.0, 1.0, None, ())
    prompt = warm.prompts.build(tuple(turn1), [])
    prefill = warm.prefill(prompt, TENANT_A, CHUNK, lambda: False)
    reply = list(decode_alone(warm, prefill, long_reply, lambda: False))
    warm.finish(prefill, reply)
    assert len(reply) > BLOCK + prompt.num_tokens % BLOCK, "the reply crosses a block boundary"
    # the next turn's tokens continue the reply's (a random model's text does not round-trip through
    # its tokenizer, so they are built as tokens)
    more = warm.tokenizer.encode(" And the ferry?", add_special_tokens=False)
    turn2 = dataclasses.replace(prompt, token_ids=prompt.token_ids + tuple(reply) + tuple(more))
    results = []
    for runner in (warm, cold):
        again = runner.prefill(turn2, TENANT_A, CHUNK, lambda: False)
        results.append((np.array(again.logits), list(decode_alone(runner, again, GREEDY, lambda: False)), again))
        runner.finish(again, results[-1][1])
    fed = prompt.num_tokens + len(reply) - 1  # the last reply token is never fed back
    assert results[0][2].prefix.num_cached_tokens == fed // BLOCK * BLOCK > prompt.num_tokens
    _assert_same(results[1], results[0])


def test_a_conversation_keeps_its_lasting_snapshots_and_the_ends_it_has_not_moved_past():
    """Lasting snapshots are spaced by the model's measured bytes (a quarter of the KV they sit
    among); a turn's own ends (prompt, reply) are dropped once the next turn resumes past them, and
    each turn still resumes at the end of the one before."""
    from gateway.engine.runner import SNAPSHOT_SHARE

    path = built_model(BuildSpec("qwen3_next", "tiny"))
    warm = _runner(path)
    every = warm.snapshot_blocks * BLOCK
    kv, state = warm.kv_bytes_per_token, warm.state_bytes
    assert kv and state and every * kv >= SNAPSHOT_SHARE * state > (every - BLOCK) * kv  # the least such spacing
    prefix = warm.caches.prefix
    tokens = warm.prompts.build((_user(LONG),), []).token_ids
    ends, resumed = [], []
    for turn in range(3):
        prompt = dataclasses.replace(warm.prompts.build((_user(LONG),), []), token_ids=tokens)
        prefill = warm.prefill(prompt, TENANT_A, CHUNK, lambda: False)
        resumed.append(prefill.prefix.num_cached_tokens)
        reply = list(decode_alone(warm, prefill, Sampling(20, 0.0, 1.0, None, ()), lambda: False))
        warm.finish(prefill, reply)
        assert prefill.snapshot is not None, "decoding passed a block boundary"
        ends.append(((prompt.num_tokens - 1) // BLOCK * BLOCK, prefill.snapshot[0]))  # prompt's end, reply's
        # the next turn continues this one's tokens (a random model's text does not round-trip)
        more = warm.tokenizer.encode(
            f" Turn {turn}: and the ferry, the bridge, the tide?" * 4, add_special_tokens=False
        )
        tokens = prompt.token_ids + tuple(reply) + tuple(more)
    assert resumed[1:] == [ends[0][1], ends[1][1]], "each turn resumes at the reply before it"
    held = sorted(block.end_token for block in prefix.pool.by_hash.values() if block.state)
    lasting = [point for point in range(every, ends[2][1] + 1, every)]
    assert lasting and set(lasting) <= set(held)
    assert set(held) - set(lasting) == {ends[1][1], *ends[2]}  # turn 1's ends are gone, and turn 2's prompt's
    assert prefix.counters.num_snapshots_superseded >= 3
    prefix.pool.check()


def test_a_snapshot_stored_under_another_block_is_never_restored(tmp_path):
    """Chunks are cut at snapshot points; a prompt that shares only the first snapshot interval with an
    earlier one resumes there, not at the last block the two share."""
    path = built_model(BuildSpec("qwen3_next", "tiny"))
    config = CacheConfig(64 << 20, 0, BLOCK, snapshot_blocks=2)
    warm, cold = ModelRunner(path, config, "fp"), _runner(path, 0, 0)
    _run(warm, [_user(LONG)])
    other = [_user(LONG[:150] + " but the tide was late.")]
    result = _run(warm, other)
    shared = result[2].prefix.miss_at_token  # where the prompts part
    assert result[2].prefix.num_cached_tokens == shared // (2 * BLOCK) * (2 * BLOCK) > 0
    _assert_same(_run(cold, other), result)


@pytest.mark.parametrize("hybrid", HYBRID)
def test_a_chunk_takes_its_snapshots_inside_one_model_call(hybrid, monkeypatch):
    """A prompt whose one chunk spans several snapshot points runs in one model call (its pieces,
    cut at the points, packed): each point's snapshot equals the state of a run whose chunks end
    there (as it does where the model cannot pack, one call per piece), and a prompt that parts from
    it inside the chunk resumes from one and equals a cold run."""
    path = built_model(BuildSpec(hybrid, "tiny"))
    config = CacheConfig(64 << 20, 0, BLOCK, snapshot_blocks=2)
    whole, stepwise, cold = ModelRunner(path, config, "fp"), ModelRunner(path, config, "fp"), _runner(path, 0, 0)
    unpacked = ModelRunner(path, config, "fp")
    unpacked.packable = False
    calls = []
    for name in ("_call_one", "_call_packed"):
        own = getattr(whole, name)
        monkeypatch.setattr(whole, name, lambda parts, own=own, name=name: calls.append(name) or own(parts))
    prompt = whole.prompts.build((_user(LONG),), [])
    for runner, chunk in ((whole, 512), (unpacked, 512), (stepwise, 2 * BLOCK)):  # stepwise: chunks end at points
        runner.finish(runner.prefill(prompt, TENANT_A, chunk, lambda: False), [])
    assert calls == ["_call_packed"] and whole.packable
    *taken, reference = [_snapshots(runner) for runner in (whole, unpacked, stepwise)]
    assert len(reference) >= prompt.num_tokens // (2 * BLOCK)
    for snapshots in taken:
        assert snapshots.keys() == reference.keys()
        for end, state in snapshots.items():
            for mine, theirs in zip(state, reference[end], strict=True):
                np.testing.assert_allclose(np.array(mine), np.array(theirs), atol=1e-5, rtol=0)
    other = [_user(LONG[:200] + " but the tide was late.")]
    result = _run(whole, other)
    assert result[2].prefix.num_cached_tokens == result[2].prefix.miss_at_token // (2 * BLOCK) * (2 * BLOCK) > 0
    _assert_same(_run(cold, other), result)


def _snapshots(runner) -> dict[int, list]:
    """The prefix cache's state snapshots by the token they follow, each layer's arrays in a row."""
    blocks = runner.caches.prefix.pool.by_hash.values()
    return {block.end_token: [a for arrays in block.state for a in arrays] for block in blocks if block.state}


def test_a_hybrid_prompt_snapshots_at_its_cache_breakpoint():
    """A breakpoint (a prefix the client marked to be sent again) gets a snapshot at its last block
    boundary, however far from the interval's: a prompt sharing only that prefix resumes there."""
    from gateway.engine.types import Pin

    path = built_model(BuildSpec("qwen3_next", "tiny"))
    config = CacheConfig(64 << 20, 0, BLOCK, snapshot_blocks=0)
    warm, cold = ModelRunner(path, config, "fp"), _runner(path, 0, 0)
    system = Message("system", (TextPart(LONG[:300]),))
    first = warm.prompts.build((system, _user("What about the ferry?")), [])
    breakpoint_at = len(warm.prompts.build((system,), []).token_ids) - 3  # inside the system turn
    prefill = warm.prefill(first, TENANT_A, CHUNK, lambda: False, pins=(Pin(breakpoint_at, 60.0),))
    warm.finish(prefill, [])
    turns = [system, _user("And what did the budget say?")]
    result = _run(warm, turns)
    assert result[2].prefix.num_cached_tokens == breakpoint_at // BLOCK * BLOCK
    _assert_same(_run(cold, turns), result)


def test_a_hybrid_prompt_snapshots_where_its_instructions_end():
    """Conversations that share their system prompt but not their first question resume at the last
    block boundary of the instructions, with no breakpoint and no interval point there."""
    path = built_model(BuildSpec("qwen3_next", "tiny"))
    config = CacheConfig(64 << 20, 0, BLOCK, snapshot_blocks=0)
    warm, cold = ModelRunner(path, config, "fp"), _runner(path, 0, 0)
    system = Message("system", (TextPart(LONG[:300]),))
    _run(warm, [system, _user("What about the ferry?")])
    turns = [system, _user("And what did the budget say?")]
    instructions = warm.prompts.tokens_through(warm.prompts.build(tuple(turns), []), 1, TENANT_A)
    result = _run(warm, turns)
    assert instructions and result[2].prefix.num_cached_tokens == instructions // BLOCK * BLOCK > 0
    _assert_same(_run(cold, turns), result)


@pytest.mark.parametrize("hybrid", HYBRID)
def test_a_long_shared_document_is_reused_by_a_different_question(hybrid):
    """One document, two questions in the same message: the second resumes at the last lasting
    snapshot inside the document (at most one interval before where they part), says how many
    matched tokens it recomputed for want of a state there, and equals a cold run."""
    path = built_model(BuildSpec(hybrid, "tiny"))
    warm, cold = _runner(path), _runner(path, 0, 0)
    document = " ".join(f"Clause {n}: {LONG}" for n in range(4))  # ~1,000 tokens
    _run(warm, [_user(document + " Who chaired the meeting?")])
    turns = [_user(document + " When does the winter ferry run?")]
    result = _run(warm, turns)
    every, report = warm.snapshot_blocks * BLOCK, result[2].prefix
    parted = report.miss_at_token
    assert report.miss_reason == "diverged" and parted > 2 * every
    assert report.num_cached_tokens == parted // every * every
    assert report.num_tokens_without_state == parted // BLOCK * BLOCK - report.num_cached_tokens
    _assert_same(_run(cold, turns), result)


@pytest.mark.parametrize("hybrid", HYBRID)
def test_a_one_token_first_message_blocks_no_later_snapshot(hybrid):
    path = built_model(BuildSpec(hybrid, "tiny"))
    warm = _runner(path)
    hi = _run(warm, [_user("hi")])
    turns = [_user("hi"), Message("assistant", (TextPart("Hello."),)), _user(LONG)]
    first, again = _run(warm, turns), _run(warm, turns)
    assert hi[2].prefix.num_cached_tokens == 0 and first[2].prefix.num_cached_tokens <= BLOCK
    assert again[2].prefix.num_cached_tokens >= first[2].prefix.num_prompt_tokens - 2 * BLOCK
    assert warm.caches.prefix.counters.snapshot_skips == {}


def test_every_attention_layer_of_every_family_prefills_on_the_cpu_attention_path(family, cold, monkeypatch):
    import gateway.engine.attention as attention

    calls = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    result = _run(cold, [_user(LONG)])  # gpt-oss's attention sinks included
    num_chunks = -(-result[2].prompt.num_tokens // CHUNK)
    num_attention = sum(  # a hybrid's other layers are recurrent (Nemotron-H keeps both under "mixer")
        "Attention" in type(getattr(layer, "self_attn", None) or getattr(layer, "mixer", None)).__name__
        for layer in cold.lm.layers
    )
    assert num_attention and len(calls) == num_chunks * num_attention


def test_every_mlp_of_every_family_prefills_on_the_numpy_activation_path(family, cold, monkeypatch):
    import gateway.engine.activations as activations

    if family == "nemotron_h":
        pytest.skip("nemotron_h's MLPs are squared-ReLU: the library runs them in MLX")
    calls = []
    real = activations._sigmoid_times
    monkeypatch.setattr(activations, "_sigmoid_times", lambda *args: calls.append(1) or real(*args))
    result = _run(cold, [_user(LONG)])
    num_chunks = -(-result[2].prompt.num_tokens // CHUNK)
    if (
        family in MIXTURES_OF_EXPERTS
    ):  # the experts' activation (a short last chunk's few pairs keep MLX's), and a shared expert's
        full_chunks = result[2].prompt.num_tokens // CHUNK
        assert full_chunks * len(cold.lm.layers) <= len(calls) <= 2 * num_chunks * len(cold.lm.layers)
    else:
        assert len(calls) == num_chunks * len(cold.lm.layers)


@pytest.mark.parametrize("model_type", ["mistral", "llama", "qwen3", "phi3", "gemma3_text"])
def test_any_text_model_type_mlx_lm_loads_takes_the_generic_text_path(tmp_path, model_type):
    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    family = family_of(tmp_path)
    assert (family.library, family.image_placeholder, family.positions) == ("mlx_lm", None, "offset")


def test_reply_ends_come_from_config_generation_config_and_tokenizer(tmp_path):
    from types import SimpleNamespace

    from gateway.engine.runner import eos_ids

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 106]}')
    config = {"text_config": {"eos_token_id": 7}, "eos_token_id": None}
    assert eos_ids(tmp_path, config, SimpleNamespace(eos_token_id=2)) == {1, 2, 7, 106}
    assert eos_ids(tmp_path / "missing", {"eos_token_id": 5}, SimpleNamespace(eos_token_id=None)) == {5}


@pytest.mark.parametrize("name", ["chat_template.jinja", "generation_config.json", "processor_config.json"])
def test_the_model_fingerprint_covers_every_file_that_changes_outputs(tiny_model_path, tmp_path, name):
    import shutil

    from gateway.engine import model_fingerprint

    copy = tmp_path / "model"
    shutil.copytree(tiny_model_path, copy)
    before = model_fingerprint(copy)
    (copy / name).write_text((copy / name).read_text() + " " if (copy / name).exists() else "{}")
    assert model_fingerprint(copy) != before
