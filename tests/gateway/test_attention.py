"""The numpy attention path against MLX's own kernel: prompt chunks, and a batch's decode rows with
their per-row masks (left padding, drafts)."""

import mlx.core as mx
import numpy as np
import pytest

from gateway.engine import attention

HEADS, KV_HEADS, DIM = 8, 2, 64


def _qkv(rows: int, queries: int, keys: int):
    mx.random.seed(7)
    q = mx.random.normal((rows, HEADS, queries, DIM))
    k = mx.random.normal((rows, KV_HEADS, keys, DIM))
    v = mx.random.normal((rows, KV_HEADS, keys, DIM))
    return q, k, v


def _left_padded_mask(queries: int, keys: int, padding: list[int]) -> mx.array:
    """What a batched cache makes: row i sees no key before padding[i], and each query its past."""
    key_index = mx.arange(keys)[None, None, None, :]
    query_index = mx.arange(keys - queries, keys)[None, None, :, None]
    return (key_index <= query_index) & (mx.array(padding)[:, None, None, None] <= key_index)


def _library_sdpa(queries, keys, values, cache, scale, mask):
    """The shape of the libraries' own module-level function (it takes the cache)."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


@pytest.mark.parametrize("queries", [1, 3])  # a decode step; a step with two drafts per row
def test_batched_rows_with_their_own_masks_equal_the_library_kernel(queries):
    q, k, v = _qkv(4, queries, 40)
    mask = _left_padded_mask(queries, 40, [0, 5, 17, 39 - queries + 1])
    ours = attention.causal_attention(q, k, v, 0.125, np.asarray(mask))
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert ours.shape == theirs.shape
    assert float(mx.abs(ours - theirs).max()) < 1e-5


def test_the_swapped_layer_sends_batched_decode_rows_to_numpy_and_a_lone_row_to_the_kernel(monkeypatch):
    calls = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    kernel = attention._cpu_prefill(_library_sdpa)

    q, k, v = _qkv(3, 1, 24)
    mask = _left_padded_mask(1, 24, [0, 4, 9])
    batched = kernel(q, k, v, None, 0.125, mask)
    assert calls == [(3, HEADS, 1, DIM)]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert float(mx.abs(batched - expected).max()) < 1e-5

    lone = kernel(q[:1], k[:1], v[:1], None, 0.125, None)  # a lone row has no mask: MLX's kernel
    assert len(calls) == 1
    assert float(mx.abs(lone - mx.fast.scaled_dot_product_attention(q[:1], k[:1], v[:1], scale=0.125)).max()) < 1e-5


@pytest.mark.parametrize("queries", [1, 5, 40])
def test_attention_sinks_equal_the_library_kernel(queries):
    """gpt-oss's sinks: a learned logit per head in every query's softmax (causal prefill, and a
    batch's rows with their masks)."""
    q, k, v = _qkv(2, queries, 40)
    sinks = mx.array([-2.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0, 8.0])  # 8.0: the sink outweighs every key
    kernel = attention._cpu_prefill(
        lambda q, k, v, cache, scale, mask, sinks=None: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks
        )
    )
    masks = [_left_padded_mask(queries, 40, [0, 7])] + (["causal"] if queries > 1 else [])
    for mask in masks:
        ours = attention.causal_attention(q, k, v, 0.125, None if isinstance(mask, str) else np.asarray(mask), sinks)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
        assert float(mx.abs(ours - theirs).max()) < 1e-5
        assert float(mx.abs(kernel(q, k, v, None, 0.125, mask, sinks=sinks) - theirs).max()) < 1e-5
    without = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=masks[0])
    assert float(mx.abs(theirs - without).max()) > 1e-2  # the sinks change the answer: the test can tell


def _window_mask(queries: int, keys: int, window: int) -> mx.array:
    """A sliding window's mask for a prompt chunk: query i sees its last `window` keys."""
    key_index = mx.arange(keys)[None, :]
    query_index = mx.arange(keys - queries, keys)[:, None]
    return (key_index <= query_index) & (key_index > query_index - window)


@pytest.mark.parametrize("window", [512, 24, 1])
def test_a_sliding_windows_mask_takes_the_causal_path_with_its_window(monkeypatch, window):
    """A prompt chunk of 20 queries after 30 cached keys under a sliding window's mask: 512 tokens
    hide nothing, 24 hide each query's older keys, 1 leaves each query its own key. Each goes to the
    causal path (the C softmax) with its window instead of the mask, and equals MLX's kernel under
    the mask."""
    calls = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: calls.append(a[4:] or kw) or real(*a, **kw))
    kernel = attention._cpu_prefill(_library_sdpa)
    q, k, v = _qkv(1, 20, 50)
    mask = _window_mask(20, 50, window)
    ours = kernel(q, k, v, None, 0.125, mask)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert float(mx.abs(ours - expected).max()) < 1e-5
    assert calls == [{"sinks": None, "window": min(window, 50)}]  # the last query's keys: all 50 under 512
    if window < 50:  # the window changes the answer: the test can tell one ignored
        causal = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        assert float(mx.abs(expected - causal).max()) > 1e-2


@pytest.mark.parametrize("path", ["c-in-blocks", "numpy", "sinks", "sinks-in-blocks", "numpy-sinks"])
def test_a_window_equals_the_library_kernel_on_every_path(monkeypatch, path):
    """A window of 24 over a 40-query chunk after 30 keys: the C softmax with the queries in blocks of
    three lines (each block's keys start at its first query's window), numpy's masked path where the
    C library is off (the window as its mask), and with gpt-oss's sinks on both."""
    q, k, v = _qkv(1, 40, 70)
    mask = _window_mask(40, 70, 24)
    sinks = mx.array([-2.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0, 8.0]) if "sinks" in path else None
    if "in-blocks" in path:
        monkeypatch.setattr(attention, "BLOCK_SCORES", HEADS * 70 * 3)
    if "numpy" in path:
        monkeypatch.setattr(attention, "causal_softmax_kernel", lambda: None)
    ours = attention.causal_attention(q, k, v, 0.125, sinks=sinks, window=24)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
    assert float(mx.abs(ours - expected).max()) < 1e-5


def test_only_one_prompts_causal_band_is_taken_with_its_window():
    causal = np.tri(4, 9, 5, dtype=np.bool_)
    assert attention._causal_window(causal) == 9 and attention._causal_window(causal[None, None]) == 9
    band = np.asarray(_window_mask(4, 9, 3))
    assert attention._causal_window(band) == 3
    holed = band.copy()
    holed[3, 7] = False  # one key hidden inside a query's window
    assert attention._causal_window(holed) is None
    assert attention._causal_window(np.tri(4, 9, 4, dtype=np.bool_)) is None  # each query one key short
    assert attention._causal_window(np.stack([causal, causal])[:, None]) is None  # a batch's rows
    assert attention._causal_window(np.zeros((4, 9), dtype=np.bool_)) is None
    assert attention._causal_window(None) is None
