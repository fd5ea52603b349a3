"""Prefill attention for MLX on the CPU, through numpy: ~4x faster than mx.fast's kernel here.

On the CPU, prefill attention is bound by the softmax's exponential, not by the matmuls (measured
here: 920 ms of a 2048-token, 8-head attention is softmax, 155 ms the matmuls).
MLX's CPU `exp` runs ~12 ns per element; numpy's vectorised `exp2` ~1 ns. So for prompt chunks
(queries > 1) we compute softmax(q kᵀ · scale) v as exp2 of log2e-scaled scores, with the matmuls
on the same OpenBLAS. Measured on this machine (8 heads, 2 KV heads, head_dim 64):

    queries x keys   mx.fast.sdpa   this      max |diff|
    240 x 2500       78.9 ms        18.1 ms   3e-7
    512 x 2500       180 ms         47.4 ms   4e-7

Whole demo-model prefill (evals/bench_engine): 240 tokens 91 -> 71 ms, 2000 tokens 1364 -> 749 ms.
A prompt chunk's causal softmax then goes to C (decode_attention.c's causal_softmax(): two passes
over each line of scores where numpy makes five, and the keys past a block's last query left out of
both products): per layer on a 2-core AVX-512 Xeon, 480 queries x 736 keys 9.2 -> 4.2 ms, 2000 x
2000 126 -> 33 ms; the demo model's prefill of 512 tokens 80 -> 66 ms (evals/bench_step).

A batch's decode rows (one query each, or a few with drafts, and a mask per row for its left
padding) take the same path: the softmax's exp over rows x heads x keys is the cost there too.
Measured here (8 heads, 2 KV heads, 320 keys, per layer): 16 rows 0.96 -> 0.58 ms, 64 rows 3.91 ->
2.59 ms; a demo-model decode step of 16 rows 14.4 -> 11.9 ms, of 64 rows 37 -> 31 ms. Decode rows
with one query each and no sinks then go one step further, to a C kernel that reads each row's keys
once for all its query heads (gateway/engine/decode_kernel.py; numpy's products cost one OpenBLAS
call per row and KV head). A lone row (no mask) keeps MLX's kernel up to LONE_ROW_FROM_KEYS keys,
and takes the C kernel over longer contexts (a coding agent's one stream). On Metal
nothing changes.
"""

from __future__ import annotations

import sys
import types
from functools import cache, lru_cache

import mlx.core as mx
import numpy as np

from .decode_kernel import causal_softmax_kernel, decode_attention
from .rows_kv import RowsLayer
from .threads import split_rows

LOG2E = 1.4426950408889634


def causal_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: np.ndarray | None = None,
    sinks: mx.array | None = None,
    window: int | None = None,
) -> mx.array:
    """Attention of L queries that are the last L positions of T keys (grouped-query heads). `mask`
    (L, T), or one per row (B, 1, L, T), True where a query may attend, replaces the plain causal
    mask (a batch's left padding). `window` (with no mask): each query sees only its last `window`
    keys (a sliding window's band). `sinks` (heads,): gpt-oss's learned logit per head, one more
    term of every query's softmax with no value behind it. A batch's rows, or a prompt's queries,
    are split across the cores (threads.split_rows) and attended in blocks of at most BLOCK_SCORES
    scores: each part and block writes its own lines of the result, computed as they are in one
    piece."""
    q, k, v = as_numpy(queries, keys, values)
    batch, num_heads, num_queries, _ = q.shape
    if num_queries == 1 and mask is not None and mask.ndim == 4 and sinks is None:
        out = decode_attention(q, k, v, scale, mask)  # decode rows: one C pass (None: not built here)
        if out is not None:
            return mx.array(out).astype(queries.dtype)
    sink = None if sinks is None else np.asarray(sinks.astype(mx.float32)) * np.float32(LOG2E)
    out = np.empty(q.shape, dtype=np.float32)
    num_keys = k.shape[2]
    if window is not None and window >= num_keys:
        window = None  # the last query sees every key: the window hides nothing
    softmax = causal_softmax_kernel() if mask is None and batch == 1 else None
    if window is not None and softmax is None:  # numpy's paths take a window as its mask
        mask, window = _band_mask(num_queries, num_keys, window), None
    causal = _causal_bias(num_queries) if mask is None else None
    if batch > 1:  # a batch's rows, each over its own keys (under its own mask where it has one)
        row_scores = num_heads * num_queries * num_keys

        def rows(first: int, last: int) -> None:
            for start, end in _blocks(first, last, row_scores):
                own = mask if mask is None or mask.ndim == 2 else _rows(mask, start, end)
                keys_, values_ = _rows(k, start, end), _rows(v, start, end)
                _attend(q[start:end], keys_, values_, scale, own, causal, sink, out[start:end])

        split_rows(rows, batch, batch * row_scores)
    else:  # a prompt's chunk: its queries in parts, each with its lines of the mask

        def lines(first: int, last: int) -> None:
            for start, end in _blocks(first, last, num_heads * num_keys):
                if softmax is not None:  # query i sees keys [0, num_keys - num_queries + i]
                    visible = num_keys - num_queries + start + 1
                    block = q[:, :, start:end]
                    _attend_causal(block, k, v, scale, visible, window, sink, softmax, out[:, :, start:end])
                    continue
                own = None if mask is None else mask[..., start:end, :]
                part = None if causal is None else causal[start:end]
                _attend(q[:, :, start:end], k, v, scale, own, part, sink, out[:, :, start:end])

        split_rows(lines, num_queries, num_queries * num_heads * num_keys)
    return mx.array(out).astype(queries.dtype)


