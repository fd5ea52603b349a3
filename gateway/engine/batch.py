"""Sequences that decode together: one batched forward per step over the library's batched caches.

Each sequence is prefilled on its own (with every cache: prefix reuse, image features, the save
moments), then joins the batch: its per-layer KVCache is merged into one left-padded BatchKVCache
per layer (mlx-vlm's / mlx-lm's own class: `merge`, `extend`, `filter`, `extract`); a hybrid model's
recurrent layers stack their rows' states in the library's ArraysCache (the same four calls). A step
feeds every row its last sampled token; positions come from each row's own offset (plus its mRoPE
delta for the Qwen VL line), and masks from the cache (left padding, and a sliding window where the
model asks for one). A leaving row's cache is extracted back into plain per-layer caches, so the
runner's finish() stores its blocks (and a hybrid row's last snapshot) as for a lone request.

On a model whose rows can keep their KV in segments (runner.rows_kv: plain KV without windows, on
the CPU), the batched rows do so instead (gateway/engine/rows_kv.py): a row joining or leaving copies
nothing of the others' KV, where BatchKVCache pads and concatenates them all.

Invariant: `rows[i]` is row i of every layer's batched cache (or of `segments`) when `batched`, and
`lengths[i]` the tokens its cache holds; otherwise there is at most one row and `cache` is its own.
Only the engine's worker thread calls in.
Measured on the tiny models of Qwen2.5-VL, Gemma 3 and Llama: greedy tokens of 8 sequences decoded
together equal each decoded alone (tests/gateway/test_batch.py keeps that true for every family).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx

from kvcache import is_recurrent

from .mapped_kv import MappedKV, first_own_token, plain_caches
from .rows_kv import RowsKV
from .runner import (
    Cancelled,
    ModelRunner,
    Part,
    PrefillResult,
    cache_offset,
    decode_positions,
    recurrent_state,
)
from .sampling import Sampler
from .types import Sampling


class DecodeBatch:
    """One row decodes on its own plain per-layer cache (a batch of one pays no padding masks or
    per-row offsets: measured 6-11% slower on the demo model); from two rows on, the rows share one
    BatchKVCache per layer, and back to plain when one row is left."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.rows: list[PrefillResult] = []  # each row's prefill: its prompt, plan and mRoPE delta
        self.lengths: list[int] = []  # tokens in each row's cache, as of the last part() fed
        self.cache: list = []  # per layer: the lone row's KVCache, or a BatchKVCache when batched; [] with no rows
        self.batched = False
        # When batched on a model whose rows keep their KV in segments (runner.rows_kv): the rows'
        # KV, and `cache` is its layers' views
        self.segments: RowsKV | None = None
        self.num_fed = 0  # tokens each row was fed by the last part(); 0 once took_step() saw them
        # A hybrid model's step that feeds drafts (start_drafts(); both None once it is verified):
        # each recurrent layer's open speculative transaction (layer, generation), which keeps its
        # state after every token the step fed (num_fed) until trim() keeps each row's verified
        # ones; or, where the library keeps no such states, the lone row's states before the step
        # (kept_state, for roll_back()).
        self.speculation: list[tuple] | None = None
        self.kept_state: list | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, prefill: PrefillResult) -> None:
        """Add a prefilled sequence as the last row. KV layers merge into the library's
        BatchKVCache, a hybrid model's recurrent layers into its ArraysCache (stacked states)."""
        if not self.rows and first_own_token(prefill.cache):  # its prompt reads cached blocks in place
            self.segments = self._new_segments(len(prefill.cache))
            self._add_row(prefill)
            self.cache, self.batched = self.segments.layers, True
        elif not self.rows:
            self.cache = prefill.cache
        elif self.segments is not None:
            self._add_row(prefill)
        elif not self.batched and self.runner.rows_kv:
            self.segments = self._new_segments(len(self.cache))
            self.rows[0].cache = self.cache
            self._add_row(self.rows[0])
            self._add_row(prefill)
            self.cache, self.batched = self.segments.layers, True
        else:
            assert self.runner.batchable, "a model without a batched cache decodes one sequence at a time"
            if self.batched:
                for layer, own in zip(self.cache, prefill.cache):
                    layer.extend(self._merge([own]))
            else:
                self.cache = [self._merge([lone, own]) for lone, own in zip(self.cache, prefill.cache)]
                self.batched = True
        self.rows.append(prefill)
        self.lengths.append(prefill.prompt.num_tokens)

    def own_copy(self, prefill: PrefillResult) -> None:
        """A prompt that read its prefix in place, about to join alone: its cache becomes a copy of its
        own (the caller reserved it), letting go of the blocks it read."""
        assert not self.rows and prefill.plan is not None
        prefill.cache = plain_caches(prefill.cache, self.runner.cache_classes.KVCache)
        prefill.plan.session.unmap()

    def _new_segments(self, num_layers: int) -> RowsKV:
        return RowsKV(self.runner.cache_classes.KVCache, num_layers, self.runner.caches.config.block_size)

    def _add_row(self, prefill: PrefillResult) -> None:
        """The row into the segments: the blocks of its prompt that the prefix cache holds are read
        there in place (mapped: held until its session closes; a prompt that came in reading its
        prefix in place maps on past it), so its own copy of them goes."""
        assert self.segments is not None
        blocks = prefill.plan.session.map(prefill.prompt.num_tokens) if prefill.plan is not None else []
        self.segments.add(prefill.cache, [block.kv for block in blocks])
        if blocks:
            prefill.cache = []  # held by the segments (leave() gives the row its KV back)

    def collapse(self) -> None:
        """The lone row in segments back on a plain cache of its own (one copy; a lone row decodes
        faster there over long contexts: 15.8 against 21.5 ms a demo-model step at 11,000 tokens),
        letting go of the cached blocks it read. The caller first makes room for that copy
        (DecodeRows.leave), else the row stays in segments: its KV is never held twice uncounted."""
        assert self.segments is not None and len(self.rows) == 1
        self.cache, self.batched, self.segments = self.segments.remove(0), False, None
        if self.rows[0].plan is not None:
            self.rows[0].plan.session.unmap()

    def _own_kv(self, row: PrefillResult, num_shared: int, index: int) -> list:
        """Row `index` out of the segments: its own tokens copied into the library's caches, behind
        the cached blocks it read in place (MappedKV layers: finish() stores from there, so its
        prompt's blocks are not copied out only to be found cached)."""
        assert self.segments is not None
        caches = self.segments.remove(index, num_shared)
        if not num_shared:
            return caches
        block = self.runner.caches.config.block_size
        mapped = row.plan.session.mapped  # type: ignore[union-attr]
        assert len(mapped) * block == num_shared, (len(mapped), num_shared)
        return [MappedKV(own, [b.kv[layer] for b in mapped], block) for layer, own in enumerate(caches)]

    def shared_tokens(self, index: int) -> int:
        """Row `index`'s tokens read in place from cached blocks (0 unless in segments)."""
        return self.segments.rows[index].num_shared if self.segments is not None else 0

    def _merge(self, layers: list):
        if is_recurrent(layers[0]):
            return type(layers[0]).merge(layers)
        return self.runner.cache_classes.BatchKVCache.merge(layers)

    def took_step(self) -> None:
        """The step of the last part() ran (rows in segments count its tokens' KV as whole). A hybrid
        model's rows whose cache now ends on a block
        boundary keep their recurrent state there (finish() stores it with the block it ends, so the
        next turn resumes past the reply): a copy, evaluated now, since a row of the batched state
        would keep the whole batch's buffer alive."""
        fed, self.num_fed = self.num_fed, 0
        if self.segments is not None:
            self.segments.confirm()
        if not fed or not self.runner.recurrent or self.runner.caches.prefix is None:
            return  # no step since the last call, no recurrent state, or nowhere to keep it
        block = self.runner.caches.config.block_size
        for index, length in enumerate(self.lengths):
            if length % block == 0:
                state = recurrent_state(self.cache, self.runner.recurrent, index if self.batched else None)
                state = tuple(tuple(mx.contiguous(array) for array in arrays) for arrays in state)
                mx.eval([array for arrays in state for array in arrays])
                self.rows[index].snapshot = (length, state)

    def step(self, tokens: list[int]) -> mx.array:
        """Feed row i the token tokens[i]; the next-token logits, one row each: (rows, vocab)."""
        logits = self.runner.run_step([self.part([[token] for token in tokens])])[0]
        self.took_step()
        return logits

    def part(self, tokens: list[list[int]]) -> Part:
        """Row i fed tokens[i] (the same count per row), as one part of a step: logits come back
        for every token fed, row-major."""
        ids = mx.array(tokens, dtype=mx.int32)
        self.lengths = [length + ids.shape[1] for length in self.lengths]
        self.num_fed = ids.shape[1]
        # mRoPE families give every row a delta, plain-RoPE families none
        deltas = [row.rope_delta for row in self.rows if row.rope_delta is not None] or None
        return Part(
            self.cache,
            ids,
            positions=decode_positions(self._offsets(ids.shape[1]), deltas, ids.shape[1]),
            keep=ids.shape[1],
        )

    def _offsets(self, num_tokens: int) -> mx.array | int:
        """Each row's KV length before this part (RoPE's offset): one per row when batched."""
        if self.segments is not None:
            return self.segments.feed(num_tokens)  # room made for the part's tokens
        kv_layer = next((layer for layer in self.cache if not is_recurrent(layer)), None)  # none: all recurrent
        return kv_layer.offset if self.batched and kv_layer is not None else cache_offset(self.cache, 0)

    def trim(self, num_tokens: list[int]) -> None:
        """Drop the last num_tokens[i] tokens of row i's KV (draft tokens a verification rejected).
        The batched cache keeps one write position for all rows: what they share is cut, and each
        row's remaining extra is rolled out to its left, where it becomes padding (as the library
        does for right padding), so every row's KV still ends at the shared position. A hybrid
        model's recurrent layers take each row's state after the tokens it keeps (start_drafts())."""
        assert len(num_tokens) == len(self.rows) and min(num_tokens, default=0) >= 0
        states_kept = self.speculation is not None
        if states_kept:
            self._keep_states(num_tokens)
        assert not self.runner.recurrent or not any(num_tokens) or states_kept, "a recurrent state cannot be trimmed"
        self.lengths = [length - n for length, n in zip(self.lengths, num_tokens)]
        if self.segments is not None:
            self.segments.trim(num_tokens)
            return
        kv_layers = [layer for layer in self.cache if not is_recurrent(layer)]
        if not self.batched:
            for layer in kv_layers:
                layer.trim(num_tokens[0])
            return
        shared = min(num_tokens)
        extra = mx.array([n - shared for n in num_tokens])
        for layer in kv_layers:
            layer.trim(shared)
            if shared == max(num_tokens):
                continue
            end = layer._idx  # the library's own write position (it has no public name)
            layer.keys[..., :end, :] = _roll_rows(layer.keys[..., :end, :], extra)
            layer.values[..., :end, :] = _roll_rows(layer.values[..., :end, :], extra)
            layer.left_padding = layer.left_padding + extra
            layer.offset = layer.offset - extra

    def start_drafts(self, num_tokens: int) -> None:
        """Before a hybrid model's step that feeds each row num_tokens (its pending token, then
        drafts it may reject): every recurrent layer keeps its state after each of them (trim()
        keeps each row's verified ones), or, where the library keeps none (runner.draft_states), the
        lone row keeps its states as they are (the arrays themselves: a step replaces them, never
        writes into them) for roll_back()."""
        if self.runner.draft_states:
            layers = [layer for layer in self.cache if is_recurrent(layer)]
            self.speculation = [(layer, layer.start_speculation(num_tokens)) for layer in layers]
            return
        assert not self.batched, "a batch cannot run one row's tokens again"
        self.kept_state = [list(layer.cache) if is_recurrent(layer) else None for layer in self.cache]

    def _keep_states(self, rejected: list[int]) -> None:
        """Each recurrent layer's state after the tokens row i kept (all it was fed but rejected[i]);
        the transactions end."""
        assert self.speculation is not None and self.num_fed, "trim() before took_step()"
        transactions, self.speculation = self.speculation, None
        kept = [self.num_fed - n for n in rejected]
        for layer, generation in transactions:
            layer.commit_speculation(kept, generation)

    def roll_back(self) -> None:
        """Undo the last part() of the lone row: its KV trimmed by what was fed, its recurrent states
        those start_drafts() kept (the row then feeds the tokens it keeps again)."""
        assert self.kept_state is not None and not self.batched
        for layer, kept in zip(self.cache, self.kept_state):
            if kept is None:
                layer.trim(self.num_fed)
            else:
                layer.cache = kept
        self.lengths = [length - self.num_fed for length in self.lengths]
        self.kept_state, self.num_fed = None, 0

    def leave(self, index: int) -> PrefillResult:
        """Remove row `index`; its prefill, with `cache` holding the row's own KV again (for finish())."""
        row = self.rows.pop(index)
        del self.lengths[index]
        # Between a drafted step and its verification a row leaves only when the step failed, and
        # then every row does (DecodeRows.fail_all): the open transactions go with their layers.
        self.kept_state = self.speculation = None
        if not self.batched:
            row.cache, self.cache = self.cache, []
            return row
        if self.segments is not None:
            row.cache = self._own_kv(row, self.segments.rows[index].num_shared, index)
            if not self.rows:
                self.cache, self.batched, self.segments = [], False, None
            elif len(self.rows) == 1 and not self.shared_tokens(0):
                self.collapse()  # back to the lone row's own cache (one that reads cached blocks: see collapse())
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
            token = sampler(logits, generated)
            if token in runner.eos_ids:
                return
            generated.append(token)
            yield token
            if cancelled():
                raise Cancelled()
            logits = batch.step([token])[0]
    finally:
        batch.leave(0)
