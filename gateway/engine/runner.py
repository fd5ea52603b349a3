"""The MLX model run: embeddings (with image features), chunked prefill, sampling, decode steps.

Owned by the engine's single worker thread: MLX is not thread-safe, so no other thread may call in.
Positions are explicit mRoPE ids computed once per prompt, so any chunking of the prompt (and,
later, any cached prefix) sees exactly the positions a one-shot prefill would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvcache import TenantSalt
from vision import processor_fingerprint

from .types import Sampling
from .attention import install_cpu_prefill_attention
from .caching import CacheConfig, EngineCaches, PrefixPlan, PrefixReport, VisionReport
from .prompt import PreparedPrompt, PromptBuilder, PromptImage

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


class Cancelled(Exception):
    """The request was cancelled (client gone) between two model steps."""


@dataclass(frozen=True, slots=True)
class ModelInputs:
    ids: mx.array  # (1, L) all prompt token ids
    embeds: mx.array  # (1, L - cached, hidden): embeddings of the tokens still to run
    positions: mx.array  # (3, 1, L) mRoPE positions of the whole prompt


@dataclass(slots=True)
class PrefillResult:
    logits: mx.array  # (vocab,) for the last prompt position
    cache: list
    rope_delta: int  # mRoPE: decode position = cache offset + rope_delta
    prompt: PreparedPrompt
    plan: PrefixPlan | None  # held until finish(): its blocks cannot be evicted meanwhile
    prefix: PrefixReport
    vision: VisionReport
    prefill_ms: float
    vision_ms: float


class ModelRunner:
    def __init__(self, model_path: Path | str, cache_config: CacheConfig, model_fingerprint: str):
        import mlx_vlm

        self.model, self.processor = mlx_vlm.load(str(model_path))
        config = self.model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
        self.lm = self.model.language_model
        install_cpu_prefill_attention(self.lm)
        self.image_token_id = int(config.image_token_id)
        self.prompts = PromptBuilder(self.processor, self.image_token_id)
        self.tokenizer = self.processor.tokenizer
        self.eos_ids = _eos_ids(config, self.tokenizer)
        self.max_positions = int(config.text_config.max_position_embeddings or 32768)
        self.caches = EngineCaches(cache_config, model_fingerprint, processor_fingerprint(vars(self.processor.image_processor)))
        self.num_encoder_calls = 0

    def warm_up(self) -> None:
        """Run the text and vision paths once: MLX builds its kernels on first use (~2 s here),
        which would otherwise land on the first request's TTFT. Touches no cache."""
        from mlx_vlm.models.cache import make_prompt_cache

        ids = mx.array([self.tokenizer.encode("warm up " * 8, add_special_tokens=False)], dtype=mx.int32)
        positions = mx.broadcast_to(mx.arange(ids.shape[1])[None, None], (3, 1, ids.shape[1]))
        mx.eval(self.lm.model(ids, cache=make_prompt_cache(self.lm), position_ids=positions))
        pixels = self.processor.image_processor([np.zeros((3, 56, 56), dtype=np.uint8)])
        mx.eval(self.model.vision_tower(mx.array(pixels["pixel_values"]), mx.array(pixels["image_grid_thw"]),
                                        output_hidden_states=False))

    # -- prefill -----------------------------------------------------------------------------

    def prefill(self, prompt: PreparedPrompt, salt: TenantSalt, chunk_tokens: int, cancelled: Callable[[], bool]) -> PrefillResult:
        """Reuse the longest cached prefix, run the rest in chunks, cache new blocks as they fill."""
        from mlx_vlm.models.cache import make_prompt_cache

        start = time.perf_counter()
        cache = make_prompt_cache(self.lm)
        plan, prefix_report = self.caches.open_prefix(prompt, salt, cache)
        try:
            cached = plan.num_cached_tokens if plan else 0
            vision_start = time.perf_counter()
            features, vision_report = self.caches.image_features(prompt, salt, cached, self._encode_image)
            vision_ms = (time.perf_counter() - vision_start) * 1000
            ids = mx.array(prompt.token_ids, dtype=mx.int32)[None]
            embeds = self._embed(ids, prompt, features, cached)
            positions, rope_delta = self._positions(ids, prompt)
            if cached:
                for layer, state in zip(cache, plan.session.gather(cached)):
                    layer.state = state
            inputs = ModelInputs(ids, embeds, positions)
            hidden = self._run_chunks(prompt, inputs, cache, plan, chunk_tokens, cancelled)
            logits = self._logits(hidden[:, -1, :])[0]
            mx.eval(logits)
        except BaseException:
            if plan:
                plan.session.close()
            raise
        prefill_ms = (time.perf_counter() - start) * 1000 - vision_ms
        return PrefillResult(logits, cache, rope_delta, prompt, plan, prefix_report, vision_report, prefill_ms, vision_ms)

    def _run_chunks(self, prompt, inputs: ModelInputs, cache, plan, chunk_tokens, cancelled) -> mx.array:
        """Prefill tokens [cached, L) in chunks ending on multiples of chunk_tokens; after each chunk
        the blocks it completed are cached, so a long prompt cut short still leaves its prefix."""
        ids, embeds, positions = inputs.ids, inputs.embeds, inputs.positions
        total = prompt.num_tokens
        first = begin = total - embeds.shape[1]  # embeds start at the first uncached token
        hidden = None
        while begin < total:
            if cancelled():
                raise Cancelled()
            end = min((begin // chunk_tokens + 1) * chunk_tokens, total)
            hidden = self.lm.model(ids[:, begin:end], inputs_embeds=embeds[:, begin - first:end - first], cache=cache,
                                   position_ids=positions[..., begin:end])
            mx.eval([c.state for c in cache])
            if plan:
                self.caches.store(plan, prompt.token_ids, cache, end)
            begin = end
        return hidden

    def finish(self, prefill: PrefillResult, generated: list[int]) -> None:
        """Cache prompt + generated blocks (the next turn reuses the reply), then release the
        request's blocks. Called once per prefill, also when generation failed or was cancelled."""
        plan = prefill.plan
        if plan is None:
            return
        try:
            kv_tokens = prefill.cache[0].offset  # the last sampled token was never fed back
            sequence = prefill.prompt.token_ids + tuple(generated)
            self.caches.store(plan, sequence, prefill.cache, min(kv_tokens, len(sequence)))
        finally:
            plan.session.close()

    def _encode_image(self, image: PromptImage) -> mx.array:
        self.num_encoder_calls += 1
        pixels = mx.array(image.pixel_values)
        features = self.model.vision_tower(pixels, mx.array([image.grid_thw]), output_hidden_states=False)
        mx.eval(features)
        return features

    def _embed(self, ids: mx.array, prompt: PreparedPrompt, features: dict[int, mx.array], start: int) -> mx.array:
        """Input embeddings of tokens [start, L): token embeddings with image features spliced in."""
        text = self.lm.model.embed_tokens(ids[:, start:])[0]
        pieces, cursor = [], start
        for index, image in enumerate(prompt.images):
            end = image.token_start + image.num_tokens
            if end <= start:
                continue
            first = max(image.token_start, start)
            pieces += [text[cursor - start:first - start], features[index][first - image.token_start:].astype(text.dtype)]
            cursor = end
        pieces.append(text[cursor - start:])
        return mx.concatenate(pieces, axis=0)[None]

    def _positions(self, ids: mx.array, prompt: PreparedPrompt) -> tuple[mx.array, int]:
        if not prompt.images:
            positions = mx.broadcast_to(mx.arange(prompt.num_tokens)[None, None], (3, 1, prompt.num_tokens))
            return positions, 0
        grids = mx.array([image.grid_thw for image in prompt.images])
        positions, deltas = self.lm.get_rope_index(ids, image_grid_thw=grids)
        return positions, int(deltas.reshape(-1)[0].item())

    def _logits(self, hidden: mx.array) -> mx.array:
        if self.lm.args.tie_word_embeddings:
            return self.lm.model.embed_tokens.as_linear(hidden)
        return self.lm.lm_head(hidden)

    # -- decode ------------------------------------------------------------------------------

    def decode(self, prefill: PrefillResult, sampling: Sampling, cancelled: Callable[[], bool]) -> Iterator[int]:
        """Yield sampled token ids until EOS or max_tokens; EOS itself is not yielded."""
        sample = Sampler(sampling)
        logits, cache = prefill.logits, prefill.cache
        for _ in range(sampling.max_tokens):
            token = sample(logits)
            if token in self.eos_ids:
                return
            yield token
            if cancelled():
                raise Cancelled()
            position = cache[0].offset + prefill.rope_delta
            hidden = self.lm.model(
                mx.array([[token]], dtype=mx.int32), cache=cache, position_ids=mx.full((3, 1, 1), position, dtype=mx.int32)
            )
            logits = self._logits(hidden[:, -1, :])[0]


class Sampler:
    """Greedy at temperature 0; otherwise temperature + nucleus sampling, seeded when asked."""

    def __init__(self, sampling: Sampling):
        self.temperature = sampling.temperature
        self.top_p = sampling.top_p
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed % 2**64)  # negative seeds are valid in the API

    def __call__(self, logits: mx.array) -> int:
        if self.temperature == 0.0:
            return int(mx.argmax(logits).item())
        self.key, step_key = mx.random.split(self.key)
        scaled = logits.astype(mx.float32) / self.temperature
        if self.top_p < 1.0:
            scaled = _nucleus(scaled, self.top_p)
        return int(mx.random.categorical(scaled, key=step_key).item())


def _nucleus(logits: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    descending = -mx.sort(-logits)
    probs = mx.softmax(descending)
    num_keep = mx.sum((mx.cumsum(probs) - probs) < top_p)  # >= 1: the top token always stays
    threshold = descending[num_keep - 1]
    return mx.where(logits >= threshold, logits, -mx.inf)


def _eos_ids(config, tokenizer) -> frozenset[int]:
    ids = config.eos_token_id or []
    ids = [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
