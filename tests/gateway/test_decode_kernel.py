"""The decode rows' C attention kernel against a float64 reference, through the strided views a
batched cache hands it, and the numpy path it replaces when it cannot be built."""

import mlx.core as mx
import numpy as np
import pytest

from gateway.engine import attention, decode_kernel
from gateway.engine.rows_kv import rows_kernel, rows_supported


def _reference(q, k, v, scale, allowed):
    """softmax(q kᵀ · scale) v per row and head in float64, grouped-query heads."""
    rows, heads, _, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros((rows, heads, 1, dim))
    for row in range(rows):
        for head in range(heads):
            scores = k[row, head // group].astype(np.float64) @ q[row, head, 0].astype(np.float64) * scale
            scores[~allowed[row, 0, 0]] = -np.inf
            weights = np.exp(scores - scores.max())
            out[row, head, 0] = weights @ v[row, head // group] / weights.sum()
    return out


def _strided(rows, kv_heads, keys, dim, seed):
    """Keys and values as a batched cache holds them: the first `keys` positions of a longer buffer."""
    generator = np.random.default_rng(seed)
    buffers = generator.standard_normal((2, rows, kv_heads, keys + 37, dim), dtype=np.float32)
    return buffers[0, :, :, :keys], buffers[1, :, :, :keys]


@pytest.mark.parametrize(
    "rows, heads, kv_heads, dim, keys",
    [
        (16, 8, 2, 64, 200),  # the demo model's decode batch
        (3, 4, 4, 128, 7),  # no grouping, head size 128
        (2, 8, 1, 80, 33),  # one KV head for eight, a head size of ten 8-float blocks
        (2, 4, 2, 36, 17),  # a head size no multiple of 8: the scalar path
    ],
)
def test_the_kernel_equals_attention_in_float64(rows, heads, kv_heads, dim, keys):
    if not decode_kernel.build_decode_kernel():
        pytest.fail("the kernel did not build on this machine")  # CI has a C compiler: it must build
    k, v = _strided(rows, kv_heads, keys, dim, seed=rows * dim)
    q = np.random.default_rng(1).standard_normal((rows, heads, 1, dim), dtype=np.float32)
    allowed = np.ones((rows, 1, 1, keys), dtype=bool)
    allowed[1:, ..., : keys // 3] = False  # left padding on every row but the first
    allowed[-1, ..., : keys - 1] = False  # a row that sees its own key only
    out = decode_kernel.decode_attention(q, k, v, dim**-0.5, allowed)
    assert out is not None and not k.flags.c_contiguous  # read through the views, as the cache holds them
    assert np.abs(out - _reference(q, k, v, dim**-0.5, allowed)).max() < 2e-5
    assert np.allclose(out[-1, :, 0], v[-1, np.arange(heads) // (heads // kv_heads), keys - 1], atol=1e-6)


def test_a_row_that_sees_no_key_gets_zeros_and_the_others_their_answer():
    k, v = _strided(2, 2, 9, 64, seed=3)
    q = np.ones((2, 8, 1, 64), dtype=np.float32)
    allowed = np.ones((2, 1, 1, 9), dtype=bool)
    allowed[0] = False
    out = decode_kernel.decode_attention(q, k, v, 0.125, allowed)
    assert out is not None
    assert not out[0].any()
    assert np.abs(out[1] - _reference(q[1:], k[1:], v[1:], 0.125, allowed[1:])[0]).max() < 2e-5


def test_the_decode_path_equals_numpys_and_falls_back_to_it_without_a_compiler(monkeypatch, tmp_path):
    mx.random.seed(11)
    q = mx.random.normal((5, 8, 1, 64)).astype(mx.bfloat16)  # converted to float32 on the way in
    k = mx.random.normal((5, 2, 50, 64)).astype(mx.bfloat16)
    v = mx.random.normal((5, 2, 50, 64)).astype(mx.bfloat16)
    allowed = np.ones((5, 1, 1, 50), dtype=bool)
    allowed[2:, ..., :20] = False
    with_kernel = attention.causal_attention(q, k, v, 0.125, allowed)
    decode_kernel.use_decode_kernel(False)
    try:
        with_numpy = attention.causal_attention(q, k, v, 0.125, allowed)
    finally:
        decode_kernel.use_decode_kernel(True)
    assert with_kernel.dtype == mx.bfloat16
    assert float(mx.abs(with_kernel.astype(mx.float32) - with_numpy.astype(mx.float32)).max()) < 1e-2  # bf16 rounding

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    _forget_the_built_kernels()
    try:
        assert decode_kernel.build_decode_kernel() is False
        assert decode_kernel.decode_attention(np.asarray(q.astype(mx.float32)), k, v, 0.125, allowed) is None
        assert rows_kernel() is None and not rows_supported(mx.zeros((1, 2, 4, 64)))  # rows keep the library's cache
        fallback = attention.causal_attention(q, k, v, 0.125, allowed)
        assert mx.array_equal(fallback, with_numpy)
    finally:
        _forget_the_built_kernels()  # the next caller finds the built kernels again


def _causal_reference(q, k, v, scale):
    """A prompt chunk's attention in float64: query i of L sees keys [0, T - L + i]."""
    _, heads, queries, _ = q.shape
    group = heads // k.shape[1]
    num_keys = k.shape[2]
    out = np.zeros(q.shape)
    for head in range(heads):
        scores = q[0, head].astype(np.float64) @ k[0, head // group].astype(np.float64).T * scale
        scores[np.arange(num_keys)[None, :] > np.arange(num_keys - queries, num_keys)[:, None]] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[0, head] = weights @ v[0, head // group] / weights.sum(axis=1, keepdims=True)
    return out


@pytest.mark.parametrize(
    "heads, kv_heads, dim, queries, keys, block_lines",
    [
        (8, 2, 64, 37, 90, 0),  # a chunk after 53 cached tokens, one block
        (8, 2, 64, 37, 90, 5),  # ... in blocks of 5 queries: each block's keys end at its last query
        (4, 4, 36, 12, 12, 1),  # a whole prompt, no grouping, a head size no multiple of 8, a query a block
        (8, 1, 128, 9, 300, 4),  # one KV head for eight, head size 128, short blocks far into the keys
    ],
)
def test_a_prompt_chunks_softmax_in_c_equals_attention_in_float64_and_numpys_path(
    monkeypatch, heads, kv_heads, dim, queries, keys, block_lines
):
    generator = np.random.default_rng(queries + keys)
    q = mx.array(generator.standard_normal((1, heads, queries, dim), dtype=np.float32))
    k = mx.array(generator.standard_normal((1, kv_heads, keys, dim), dtype=np.float32))
    v = mx.array(generator.standard_normal((1, kv_heads, keys, dim), dtype=np.float32))
    if block_lines:
        monkeypatch.setattr(attention, "BLOCK_SCORES", block_lines * heads * keys)
    assert decode_kernel.causal_softmax_kernel() is not None
    with_kernel = np.asarray(attention.causal_attention(q, k, v, 0.125))
    decode_kernel.use_decode_kernel(False)
    try:
        assert decode_kernel.causal_softmax_kernel() is None
        with_numpy = np.asarray(attention.causal_attention(q, k, v, 0.125))
    finally:
        decode_kernel.use_decode_kernel(True)
    expected = _causal_reference(np.asarray(q), np.asarray(k), np.asarray(v), 0.125)
    assert np.abs(with_kernel - expected).max() < 2e-5
    assert np.abs(with_kernel - with_numpy).max() < 2e-6


def test_a_prompt_chunk_keeps_numpys_softmax_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    _forget_the_built_kernels()
    try:
        assert decode_kernel.causal_softmax_kernel() is None
        q, k, v = (
            mx.array(np.random.default_rng(5).standard_normal((1, h, n, 64), dtype=np.float32))
            for h, n in ((8, 20), (2, 50), (2, 50))
        )
        out = np.asarray(attention.causal_attention(q, k, v, 0.125))
        assert np.abs(out - _causal_reference(np.asarray(q), np.asarray(k), np.asarray(v), 0.125)).max() < 2e-5
    finally:
        _forget_the_built_kernels()


def _forget_the_built_kernels() -> None:
    for cached in (decode_kernel.kernel_library, decode_kernel._kernel, decode_kernel._causal_softmax, rows_kernel):
        cached.cache_clear()
