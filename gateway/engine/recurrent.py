"""Gated-delta prefill in chunks, on backends without a fused kernel (the CPU here).

Qwen3.5 and Qwen3-Next run their linear-attention layers through mlx-vlm's `gated_delta_update`.
On a GPU that is one Metal kernel; anywhere else the library runs the recurrence one token at a time
(a compiled step per token per layer). This module computes the same recurrence a chunk of tokens at
a time with matrix products (the WY / UT-transform form of Gated DeltaNet, Yang et al. 2024).

The recurrence, per head, with state S (Dv x Dk), decay g_t in (0, 1], strength beta_t:
    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,        y_t = S_t q_t
Within a chunk, with gamma_t the decay accumulated since the chunk's start,
    S_t = gamma_t S_0 + sum_{j<=t} (gamma_t / gamma_j) u_j k_j^T
where the pseudo-values u solve the unit lower-triangular system
    (I + A) U = diag(beta) V - diag(beta gamma) K S_0^T,   A_tj = beta_t (gamma_t / gamma_j) k_t.k_j  (j < t)
so the outputs and the chunk's last state are products of (C x C) and (C x D) matrices:
    Y = diag(gamma) Q S_0^T + (Q K^T * Gamma_incl) U,      S_C = gamma_C S_0 + U^T diag(gamma_C / gamma) K.
Decays are carried as logarithms (cumulative sums of log g), so no product of many small factors
underflows. Equal to the step-by-step form within float32 rounding (tests/gateway/test_recurrent.py).
"""

from __future__ import annotations

import sys
import types
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .activations import NN, cpu_mlp_class
from .attention import as_numpy, rebound, swap_layer_classes, with_globals

# Tokens per chunk: the triangular solve and the (C x C) products grow with C^2, the per-chunk
# calls with T / C. Measured on the demo Qwen3.5 (8 heads of 64): see docs/engine.md.
CHUNK_TOKENS = 64


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array, lower_bound: float | None) -> mx.array:
    """log g of mlx-vlm's compute_g / compute_g_safe, without the exp (no underflow to log 0)."""
    rate = mx.exp(A_log.astype(mx.float32))
    if lower_bound is None:
        return -rate * nn.softplus(a.astype(mx.float32) + dt_bias)
    return lower_bound * mx.sigmoid(rate * (a.astype(mx.float32) + dt_bias))


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[mx.array, mx.array]:
    """The gated-delta recurrence over T tokens. q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv);
    log_g, beta: (B, T, Hv) (a scalar decay per head); state: (B, Hv, Dv, Dk); mask: (B, T), False
    at padding (its tokens leave the state as it was). Returns y (B, T, Hv, Dv) in q's dtype and the
    final state (float32)."""
    num_v_heads = v.shape[2]
    if (repeat := num_v_heads // q.shape[2]) > 1:
        q, k = mx.repeat(q, repeat, 2), mx.repeat(k, repeat, 2)
    if mask is not None:  # a padded token: decay 1 (log 0), strength 0
        log_g, beta = log_g * mask[..., None], beta * mask[..., None]
    heads_first = [x.astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k, v)]  # (B, H, T, D)
    log_g, beta = (x.astype(mx.float32).transpose(0, 2, 1) for x in (log_g, beta))  # (B, H, T)
    state = state.astype(mx.float32)
    outputs = []
    for start in range(0, q.shape[1], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        chunk_q, chunk_k, chunk_v = (x[:, :, part] for x in heads_first)
        y, state = _chunk(chunk_q, chunk_k, chunk_v, log_g[:, :, part], beta[:, :, part], state)
        outputs.append(y)
    y = mx.concatenate(outputs, axis=2) if len(outputs) > 1 else outputs[0]
    return y.transpose(0, 2, 1, 3).astype(q.dtype), state


def _chunk(q, k, v, log_g, beta, state):
    """One chunk: q, k (B, H, C, Dk), v (B, H, C, Dv), log_g and beta (B, H, C), state (B, H, Dv, Dk)."""
    size = q.shape[2]
    cumulative = mx.cumsum(log_g, axis=-1)  # log gamma_t
    below = mx.tril(mx.ones((size, size), dtype=mx.bool_))  # j <= t
    # Gamma_tj = gamma_t / gamma_j where j <= t, else 0 (the exponent masked to -inf first: no overflow)
    gaps = cumulative[..., :, None] - cumulative[..., None, :]
    ratio = mx.exp(mx.where(below, gaps, -mx.inf))
    key_products = k @ k.swapaxes(-1, -2)
    strictly = ratio * mx.tril(mx.ones((size, size)), k=-1)
    unit_lower = mx.eye(size) + beta[..., None] * key_products * strictly  # I + A
    inverse = mx.linalg.tri_inv(unit_lower, upper=False, stream=mx.cpu)
    gamma = mx.exp(cumulative)
    weights = inverse @ ((beta * gamma)[..., None] * k)  # W: (B, H, C, Dk)
    state_t = state.swapaxes(-1, -2)  # S_0^T: (B, H, Dk, Dv)
    pseudo = inverse @ (beta[..., None] * v) - weights @ state_t  # U: (B, H, C, Dv)
    y = gamma[..., None] * (q @ state_t) + ((q @ k.swapaxes(-1, -2)) * ratio) @ pseudo
    to_end = mx.exp(cumulative[..., -1:] - cumulative)  # gamma_C / gamma_j
    state = gamma[..., -1, None, None] * state + pseudo.swapaxes(-1, -2) @ (to_end[..., None] * k)
    return y, state


def install_chunked_prefill(language_model) -> int:
    """Give each gated-delta layer of this model instance the chunked prefill, where the library
    would run the recurrence token by token (no Metal). Returns how many layers were swapped."""
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        return 0  # the library's fused kernel
    return swap_layer_classes(language_model, "linear_attn", _chunked_class)


@cache
def _chunked_class(base: type) -> type | None:
    original = sys.modules[base.__module__].__dict__.get(UPDATE)
    if original is None:
        return None
    return with_globals(base, f"Chunked{base.__name__}", {UPDATE: _chunked_update(original)})


UPDATE = "gated_delta_update"


# The keyword options of mlx-vlm's and mlx-lm's gated_delta_update (mlx-vlm's may come by position,
# after `mask`, in this order). A call with any other option is the library's own.
OPTIONS = ("use_kernel", "lower_bound", "state_steps", "cache", "cache_index")
KNOWN = frozenset(OPTIONS) | {"allow_neg_eigval"}


def _chunked_update(original):
    def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *args, **kwargs):
        """The library's gated_delta_update, with prompt chunks (more than one token, a scalar decay
        per head, no speculative history asked for) computed in chunks; everything else is the library's."""
        options = dict(zip(OPTIONS, args)) | kwargs
        if q.shape[1] == 1 or a.ndim != 3 or options.get("state_steps") is not None or not options.keys() <= KNOWN:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, *args, **kwargs)
        cache = options.pop("cache", None)
        if cache is not None:  # mlx-vlm's cache owns the state (and says whether it keeps a history)
            rest = {key: value for key, value in options.items() if key not in ("cache_index", "state_steps")}
            return cache.update_recurrent(
                options.get("cache_index", 1),
                q.shape[1],
                lambda initial, steps: gated_delta_update(
                    q, k, v, a, b, A_log, dt_bias, initial, mask, **rest, state_steps=steps
                ),
            )
        if state is None:
            state = mx.zeros((q.shape[0], v.shape[2], v.shape[3], k.shape[3]), dtype=mx.float32)
        beta = mx.sigmoid(b) * (2.0 if options.get("allow_neg_eigval") else 1.0)  # mlx-lm's option: beta in [0, 2]
        log_g = log_decay(A_log, a, dt_bias, options.get("lower_bound"))
        return chunked_gated_delta(q, k, v, log_g, beta, state, mask)

    return gated_delta_update


