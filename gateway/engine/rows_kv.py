"""The KV of a batch's decode rows, in segments: a row joining or leaving copies nothing of the others'.

The libraries' BatchKVCache holds the rows left-padded in one array per layer: a row joining pads and
concatenates all of them (16 rows of 300-450 tokens on the demo model: 45 ms, two decode steps), a
row leaving gathers the rest (12 ms), and each row's attention runs over the longest row's padding.
Here a row's KV stays where its prefill left it (its own cache's buffers: the row's first segment),
its decode writes go to blocks of its own (numpy arrays of `block_tokens` tokens), and the attention
(rows_attention() in decode_attention.c) reads each row's segments through per-layer tables of
pointers, writing the step's new keys and values itself. A row leaving gets its KV back as the
library's plain caches (one copy of that row alone), for the runner's finish() or to decode on alone.

    rows = RowsKV(kv_cache_class, num_layers, block_tokens)
    rows.add(cache)                    a prefilled row: its per-layer KVCache list
    rows.add(cache, shared)            ... whose first tokens are read in place from cached blocks
    rows.layers[i]                     the cache layer i's attention module gets in a step (RowsLayer)
    rows.feed(num_tokens)              before a step: room for every row's new tokens; their offsets
    rows.confirm()                     the step ran: its tokens' KV is written in every layer
    rows.trim(num_tokens)              drop row r's last num_tokens[r] (drafts a verification rejected)
    rows.remove(index, first) -> list  the row's KV from token `first` on as plain caches, the row gone

Invariants: a row's segments hold its tokens in order, each but the last exactly `size` tokens, the
last at least what is left (sum of sizes >= length); every pointer in `tables` points into an array
a segment holds (MLX arrays stay alive while their segment does); `tables` is None whenever the
rows' segments changed since it was built; a row's first `num_shared` tokens are in segments that
read cached blocks in place, which nothing here writes (a step writes past the row's prompt, and
trim() never cuts below it). `lengths[r]` counts row r's tokens fed, `before[r]` those
before the step under way, and `unconfirmed` the last feed's tokens until confirm(): a row leaving
before then (its step failed part-way) leaves without them, so no half-written KV is ever stored.
Only the engine's worker thread calls in.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import mlx.core as mx
import numpy as np

from .decode_kernel import _LONG, _POINTER, LOG2E, kernel_function
from .mapped_kv import first_own_token
from .threads import split_rows


@dataclass(slots=True)
class Segment:
    """A run of one row's tokens: per layer, keys and values as (kv_heads, capacity, head_dim) float32
    views with unit stride along head_dim, and `size` tokens counted in the row (its capacity for the
    row's last segment)."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    size: int
    holds: tuple = ()  # the MLX arrays the views read
    # What the tables read of it, per layer: its keys' and values' addresses and head strides (in
    # floats), as rows of a (4, layers) array; taken once here (a table of 16 rows of 32 segments
    # each, read array by array at every rebuild, took 18.5 ms: most of a decode step)
    table: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.table = np.array(
            [
                [k.ctypes.data for k in self.keys],
                [v.ctypes.data for v in self.values],
                [k.strides[0] // 4 for k in self.keys],
                [v.strides[0] // 4 for v in self.values],
            ],
            dtype=np.int64,
        )


@dataclass(slots=True)
class Row:
    segments: list[Segment] = field(default_factory=list)
    num_shared: int = 0  # its first tokens, read in place from cached blocks (their segments are never written)

    @property
    def capacity(self) -> int:
        return sum(segment.size for segment in self.segments)


@dataclass(slots=True)
class Tables:
    """Per layer, the pointer table rows_attention() reads: every row's segments in row order."""

    first: np.ndarray  # (rows + 1,) row r's segments are first[r] .. first[r + 1] - 1
    sizes: np.ndarray  # (segments,)
    keys: list[np.ndarray]  # per layer (segments,) addresses
    values: list[np.ndarray]
    key_strides: list[np.ndarray]  # per layer (segments,) elements between KV heads
    value_strides: list[np.ndarray]


class RowsKV:
    def __init__(self, kv_cache_class: type, num_layers: int, block_tokens: int):
        self.kv_cache_class = kv_cache_class
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self.rows: list[Row] = []
        self.lengths: list[int] = []
        self.before: list[int] = []
        self.offsets = mx.array([], dtype=mx.int32)  # `before` for the model's RoPE
        self.tables: Tables | None = None
        self.layers = [RowsLayer(self, index) for index in range(num_layers)]
        self.num_attended = 0  # layer calls attended (the runner's check that every layer came through here)
        self.unconfirmed = 0  # tokens of the last feed() its step has not confirmed

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, cache: list, shared: Sequence[tuple] = ()) -> None:
        """A prefilled row. Its caches' buffers become its first segment (no copy); or, given
        `shared` (cached blocks of its first tokens, each per layer (keys, values) of `block_tokens`
        tokens), those blocks are its first segments, read in place and never written, and only its
        tokens past them are copied out of its caches, so the caches' buffers can go. A prompt's
        MappedKV caches (mapped_kv.py) hold their tokens from their first own token on: `shared`
        covers those before."""
        length, first = int(cache[0].offset), first_own_token(cache)
        start = len(shared) * self.block_tokens
        assert first <= start <= length, (first, start, length)
        if shared:
            segments = [_read_only(kv, self.block_tokens) for kv in shared]
            segments += [self._tail(cache, start, length, first)] if length > start else []
        else:
            keys = [_tokens_view(layer.keys) for layer in cache]
            values = [_tokens_view(layer.values) for layer in cache]
            holds = tuple(array for layer in cache for array in (layer.keys, layer.values))
            segments = [Segment(keys, values, length, holds)]
        self.rows.append(Row(segments, start))
        self.lengths.append(length)
        self.before.append(length)
        self.tables = None

    def _tail(self, cache: list, start: int, length: int, first: int) -> Segment:
        """A block of the row's own holding its tokens [start, length) copied from its caches (whose
        buffers hold the tokens from `first` on)."""
        size = -(-(length - start) // self.block_tokens) * self.block_tokens
        keys: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for layer in cache:
            for out, source in ((keys, layer.keys), (values, layer.values)):
                view = _tokens_view(source)
                block = np.empty((view.shape[0], size, view.shape[2]), dtype=np.float32)
                block[:, : length - start] = view[:, start - first : length - first]
                out.append(block)
        return Segment(keys, values, size)

    def remove(self, index: int, first: int = 0) -> list:
        """Row `index` leaves: its KV as the library's plain caches, holding exactly its tokens from
        `first` on (a row that read its first tokens in place from cached blocks need not copy them)."""
        row, length = self.rows.pop(index), self.lengths.pop(index) - self.unconfirmed
        del self.before[index]
        self.tables = None
        sizes = [segment.size for segment in row.segments]
        caches = []
        for layer in range(self.num_layers):
            kv = self.kv_cache_class()
            kv.keys = mx.array(_joined([s.keys[layer] for s in row.segments], sizes, first, length))
            kv.values = mx.array(_joined([s.values[layer] for s in row.segments], sizes, first, length))
            kv.offset = length - first
            caches.append(kv)
        return caches

    def feed(self, num_tokens: int) -> mx.array:
        """Before a step that feeds every row `num_tokens` tokens: room for them, and the rows'
        offsets (their tokens before the step, where the new ones go)."""
        for row, length in zip(self.rows, self.lengths):
            missing = length + num_tokens - row.capacity
            if missing > 0:
                row.segments.append(self._block(-(-missing // self.block_tokens) * self.block_tokens, row))
                self.tables = None
        self.before = list(self.lengths)
        self.lengths = [length + num_tokens for length in self.lengths]
        self.unconfirmed = num_tokens
        self.offsets = mx.array(self.before, dtype=mx.int32)
        return self.offsets

    def confirm(self) -> None:
        """The step of the last feed() ran through every layer: its tokens' KV is whole."""
        self.unconfirmed = 0

    def trim(self, num_tokens: list[int]) -> None:
        """Drop row r's last num_tokens[r] tokens (they were fed in the last step: written in blocks)."""
        self.lengths = [length - n for length, n in zip(self.lengths, num_tokens)]

    def _block(self, tokens: int, row: Row) -> Segment:
        """An empty segment of `tokens` for the row's decode, shaped like its first segment."""
        kv_heads, _, head_dim = row.segments[0].keys[0].shape
        keys = [np.empty((kv_heads, tokens, head_dim), dtype=np.float32) for _ in range(self.num_layers)]
        values = [np.empty((kv_heads, tokens, head_dim), dtype=np.float32) for _ in range(self.num_layers)]
        return Segment(keys, values, tokens)

    def _tables(self) -> Tables:
        if self.tables is None:
            segments = [segment for row in self.rows for segment in row.segments]
            first = np.cumsum([0] + [len(row.segments) for row in self.rows], dtype=np.int64)
            sizes = np.array([segment.size for segment in segments], dtype=np.int64)
            keys, values, key_strides, value_strides = np.stack([s.table for s in segments], axis=-1)
            self.tables = Tables(first, sizes, list(keys), list(values), list(key_strides), list(value_strides))
        return self.tables

    def attend(self, layer: int, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        """Layer `layer`'s attention for the step fed: each row's new keys and values written at its
        positions, then its queries over its keys."""
        from .attention import as_numpy

        self.num_attended += 1
        q, new_k, new_v = (np.ascontiguousarray(a, dtype=np.float32) for a in as_numpy(queries, keys, values))
        rows, heads, num_queries, head_dim = q.shape
        kv_heads = new_k.shape[1]
        tables, lengths = self._tables(), np.array(self.before, dtype=np.int64)
        out = np.empty_like(q)
        kernel = rows_kernel()
        assert kernel is not None, "RowsKV runs only where its kernel was built"
        group = heads // kv_heads

        def attend_rows(first: int, last: int, kv_first: int = 0, kv_last: int = kv_heads) -> None:
            """Rows [first, last); with one row, only its KV heads [kv_first, kv_last) (and their query
            heads): its tables' addresses moved to the first of them."""
            keys_at, values_at = tables.keys[layer], tables.values[layer]
            if kv_first:
                keys_at = keys_at + kv_first * tables.key_strides[layer] * 4
                values_at = values_at + kv_first * tables.value_strides[layer] * 4
            scores = np.empty(num_queries * group * (int(lengths[first:last].max()) + num_queries), dtype=np.float32)
            kernel(
                q[first:, kv_first * group :].ctypes.data,
                new_k[first:, kv_first:].ctypes.data,
                new_v[first:, kv_first:].ctypes.data,
                tables.first[first:].ctypes.data,
                keys_at.ctypes.data,
                values_at.ctypes.data,
                tables.key_strides[layer].ctypes.data,
                tables.value_strides[layer].ctypes.data,
                tables.sizes.ctypes.data,
                lengths[first:].ctypes.data,
                last - first,
                num_queries,
                (kv_last - kv_first) * group,
                kv_last - kv_first,
                head_dim,
                scale * LOG2E,
                scores.ctypes.data,
                out[first:, kv_first * group :].ctypes.data,
            )

        num_scores = rows * heads * num_queries * (int(lengths.max()) + num_queries)
        if rows == 1:  # a lone row (left alone reading cached blocks): its KV heads go to the cores
            split_rows(lambda kv_first, kv_last: attend_rows(0, 1, kv_first, kv_last), kv_heads, num_scores)
        else:
            split_rows(attend_rows, rows, num_scores)
        return mx.array(out)


class RowsLayer:
    """Layer `index`'s cache in a step of the rows: what its attention module is given. It keeps no
    KV of its own (update_and_fetch hands the new keys and values through, and the attention reads
    and writes the rows' segments); the window-free causal mask is the kernel's, so make_mask gives none."""

    def __init__(self, rows: RowsKV, index: int):
        self.rows = rows
        self.index = index

    @property
    def offset(self) -> mx.array:
        return self.rows.offsets

    def make_mask(self, num_tokens: int, return_array: bool = False, window_size: int | None = None):
        if window_size:
            raise NotImplementedError("rows in segments attend without a sliding window")
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        return self.rows.attend(self.index, queries, keys, values, scale)


def _tokens_view(array: mx.array) -> np.ndarray:
    """A (1, kv_heads, capacity, head_dim) float32 MLX buffer as (kv_heads, capacity, head_dim), with
    no copy when its last two axes are contiguous (a copy otherwise)."""
    view = np.asarray(array)[0]
    if view.dtype != np.float32 or view.strides[1:] != (view.shape[2] * 4, 4):
        view = np.ascontiguousarray(view, dtype=np.float32)
    return view


def _read_only(kv: tuple, block_tokens: int) -> Segment:
    """A cached block's per-layer (keys, values) as a segment of `block_tokens`, read in place."""
    keys = [_tokens_view(k) for k, _ in kv]
    values = [_tokens_view(v) for _, v in kv]
    assert all(k.shape[1] == block_tokens for k in keys), (keys[0].shape, block_tokens)
    return Segment(keys, values, block_tokens, tuple(array for pair in kv for array in pair))


def _joined(parts: list[np.ndarray], sizes: list[int], first: int, length: int) -> np.ndarray:
    """Tokens [first, length) of the segments' arrays, as one (1, kv_heads, length - first, head_dim) array."""
    pieces, start = [parts[0][:, :0]], 0  # no token at all: a row whose every token is a cached block's
    for part, size in zip(parts, sizes):
        begin, end = max(first - start, 0), min(size, length - start)
        if begin < end:
            pieces.append(part[:, begin:end])
        start += size
        if start >= length:
            break
    return np.concatenate(pieces, axis=1)[None]


def rows_supported(keys: mx.array) -> bool:
    """Whether KV like `keys` (a layer's cache buffer) can be read in segments here: float32, head
    sizes of whole 8-float vectors up to 256, and the kernel built."""
    head_dim = keys.shape[-1]
    return keys.dtype == mx.float32 and head_dim % 8 == 0 and head_dim <= 256 and rows_kernel() is not None


@cache
def rows_kernel():
    """rows_attention() (decode_attention.c) with its argument types, or None where the library
    cannot be built."""
    # q, new keys, new values; the tables (first, key and value addresses, their head strides, sizes);
    # lengths; rows, queries per row, heads, kv_heads, head_dim; the scale; the scores' scratch, out
    return kernel_function("rows_attention", [*[_POINTER] * 10, *[_LONG] * 5, ctypes.c_float, _POINTER, _POINTER])
