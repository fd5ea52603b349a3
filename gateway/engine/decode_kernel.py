"""The decode rows' attention in one C pass (decode_attention.c), built at first use; rows_kv.py
calls the same library's rows_attention(), and attention.py its causal_softmax() for prompt chunks.

    decode_attention(q, keys, values, scale, allowed) -> np.ndarray | None
        q (rows, heads, 1, head_dim); keys / values (rows, kv_heads, keys, head_dim) float32 views
        with unit stride along head_dim; allowed (rows, 1, 1, keys) booleans. None when the kernel
        is switched off or not available here (no C compiler, not Linux, a build that failed): the
        caller keeps its numpy path.
    build_decode_kernel() -> bool      builds (or finds) it now: the engine's warm-up calls it, so
                                       the first batch does not wait for the compiler
    use_decode_kernel(enabled)         switches it for the process (benchmarks measure both paths)

The shared library is compiled once per machine (gateway/engine/native.py). The compiler flags allow
reordering float sums (so the dot products vectorise) but keep infinities (the masked keys' -inf);
AVX2 and FMA are used where /proc/cpuinfo lists them (machines differ: nothing is assumed).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from functools import cache
from pathlib import Path

import numpy as np

from .native import built_library, cpu_flags
from .threads import split_rows

log = logging.getLogger("strata.engine")

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-fPIC", "-shared", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
LOG2E = 1.4426950408889634
_POINTER, _LONG = ctypes.c_void_p, ctypes.c_long


_switch = {"enabled": True}  # process-wide; only benchmarks turn it off


def use_decode_kernel(enabled: bool) -> None:
    _switch["enabled"] = enabled


def build_decode_kernel() -> bool:
    return _kernel() is not None


def decode_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, allowed: np.ndarray
) -> np.ndarray | None:
    kernel = _kernel() if _switch["enabled"] else None
    if kernel is None or not (_unit_stride(keys) and _unit_stride(values)):
        return None
    rows, heads, _, head_dim = q.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    q = np.ascontiguousarray(q, dtype=np.float32)
    visible = np.ascontiguousarray(allowed, dtype=np.bool_).view(np.uint8)  # numpy's bool is one byte, 0 or 1
    out = np.empty((rows, heads, 1, head_dim), dtype=np.float32)

    group = heads // kv_heads

    def attend(first: int, last: int, kv_first: int = 0, kv_last: int = kv_heads) -> None:
        """Rows [first, last), KV heads [kv_first, kv_last) with their query heads: each result
        depends on its own inputs only. A part of the KV heads is for one row alone (the kernel
        steps from row to row by `heads`)."""
        scores = np.empty((group, num_keys), dtype=np.float32)
        kernel(
            q[first:, kv_first * group :].ctypes.data,
            keys[first:, kv_first:].ctypes.data,
            values[first:, kv_first:].ctypes.data,
            visible[first:].ctypes.data,
            last - first,
            (kv_last - kv_first) * group,
            kv_last - kv_first,
            num_keys,
            head_dim,
            *_element_strides(keys),
            *_element_strides(values),
            scale * LOG2E,
            scores.ctypes.data,
            out[first:, kv_first * group :].ctypes.data,
        )

    if rows == 1:  # a lone row over a long context: its KV heads in parts
        split_rows(lambda kv_first, kv_last: attend(0, 1, kv_first, kv_last), kv_heads, heads * num_keys)
    else:
        split_rows(attend, rows, rows * heads * num_keys)
    return out


def _unit_stride(array: np.ndarray) -> bool:
    return array.dtype == np.float32 and array.ndim == 4 and array.strides[3] == 4


def _element_strides(array: np.ndarray) -> tuple[int, int, int]:
    return array.strides[0] // 4, array.strides[1] // 4, array.strides[2] // 4


@cache
def kernel_library() -> ctypes.CDLL | None:
    """decode_attention.c compiled (once per machine), or None (logged once) where it cannot be built."""
    try:
        return ctypes.CDLL(str(built_library(SOURCE, FLAGS + cpu_flags(), ("-lm",))))
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("decode attention kernels not available (%s): decode rows keep numpy and the library's cache", exc)
        return None


def kernel_function(name: str, argtypes: list):
    """The library's C function `name` with its argument types (it returns nothing), or None where
    the library cannot be built. Its callers keep what it returns (functools.cache)."""
    library = kernel_library()
    if library is None:
        return None
    function = getattr(library, name)
    function.restype = None
    function.argtypes = argtypes
    return function


@cache
def _kernel():
    """decode_attention() with its argument types, or None where the library cannot be built."""
    # q, keys, values, allowed; rows, heads, kv_heads, keys, head_dim; the keys' and the values'
    # strides; the scale; the scores' scratch, out
    return kernel_function("decode_attention", [*[_POINTER] * 4, *[_LONG] * 11, ctypes.c_float, _POINTER, _POINTER])


def causal_softmax_kernel():
    """causal_softmax() with its argument types, or None where the library cannot be built or the
    kernels are switched off (use_decode_kernel)."""
    return _causal_softmax() if _switch["enabled"] else None


@cache
def _causal_softmax():
    # scores; lines, keys, queries per block, the first query's visible keys, the window; sinks or
    # None; inverse sums
    return kernel_function("causal_softmax", [_POINTER, _LONG, _LONG, _LONG, _LONG, _LONG, _POINTER, _POINTER])
