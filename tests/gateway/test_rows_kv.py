"""Decode rows whose KV lies in segments (gateway/engine/rows_kv.py, decode_attention.c): attention equal
to a plain computation over each row's whole KV (new tokens written first, causal among them),
across block boundaries, rows joining mid-way, drafts trimmed; a row's prefill buffers taken without
a copy and left untouched by the others' joining and leaving; a leaving row's KV back exactly; the
runner's check keeping a family on the library's cache when its attention does not come through."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from gateway.checkpoints import BuildSpec
from gateway.engine import CacheConfig, Message, ModelRunner, TextPart
from gateway.engine.batch import DecodeBatch
from gateway.engine.rows_kv import RowsKV, rows_kernel
from kvcache import TenantSalt
from tests.conftest import built_model

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 8, 2, 64, 2, 16
SCALE = HEAD_DIM**-0.5
SALT = TenantSalt(b"R" * 32)

pytestmark = pytest.mark.skipif(rows_kernel() is None, reason="no C compiler here: rows keep the library's cache")


class Rows:
    """A RowsKV and, beside it, each row's whole KV per layer as plain arrays (the reference)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.kv = RowsKV(KVCache, LAYERS, BLOCK)
        self.full: list[list[tuple[np.ndarray, np.ndarray]]] = []

    def add(self, length: int) -> list[KVCache]:
        caches = []
        for _ in range(LAYERS):
            cache = KVCache()
            cache.update_and_fetch(self._array(1, KV_HEADS, length), self._array(1, KV_HEADS, length))
            mx.eval(cache.keys, cache.values)
            caches.append(cache)
        self.kv.add(caches)
        self.full.append([(np.array(c.keys)[0, :, :length], np.array(c.values)[0, :, :length]) for c in caches])
        return caches

    def step(self, num_tokens: int) -> None:
        """Every row fed num_tokens tokens through every layer; each layer's output checked."""
        before = list(self.kv.lengths)
        self.kv.feed(num_tokens)
        rows = len(self.full)
        for layer in range(LAYERS):
            q = self._array(rows, HEADS, num_tokens)
            keys, values = self._array(rows, KV_HEADS, num_tokens), self._array(rows, KV_HEADS, num_tokens)
            out = np.array(self.kv.layers[layer].attend(q, keys, values, SCALE))
            for row in range(rows):
                old_keys, old_values = self.full[row][layer]
                whole = (
                    np.concatenate([old_keys, np.array(keys)[row]], 1),
                    np.concatenate([old_values, np.array(values)[row]], 1),
                )
                self.full[row][layer] = whole
                expected = _attention(np.array(q)[row], *whole, before[row])
                np.testing.assert_allclose(out[row], expected, rtol=2e-4, atol=2e-5)
        self.kv.confirm()

    def trim(self, num_tokens: list[int]) -> None:
        self.kv.trim(num_tokens)
        for row, n in enumerate(num_tokens):
            self.full[row] = [(k[:, : k.shape[1] - n], v[:, : v.shape[1] - n]) for k, v in self.full[row]]

    def _array(self, *shape_before_dim: int) -> mx.array:
        return mx.array(self.rng.standard_normal((*shape_before_dim, HEAD_DIM)).astype(np.float32))


