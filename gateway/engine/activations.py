"""MLP activations of prompt chunks on the CPU, through numpy: MLX's CPU `exp` is scalar.

SiLU and tanh-GELU are built on the exponential, which MLX's CPU backend computes one element at a
time (~13 ns each here); numpy's float32 `exp` is vectorised (~1 ns). On the demo model a 277-token
prefill spent 25 of its 76 ms in `silu(gate) * up` (6.2 ms a layer; 1.7 ms through numpy). So for
prompt chunks and a batch's decode rows (more than one token in all) the MLP's activation runs on
numpy; a lone decode row keeps MLX's own, as does everything on a GPU.

A mixture of experts' activation module (the libraries' `SwiGLU`, mlx-lm's gpt-oss `SwigluOAI`)
gets the same, from EXPERT_ROWS_FROM (token, expert) rows on (install_cpu_expert_activations).

Every family's MLP calls its activation by a module-level name: mlx-lm's and mlx-vlm's compiled
`swiglu(gate, up)`, Gemma 4's `geglu(gate, up)`, or `nn.silu` / `nn.gelu_approx`. Each MLP of this
model instance gets a subclass whose `__call__` is the same code with those names bound to the
functions below (the technique of gateway/engine/attention.py). A prompt's tokens are always
prefilled (the last one is recomputed even on a full cache hit), so a token's activations come from
the same path warm or cold.
"""

from __future__ import annotations

import copy
import math
import sys
import types
from functools import cache

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np

from .attention import as_numpy, swap_layer_classes, with_globals


def _is_chunk(x: mx.array) -> bool:
    """More than one token in all: a prompt chunk, or a batch's decode rows (a lone decode row keeps
    MLX's own: one token's activations cost less than the trip to numpy)."""
    return x.ndim >= 2 and x.size > x.shape[-1]


# (token, expert) rows from which an expert activation runs on numpy: a decode row's top-k pairs
# (2-8 in the families here) stay on MLX, a 16-row decode batch's pairs or a prompt chunk's go
EXPERT_ROWS_FROM = 16


def _is_expert_chunk(x: mx.array) -> bool:
    """An expert layer's rows are (token, expert) pairs: a lone decode row's few (its top k) keep
    MLX's own, as a dense MLP's one row does."""
    return x.size >= EXPERT_ROWS_FROM * x.shape[-1]


def _numpy(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))  # a copy numpy owns and may overwrite (numpy has no bfloat16)


def _sigmoid_times(scaled: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x * sigmoid(scaled), overwriting `scaled`."""
    np.negative(scaled, out=scaled)
    with np.errstate(over="ignore"):  # exp(large) is inf: x / inf is the 0 wanted
        np.exp(scaled, out=scaled)
    scaled += 1
    np.divide(x, scaled, out=scaled)
    return scaled


def _silu(values: np.ndarray) -> np.ndarray:
    """x * sigmoid(x); a new array."""
    return _sigmoid_times(values.copy(), values)


def silu(x: mx.array) -> mx.array:
    if not _is_chunk(x):
        return mlx_nn.silu(x)
    return mx.array(_silu(_numpy(x))).astype(x.dtype)


def gelu_approx(x: mx.array) -> mx.array:
    if not _is_chunk(x):
        return mlx_nn.gelu_approx(x)
    return mx.array(_gelu_approx(_numpy(x))).astype(x.dtype)


def _gelu_approx(values: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(z)) == x * sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3); a new array."""
    doubled = values * values
    doubled *= np.float32(0.044715)
    doubled += 1
    doubled *= values
    doubled *= np.float32(2 * math.sqrt(2 / math.pi))
    return _sigmoid_times(doubled, values)


def _cpu_gated(original, activation, is_chunk=_is_chunk):
    """The library's `original(gate, x)` == activation(gate) * x, with chunks through numpy
    (`activation` takes the gate's values and returns a new array)."""

    def gated(gate: mx.array, x: mx.array) -> mx.array:
        if not is_chunk(gate):
            return original(gate, x)
        gate_values, up = as_numpy(gate, x)  # both products in one evaluation
        out = activation(gate_values)
        out *= up
        return mx.array(out).astype(x.dtype)

    return gated


def _cpu_swiglu(original, is_chunk=_is_chunk):
    return _cpu_gated(original, _silu, is_chunk)


def _cpu_geglu(original):
    """Gemma 4's MLP: geglu(gate, x) == gelu_approx(gate) * x."""
    return _cpu_gated(original, _gelu_approx)


def _cpu_swiglu_oai(original):
    def swiglu_oai(gate: mx.array, x: mx.array, alpha: float = 1.702, limit: float = 7.0) -> mx.array:
        """gpt-oss's: (clip(x, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
        if not _is_expert_chunk(gate):
            return original(gate, x, alpha=alpha, limit=limit)
        clipped = np.minimum(_numpy(gate), np.float32(limit))
        out = _sigmoid_times(clipped * np.float32(alpha), clipped)
        linear = np.clip(_numpy(x), -limit, limit)
        linear += 1
        out *= linear
        return mx.array(out).astype(x.dtype)

    return swiglu_oai


NN = types.ModuleType("mlx.nn (CPU prefill activations)")
NN.__dict__.update(mlx_nn.__dict__)
NN.__dict__.update(silu=silu, gelu_approx=gelu_approx)


def install_cpu_prefill_activations(language_model) -> int:
    """Give each MLP of this model instance the numpy activations for prompt chunks. Returns how
    many MLPs were swapped (0 on a GPU, or for MLPs that name no activation we know)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    # LFM2 names its MLP "feed_forward"
    return sum(swap_layer_classes(language_model, name, cpu_mlp_class) for name in ("mlp", "feed_forward"))


def install_cpu_expert_activations(language_model) -> int:
    """The same for the activation modules of a mixture of experts' layers (the libraries' `SwiGLU`
    and mlx-lm's gpt-oss `SwigluOAI`), which get the experts' sorted rows. Returns how many."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    swapped = 0
    for module in language_model.modules():
        activation = getattr(module, "activation", None)
        cpu = _cpu_activation_class(type(activation)) if isinstance(activation, mlx_nn.Module) else None
        if cpu is not None:  # on a copy: the libraries' default `activation=SwiGLU()` is one shared instance
            own = copy.copy(activation)
            own.__class__ = cpu
            module.activation = own
            swapped += 1
    return swapped


@cache
def _cpu_activation_class(base: type) -> type | None:
    module = sys.modules[base.__module__].__dict__
    if base.__name__ == "SwiGLU" and base.__module__.endswith(".switch_layers"):
        return with_globals(base, "CpuSwiGLU", {"swiglu": _cpu_swiglu(module["swiglu"], _is_expert_chunk)})
    if base.__name__ == "SwigluOAI" and "swiglu_oai" in module:
        return with_globals(base, "CpuSwigluOAI", {"swiglu_oai": _cpu_swiglu_oai(module["swiglu_oai"])})
    return None


@cache
def cpu_mlp_class(base: type) -> type | None:
    module = sys.modules[base.__module__].__dict__
    replacements = {"nn": NN}
    if "swiglu" in module:
        replacements["swiglu"] = _cpu_swiglu(module["swiglu"])
    if "geglu" in module:  # Gemma 4's MLP calls its module's geglu(gate, x)
        replacements["geglu"] = _cpu_geglu(module["geglu"])
    return with_globals(base, f"CpuPrefill{base.__name__}", replacements)