# -- Mamba-2 (Nemotron-H): the libraries' chunked SSD scan, its exponentials on numpy ----------------
#
# mlx-vlm's Mamba-2 mixer already prefills in the chunked SSD form (`ssm_attn`, 256-token steps),
# but each step takes exp() of a (heads, 256, 256) decay matrix, and MLX's CPU `exp` is scalar (~12
# ns an element): 6.1 ms a layer for 256 tokens of the demo model's 8 heads, 0.4 ms through numpy.
# The mixer's SiLU (of the convolution's output) and its gated norm's SwiGLU are exponentials too.
# So each Mamba-2 mixer of this instance runs the library's own code with `ssm_attn`'s `mx.exp`, the
# convolution's `nn.silu` and the norm's `swiglu` bound to numpy versions for arrays of at least
# NUMPY_EXP_FROM elements (a decode row's few stay on MLX).
NUMPY_EXP_FROM = 1 << 14


def _exp(x: mx.array) -> mx.array:
    if x.size < NUMPY_EXP_FROM:
        return mx.exp(x)
    (values,) = as_numpy(x)
    with np.errstate(over="ignore"):  # exp of a large value is inf, as MLX's
        return mx.array(np.exp(values)).astype(x.dtype)


MX = types.ModuleType("mlx.core (numpy exp)")
MX.__dict__.update(mx.__dict__)
MX.__dict__.update(exp=_exp)


def install_cpu_ssd(language_model) -> int:
    """Give each Mamba-2 mixer of this model instance (and its gated norm) the numpy exponentials
    for prompt chunks, on the CPU. Returns how many mixers were swapped."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    swapped = 0
    for layer in language_model.layers:
        mixer = getattr(layer, "mixer", None)
        kind: type = type(mixer)
        if (cpu := _ssd_class(kind)) is None:
            continue  # Nemotron-H's attention and MLP "mixers", or another family's layers (no mixer)
        mixer.__class__ = cpu
        if (norm := getattr(mixer, "norm", None)) is not None:
            norm_kind: type = type(norm)
            norm.__class__ = cpu_mlp_class(norm_kind) or norm_kind
        swapped += 1
    return swapped


@cache
def _ssd_class(base: type) -> type | None:
    ssm_update = getattr(getattr(base, "_ssm", None), "__globals__", {}).get("ssm_update")
    if ssm_update is None or "ssm_attn" not in ssm_update.__globals__:
        return None  # not mlx-vlm's Mamba-2 mixer
    scan = rebound(ssm_update.__globals__["ssm_attn"], {"mx": MX})
    update = rebound(ssm_update, {"ssm_attn": scan}) if scan is not None else None
    if update is None:
        return None  # a scan that takes no exponential by that name: the library's own
    return with_globals(base, f"CpuSsd{base.__name__}", {"ssm_update": update, "nn": NN}, methods=("_ssm", "_conv"))
