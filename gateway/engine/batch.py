"""Sequences that decode together: one batched forward per step over the library's BatchKVCache.

Each sequence is prefilled on its own (with every cache: prefix reuse, image features, the save
moments), then joins the batch: its per-layer KVCache is merged into one left-padded BatchKVCache
per layer (mlx-vlm's / mlx-lm's own class: `merge`, `extend`, `filter`, `extract`). A step feeds
every row its last sampled token; positions come from each row's own offset (plus its mRoPE delta
for the Qwen VL line), and masks from the cache (left padding, and a sliding window where the model
asks for one). A leaving row's KV is extracted back into a plain KVCache, so the runner's finish()
stores its blocks as it would for a lone request.

Invariant: `rows[i]` is row i of every layer's BatchKVCache when `batched`; otherwise there is at most
one row and `cache` is its own. Only the engine's worker thread calls in.
Measured on the tiny models of Qwen2.5-VL, Gemma 3 and Llama: greedy tokens of 8 sequences decoded
together equal each decoded alone (tests/gateway/test_batch.py keeps that true for every family).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx

from .runner import Cancelled, ModelRunner, Part, PrefillResult, Sampler, as_token, cache_offset, decode_positions
from .types import Sampling


class DecodeBatch:
    """One row decodes on its own plain per-layer cache (a batch of one pays no padding masks or
    per-row offsets: measured 6-11% slower on the demo model); from two rows on, the rows share one
    BatchKVCache per layer, and back to plain when one row is left."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.rows: list[PrefillResult] = []  # each row's prefill: its prompt, plan and mRoPE delta
        self.cache: list = []  # per layer: the lone row's KVCache, or a BatchKVCache when batched; [] with no rows
        self.batched = False

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, prefill: PrefillResult) -> None:
        """Add a prefilled sequence as the last row. A model with recurrent layers (no batched cache
        for them here) runs one row at a time."""
        if not self.rows:
            self.cache = prefill.cache
        else:
            assert self.runner.batchable, "a model without a batched cache decodes one sequence at a time"
            merge = self.runner.cache_classes.BatchKVCache.merge
            if self.batched:
                for layer, own in zip(self.cache, prefill.cache):
                    layer.extend(merge([own]))
            else:
                self.cache = [merge([lone, own]) for lone, own in zip(self.cache, prefill.cache)]
                self.batched = True
        self.rows.append(prefill)

    def step(self, tokens: list[int]) -> mx.array:
        """Feed row i the token tokens[i]; the next-token logits, one row each: (rows, vocab)."""
        return self.runner.run_step([self.part([[token] for token in tokens])])[0]

    def part(self, tokens: list[list[int]]) -> Part:
        """Row i fed tokens[i] (the same count per row), as one part of a step: logits come back
        for every token fed, row-major."""
        ids = mx.array(tokens, dtype=mx.int32)
        # mRoPE families give every row a delta, plain-RoPE families none
        deltas = [row.rope_delta for row in self.rows if row.rope_delta is not None] or None
        offsets = self.cache[0].offset if self.batched else cache_offset(self.cache, 0)
        return Part(self.cache, ids, positions=decode_positions(offsets, deltas, ids.shape[1]), keep=ids.shape[1])

    def trim(self, num_tokens: list[int]) -> None:
        """Drop the last num_tokens[i] tokens of row i's KV (draft tokens a verification rejected).
        The batched cache keeps one write position for all rows: what they share is cut, and each
        row's remaining extra is rolled out to its left, where it becomes padding (as the library
        does for right padding), so every row's KV still ends at the shared position."""
        assert len(num_tokens) == len(self.rows) and min(num_tokens, default=0) >= 0
        if not self.batched:
            for layer in self.cache:
                layer.trim(num_tokens[0])
            return
        shared = min(num_tokens)
        extra = mx.array([n - shared for n in num_tokens])
        for layer in self.cache:
            layer.trim(shared)
            if shared == max(num_tokens):
                continue
            end = layer._idx  # the library's own write position (it has no public name)
            layer.keys[..., :end, :] = _roll_rows(layer.keys[..., :end, :], extra)
            layer.values[..., :end, :] = _roll_rows(layer.values[..., :end, :], extra)
            layer.left_padding = layer.left_padding + extra
            layer.offset = layer.offset - extra

    def leave(self, index: int) -> PrefillResult:
        """Remove row `index`; its prefill, with `cache` holding the row's own KV again (for finish())."""
        row = self.rows.pop(index)
        if not self.batched:
            row.cache, self.cache = self.cache, []
            return row
        row.cache = [layer.extract(index) for layer in self.cache]
        keep = mx.array([i for i in range(len(self.rows) + 1) if i != index])
        for layer in self.cache:
            layer.filter(keep)
        if len(self.rows) == 1:  # back to the lone row's own cache
            self.cache = [layer.extract(0) for layer in self.cache]
            self.batched = False
        return row


def _roll_rows(x: mx.array, shifts: mx.array) -> mx.array:
    """Row i of x (rows, heads, tokens, dim) rolled right by shifts[i] along the token axis."""
    n = x.shape[2]
    index = (mx.arange(n)[None, :] - shifts[:, None]) % n
    return mx.take_along_axis(x, index[:, None, :, None], axis=2)


def decode_alone(
    runner: ModelRunner, prefill: PrefillResult, sampling: Sampling, cancelled: Callable[[], bool]
) -> Iterator[int]:
    """One sequence decoded on its own through the worker's batch step (a batch of one row): the
    single-row path for tests, benchmarks and tools. Yields token ids until EOS or max_tokens (EOS
    itself is not yielded); `prefill.cache` holds the sequence's KV throughout, for finish()."""
    batch, sampler = DecodeBatch(runner), Sampler(sampling)
    batch.join(prefill)
    logits, generated = prefill.logits, list[int]()
    try:
        for _ in range(sampling.max_tokens):
            token = as_token(sampler.draw(logits, generated))
            if token in runner.eos_ids:
                return
            generated.append(token)
            yield token
            if cancelled():
                raise Cancelled()
            logits = batch.step([token])[0]
    finally:
        batch.leave(0)
