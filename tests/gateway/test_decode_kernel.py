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


def _forget_the_built_kernels() -> None:
    for cached in (decode_kernel.kernel_library, decode_kernel._kernel, rows_kernel):
        cached.cache_clear()
