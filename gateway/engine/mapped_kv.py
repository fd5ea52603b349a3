"""A prompt's KV whose first tokens are cached blocks read in place: a prefix-cache hit copies nothing.

Before, a prompt that hit the prefix cache gathered its cached blocks into a cache of its own (a copy
of the whole prefix, every layer, held beside the blocks until the prompt joined the decode rows and
counted twice under the budget meanwhile). Here each layer's cache is a `MappedKV`: the blocks the
prompt's session maps (PrefixSession.map: held while it runs, never written) and the library's own
KVCache for the tokens past them — the partly filled last block copied in (the one copy-on-write),
then every token the prompt computes. A chunk's attention reads the blocks and its own tokens as one
array per layer, made for that layer's call and dropped after it: a transient of one layer, where
the gather held every layer for the prompt's life. The prompt's own KV (`keys`, `values`) starts at
token `start`; the prefix cache's store() and the decode rows' segments take it from there.

Invariant: `start` == len(blocks) * block_tokens; blocks[i] holds this layer's tokens
[i * block_tokens, (i + 1) * block_tokens); `offset` == start + own.offset.
"""

from __future__ import annotations

import mlx.core as mx


class MappedKV:
    """One layer's cache of a prompt whose first `start` tokens are mapped cached blocks."""

    def __init__(self, own, blocks: list[tuple[mx.array, mx.array]], block_tokens: int):
        assert blocks, "a prompt with no mapped block keeps the library's cache"
        self.own = own  # the library's KVCache: the tokens from `start` on
        self.blocks = blocks  # this layer's (keys, values) of each mapped block, (1, kv_heads, block_tokens, head_dim)
        self.start = len(blocks) * block_tokens

    @property
    def offset(self) -> int:
        return self.start + self.own.offset

    @property
    def keys(self) -> mx.array:
        """The own tokens' buffer (its first own.offset tokens valid), as the library's cache names it."""
        return self.own.keys

    @property
    def values(self) -> mx.array:
        return self.own.values

    @property
    def state(self):
        return self.own.state

    def make_mask(self, *args, **kwargs):
        """The library's mask for new tokens after `offset` (its class's own rule, at this offset)."""
        return type(self.own).make_mask(self, *args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append the new tokens to the own cache; every token's keys and values for this call."""
        own_keys, own_values = self.own.update_and_fetch(keys, values)
        return (
            mx.concatenate([k for k, _ in self.blocks] + [own_keys], axis=2),
            mx.concatenate([v for _, v in self.blocks] + [own_values], axis=2),
        )


def plain_caches(cache: list, kv_cache_class: type) -> list:
    """A prompt's MappedKV layers as the library's plain caches holding all its tokens: one copy of
    the blocks, as the prefix's gather made before (a lone row decodes there)."""
    caches = []
    for layer in cache:
        kv, num_own = kv_cache_class(), layer.own.offset
        kv.update_and_fetch(
            mx.concatenate([k for k, _ in layer.blocks] + [layer.own.keys[:, :, :num_own]], axis=2),
            mx.concatenate([v for _, v in layer.blocks] + [layer.own.values[:, :, :num_own]], axis=2),
        )
        caches.append(kv)
    return caches


def first_own_token(cache: list) -> int:
    """The first token a prompt's cache holds itself (0 unless its prefix is mapped blocks)."""
    return cache[0].start if cache and isinstance(cache[0], MappedKV) else 0
