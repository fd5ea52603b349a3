"""Optional quantisation of stored KV blocks (RAM and SSD): MLX affine quantisation per group.

A block's per-layer keys and values are each either an mx.array (full precision) or a Quantized
triple. Only blocks whose end lies at least `min_tokens` deep are quantised: short prompts keep
full precision, long shared prefixes (where bytes matter) shrink 3.5x (8-bit) or 6x (4-bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, slots=True)
class QuantConfig:
    bits: int  # 8 or 4
    group_size: int = 32
    min_tokens: int = 1024

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError("KV quantisation supports 8 or 4 bits")


@dataclass(frozen=True, slots=True)
class Quantized:
    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + self.biases.nbytes


def quantize(x: mx.array, config: QuantConfig) -> Quantized:
    data, scales, biases = mx.quantize(x, group_size=config.group_size, bits=config.bits)
    return Quantized(data, scales, biases, config.bits, config.group_size)


def restore(x) -> mx.array:
    if isinstance(x, Quantized):
        return mx.dequantize(x.data, x.scales, x.biases, group_size=x.group_size, bits=x.bits)
    return x


STATE_PREFIX = "state."  # a recurrent-state snapshot's tensors: "state.<layer>.<array>"


def to_tensors(kv: tuple, state: tuple = ()) -> dict[str, np.ndarray]:
    """A block's per-layer (keys, values), and its recurrent-state snapshot if it has one (per
    recurrent layer, that layer's arrays), as named numpy tensors for a safetensors file. numpy has
    no bfloat16: such a tensor is stored as its raw 16-bit words under the name + BF16_SUFFIX."""
    tensors = {}
    for layer, arrays in enumerate(state):
        for index, array in enumerate(arrays):
            tensors.update(_numpy(f"{STATE_PREFIX}{layer}.{index}", array))
    for layer, pair in enumerate(kv):
        for name, value in zip(("k", "v"), pair):
            if isinstance(value, Quantized):
                for part, array in (("q", value.data), ("s", value.scales), ("b", value.biases)):
                    tensors.update(_numpy(f"{layer}.{name}.{part}", array))
            else:
                tensors.update(_numpy(f"{layer}.{name}", value))
    return tensors


def from_tensors(tensors: dict[str, np.ndarray], config: QuantConfig | None) -> tuple:
    """The per-layer (keys, values) of to_tensors() (a snapshot's tensors are left to state_from_tensors)."""
    num_layers = 1 + max(int(name.split(".")[0]) for name in tensors if not name.startswith(STATE_PREFIX))
    layers = []
    for layer in range(num_layers):
        layers.append(tuple(_load_one(tensors, f"{layer}.{name}", config) for name in ("k", "v")))
    return tuple(layers)


def state_from_tensors(tensors: dict[str, np.ndarray]) -> tuple:
    """The recurrent-state snapshot of to_tensors(): per layer, its arrays in order; () without one.
    Snapshots are never quantised (a recurrent state compounds every rounding into what follows)."""
    names = [name.removesuffix(BF16_SUFFIX) for name in tensors if name.startswith(STATE_PREFIX)]
    shape: dict[int, int] = {}
    for name in names:
        layer, index = (int(part) for part in name[len(STATE_PREFIX) :].split("."))
        shape[layer] = max(shape.get(layer, 0), index + 1)
    return tuple(
        tuple(_required(tensors, f"{STATE_PREFIX}{layer}.{index}") for index in range(shape[layer]))
        for layer in range(len(shape))
    )


BF16_SUFFIX = "@bf16"


def _numpy(name: str, array: mx.array) -> dict[str, np.ndarray]:
    if array.dtype == mx.bfloat16:
        return {name + BF16_SUFFIX: np.array(array.view(mx.uint16))}
    return {name: np.array(array)}


def _mlx(tensors: dict[str, np.ndarray], name: str) -> mx.array | None:
    if name in tensors:
        return mx.array(tensors[name])
    if name + BF16_SUFFIX in tensors:
        return mx.array(tensors[name + BF16_SUFFIX]).view(mx.bfloat16)
    return None


def _required(tensors: dict[str, np.ndarray], name: str) -> mx.array:
    array = _mlx(tensors, name)
    if array is None:
        raise KeyError(f"{name} is missing from the block's tensors")
    return array


def _load_one(tensors: dict[str, np.ndarray], name: str, config: QuantConfig | None):
    full = _mlx(tensors, name)
    if full is not None:
        return full
    assert config is not None, f"{name} is quantised but this cache is not"
    return Quantized(
        _required(tensors, name + ".q"),
        _required(tensors, name + ".s"),
        _required(tensors, name + ".b"),
        config.bits,
        config.group_size,
    )
