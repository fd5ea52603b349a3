"""The MLX model run: embeddings (with image features), chunked prefill, decode steps (sampling.py draws).

One generic implementation for every family (gateway/engine/families.py holds the per-family data):
the library's own loader, processor, cache classes and language-model call; Strata's own block
hashing, image keys, vision-feature reuse and explicit positions. Positions come from the cache
offset (plain RoPE), or for the Qwen VL line are mRoPE ids computed once per prompt, so any chunking
of the prompt (and any cached prefix) sees exactly the positions a one-shot prefill would.

Owned by the engine's single worker thread: MLX is not thread-safe, so no other thread may call in.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from kvcache import PrefixSession, TenantSalt, is_recurrent, state_nbytes
from vision import DecodedImage, pixel_hash, processor_fingerprint

from .activations import install_cpu_expert_activations, install_cpu_prefill_activations
from .attention import install_cpu_prefill_attention
from .caching import CacheConfig, EngineCaches, PrefixPlan, PrefixReport, VisionReport
from .constraint import Grammars
from .decode_kernel import build_decode_kernel
from .experts import install_grouped_experts
from .families import Family, family_of, read_config
from .mapped_kv import MappedKV, first_own_token
from .mixed import Segment, SegmentCache
from .mixed import install as install_packed_calls
from .mtp import load_heads
from .native import keep_freed_memory
from .prompt import PreparedPrompt, PromptBuilder, PromptImage
from .recurrent import install_chunked_prefill, install_cpu_ssd
from .rows_kv import RowsKV, rows_supported
from .types import Pin

log = logging.getLogger("strata.engine")
BATCHED_CACHE_TYPES = ("KVCache", "ArraysCache")  # per-layer caches the libraries can batch
LAST_TOKEN_POOLING = ("qwen3",)  # model types whose mlx-vlm embedding model pools the last token
# A hybrid prompt's lasting snapshots are spaced so that they hold about a quarter of the bytes of
# the KV they sit among: on the demo Qwen3.5 a snapshot weighs as much as 137 tokens' KV, so one every
# 18 blocks of 32. Within 8 blocks — each snapshot point cuts its prefill chunk into one more piece
# of the call (per-piece attention and recurrent calls): LFM2-VL's cheap short-convolution state at
# every 4 blocks made a cold 1,013-token prompt 518 ms against 492 at every 8 — and 64 (2,048 tokens,
# mlx-vlm's APC checkpoint interval: a prompt parting from a cached one recomputes at most that much).
SNAPSHOT_SHARE = 4
SNAPSHOT_BLOCKS = (8, 64)


class Cancelled(Exception):
    """The request was cancelled (client gone) between two model steps."""


@dataclass(frozen=True, slots=True)
class ModelInputs:
    ids: mx.array  # (1, L) all prompt token ids
    embeds: mx.array | None  # (1, L - cached, hidden) with image features spliced in; None: no image to run
    positions: mx.array | None  # (3, 1, L) mRoPE positions of the whole prompt; None: from the cache offset
    # Qwen3-VL's "deepstack": visual features added to the first decoder layers' hidden states at the
    # image tokens. (layers, L - cached, hidden), and which of those L - cached positions are image rows.
    deepstack: mx.array | None = None
    visual: np.ndarray | None = None


@dataclass(slots=True)
class Part:
    """One segment of a step's model call: `ids` (rows, tokens) fed on `cache` (per layer: a
    prompt's own KVCache, or the decode rows' cache); logits come back for each row's last `keep`
    tokens. A prompt chunk names its admission and the prompt position it starts at (`begin`); the
    admission advances once the step ran."""

    cache: list
    ids: mx.array
    embeds: mx.array | None = None  # (1, tokens, hidden) with image rows spliced in; None: from ids
    positions: mx.array | None = None  # (3, rows, tokens) mRoPE ids; None: from the cache offsets
    extra: dict = field(default_factory=dict)  # the library's deepstack arguments, chunks only
    keep: int = 1
    admission: Admission | None = None
    begin: int = 0
    # A hybrid prompt's piece that ends at a snapshot point inside its step's chunk (chunk_parts):
    # its recurrent layers' state where it ends (layer index -> arrays), taken during the call,
    # before the next piece moves it on. None: no state to take (the last piece's is the cache's).
    states: dict[int, tuple] | None = None


@dataclass(slots=True)
class Admission:
    """A prompt on its way into the KV: its own cache (the reused prefix copied in, or mapped), the prefix plan
    that stores its blocks as chunks complete them, and its inputs. It keeps no count of the tokens
    computed: its owner does (the worker's Sequence.num_computed_tokens, prefill_steps' loop) and
    names it in each call. `logits` is set once a chunk ended at the prompt's last token."""

    prompt: PreparedPrompt
    cache: list
    plan: PrefixPlan | None
    prefix: PrefixReport
    vision: VisionReport
    vision_ms: float
    inputs: ModelInputs
    rope_delta: int | None
    first: int  # the first token not reused from the prefix cache
    # A hybrid model's recurrent layers (indices into cache) and the prompt positions after which
    # their state is snapshotted into the block ending there; chunks end at them. Empty otherwise.
    # Of those, the passing points mark only where this prompt ends (its retry resumes there): a
    # later request that resumes past them drops them (kvcache's Block.passing).
    recurrent: tuple[int, ...] = ()
    snapshot_points: frozenset[int] = frozenset()
    passing_points: frozenset[int] = frozenset()
    spent_s: float = 0.0  # time in this prompt's setup and steps (a step's whole time counts)
    logits: mx.array | None = None

    @property
    def done(self) -> bool:
        return self.logits is not None

    @property
    def num_mapped_tokens(self) -> int:
        """Of the reused prefix, the tokens read in place from cached blocks (mapped_kv.py)."""
        return first_own_token(self.cache)

    def advance(
        self, caches: EngineCaches, end: int, last_logits: mx.array, spent_s: float, states: dict | None = None
    ) -> None:
        """A step ran the prompt up to `end`: store the blocks that completed (and at a snapshot
        point, the recurrent state with the block it ends: `states`, taken inside the call where a
        later piece of the prompt ran after this one, else the cache's)."""
        self.spent_s += spent_s
        if self.plan:
            snapshot = None
            if end in self.snapshot_points and states is not None:  # every recurrent layer's, or a KeyError
                snapshot = (end, tuple(states[i] for i in self.recurrent))
            elif end in self.snapshot_points:
                snapshot = self._snapshot(end)
            caches.store(self.plan, self.prompt.token_ids, self.cache, end, snapshot, end in self.passing_points)
            self.plan.session.let_go()  # cached copies, not held: the prompt's cache has the KV
        if end == self.prompt.num_tokens:
            self.logits = last_logits

    def close(self, caches: EngineCaches | None = None, computed: int = 0) -> None:
        """Give up the prompt (cancelled, failed, preempted): blocks stored so far stay cached. With
        `caches` (cancelled or preempted between steps, so the cache holds exactly `computed` tokens),
        a hybrid model's recurrent state is snapshotted there too, so a retry resumes where it stopped."""
        if not self.plan:
            return
        try:
            if caches is not None and self.recurrent and computed and computed % caches.config.block_size == 0:
                caches.store(
                    self.plan, self.prompt.token_ids, self.cache, computed, self._snapshot(computed), passing=True
                )
        finally:
            self.plan.session.close()

    def _snapshot(self, computed: int) -> tuple[int, tuple]:
        """The recurrent layers' state now, labelled with the tokens it follows (a block boundary)."""
        return computed, recurrent_state(self.cache, self.recurrent)

    def result(self) -> PrefillResult:
        assert self.logits is not None, "every prompt token has run"
        return PrefillResult(
            self.logits,
            self.cache,
            self.rope_delta,
            self.prompt,
            self.plan,
            self.prefix,
            self.vision,
            self.spent_s * 1000,
            self.vision_ms,
        )


