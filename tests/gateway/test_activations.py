"""The numpy activations for prompt chunks equal MLX's own; decode steps keep MLX's."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from gateway.engine import activations


@pytest.fixture
def chunk():
    return mx.random.normal((1, 37, 96), key=mx.random.key(3)) * 6  # tails where exp overflows in float32


@pytest.mark.parametrize("ours, theirs", [(activations.silu, nn.silu), (activations.gelu_approx, nn.gelu_approx)])
def test_chunk_activations_equal_mlx(chunk, ours, theirs):
    np.testing.assert_allclose(np.array(ours(chunk)), np.array(theirs(chunk)), rtol=2e-6, atol=2e-6)


def test_swiglu_equals_the_library_one_and_keeps_the_dtype(chunk):
    from mlx_lm.models.activations import swiglu

    up = mx.random.normal(chunk.shape, key=mx.random.key(4))
    cpu = activations._cpu_swiglu(swiglu)
    np.testing.assert_allclose(np.array(cpu(chunk, up)), np.array(swiglu(chunk, up)), rtol=2e-6, atol=2e-6)
    half = cpu(chunk.astype(mx.bfloat16), up.astype(mx.bfloat16))
    assert half.dtype == mx.bfloat16


def test_gemma4_s_geglu_equals_the_library_one_and_keeps_the_dtype(chunk):
    from mlx_vlm.models.gemma4.language import geglu

    up = mx.random.normal(chunk.shape, key=mx.random.key(5))
    cpu = activations._cpu_geglu(geglu)
    np.testing.assert_allclose(np.array(cpu(chunk, up)), np.array(geglu(chunk, up)), rtol=2e-6, atol=2e-5)
    assert cpu(chunk.astype(mx.bfloat16), up.astype(mx.bfloat16)).dtype == mx.bfloat16
    row = chunk[:, :1]  # a lone decode row keeps the library's
    assert mx.array_equal(cpu(row, up[:, :1]), geglu(row, up[:, :1]))


def test_huge_negative_inputs_give_zero_not_nan():
    x = mx.array([[[-1e4, -100.0, 0.0, 100.0]] * 2])
    assert np.array(activations.silu(x)).tolist()[0][0] == [
        0.0,
        pytest.approx(-100 * np.exp(-100.0), abs=1e-30),
        0.0,
        100.0,
    ]


def test_a_lone_decode_row_keeps_mlx_s_own_and_a_batch_s_rows_take_numpy(monkeypatch):
    calls = []
    real = activations._sigmoid_times
    monkeypatch.setattr(activations, "_sigmoid_times", lambda *args: calls.append(1) or real(*args))
    one_token = mx.random.normal((1, 1, 96), key=mx.random.key(5))
    assert mx.array_equal(activations.silu(one_token), nn.silu(one_token))
    assert not calls
    rows = mx.random.normal((4, 1, 96), key=mx.random.key(6))  # four decode rows, one token each
    assert mx.allclose(activations.silu(rows), nn.silu(rows), atol=1e-6)
    assert calls == [1]


@pytest.mark.parametrize("alpha, limit", [(1.702, 7.0), (1.0, 3.0)])
def test_gpt_oss_s_clamped_swiglu_equals_the_library_one(chunk, alpha, limit):
    from mlx_lm.models.activations import swiglu_oai

    up = mx.random.normal(chunk.shape, key=mx.random.key(6)) * 6  # past the clamp on both sides
    cpu = activations._cpu_swiglu_oai(swiglu_oai)
    expected = swiglu_oai(chunk, up, alpha=alpha, limit=limit)
    np.testing.assert_allclose(np.array(cpu(chunk, up, alpha, limit)), np.array(expected), rtol=2e-6, atol=2e-5)
    assert cpu(chunk.astype(mx.bfloat16), up.astype(mx.bfloat16)).dtype == mx.bfloat16


def test_a_mixture_of_experts_activation_modules_take_numpy():
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwitchGLU

    model = nn.Sequential(SwitchGLU(32, 48, 4), SwitchGLU(32, 48, 4, activation=SwigluOAI()))
    expected = [layer.activation(mx.ones((5, 1, 48)), mx.full((5, 1, 48), 9.0)) for layer in model.layers]
    assert activations.install_cpu_expert_activations(model) == 2
    assert [type(layer.activation).__name__ for layer in model.layers] == ["CpuSwiGLU", "CpuSwigluOAI"]
    got = [layer.activation(mx.ones((5, 1, 48)), mx.full((5, 1, 48), 9.0)) for layer in model.layers]
    for ours, theirs in zip(got, expected):
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=2e-6)
    assert type(SwitchGLU(8, 8, 2).activation).__name__ == "SwiGLU"  # the libraries' shared default is untouched
