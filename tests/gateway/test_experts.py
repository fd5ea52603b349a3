"""Expert layers that multiply per expert (gateway/engine/experts.py) give the library's outputs: the
layers alone (both libraries' SwitchGLU and SwitchMLP, with biases, quantised, with mlx-vlm's routing
weights and shared experts) and through the tiny MoE models, greedy tokens included."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.switch_layers as lm_switch
import mlx_vlm.models.switch_layers as vlm_switch
import numpy as np
import pytest

from gateway.checkpoints import BuildSpec
from gateway.engine import Message, TextPart
from gateway.engine.caching import CacheConfig
from gateway.engine.experts import SORT_FROM, install_grouped_experts
from gateway.engine.runner import ModelRunner
from tests.conftest import built_model, logits_and_greedy_tokens

NUM_EXPERTS, TOP_K = 4, 2


def _routed(num_tokens: int, rows: int = 1, seed: int = 0) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    x = mx.random.normal((rows, num_tokens, 64))
    scores = mx.random.normal((rows, num_tokens, NUM_EXPERTS))
    indices = mx.argsort(-scores, axis=-1)[..., :TOP_K].astype(mx.uint32)
    return x, indices


def _grouped_copy(layer: nn.Module) -> nn.Module:
    grouped = copy.deepcopy(layer)
    assert install_grouped_experts(grouped) >= 2  # the layer and its projections
    assert type(grouped).__name__.startswith("Grouped")
    return grouped


def _layers(library, quantised: bool) -> list[nn.Module]:
    mx.random.seed(1)
    layers = [
        library.SwitchGLU(64, 96, NUM_EXPERTS, bias=True),
        library.SwitchGLU(64, 96, NUM_EXPERTS),
        library.SwitchMLP(64, 96, NUM_EXPERTS, bias=True),
    ]
    for layer in layers:  # biases start at zero: make them count
        layer.update(
            {
                name: {"bias": mx.random.normal(projection.bias.shape)}
                for name, projection in layer.children().items()
                if "bias" in projection
            }
        )
        if quantised:
            nn.quantize(layer, group_size=32, bits=4)
        layer.eval()  # as a loaded model is: mlx-vlm's exact short-chunk path is taken only then
    return layers


@pytest.mark.parametrize("library", [lm_switch, vlm_switch], ids=["mlx_lm", "mlx_vlm"])
@pytest.mark.parametrize("quantised", [False, True], ids=["float", "4-bit"])
@pytest.mark.parametrize("num_tokens, rows", [(413, 1), (40, 1), (1, 16), (1, 3), (12, 2)])
def test_per_expert_products_equal_the_library_s_layers(library, quantised, num_tokens, rows):
    x, indices = _routed(num_tokens, rows)
    for layer in _layers(library, quantised):
        expected = layer(x, indices)
        got = _grouped_copy(layer)(x, indices)
        assert got.shape == expected.shape
        assert np.abs(np.array(got) - np.array(expected)).max() <= 1e-4 * max(1.0, float(mx.abs(expected).max()))


def test_mlx_vlm_s_routing_weights_and_shared_experts_are_combined_as_the_library_does():
    layer = _layers(vlm_switch, False)[0]
    x, indices = _routed(100)
    weights = mx.softmax(mx.random.normal(indices.shape), axis=-1)
    shared = mx.random.normal((1, 100, 64))
    expected = layer(x, indices, weights, shared=shared)
    got = _grouped_copy(layer)(x, indices, weights, shared=shared)
    assert got.shape == (1, 100, 64)
    assert np.abs(np.array(got) - np.array(expected)).max() <= 1e-4


def test_a_lone_decode_row_and_mlx_vlm_s_exact_short_chunks_keep_the_library_s_call(monkeypatch):
    layer = _layers(vlm_switch, False)[0]
    grouped = _grouped_copy(layer)
    sorted_calls = []
    original = vlm_switch._gather_sort
    monkeypatch.setattr(vlm_switch, "_gather_sort", lambda *a: sorted_calls.append(a) or original(*a))
    x, indices = _routed(1)  # 2 pairs
    assert indices.size < SORT_FROM
    grouped(x, indices)
    x, indices = _routed(vlm_switch.DECODE_BLOCK_SIZE, rows=4)  # a verify call: mlx-vlm's exact path
    grouped(x, indices)
    assert sorted_calls == []
    grouped(*_routed(100))
    assert len(sorted_calls) == 1


LONG = (
    "Routing tokens to experts: each token picks its top two experts, the router's softmax weighs "
    "their outputs, and the sum goes back into the residual stream. Describe the balance of load "
    "across experts when prompts are long and repetitive, and what happens to rare tokens. " * 3
)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5_moe", "qwen3_next"])
def test_a_mixture_of_experts_model_keeps_the_library_s_outputs(family, monkeypatch):
    path = built_model(BuildSpec(family, "tiny"))
    grouped = ModelRunner(path, CacheConfig(0, 0, 16, None), "fp")
    names = {type(module).__name__ for module in grouped.lm.modules()}
    assert {"GroupedSwitchGLU", "GroupedSwitchLinear"} <= names
    assert names & {"CpuSwiGLU", "CpuSwigluOAI"}  # the experts' activations on numpy as well
    monkeypatch.setattr("gateway.engine.runner.install_grouped_experts", lambda language_model: 0)
    monkeypatch.setattr("gateway.engine.runner.install_cpu_expert_activations", lambda language_model: 0)
    library = ModelRunner(path, CacheConfig(0, 0, 16, None), "fp")
    library_names = {type(m).__name__ for m in library.lm.modules()}
    assert not any(name.startswith(("Grouped", "CpuSwiGLU", "CpuSwigluOAI")) for name in library_names)
    prompt = grouped.prompts.build((Message("user", (TextPart(LONG),)),), [])
    assert prompt.num_tokens > 100
    grouped_logits, grouped_tokens = logits_and_greedy_tokens(grouped, prompt)
    library_logits, library_tokens = logits_and_greedy_tokens(library, prompt)
    assert np.abs(grouped_logits - library_logits).max() <= 1e-3
    assert grouped_tokens == library_tokens and len(grouped_tokens) > 0
