"""Chunked gated-delta prefill equals the library's token-by-token recurrence.

Tolerance: float32 outputs and states within 1e-5 absolute on unit-scale inputs (the chunked form
sums the same products in another order); through the tiny Qwen3.5 and Qwen3-Next models, prefill
logits within 1e-4 (as warm against cold elsewhere) and greedy tokens equal.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.gated_delta import compute_g, compute_g_safe, gated_delta_ops

from gateway.checkpoints import BuildSpec
from gateway.engine import Message, TextPart
from gateway.engine.caching import CacheConfig
from gateway.engine.recurrent import chunked_gated_delta, log_decay
from gateway.engine.runner import ModelRunner
from tests.conftest import built_model, logits_and_greedy_tokens

TOLERANCE = 1e-5


def _inputs(num_tokens, key_heads=2, value_heads=8, dim=32, seed=0):
    mx.random.seed(seed)
    shape = (2, num_tokens)
    q, k = (mx.random.normal((*shape, key_heads, dim)) for _ in range(2))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * dim**-0.5  # as the families normalise them
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((*shape, value_heads, dim))
    a, b = mx.random.normal((*shape, value_heads)), mx.random.normal((*shape, value_heads))
    A_log, dt_bias = mx.random.normal((value_heads,)) * 0.5, mx.random.normal((value_heads,)) * 0.5
    state = mx.random.normal((2, value_heads, dim, dim)) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state


def _close(expected, actual):
    difference = float(mx.abs(expected.astype(mx.float32) - actual.astype(mx.float32)).max())
    assert difference <= TOLERANCE, difference


@pytest.mark.parametrize("num_tokens", [1, 2, 31, 64, 65, 130, 257])
@pytest.mark.parametrize("chunk_tokens", [16, 64])
def test_chunks_equal_the_token_by_token_recurrence(num_tokens, chunk_tokens):
    q, k, v, a, b, A_log, dt_bias, state = _inputs(num_tokens, seed=num_tokens)
    beta = mx.sigmoid(b)
    expected_y, expected_state = gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), beta, state)
    log_g = log_decay(A_log, a, dt_bias, None)
    y, final = chunked_gated_delta(q, k, v, log_g, beta, state, chunk_tokens=chunk_tokens)
    assert y.shape == expected_y.shape and final.shape == expected_state.shape
    _close(expected_y, y)
    _close(expected_state, final)


def test_the_bounded_decay_and_one_head_per_key_head_match_too():
    q, k, v, a, b, A_log, dt_bias, state = _inputs(100, key_heads=4, value_heads=4)
    beta = mx.sigmoid(b)
    expected = gated_delta_ops(q, k, v, compute_g_safe(A_log, a, dt_bias, -5.0), beta, state)
    actual = chunked_gated_delta(q, k, v, log_decay(A_log, a, dt_bias, -5.0), beta, state, chunk_tokens=32)
    for e, x in zip(expected, actual):
        _close(e, x)


def test_padded_tokens_leave_the_state_as_it_was():
    """Left padding (a batch's shorter row): the state after the padded prefix is the state the row
    would have with no padding at all."""
    q, k, v, a, b, A_log, dt_bias, state = _inputs(90)
    beta, log_g = mx.sigmoid(b), log_decay(A_log, a, dt_bias, None)
    mask = mx.array([[False] * 20 + [True] * 70, [True] * 90])
    _, padded = chunked_gated_delta(q, k, v, log_g, beta, state, mask, chunk_tokens=32)
    _, unpadded = chunked_gated_delta(q[:1, 20:], k[:1, 20:], v[:1, 20:], log_g[:1, 20:], beta[:1, 20:], state[:1])
    _close(unpadded[0], padded[0])
    _, expected = gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), beta, state, mask)
    _close(expected, padded)


def test_a_long_decay_does_not_underflow():
    """Strong decays over a long chunk: gamma underflows float32 as a product, not as a log."""
    q, k, v, a, b, A_log, dt_bias, state = _inputs(128)
    a = a + 30.0  # softplus(a) ~ 30: g ~ e^-30 per token
    beta = mx.sigmoid(b)
    expected = gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), beta, state)
    actual = chunked_gated_delta(q, k, v, log_decay(A_log, a, dt_bias, None), beta, state, chunk_tokens=64)
    assert not bool(mx.isnan(actual[0]).any()) and not bool(mx.isnan(actual[1]).any())
    for e, x in zip(expected, actual):
        _close(e, x)


LONG = "The ferry crossed the river at dawn while the committee argued about the bridge budget. " * 12


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_model_prefills_in_chunks_with_the_library_s_outputs(family, monkeypatch):
    path = built_model(BuildSpec(family, "tiny"))
    chunked = ModelRunner(path, CacheConfig(0, 0, 16, None), "fp")
    layers = [layer.linear_attn for layer in chunked.lm.layers if hasattr(layer, "linear_attn")]
    assert layers and all(any(c.__name__.startswith("Chunked") for c in type(m).__mro__) for m in layers)
    monkeypatch.setattr("gateway.engine.runner.install_chunked_prefill", lambda language_model: 0)
    library = ModelRunner(path, CacheConfig(0, 0, 16, None), "fp")  # the library's token-by-token recurrence
    prompt = chunked.prompts.build((Message("user", (TextPart(LONG),)),), [])
    assert prompt.num_tokens > 130  # several chunks of 64, and a partial one
    chunked_logits, chunked_tokens = logits_and_greedy_tokens(chunked, prompt)
    library_logits, library_tokens = logits_and_greedy_tokens(library, prompt)
    assert np.abs(chunked_logits - library_logits).max() <= 1e-4
    assert chunked_tokens == library_tokens and len(chunked_tokens) > 0


def test_a_mamba_model_s_scan_exponentials_on_numpy_give_the_library_s_outputs(monkeypatch):
    """Nemotron-H's Mamba-2 mixers run the library's chunked SSD scan with its exponentials (the
    decay matrix, the SiLU, the gated norm) on numpy: the same logits and greedy tokens as the
    library's own code, over more than one of the scan's 256-token steps."""
    path = built_model(BuildSpec("nemotron_h", "tiny"))
    numpy_exp = ModelRunner(path, CacheConfig(0, 0, 16, None), "fp")
    mixers = [layer.mixer for layer in numpy_exp.lm.layers if hasattr(layer.mixer, "A_log")]
    assert mixers and all(any(c.__name__.startswith("CpuSsd") for c in type(m).__mro__) for m in mixers)
    assert all(type(m.norm).__name__.startswith("CpuPrefill") for m in mixers)
    monkeypatch.setattr("gateway.engine.runner.install_cpu_ssd", lambda language_model: 0)
    library = ModelRunner(path, CacheConfig(0, 0, 16, None), "fp")
    prompt = numpy_exp.prompts.build((Message("user", (TextPart(LONG * 3),)),), [])
    assert prompt.num_tokens > 256
    ours_logits, ours_tokens = logits_and_greedy_tokens(numpy_exp, prompt)
    library_logits, library_tokens = logits_and_greedy_tokens(library, prompt)
    assert np.abs(ours_logits - library_logits).max() <= 1e-4
    assert ours_tokens == library_tokens and len(ours_tokens) > 0


@pytest.mark.parametrize(
    "options",
    [{}, {"allow_neg_eigval": True}, {"lower_bound": -5.0}, {"use_kernel": False, "allow_neg_eigval": True}],
)
def test_the_wrapper_honours_mlx_lm_s_options(options):
    from mlx_lm.models.gated_delta import gated_delta_update

    from gateway.engine.recurrent import _chunked_update

    q, k, v, a, b, A_log, dt_bias, state = _inputs(70)
    expected = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, **options)
    actual = _chunked_update(gated_delta_update)(q, k, v, a, b, A_log, dt_bias, state, None, **options)
    for e, x in zip(expected, actual):
        _close(e, x)


def test_the_wrapper_takes_mlx_vlm_s_options_by_position():
    from mlx_vlm.models.gated_delta import gated_delta_update

    from gateway.engine.recurrent import _chunked_update

    q, k, v, a, b, A_log, dt_bias, state = _inputs(70)
    expected = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, True, -5.0)
    actual = _chunked_update(gated_delta_update)(q, k, v, a, b, A_log, dt_bias, state, None, True, -5.0)
    for e, x in zip(expected, actual):
        _close(e, x)
