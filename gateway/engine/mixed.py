"""One model call over several sequences of different query lengths: decode rows and prefill chunks.

MLX's batched cache (BatchKVCache) holds rows that each take the same number of new tokens per call,
so a decode step (one token per row) and a prompt chunk (hundreds of tokens of one sequence) used to
be two calls, each streaming every weight. Here they are packed into one sequence of N tokens,
(1, N, hidden), and run through the library's own model code once: embeddings, norms, MLPs and the
output head see the packed tokens as one sequence (one matmul per weight). Only attention must keep
the sequences apart (and a hybrid model's recurrent state, per sequence as KV is), so each layer's
attention module or recurrent mixer gets, instead of a cache, a `SegmentCache`:
the packed tokens' segments in order, each with its own cache (the decode rows' BatchKVCache, a
prompt's own KVCache). The attention module (a subclass swapped onto this instance, see `install`)
then runs its own unchanged code once per segment, with that segment's cache, mask and positions,
and concatenates the outputs. Masks come from the segments' caches (the model asks its cache for a
mask with the window it wants; a SegmentCache answers with one mask per segment). Positions come
from each segment's cache offset (plain RoPE) or from the packed mRoPE ids, cut per segment.

Invariant: segment i covers packed tokens [start_i, start_i + rows_i * tokens_i), row-major (row 0's
tokens, then row 1's), and the segments tile [0, N) in order. Several segments may share a cache (one
prompt's pieces, cut at a hybrid's snapshot points): they run in order, each continuing the last, and
a later one's mask is made as its cache will stand when it runs.
Measured equal: greedy tokens of mixed steps equal each sequence run alone, every family
(tests/gateway/test_batch.py).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class Segment:
    cache: object  # this layer's cache of the segment: a KVCache (one row) or a BatchKVCache
    start: int  # first packed token
    rows: int
    tokens: int  # new tokens per row
    after: Callable[[], None] | None = None  # called once this segment ran (a piece keeps its state)

    @property
    def end(self) -> int:
        return self.start + self.rows * self.tokens


@dataclass(frozen=True, slots=True)
class SegmentMasks:
    """One attention mask per segment, as each segment's cache made it."""

    masks: tuple


class SegmentCache:
    """What one layer's attention gets in a packed call: the segments and their caches."""

    offset = 0  # the packed sequence has no single offset; model code that reads one sees 0

    def __init__(self, segments: list[Segment]):
        self.segments = segments

    def make_mask(self, num_tokens: int, **options) -> SegmentMasks:
        """Each segment's cache makes its own mask with the model's options (an attention layer's
        window; a recurrent layer's cache takes none)."""
        assert num_tokens == self.segments[-1].end, "the packed call's length"
        masks, ahead = [], Counter[int]()  # tokens the earlier segments on a cache add before a later one runs
        for segment in self.segments:
            cache = segment.cache
            if ahead[id(cache)] and hasattr(cache, "offset"):  # a recurrent layer's mask has no position
                cache = _Ahead(cache, ahead[id(cache)])
            masks.append(type(segment.cache).make_mask(cache, segment.tokens, **options))  # type: ignore[attr-defined]
            ahead[id(segment.cache)] += segment.tokens
        return SegmentMasks(tuple(masks))

    def run(self, module, call, bound: inspect.BoundArguments) -> mx.array:
        """`call` (the attention module's own __call__) once per segment; outputs packed again."""
        arguments = dict(bound.arguments)
        for name in UNUSED_PARAMETERS.intersection(arguments):
            if arguments[name] is not None:
                _unsupported(name, arguments[name])
        x_name = list(arguments)[1]  # after self
        packed = arguments[x_name]
        outputs = []
        for index, segment in enumerate(self.segments):
            own = dict(arguments)
            own[x_name] = packed[:, segment.start : segment.end].reshape(segment.rows, segment.tokens, -1)
            own["cache"] = segment.cache
            mask = own.get("mask")
            own["mask"] = mask.masks[index] if isinstance(mask, SegmentMasks) else _unsupported("mask", mask)
            positions = own.get("position_ids")
            if isinstance(positions, mx.array):
                cut = positions[..., segment.start : segment.end]
                own["position_ids"] = cut.reshape(positions.shape[0], segment.rows, segment.tokens)
                if own.get("position_embeddings") is not None:  # the model's own once-per-call rotary tables
                    own["position_embeddings"] = module.rotary_emb(own[x_name], own["position_ids"])
            own_bound = inspect.BoundArguments(bound.signature, own)
            out = call(*own_bound.args, **own_bound.kwargs)
            outputs.append(out.reshape(1, segment.rows * segment.tokens, -1))
            if segment.after is not None:
                segment.after()
        return mx.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]


class _Ahead:
    """A cache as a later segment on it sees it: `tokens` further on than it stands now."""

    def __init__(self, cache, tokens: int):
        self.cache_now = cache
        self.offset = cache.offset + tokens

    def __getattr__(self, name: str):
        return getattr(self.cache_now, name)


def _unsupported(name: str, value):
    raise NotImplementedError(f"a packed call cannot cut this layer's {name} per segment: {type(value).__name__}")


# Where a layer keeps the module that takes its cache: attention, and the recurrent mixers of hybrid
# models (qwen3_next's and Qwen3.5's gated delta under `linear_attn`, Nemotron-H's Mamba or attention
# under `mixer`, LFM2's short convolution under `conv`). A recurrent state is per sequence just as KV
# is, so it runs per segment the same way.
CACHED_MODULES = ("self_attn", "linear_attn", "mixer", "conv")


def install(language_model) -> int:
    """Let each module of this instance that takes a cache run packed calls: its class gets a
    subclass whose __call__ hands a SegmentCache its own code, and runs as before for any other
    cache. Returns how many modules take a cache (the runner packs only if that is every layer's)."""
    from .attention import swap_layer_classes

    return sum(swap_layer_classes(language_model, name, _segmented_class) for name in CACHED_MODULES)


# What a packed call can cut per segment: the hidden states, the cache, the mask (each segment's
# cache makes its own), and positions. A module that takes more (Gemma 4's attention passes KV and
# offsets on to the layers that share them) keeps its class, and the runner then calls parts one by one.
SEGMENTABLE_PARAMETERS = {
    "self",
    "x",
    "hidden_states",
    "inputs",
    "mask",
    "cache",
    "position_ids",
    "position_embeddings",
}
# Hooks a packed call can pass through only while unused (LFM2's short convolution takes a list that
# collects states for speculative decoding): checked per call, before any segment runs.
UNUSED_PARAMETERS = {"gdn_sink"}


@cache
def _segmented_class(base: type) -> type | None:
    call = base.__call__
    signature = inspect.signature(call)
    if "cache" not in signature.parameters or set(signature.parameters) - SEGMENTABLE_PARAMETERS - UNUSED_PARAMETERS:
        return None  # takes no cache (Nemotron-H's MLP "mixer"), or what cannot be cut per segment

    def __call__(self, *args, **kwargs):
        cache_arg = kwargs.get("cache")
        if cache_arg is None:
            bound = signature.bind(self, *args, **kwargs)
            cache_arg = bound.arguments.get("cache")
        if not isinstance(cache_arg, SegmentCache):
            return call(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return cache_arg.run(self, call, bound)

    return type(f"Segmented{base.__name__}", (base,), {"__call__": __call__})