@dataclass(slots=True)
class PrefillResult:
    logits: mx.array  # (vocab,) for the last prompt position
    cache: list
    rope_delta: int | None  # mRoPE: decode position = cache offset + rope_delta; None: plain RoPE
    prompt: PreparedPrompt
    # Open until finish(), which stores and holds the blocks again to pin them. Meanwhile the session
    # holds none (let_go): the sequence's own cache has its KV, so the budget counts it once, and the
    # cached copies give way to running sequences like any free block.
    plan: PrefixPlan | None
    prefix: PrefixReport
    vision: VisionReport
    prefill_ms: float
    vision_ms: float
    # A hybrid model's recurrent state at the latest block boundary its decoding passed (tokens,
    # state): finish() stores it with the block it ends, so the next turn resumes from there.
    snapshot: tuple[int, tuple] | None = None


class ModelRunner:
    def __init__(self, model_path: Path | str, cache_config: CacheConfig, model_fingerprint: str):
        self.family = family_of(Path(model_path))  # UnsupportedModel before anything loads
        config = read_config(Path(model_path))
        self.model, self.processor, self.lm, self.cache_classes = _load(self.family, Path(model_path))
        weights: list[tuple[str, mx.array]] = tree_flatten(self.model.parameters())  # type: ignore[assignment]
        self.weights_nbytes = sum(array.nbytes for _, array in weights)
        layers = self.new_cache()
        # A hybrid model's recurrent layers (their state is snapshotted at block boundaries).
        self.recurrent = tuple(index for index, layer in enumerate(layers) if is_recurrent(layer))
        # Every layer holds plain KV (sliding windows included) or a recurrent state: the library's
        # batched classes (BatchKVCache, ArraysCache) let sequences decode in one batch.
        self.batchable = all(type(layer).__name__ in BATCHED_CACHE_TYPES for layer in layers)
        self.cpu_attention = install_cpu_prefill_attention(self.lm) > 0
        install_cpu_prefill_activations(self.lm)
        install_chunked_prefill(self.lm)
        install_cpu_ssd(self.lm)
        install_grouped_experts(self.lm)
        install_cpu_expert_activations(self.lm)
        num_packable = install_packed_calls(self.lm)
        keep_last_position_logits(self.lm)
        # The checkpoint's MTP layers (gateway/engine/mtp.py), or None. With them, each step keeps the
        # decode rows' last hidden states (decode_hidden: the final norm's input at the positions
        # whose logits come back, rows x kept, as the logits are laid out).
        self.heads = load_heads(Path(model_path), self.model)
        self.decode_hidden: mx.array | None = None
        if self.heads is not None:
            tap_final_hidden(self.lm)
        self.prompts = PromptBuilder(self.processor, self.family)
        # The token the model's own code treats as an image row (deepstack rows go there).
        model_config = getattr(self.model, "config", None)
        self.image_token_id = getattr(model_config, "image_token_index", None) or getattr(
            model_config, "image_token_id", None
        )
        # ... and a video frame's row (Qwen3-VL's deepstack rows go at both)
        self.video_token_id = getattr(model_config, "video_token_id", None)
        self.tokenizer = self.prompts.tokenizer
        self.eos_ids = eos_ids(Path(model_path), config, self.tokenizer)
        self.max_positions = int(_text_setting(config, "max_position_embeddings") or 32768)
        self.vocab_size = int(_text_setting(config, "vocab_size") or len(self.tokenizer))
        image_processor = getattr(self.processor, "image_processor", None)
        fingerprint = processor_fingerprint(vars(image_processor)) if image_processor is not None else "text"
        self.caches = EngineCaches(cache_config, model_fingerprint, fingerprint)
        self.num_encoder_calls = 0
        self.kv_bytes_per_token = 0  # measured by warm_up(): the worker reserves running KV by it
        self.state_bytes = 0  # ... and a hybrid model's recurrent state, fixed per sequence
        # Families whose embedding checkpoints mlx-vlm runs by pooling the same decoder (qwen3 ->
        # qwen3_embedding: the final hidden state of the last token, L2-normalised).
        self.poolable = config.get("model_type") in LAST_TOKEN_POOLING and hasattr(self.lm, "model")
        # Whether several parts can share one model call (gateway/engine/mixed.py): every cached
        # layer's module runs per segment. A family with other cached modules (Nemotron-H's Mamba
        # "mixer"), or whose attention takes an argument a packed call cannot cut, runs its parts one by one.
        self.packable = num_packable == len(layers)

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """The text's embedding as mlx-vlm's embedding model of this family computes it (poolable only)."""
        hidden = self.lm.model(mx.array([token_ids], dtype=mx.int32))[0, -1].astype(mx.float32)
        return np.array(hidden / mx.linalg.norm(hidden))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """llguidance's view of the vocabulary (built on first use: ~1 s for a 150k vocabulary)."""
        return Grammars(self.tokenizer, self.vocab_size, self.eos_ids)

    def warm_up(self) -> None:
        """Run the text and vision paths once: MLX builds its kernels on first use (~2 s here),
        which would otherwise land on the first request's TTFT. Touches no cache."""
        self._measure_bytes()
        if self.family.image_placeholder:
            from PIL import Image

            image = Image.new("RGB", (56, 56))
            decoded = DecodedImage(image, pixel_hash(image), 56, 56)
            mx.eval(self._encode_image(self.prompts.process_image(decoded)))
        self.num_encoder_calls = 0
        self.caches.judge_ssd(self._prefill_s_per_token, self.kv_bytes_per_token)
        assert isinstance(self.draft_states, bool)  # probed now, not at a hybrid model's first drafts
        if self.cpu_attention:
            keep_freed_memory()  # a step's arrays reuse the last step's memory, not fresh pages
            build_decode_kernel()  # the decode rows' attention kernel: compiled once per machine, ~1 s
            assert isinstance(self.rows_kv, bool)  # decided now (its kernel built), not at the first batch

    def _measure_bytes(self) -> None:
        """A token's KV bytes and a recurrent state's bytes, from one short text call."""
        cache = self._short_prompt_cache(8)
        self.kv_bytes_per_token = kv_bytes_per_token(cache)
        self.state_bytes = state_nbytes(recurrent_state(cache, self.recurrent))

    @functools.cached_property
    def rows_kv(self) -> bool:
        """Whether decode rows keep their KV in segments on this model (gateway/engine/rows_kv.py):
        every layer plain KV without a window, attention on the CPU path, KV the kernel takes, the
        kernel built; and a step of two rows of different lengths through the segments gives the
        logits the library's batched cache gives (a family whose attention read its keys anywhere
        but through the patched call would not, and keeps the library's cache)."""
        if self.recurrent or not self.batchable or self.family.window_as_mask or not self.cpu_attention:
            return False
        caches = [self._short_prompt_cache(words) for words in (3, 7)]
        if not rows_supported(caches[0][0].keys):
            return False
        ids = mx.array([[1], [2]], dtype=mx.int32)
        deltas = [0, 0] if self.family.positions == "mrope" else None
        batched = [self.cache_classes.BatchKVCache.merge(list(layers)) for layers in zip(*caches)]
        expected = self._call_one(Part(batched, ids, positions=decode_positions(batched[0].offset, deltas)))[0]
        rows = RowsKV(self.cache_classes.KVCache, len(caches[0]), self.caches.config.block_size)
        for cache in caches:
            rows.add(cache)
        got = self._call_one(Part(rows.layers, ids, positions=decode_positions(rows.feed(1), deltas)))[0]
        agree = rows.num_attended == len(caches[0]) and bool(mx.allclose(expected, got, rtol=1e-3, atol=1e-3))
        if not agree:
            log.warning("decode rows keep the library's batched cache: through segments a step's logits differed")
        return agree

    @functools.cached_property
    def draft_states(self) -> bool:
        """Whether a hybrid model's recurrent layers keep their state after each token a step feeds,
        so a row that rejects drafts takes the state after its last kept token instead of running
        the kept tokens again (DecodeBatch.start_drafts()). mlx-vlm's ArraysCache records those
        states inside a speculative transaction when the layer's update goes through the cache
        (Qwen3.5's gated delta and its convolution window); probed: a two-token step inside a
        transaction must leave a full record in every recurrent layer."""
        if not self.recurrent:
            return False
        cache = self._short_prompt_cache(3)
        layers = [cache[index] for index in self.recurrent]
        if not all(callable(getattr(layer, "start_speculation", None)) for layer in layers):
            return False
        generations = [layer.start_speculation(2) for layer in layers]
        deltas = [0] if self.family.positions == "mrope" else None
        ids = mx.array([[1, 2]], dtype=mx.int32)
        try:
            mx.eval(self._call_one(Part(cache, ids, positions=decode_positions(cache_offset(cache, 0), deltas, 2))))
            for layer, generation in zip(layers, generations):
                layer.validate_speculation([1], generation)
        except (RuntimeError, ValueError) as exc:  # the layer's update left no record, or a partial one
            log.info("a hybrid row that rejects drafts runs its kept tokens again: no state per token (%s)", exc)
            return False
        return True

    def _short_prompt_cache(self, words: int) -> list:
        """A new cache holding a short text prompt's KV."""
        ids = mx.array([self.tokenizer.encode("warm up " * words, add_special_tokens=False)], dtype=mx.int32)
        positions = _plain_mrope(ids.shape[1]) if self.family.positions == "mrope" else None
        cache = self.new_cache()
        mx.eval(self._call_one(Part(cache, ids, positions=positions)))
        return cache

    @functools.cached_property
    def snapshot_blocks(self) -> int:
        """Blocks between a hybrid prompt's lasting snapshots: the setting, or by default the spacing
        at which snapshots hold about 1/SNAPSHOT_SHARE of the KV bytes they sit among (a snapshot
        of S bytes every SNAPSHOT_SHARE * S / kv_bytes_per_token tokens), within SNAPSHOT_BLOCKS."""
        if self.caches.config.snapshot_blocks is not None:
            return self.caches.config.snapshot_blocks
        if not self.state_bytes:
            self._measure_bytes()
        block = self.caches.config.block_size
        fewest, most = SNAPSHOT_BLOCKS
        if not self.kv_bytes_per_token:  # no attention layer: the snapshots are all a prefix holds
            return most
        return min(most, max(fewest, -(-SNAPSHOT_SHARE * self.state_bytes // (self.kv_bytes_per_token * block))))

    def _prefill_s_per_token(self, num_tokens: int = 256) -> float:
        """Seconds per token of a num_tokens prefill (the second of two: the first builds kernels)."""
        ids = mx.array([[self.tokenizer.encode("warm", add_special_tokens=False)[0]] * num_tokens], dtype=mx.int32)
        positions = _plain_mrope(num_tokens) if self.family.positions == "mrope" else None
        elapsed = 0.0
        for _ in range(2):
            started = time.perf_counter()
            mx.eval(self._call_one(Part(self.new_cache(), ids, positions=positions)))
            elapsed = time.perf_counter() - started
        return elapsed / num_tokens

    def new_cache(self) -> list:
        """The family's own cache classes; sliding-window layers of a window_as_mask family get a
        full KVCache (the library then applies the window as a mask), so their KV fits in blocks."""
        cache = self.cache_classes.make_prompt_cache(self.lm)
        if self.family.window_as_mask:
            cache = [self.cache_classes.KVCache() if type(c).__name__ == "RotatingKVCache" else c for c in cache]
        return cache

    # -- prefill -----------------------------------------------------------------------------

    def prefill(
        self,
        prompt: PreparedPrompt,
        salt: TenantSalt,
        chunk_tokens: int,
        cancelled: Callable[[], bool],
        owner: str | None = None,
        pins: tuple[Pin, ...] = (),
    ) -> PrefillResult:
        """Reuse the longest cached prefix, run the rest in chunks, cache new blocks as they fill.
        `owner` labels what this request stores or reuses (purges select by it); `pins` are kept
        cached for their TTL once finish() stored the request."""
        steps = self.prefill_steps(prompt, salt, chunk_tokens, cancelled, owner, pins)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(
        self,
        prompt: PreparedPrompt,
        salt: TenantSalt,
        chunk_tokens: int,
        cancelled: Callable[[], bool],
        owner: str | None = None,
        pins: tuple[Pin, ...] = (),
    ) -> Generator[int, None, PrefillResult]:
        """prefill() one chunk at a time: yields each chunk's token count but the last's and returns
        the PrefillResult. Closing it early releases the prefix blocks. Chunks of chunk_tokens (a
        multiple of the block size, so every chunk but the last ends on a block boundary)."""
        admission = self.open_prefill(prompt, salt, owner, pins)
        computed = admission.first
        try:
            while computed < prompt.num_tokens:
                if cancelled():
                    raise Cancelled()
                end = min(computed + chunk_tokens, prompt.num_tokens)
                self.run_step(self.chunk_parts(admission, computed, end))
                if end < prompt.num_tokens:
                    yield end - computed
                computed = end
        except Cancelled:  # between steps: what ran is kept, a hybrid's state with it
            admission.close(self.caches, computed)
            raise
        except BaseException:  # failed, or closed before the end: the blocks are released
            admission.close()
            raise
        return admission.result()

    def open_prefill(
        self,
        prompt: PreparedPrompt,
        salt: TenantSalt,
        owner: str | None = None,
        pins: tuple[Pin, ...] = (),
        tenant: str = "",
        in_place: bool = False,
    ) -> Admission:
        """Start a prompt: reuse the longest cached prefix (its KV copied into the prompt's own cache,
        or with `in_place` on a model whose decode rows keep KV in segments, its blocks read in place:
        mapped_kv.py), find or encode its images' features, compute its positions. The rest runs as
        chunks (chunk_part) in steps (run_step). `owner` labels what this request stores or reuses
        (purges select by it); `pins` are kept cached for their TTL once finish() stored the request;
        `tenant`'s data key seals the blocks it leaves on SSD."""
        start = time.perf_counter()
        cache = self.new_cache()
        plan, prefix_report = self.caches.open_prefix(prompt, salt, cache, owner, tenant)
        if plan is not None:
            plan.pins = pins
        try:
            cached = plan.num_cached_tokens if plan else 0
            vision_start = time.perf_counter()
            features, vision_report = self.caches.image_features(prompt, salt, cached, self._encode_image, owner)
            vision_ms = (time.perf_counter() - vision_start) * 1000
            ids = mx.array(prompt.token_ids, dtype=mx.int32)[None]
            embeds = self._embed(ids, prompt, features, cached) if features else None
            deepstack, visual = self._deepstack(prompt, features, cached)
            positions, rope_delta = self._positions(ids, prompt)
            if plan is not None and cached:
                cache = self._restore(cache, plan, cached, in_place)
            if plan is not None:
                plan.session.let_go()  # the prompt's cache holds (or maps) the prefix now: other blocks may give way
        except BaseException:
            if plan:
                plan.session.close()
            raise
        first = cached  # the first uncached token: the reused prefix ends here (a model with no KV layer has no offset)
        inputs = ModelInputs(ids, embeds, positions, deepstack, visual)
        admission = Admission(prompt, cache, plan, prefix_report, vision_report, vision_ms, inputs, rope_delta, first)
        if self.recurrent and plan is not None:
            admission.recurrent = self.recurrent
            admission.snapshot_points, admission.passing_points = self._snapshot_points(prompt, pins, salt)
        admission.spent_s = time.perf_counter() - start - vision_ms / 1000
        return admission

    def prefix_chain(self, prompt: PreparedPrompt, salt: TenantSalt) -> PrefixSession | None:
        """The prompt's prefix chain, to look up (`num_tokens_in_use`: the tokens open_prefill with
        `in_place` would read from blocks other readers hold already); None where nothing is read
        in place. It holds nothing and is never closed."""
        return self.caches.prefix_chain(prompt, salt) if self.rows_kv else None

    def _restore(self, cache: list, plan: PrefixPlan, num_tokens: int, in_place: bool = False) -> list:
        """The prompt's cache with the reused prefix: its blocks mapped in place as far as they can be
        (`in_place`, where decode rows keep KV in segments: _map_prefix), else copied into the new cache (KV layers get its blocks' keys and values, a hybrid model's
        recurrent layers the state snapshotted where it ends)."""
        if in_place and self.rows_kv:
            mapped = self._map_prefix(cache, plan, num_tokens)
            if mapped is not None:
                return mapped
        kv_layers = [layer for layer in cache if not is_recurrent(layer)]
        for layer, (keys, values) in zip(kv_layers, plan.session.gather(num_tokens)):
            layer.update_and_fetch(keys, values)  # the libraries' KVCache append: offset follows
        if self.recurrent:
            for index, arrays in zip(self.recurrent, plan.session.state_at(num_tokens)):
                cache[index].cache = list(arrays)  # MLX arrays are never written in place: sharing is safe
        return cache

    def _map_prefix(self, cache: list, plan: PrefixPlan, num_tokens: int) -> list | None:
        """The cache as MappedKV layers over the prefix's cached blocks that can be read in place
        (PrefixSession.map: from the start, up to the first quantised one), the rest of the prefix
        (the partly filled last block at least) copied into the prompt's own cache; None when not one
        block can be mapped."""
        session, block = plan.session, self.caches.config.block_size
        blocks = session.map(num_tokens)
        if not blocks:
            return None
        start = len(blocks) * block
        if num_tokens > start:
            for layer, (keys, values) in zip(cache, session.gather(num_tokens, start)):
                layer.update_and_fetch(keys, values)
        return [MappedKV(layer, [b.kv[index] for b in blocks], block) for index, layer in enumerate(cache)]

    def _snapshot_points(
        self, prompt: PreparedPrompt, pins: tuple[Pin, ...] = (), salt: TenantSalt | None = None
    ) -> tuple[frozenset[int], frozenset[int]]:
        """Where a hybrid prompt's recurrent state is snapshotted, and which of those points pass.
        Lasting: every snapshot interval, the last block boundary of each cache breakpoint (a prefix
        the client will send again), of its instructions (tools and leading system messages: other
        conversations start with them too) and of each image or video (another question follows).
        Passing: the last block boundaries before its end (where the same prompt, and one that
        continues it, resume) — once a later request resumes past them, they are dropped."""
        block, num_tokens = self.caches.config.block_size, prompt.num_tokens
        every = self.snapshot_blocks * block
        lasting = set(range(every, num_tokens + 1, every)) if every else set()
        lasting |= {min(pin.num_tokens, num_tokens) // block * block for pin in pins}
        lasting |= {self._instructions_end(prompt, salt) // block * block}
        lasting |= {(image.token_start + image.num_tokens) // block * block for image in prompt.images}
        passing = {(num_tokens - 1) // block * block, num_tokens // block * block} - lasting
        return frozenset(p for p in lasting | passing if p > 0), frozenset(p for p in passing if p > 0)

    def _instructions_end(self, prompt: PreparedPrompt, salt: TenantSalt | None) -> int:
        """Tokens of the prompt's tools and leading system messages (0: none, or the template cannot
        render them alone); counted once per tenant `salt` and instructions."""
        leading = next((i for i, m in enumerate(prompt.messages) if m.role not in ("system", "developer")), 0)
        if not (leading or prompt.tools) or salt is None:
            return 0
        return self.prompts.tokens_through(prompt, leading, salt) or 0

    def chunk_parts(self, admission: Admission, begin: int, end: int) -> list[Part]:
        """The admission's prompt tokens [begin, end) as parts of one step, cut at the snapshot
        points inside: each piece but the last takes its recurrent state where it ends, during the
        call. A model that packs calls runs them all in one (the weights streamed once, as for one
        chunk); the others, one call each."""
        cuts = sorted(point for point in admission.snapshot_points if begin < point < end)
        bounds = [begin, *cuts, end]
        parts = [self.chunk_part(admission, start, stop) for start, stop in pairwise(bounds)]
        for part in parts[:-1]:
            part.states = {}
        return parts

    def chunk_part(self, admission: Admission, begin: int, end: int) -> Part:
        """The admission's prompt tokens [begin, end) as one part of a step (`begin`: the tokens its
        cache holds); the blocks it completes are stored once the step ran (Admission.advance)."""
        first, inputs = admission.first, admission.inputs
        assert begin < end <= admission.prompt.num_tokens, (begin, end, admission.prompt.num_tokens)
        return Part(
            admission.cache,
            inputs.ids[:, begin:end],
            None if inputs.embeds is None else inputs.embeds[:, begin - first : end - first],
            None if inputs.positions is None else inputs.positions[..., begin:end],
            _deepstack_kwargs(inputs, begin - first, end - first),
            admission=admission,
            begin=begin,
        )

    def run_step(self, parts: list[Part]) -> list[mx.array]:
        """One model call over every part (decode rows, prompt chunks): each part's logits, (rows x
        keep, vocab), in order. One part runs as the library's plain call; several are packed
        (gateway/engine/mixed.py). Chunks' admissions then store the blocks they completed."""
        start = time.perf_counter()
        alone = len(parts) == 1 and not self._rows_of_drafts(parts[0])
        logits = self._call_one(parts[0]) if alone else self._call_parts(parts)
        chunks = [part for part in parts if part.admission is not None]
        if chunks:  # their blocks are stored now; decode logits alone stay lazy until the draws (one sync a step)
            taken = [array for part in chunks for arrays in (part.states or {}).values() for array in arrays]
            mx.eval(logits + taken + [array for part in chunks for array in _state_arrays(part.cache)])
        spent = time.perf_counter() - start
        for part, part_logits in zip(parts, logits):
            if part.admission is not None:  # a prompt's step time counts once, at its first piece
                first_piece = part is next(p for p in chunks if p.admission is part.admission)
                end = part.begin + part.ids.shape[1]
                part.admission.advance(self.caches, end, part_logits[-1], spent if first_piece else 0.0, part.states)
        return logits

    def _rows_of_drafts(self, part: Part) -> bool:
        """Whether the part is a hybrid model's decode rows fed several tokens each (drafts), which
        run as a packed call even alone: mlx-vlm's Qwen3.5 runs such a step of left-padded rows one
        row at a time, on caches it rebuilds (the states kept per token are lost with them), and its
        logits differed from each row's own call from the third token on (measured; packed: equal)."""
        return bool(self.recurrent) and part.admission is None and part.ids.shape[0] > 1 and part.ids.shape[1] > 1

    @property
    def batch_drafts(self) -> bool:
        """Whether a hybrid model's rows may draft in a batch: each row keeps the state after its
        own last kept token (draft_states) and the step runs packed (the library's batched call
        would not keep those states)."""
        return self.draft_states and self.packable

    def _call_parts(self, parts: list[Part]) -> list[mx.array]:
        """Several parts in one packed call; one call each for a family that cannot pack. The packed
        call finds that out at its first layer's first segment, before any cache has changed."""
        if self.packable:
            try:
                return self._call_packed(parts)
            except NotImplementedError as exc:
                log.warning("this model's calls cannot be packed (%s): its steps run one call per part", exc)
                self.packable = False
        logits = []
        for part in parts:
            logits += self._call_one(part)
            if part.states is not None:  # before the prompt's next piece moves its state on
                recurrent = part.admission.recurrent  # type: ignore[union-attr]
                part.states.update(zip(recurrent, recurrent_state(part.cache, recurrent)))
        return logits

    def _call_one(self, part: Part) -> list[mx.array]:
        kwargs = {"cache": part.cache} | part.extra
        if part.embeds is not None:
            kwargs["inputs_embeds"] = part.embeds
        if part.positions is not None:
            kwargs["position_ids"] = part.positions
        with keep_positions(self.lm, part.keep):
            out = self.lm(part.ids, **kwargs)
        logits = getattr(out, "logits", out)
        if part.admission is None:
            self._keep_decode_hidden(part)
        return [logits.reshape(-1, logits.shape[-1])]

    def _keep_decode_hidden(self, part: Part) -> None:
        """The decode part's hidden states at its kept positions (it is the call's first part)."""
        if self.heads is None:
            return
        tapped = self.lm.model.norm.__dict__.pop("tapped")
        rows, tokens = part.ids.shape
        hidden = tapped.reshape(-1, tapped.shape[-1])[: rows * tokens].reshape(rows, tokens, -1)
        self.decode_hidden = hidden[:, tokens - part.keep :].reshape(rows * part.keep, -1)

    def _call_packed(self, parts: list[Part]) -> list[mx.array]:
        starts, cursor, keep = [], 0, []
        for part in parts:
            rows, tokens = part.ids.shape
            starts.append(cursor)
            keep += [cursor + row * tokens + tokens - k for row in range(rows) for k in range(part.keep, 0, -1)]
            cursor += rows * tokens
        layers = [
            SegmentCache([_segment(part, layer, start) for part, start in zip(parts, starts)])
            for layer in range(len(parts[0].cache))
        ]
        kwargs: dict = {"cache": layers} | _packed_deepstack(parts, cursor)
        if any(part.embeds is not None for part in parts):
            kwargs["inputs_embeds"] = mx.concatenate(
                [_flat(self._text_embeds(p.ids) if p.embeds is None else p.embeds) for p in parts], axis=1
            )
        if parts[0].positions is not None:
            kwargs["position_ids"] = mx.concatenate([p.positions.reshape(3, 1, -1) for p in parts], axis=2)  # type: ignore[union-attr]
        ids = mx.concatenate([part.ids.reshape(1, -1) for part in parts], axis=1)
        with keep_positions(self.lm, keep):
            out = self.lm(ids, **kwargs)
        logits = getattr(out, "logits", out)[0]
        if parts[0].admission is None:
            self._keep_decode_hidden(parts[0])
        sizes = [part.ids.shape[0] * part.keep for part in parts]
        bounds = np.cumsum([0, *sizes]).tolist()
        return [logits[bounds[i] : bounds[i + 1]] for i in range(len(parts))]

    def finish(self, prefill: PrefillResult, generated: list[int], to_ssd: bool = False) -> None:
        """Cache prompt + generated blocks (the next turn reuses the reply), then release the
        request's blocks. Called once per prefill, also when generation failed or was cancelled.
        `to_ssd`: write them to the SSD tier now as well (a preempted sequence resumes from them)."""
        plan = prefill.plan
        if plan is None:
            return
        try:
            sequence = prefill.prompt.token_ids + tuple(generated)
            kv_tokens = cache_offset(prefill.cache, len(sequence))  # the last sampled token was never fed back
            self.caches.store(
                plan, sequence, prefill.cache, min(kv_tokens, len(sequence)), prefill.snapshot, passing=True
            )
            self.caches.pin(plan)
            if to_ssd:
                plan.session.write_to_ssd()
        finally:
            plan.session.close()

    def _encode_image(self, image: PromptImage) -> mx.array:
        """The input embeddings of the image's expansion (its tokens' rows), through the family's
        own get_input_embeddings: vision tower, projector and any scaling, as the library does it.
        Shape (1 + d, span, hidden): row block 0 the embeddings, then one per deepstack layer (d = 0
        for families without deepstack; rows of non-image tokens in the span are zero there)."""
        self.num_encoder_calls += 1
        ids = mx.array([image.token_ids], dtype=mx.int32)
        inputs = {name: mx.array(value) for name, value in image.inputs.items()}
        out = self.model.get_input_embeddings(ids, mask=mx.ones_like(ids), **inputs)
        blocks = [out.inputs_embeds[0]]
        deepstack = getattr(out, "deepstack_visual_embeds", None)
        if deepstack is not None:
            rows = mx.array(np.flatnonzero(np.array(out.visual_pos_masks[0])), dtype=mx.uint32)
            for layer in deepstack:
                blocks.append(mx.zeros_like(blocks[0]).at[rows].add(layer.astype(blocks[0].dtype)))
        features = mx.stack(blocks)
        mx.eval(features)
        return features

    def _embed(self, ids: mx.array, prompt: PreparedPrompt, features: dict[int, mx.array], start: int) -> mx.array:
        """Input embeddings of tokens [start, L): token embeddings with each image's rows spliced in."""
        text = self._text_embeds(ids[:, start:])[0]
        pieces, cursor = [], start
        for index, image in enumerate(prompt.images):
            end = image.token_start + image.num_tokens
            if end <= start:
                continue
            first = max(image.token_start, start)
            pieces += [
                text[cursor - start : first - start],
                features[index][0, first - image.token_start :].astype(text.dtype),
            ]
            cursor = end
        pieces.append(text[cursor - start :])
        return mx.concatenate(pieces, axis=0)[None]

    def _text_embeds(self, ids: mx.array) -> mx.array:
        """Input embeddings of text tokens, as the model takes them with `inputs_embeds`: the table's
        rows, times the embedding scale where the model applies it to token ids only (Gemma 4)."""
        rows = token_embedding(self.lm)(ids)
        if self.family.scaled_embeds:
            rows = rows * getattr(self.lm, "model", self.lm).embed_scale
        return rows

    def _deepstack(
        self, prompt: PreparedPrompt, features: dict[int, mx.array], start: int
    ) -> tuple[mx.array | None, np.ndarray | None]:
        """Deepstack rows for tokens [start, L), and which of them are image tokens; (None, None) when
        no image there carries deepstack features."""
        needed = [i for i in features if features[i].shape[0] > 1]
        if not needed:
            return None, None
        layers, hidden = features[needed[0]].shape[0] - 1, features[needed[0]].shape[-1]
        deep = mx.zeros((layers, prompt.num_tokens - start, hidden), dtype=features[needed[0]].dtype)
        visual = np.zeros(prompt.num_tokens - start, dtype=bool)
        for index in needed:
            image = prompt.images[index]
            first = max(image.token_start, start)
            end = image.token_start + image.num_tokens
            deep[:, first - start : end - start] = features[index][1:, first - image.token_start :]
            visual[first - start : end - start] = np.asarray(image.token_ids[first - image.token_start :]) == (
                self.video_token_id if image.is_video else self.image_token_id
            )
        return deep, visual

    def _positions(self, ids: mx.array, prompt: PreparedPrompt) -> tuple[mx.array | None, int | None]:
        if self.family.positions != "mrope":
            return None, None
        if not prompt.images:
            return _plain_mrope(prompt.num_tokens), 0
        images = [image.grid_thw for image in prompt.images if not image.is_video]
        videos = [image.grid_thw for image in prompt.images if image.is_video]
        positions, deltas = self.lm.get_rope_index(
            ids,
            image_grid_thw=mx.array(images) if images else None,
            video_grid_thw=mx.array(videos) if videos else None,
        )
        return positions, int(deltas.reshape(-1)[0].item())


def eos_ids(model_path: Path, config: dict, tokenizer) -> frozenset[int]:
    """Every token that ends a reply: config.json's (top level or text_config), generation_config.json's
    (real checkpoints often list the chat turn's end only there, e.g. Gemma 3's <end_of_turn>), and
    the tokenizer's own EOS."""
    generation = model_path / "generation_config.json"
    sources = [
        config,
        config.get("text_config") or {},
        json.loads(generation.read_text()) if generation.exists() else {},
    ]
    found = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for source in sources:
        ids = source.get("eos_token_id") or []
        found.update([ids] if isinstance(ids, int) else ids)
    return frozenset(int(i) for i in found)


def _load(family: Family, model_path: Path):
    """The family's library loads the folder: (model, processor or tokenizer, language model, the
    library's cache module). Every array the model holds is evaluated here, on the loading thread."""
    if family.library == "mlx_vlm":
        import mlx_vlm
        from mlx_vlm.models import cache as cache_classes

        model, processor = mlx_vlm.load(str(model_path))
        return _evaluated(model), processor, model.language_model, cache_classes
    import mlx_lm
    from mlx_lm.models import cache as lm_cache_classes

    model, tokenizer = mlx_lm.load(str(model_path))[:2]
    return _evaluated(model), tokenizer, model, lm_cache_classes


def _evaluated(model):
    mx.eval(_reachable_arrays(model))
    return model


def _reachable_arrays(root) -> list[mx.array]:
    """Every array the model holds, parameters or not. Some families keep lazily computed arrays on
    helper objects (Pixtral's rotary inv_freq); evaluated on the loading thread, they would fail on
    the worker thread ("There is no Stream(cpu, 0) in current thread"), so loading evaluates them all."""
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return found


def _deepstack_kwargs(inputs: ModelInputs, begin: int, end: int) -> dict:
    """The library's deepstack arguments for rows [begin, end) of the uncached part (none without)."""
    visual = inputs.visual  # set together with deepstack
    if inputs.deepstack is None or visual is None or not visual[begin:end].any():
        return {}
    rows = mx.array(np.flatnonzero(visual[begin:end]), dtype=mx.uint32)
    return {
        "visual_pos_masks": mx.array(visual[begin:end])[None],
        "deepstack_visual_embeds": [layer[begin:end][rows] for layer in inputs.deepstack],
    }


def token_embedding(language_model) -> nn.Module:
    """The token embedding table: under `.model` in most families, on the language model itself in
    Idefics3's, `backbone.embeddings` in Nemotron-H's."""
    inner = getattr(language_model, "model", None) or getattr(language_model, "backbone", None) or language_model
    for name in ("embed_tokens", "embeddings"):
        if hasattr(inner, name):
            return getattr(inner, name)
    return language_model.embed_tokens


def kv_bytes_per_token(cache: list) -> int:
    """Bytes one token's keys and values take over all KV layers of a cache the model has run on
    (recurrent layers hold a fixed state and count nothing): heads, head size and dtype are whatever
    the model's own code allocated."""
    total = 0
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            total += keys.shape[1] * keys.shape[3] * keys.itemsize + values.shape[1] * values.shape[3] * values.itemsize
    return total


def _segment(part: Part, layer: int, start: int) -> Segment:
    """The part's segment of one layer in a packed call; a piece that takes its recurrent state
    keeps this layer's there, once the layer ran it."""
    rows, tokens = part.ids.shape
    cache, states = part.cache[layer], part.states
    if states is None or layer not in part.admission.recurrent:  # type: ignore[union-attr]
        return Segment(cache, start, rows, tokens)
    return Segment(cache, start, rows, tokens, lambda: states.__setitem__(layer, tuple(cache.cache)))


def _state_arrays(cache: list) -> list[mx.array]:
    """Every array a cache holds (mlx-lm's KVCache.state also carries its offset, an int; an
    ArraysCache's is (its list of arrays, padding, lengths))."""
    found: list[mx.array] = []
    stack = [layer.state for layer in cache]
    while stack:
        item = stack.pop()
        if isinstance(item, mx.array):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return found


def recurrent_state(cache: list, recurrent: Sequence[int], row: int | None = None) -> tuple:
    """The recurrent layers' state (per layer, its arrays), of one row of a batched cache if asked."""
    layers = (cache[index].cache for index in recurrent)
    if row is None:
        return tuple(tuple(arrays) for arrays in layers)
    return tuple(tuple(array[row : row + 1] for array in arrays) for arrays in layers)


def _text_setting(config: dict, name: str):
    """A language-model setting: a vision model's text_config holds it, a text model's config itself."""
    return (config.get("text_config") or {}).get(name) or config.get(name)


def decode_positions(offsets, deltas: list[int] | None, num_tokens: int = 1) -> mx.array | None:
    """mRoPE ids of num_tokens new tokens per row, (3, rows, num_tokens): from the row's KV length
    (`offsets`, an int or one per row) plus its delta; None for plain RoPE, where the cache offset
    gives the position."""
    if deltas is None:
        return None
    first = (offsets + mx.array(deltas))[:, None] + mx.arange(num_tokens)[None]
    return mx.broadcast_to(first[None], (3, len(deltas), num_tokens)).astype(mx.int32)


def _plain_mrope(num_tokens: int) -> mx.array:
    return mx.broadcast_to(mx.arange(num_tokens)[None, None], (3, 1, num_tokens))


def cache_offset(cache: list, default: int) -> int:
    """Tokens the KV cache holds (its first layer with an offset; recurrent layers have none)."""
    for layer in cache:
        if hasattr(layer, "offset"):
            return int(layer.offset)
    return default


def keep_last_position_logits(language_model) -> None:
    """Make this model instance compute logits for the last position only (or the positions
    keep_positions() names): prefill needs no others, and a 512-token chunk's full logits cost as
    much as a quarter of its layers. The output head (an untied lm_head, or the tied embedding's
    as_linear) gets a subclass that slices first."""
    target = output_head(language_model)
    method = "__call__" if target is getattr(language_model, "lm_head", None) else "as_linear"
    target.__class__ = _last_position_class(type(target), method)


def output_head(language_model) -> nn.Module:
    head = getattr(language_model, "lm_head", None)
    return head if isinstance(head, nn.Module) else token_embedding(language_model)


@contextlib.contextmanager
def keep_positions(language_model, keep: int | list[int]):
    """Within the block, the output head keeps each row's last `keep` positions, or the packed
    positions listed."""
    head = output_head(language_model)
    object.__setattr__(head, "kept", keep)  # a plain attribute: an array here would become a parameter
    try:
        yield
    finally:
        object.__setattr__(head, "kept", 1)


def tap_final_hidden(language_model) -> None:
    """Make this model instance's final norm keep its input (`tapped`: the last hidden states of
    the latest call, every position), for the MTP layers."""
    norm = language_model.model.norm
    norm.__class__ = _tapped_class(type(norm))


_TAPPED_CLASSES: dict = {}


def _tapped_class(base: type) -> type:
    if base not in _TAPPED_CLASSES:

        def tapped(self, x, *args, **kwargs):
            object.__setattr__(self, "tapped", x)  # a plain attribute: an array here would become a parameter
            return base.__call__(self, x, *args, **kwargs)

        _TAPPED_CLASSES[base] = type(f"Tapped{base.__name__}", (base,), {"__call__": tapped})
    return _TAPPED_CLASSES[base]


_LAST_POSITION_CLASSES: dict = {}


def _last_position_class(base: type, method: str) -> type:
    key = (base, method)
    if key not in _LAST_POSITION_CLASSES:
        original = getattr(base, method)

        def last_position(self, x, *args, **kwargs):
            if x.ndim == 3:
                kept = self.__dict__.get("kept", 1)
                x = x[:, -kept:] if isinstance(kept, int) else x[:, mx.array(kept)]
            return original(self, x, *args, **kwargs)

        _LAST_POSITION_CLASSES[key] = type(f"LastPosition{base.__name__}", (base,), {method: last_position})
    return _LAST_POSITION_CLASSES[key]


def _flat(x: mx.array) -> mx.array:
    """(rows, tokens, hidden) -> (1, rows x tokens, hidden), row-major."""
    return x.reshape(1, -1, x.shape[-1])


def _packed_deepstack(parts: list[Part], num_tokens: int) -> dict:
    """The library's deepstack arguments over the packed tokens: each chunk's visual rows at its place."""
    if not any(part.extra for part in parts):
        return {}
    masks, layers, cursor = [], [], 0
    for part in parts:
        size = part.ids.size
        if part.extra:
            masks.append(part.extra["visual_pos_masks"].reshape(-1))
            layers.append(part.extra["deepstack_visual_embeds"])
        else:
            masks.append(mx.zeros((size,), dtype=mx.bool_))
        cursor += size
    assert cursor == num_tokens
    return {
        "visual_pos_masks": mx.concatenate(masks)[None],
        "deepstack_visual_embeds": [mx.concatenate(list(rows)) for rows in zip(*layers)],
    }