# The most scores one numpy pass holds (16 MiB of float32): a long prompt's chunk is attended in
# blocks of queries that stay near the cache instead of one (queries x keys) array per head
# streamed through memory at each of the softmax's passes. A 512-query chunk, one thread, against
# one block: 2,000 keys 37.5 -> 35.2 ms, 4,000 86.7 -> 62.8 ms, 8,000 185.1 -> 118.9 ms, 11,000
# 307.2 -> 235.8 ms (blocks of 2^21 and 2^23 scores measured slower at 4,000 keys and beyond).
BLOCK_SCORES = 1 << 22


def _blocks(first: int, last: int, scores_per_line: int) -> list[tuple[int, int]]:
    """[first, last) in consecutive blocks of at most BLOCK_SCORES scores (one line at least)."""
    size = max(1, BLOCK_SCORES // scores_per_line)
    return [(start, min(last, start + size)) for start in range(first, last, size)]


def _rows(array: np.ndarray, first: int, last: int) -> np.ndarray:
    """Rows [first, last) of a batch's array; one row shared by all (broadcast) stays whole."""
    return array if array.shape[0] == 1 else array[first:last]


def _attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    mask: np.ndarray | None,
    causal: np.ndarray | None,
    sink: np.ndarray | None,
    out: np.ndarray,
) -> None:
    """softmax(q kᵀ · scale + the mask's -inf) v into `out`, for q (B, H, L, D) against k, v
    (B, KV heads, T, D): `mask` (L, T) or (B, 1, L, T) booleans, or `causal` (L, C), the -inf
    above the diagonal over the last C keys; `sink` (H,): log2-scaled sink logits."""
    batch, num_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.reshape(batch, num_kv_heads, group * num_queries, head_dim) * np.float32(scale * LOG2E)
    scores = np.matmul(grouped, k.transpose(0, 1, 3, 2)).reshape(batch, num_kv_heads, group, num_queries, num_keys)
    if causal is not None:
        scores[..., num_keys - causal.shape[1] :] += causal
    if mask is not None:
        bias = np.where(mask, np.float32(0), np.float32(-np.inf))
        scores += bias[:, :, None] if bias.ndim == 4 else bias  # per row: (B, 1, 1, L, T) over the heads
    top = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        sink = sink.reshape(1, num_kv_heads, group, 1, 1)
        top = np.maximum(top, sink)
    scores -= top
    np.exp2(scores, out=scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    if sink is not None:
        denominator += np.exp2(sink - top)
    denominator = denominator.reshape(batch, num_kv_heads, group * num_queries, 1)
    weighted = np.matmul(scores.reshape(batch, num_kv_heads, group * num_queries, num_keys), v) / denominator
    out[...] = weighted.reshape(batch, num_heads, num_queries, head_dim)


def _attend_causal(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    first_visible: int,
    window: int | None,
    sink: np.ndarray | None,
    softmax,
    out: np.ndarray,
) -> None:
    """_attend's causal case for one prompt's block of queries (batch 1), its softmax in C
    (decode_attention.c's causal_softmax): query j of the block sees keys [0, first_visible + j),
    only its last `window` of them when a window is given, so the keys past the block's last query
    and before its first query's window are left out of both products. `sink` (heads,): the
    log2-scaled sink logits, float32."""
    _, num_heads, num_queries, head_dim = q.shape
    num_kv_heads = k.shape[1]
    end = first_visible + num_queries - 1
    start = 0 if window is None else max(0, first_visible - window)
    grouped = q.reshape(num_kv_heads, num_heads // num_kv_heads * num_queries, head_dim) * np.float32(scale * LOG2E)
    scores = np.matmul(grouped, k[0, :, start:end].transpose(0, 2, 1))  # (KV heads, group x queries, keys)
    inverse = np.empty(scores.shape[:2], dtype=np.float32)
    lines, num_keys = scores.shape[0] * scores.shape[1], end - start
    sinks = None if sink is None else sink.ctypes.data
    softmax(
        scores.ctypes.data,
        lines,
        num_keys,
        num_queries,
        first_visible - start,
        window or num_keys,
        sinks,
        inverse.ctypes.data,
    )
    weighted = np.matmul(scores, v[0, :, start:end])
    weighted *= inverse[..., None]
    out[...] = weighted.reshape(1, num_heads, num_queries, head_dim)


def as_numpy(*arrays: mx.array) -> list[np.ndarray]:
    """The arrays as float32 numpy arrays (numpy has no bfloat16), evaluated together: one hand-off
    to MLX's stream for all of them, not one each."""
    floats = [x.astype(mx.float32) for x in arrays]
    mx.eval(floats)
    return [np.asarray(x) for x in floats]


@lru_cache(maxsize=8)
def _causal_bias(size: int) -> np.ndarray:
    return np.triu(np.full((size, size), -np.inf, dtype=np.float32), 1)


def install_cpu_prefill_attention(language_model) -> int:
    """Route this model instance's prefill attention through `causal_attention`. Every family of
    mlx-vlm and mlx-lm computes attention by calling its module's `scaled_dot_product_attention`
    from the attention layer's `__call__`; each attention layer of this instance (not its class,
    not other models in the process) gets a subclass whose `__call__` is the same code run with
    that name bound to the CPU path. Returns how many layers were swapped (0 on a GPU)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    _limit_numpy_blas_threads()
    # Nemotron-H keeps its attention (and its Mamba and MLP blocks) under "mixer"; those others do
    # not call the name and keep their class.
    return sum(swap_layer_classes(language_model, name, _cpu_attention_class) for name in ("self_attn", "mixer"))


def swap_layer_classes(language_model, attribute: str, cpu_class_of) -> int:
    """Give each layer's `attribute` module the class `cpu_class_of(its class)` (None: it keeps its
    own). Only this instance changes: not its class, not other models in the process."""
    swapped = 0
    for layer in language_model.layers:
        module = getattr(layer, attribute, None)
        cpu_class = cpu_class_of(type(module)) if module is not None else None
        if cpu_class is not None:
            module.__class__ = cpu_class
            swapped += 1
    return swapped


@cache
def _cpu_attention_class(base: type) -> type | None:
    original = sys.modules[base.__module__].__dict__.get(SDPA)
    if original is None:
        return None  # this layer computes attention some other way: it keeps MLX's kernel
    return with_globals(base, f"CpuPrefill{base.__name__}", {SDPA: _cpu_prefill(original)})


def with_globals(base: type, name: str, replacements: dict, methods: tuple[str, ...] = ("__call__",)) -> type | None:
    """A subclass of `base` whose `methods` are the same code run with some of their global names
    bound to other objects; None when none of them uses any of those names."""
    patched = {}
    for method in methods:
        function = getattr(base, method, None)
        own = rebound(function, replacements) if function is not None else None
        if own is not None:
            patched[method] = own
    return type(name, (base,), patched) if patched else None


def rebound(function, replacements: dict):
    """The same function run with those of `replacements`' global names its code uses bound to
    their objects; None when it uses none of them."""
    code = getattr(function, "__code__", _NO_CODE)
    used = {key: value for key, value in replacements.items() if key in code.co_names}
    if not used:
        return None
    own = types.FunctionType(
        code, dict(function.__globals__, **used), function.__name__, function.__defaults__, function.__closure__
    )
    own.__kwdefaults__ = function.__kwdefaults__
    return own


SDPA = "scaled_dot_product_attention"
_NO_CODE = compile("", "<none>", "exec")


def _cpu_prefill(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, *args, **kwargs):
        """Prefill (queries > 1) with a causal or boolean mask, and a batch's rows with their boolean
        masks, run on numpy (attention sinks included); the rest (a lone decode row, quantised
        caches, masks per head) stays on the library's own kernel. Keys that the mask hides from every query (a sliding
        window's past, a batch's shared padding) are dropped first. Decode rows whose KV lies in
        segments (rows_kv.py) attend through their cache."""
        if isinstance(cache, RowsLayer) and mask is None and not args and not kwargs:
            return cache.attend(queries, keys, values, scale)
        allowed = None  # the boolean mask as numpy, read once: (L, T), or (B, 1, L, T) for a batch's rows
        if isinstance(keys, mx.array) and isinstance(mask, mx.array) and mask.dtype == mx.bool_ and _one_per_row(mask):
            allowed = np.asarray(mask)
            first = _first_visible_key(allowed)
            if first:
                keys, values, mask, allowed = (
                    keys[..., first:, :],
                    values[..., first:, :],
                    mask[..., first:],
                    allowed[..., first:],
                )
        if _lone_row_over_long_context(queries, keys, mask) and not args and not kwargs:
            return causal_attention(queries, keys, values, scale, np.ones((1, 1, 1, keys.shape[2]), dtype=np.bool_))
        several = queries.shape[2] > 1 or (queries.shape[0] > 1 and allowed is not None)
        if several and not args and kwargs.keys() <= {"sinks"} and isinstance(keys, mx.array):
            sinks = kwargs.get("sinks")
            if isinstance(mask, str) and mask == "causal":
                return causal_attention(queries, keys, values, scale, sinks=sinks)
            if (window := _causal_window(allowed)) is not None:
                return causal_attention(queries, keys, values, scale, sinks=sinks, window=window)
            if allowed is not None:
                return causal_attention(queries, keys, values, scale, allowed, sinks)
        return original(queries, keys, values, cache, scale, mask, *args, **kwargs)

    return scaled_dot_product_attention


# From this many keys a lone decode row's attention takes the C kernel too (mask None: it sees every
# key), its KV heads split across the cores. Attention alone, one row, 8 heads over 2 KV heads:
# MLX's kernel against the C kernel 0.21 / 0.06 ms at 200 keys, 0.71 / 0.25 at 2,000, 2.53 / 1.09 at
# 8,000, 5.33 / 1.90 at 16,000. A whole decode step of the demo model (alternated): 0.96x at 1,000
# keys, 1.04x at 2,000, 1.14x at 4,000, 1.37x at 8,000, 1.43x at 16,000 (below ~2,000 the two trips
# between MLX and numpy a layer cost what the kernel saves).
LONE_ROW_FROM_KEYS = 2048
_lone_row = {"enabled": True}  # process-wide; only benchmarks turn it off


def use_lone_row_kernel(enabled: bool) -> None:
    _lone_row["enabled"] = enabled


def _lone_row_over_long_context(queries: mx.array, keys, mask) -> bool:
    return (
        _lone_row["enabled"]
        and mask is None
        and isinstance(keys, mx.array)
        and queries.shape[0] == 1
        and queries.shape[2] == 1
        and keys.shape[2] >= LONE_ROW_FROM_KEYS
    )


def _one_per_row(mask: mx.array) -> bool:
    """A mask the numpy path takes: (L, T) for every row, or (B, 1, L, T), one per row (not per head)."""
    return mask.ndim == 2 or (mask.ndim == 4 and mask.shape[1] == 1)


def _causal_window(allowed: np.ndarray | None) -> int | None:
    """The window w when one prompt's boolean mask is a causal band (query i of L sees keys
    (T - L + i - w, T - L + i]: a sliding window's mask, the plain causal one when w covers every
    key), else None. Such a chunk takes the causal path (the C softmax, keys outside every query's
    band left out) instead of the masked one."""
    if allowed is None or allowed.shape[:-2] not in ((), (1, 1)):
        return None
    num_queries, num_keys = allowed.shape[-2:]
    lines = allowed.reshape(num_queries, num_keys)
    window = int(np.count_nonzero(lines[-1]))
    return window if window and np.array_equal(lines, _band_mask(num_queries, num_keys, window)) else None


@lru_cache(maxsize=8)
def _band_mask(num_queries: int, num_keys: int, window: int) -> np.ndarray:
    """Query i of L sees its last `window` keys up to key T - L + i (read-only: it is shared)."""
    causal = np.tri(num_queries, num_keys, num_keys - num_queries, dtype=np.bool_)
    band = causal & ~np.tri(num_queries, num_keys, num_keys - num_queries - window, dtype=np.bool_)
    band.flags.writeable = False
    return band


def _first_visible_key(allowed: np.ndarray) -> int:
    """The first key any query may see. With a sliding window over a long reused prefix, a layer then
    attends over window + queries keys instead of the whole context."""
    visible = allowed.reshape(-1, allowed.shape[-1]).any(axis=0)
    return int(visible.argmax()) if visible.any() else 0


def _limit_numpy_blas_threads() -> None:
    """numpy wheels bundle their own OpenBLAS beside the one MLX runs on. Two pools of spinning
    threads on the same cores made prefill 2x slower (216 vs 91 ms at 240 tokens); with numpy's
    pool at one thread the numpy path wins (71 ms). MLX's own BLAS keeps its threads."""
    from threadpoolctl import threadpool_info, threadpool_limits

    bundled = {pool["prefix"]: 1 for pool in threadpool_info() if pool["prefix"].startswith("libscipy_openblas")}
    if bundled:
        threadpool_limits(limits=bundled)