def _attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, before: int) -> np.ndarray:
    """q (heads, L, dim) over keys / values (kv_heads, T, dim): query j sees keys [0, before + j]."""
    group, out = HEADS // KV_HEADS, np.empty_like(q)
    for head in range(HEADS):
        scores = q[head] @ keys[head // group].T * SCALE
        for j in range(q.shape[1]):
            scores[j, before + j + 1 :] = -np.inf
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[head] = (weights / weights.sum(-1, keepdims=True)) @ values[head // group]
    return out


def test_rows_attend_over_their_segments_across_blocks_joins_and_drafts():
    rows = Rows()
    for length in (37, 100, 5):
        rows.add(length)
    for num_tokens in (1, 3, 1):  # 3: a row verifying two drafts, causal among them
        rows.step(num_tokens)
    rows.trim([1, 0, 2])  # drafts rejected: their positions are written again
    rows.add(16)  # a row joins once the tables were built
    for num_tokens in (20, 1, 2):  # 20: past one block of room at once
        rows.step(num_tokens)
    assert rows.kv.lengths == [length.shape[1] for length, _ in (row[0] for row in rows.full)]


def test_a_row_joins_without_a_copy_and_the_others_leave_its_buffers_alone():
    rows = Rows(seed=1)
    first = rows.add(40)
    address = np.asarray(first[0].keys).ctypes.data
    assert rows.kv.rows[0].segments[0].keys[0].ctypes.data == address  # the prefill's own buffer
    rows.add(70)
    rows.step(1)
    rows.add(12)
    rows.kv.remove(1)
    del rows.full[1]
    rows.step(2)
    assert rows.kv.rows[0].segments[0].keys[0].ctypes.data == address


def test_a_leaving_row_gets_exactly_its_tokens_back_as_plain_caches():
    rows = Rows(seed=2)
    for length in (30, 9):
        rows.add(length)
    for num_tokens in (1, 18, 1):
        rows.step(num_tokens)
    rows.trim([2, 0])
    caches = rows.kv.remove(0)
    for layer, cache in enumerate(caches):
        keys, values = rows.full[0][layer]
        assert cache.offset == keys.shape[1] == 30 + 20 - 2
        np.testing.assert_array_equal(np.array(cache.keys)[0], keys)
        np.testing.assert_array_equal(np.array(cache.values)[0], values)
    assert len(rows.kv) == 1 and rows.kv.lengths == [9 + 20]


def test_a_row_leaving_after_its_step_failed_leaves_without_that_steps_tokens():
    """A step that raised part-way wrote its tokens' KV in some layers or none: the rows then leave
    (and store their blocks) with what the steps before confirmed."""
    rows = Rows(seed=3)
    for length in (20, 33):
        rows.add(length)
    rows.step(1)
    rows.kv.feed(2)  # the step that fails: never confirmed
    for index in (1, 0):
        caches = rows.kv.remove(index)
        keys, _ = rows.full[index][0]
        assert caches[0].offset == keys.shape[1] == (20, 33)[index] + 1
        np.testing.assert_array_equal(np.array(caches[0].keys)[0], keys)


def test_batched_rows_of_a_plain_family_decode_in_segments_and_a_lone_row_on_its_own_cache():
    runner = ModelRunner(built_model(BuildSpec("llama", "tiny")), CacheConfig(0, 0, 16), "fp")
    assert runner.rows_kv
    batch = DecodeBatch(runner)
    texts = [f"Row {index} says hello " * (index + 1) for index in range(3)]
    prompts = [runner.prompts.build((Message("user", (TextPart(text),)),), []) for text in texts]
    for prompt in prompts:
        batch.join(runner.prefill(prompt, SALT, 64, lambda: False))
    assert batch.segments is not None and len(batch.segments) == 3
    batch.step([1, 2, 3])
    batch.leave(0)
    batch.leave(0)
    assert batch.segments is None and not batch.batched
    assert batch.cache[0].offset == prompts[2].num_tokens + 1  # the lone row's own KVCache


def test_a_family_whose_attention_does_not_come_through_the_segments_keeps_the_library_cache(monkeypatch):
    def bypassed(self, layer, queries, keys, values, scale):  # as if the layer computed attention elsewhere
        return mx.zeros_like(queries)

    monkeypatch.setattr(RowsKV, "attend", bypassed)
    runner = ModelRunner(built_model(BuildSpec("llama", "tiny")), CacheConfig(0, 0, 16), "fp")
    assert not runner.rows_kv


def test_a_lone_row_over_a_long_context_splits_its_kv_heads_across_the_cores(monkeypatch):
    """One row: its KV heads go to the cores (past SPLIT_FROM_SCORES), each part reading its own
    heads' keys through tables shifted to them; the result equals the plain computation."""
    from gateway.engine import rows_kv, threads

    calls = []

    def recorded(work, num_parts, num_scores):
        calls.append(num_parts)
        for part in range(num_parts):  # each KV head alone, as the parts run
            work(part, part + 1)

    monkeypatch.setattr(rows_kv, "split_rows", recorded)
    rows = Rows(seed=4)
    rows.add(threads.SPLIT_FROM_SCORES // HEADS + 40)
    for num_tokens in (1, 3, 1):
        rows.step(num_tokens)
    assert calls and set(calls) == {KV_HEADS}
