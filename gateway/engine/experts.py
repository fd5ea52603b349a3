"""A mixture of experts' matmuls on the CPU, one matrix product per expert.

mlx-lm's and mlx-vlm's expert layers (`SwitchGLU`, `SwitchMLP`) route each token to k experts and
run every expert projection as one `gather_mm` (`gather_qmm` when quantised). MLX's CPU `gather_mm`
computes each (token, expert) pair as its own matrix-vector product, so an expert's weights are read
once per token: on the demo gpt-oss (4 experts, top 2, 512 -> 1376) one projection of a 413-token
chunk took 96 ms against 5.8 ms as one product per expert, and a decode batch of 16 rows 3.9 against
2.0 ms (`docs/engine.md`). So here the (token, expert) pairs are sorted by expert (the library's own
`_gather_sort`, which it already uses from 64 pairs on) and each expert multiplies its contiguous
rows at once. The sums are the same products in another order. A lone decode row (fewer than
SORT_FROM pairs), mlx-vlm's exact path for 2-8 token chunks (drafts verified) and nvfp4 weights with
a global scale keep the library's call; on a GPU nothing changes.
"""

from __future__ import annotations

import sys
from functools import cache

import mlx.core as mx
import numpy as np

# (token, expert) pairs from which the expert layer sorts them and multiplies per expert: a lone
# decode row's 1-8 pairs cost more to sort and split (0.9 ms) than to gather (0.3 ms)
SORT_FROM = 16


def install_grouped_experts(language_model) -> int:
    """Give this model instance's expert layers and their projections the per-expert products.
    Returns how many modules were swapped (0 on a GPU, or with no experts)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    swapped = 0
    for module in language_model.modules():
        base: type = type(module)
        grouped = _grouped_class(base)
        if grouped is not None:
            module.__class__ = grouped
            swapped += 1
    return swapped


@cache
def _grouped_class(base: type) -> type | None:
    if not base.__module__.endswith(".switch_layers"):
        return None
    if base.__name__ in ("SwitchLinear", "QuantizedSwitchLinear"):
        return type(f"Grouped{base.__name__}", (base,), {"__call__": _grouped_projection(base)})
    if base.__name__ in ("SwitchGLU", "SwitchMLP"):
        return type(f"Grouped{base.__name__}", (base,), {"__call__": _sorted_experts(base)})
    return None


def _sorted_experts(base: type):
    library = sys.modules[base.__module__]
    # mlx-vlm runs chunks of 2..DECODE_BLOCK_SIZE tokens token by token, so that a verified draft
    # sees the very sums decoding would (mlx-lm has no such path)
    exact_up_to = getattr(library, "DECODE_BLOCK_SIZE", 0)

    def __call__(self, x: mx.array, indices: mx.array, *args, **kwargs) -> mx.array:
        """The library's SwitchGLU / SwitchMLP call, sorting the pairs by expert from SORT_FROM on;
        mlx-vlm's routing weights, shared experts and residual are combined by its own `_combine`."""
        if indices.size < SORT_FROM or (not self.training and x.ndim == 3 and 1 < x.shape[1] <= exact_up_to):
            return base.__call__(self, x, indices, *args, **kwargs)
        rows, order, inverse = library._gather_sort(mx.expand_dims(x, (-2, -3)), indices)
        if hasattr(self, "fc1"):  # SwitchMLP
            out = self.fc2(self.activation(self.fc1(rows, order, sorted_indices=True)), order, sorted_indices=True)
        else:
            up = self.up_proj(rows, order, sorted_indices=True)
            gate = self.gate_proj(rows, order, sorted_indices=True)
            out = self.down_proj(self.activation(up, gate), order, sorted_indices=True)
        routed = library._scatter_unsort(out, inverse, indices.shape).squeeze(-2)
        return self._combine(routed, *_combining(*args, **kwargs)) if hasattr(base, "_combine") else routed

    return __call__


def _combining(weights=None, shared=None, residual=None) -> tuple:
    """mlx-vlm's SwitchGLU arguments after the indices, with its defaults, for its `_combine`."""
    return weights, shared, residual


def _grouped_projection(base: type):
    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (pairs, 1, in) sorted by expert as `indices` (pairs,) says: each expert's rows in one product."""
        if not sorted_indices or getattr(self, "global_scale", None) is not None:
            return base.__call__(self, x, indices, sorted_indices)
        rows = x.reshape(-1, x.shape[-1])
        counts = np.bincount(np.array(indices).reshape(-1), minlength=self.num_experts)
        parts, start = [], 0
        for expert in np.flatnonzero(counts):
            end = start + int(counts[expert])
            parts.append(_expert_product(self, rows[start:end], int(expert)))
            start = end
        out = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return __call__


def _expert_product(layer, rows: mx.array, expert: int) -> mx.array:
    if "scales" in layer:  # QuantizedSwitchLinear
        biases = layer.get("biases")
        out = mx.quantized_matmul(
            rows,
            layer["weight"][expert],
            layer["scales"][expert],
            None if biases is None else biases[expert],
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
        )
    else:
        out = rows @ layer["weight"][expert].T
    return out + layer["bias"][expert] if "bias" in layer else out
