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

from ..schemas import Sampling
from .prompt import PreparedPrompt, PromptBuilder

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


class Cancelled(Exception):
    """The request was cancelled (client gone) between two model steps."""


@dataclass(slots=True)
class PrefillResult:
    logits: mx.array  # (vocab,) for the last prompt position
    cache: list
    rope_delta: int  # mRoPE: decode position = cache offset + rope_delta
    num_cached_tokens: int
    prefill_ms: float
    vision_ms: float


class ModelRunner:
    def __init__(self, model_path: Path | str):
        import mlx_vlm

        self.model, self.processor = mlx_vlm.load(str(model_path))
        config = self.model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
        self.lm = self.model.language_model
        self.image_token_id = int(config.image_token_id)
        self.prompts = PromptBuilder(self.processor, self.image_token_id)
        self.tokenizer = self.processor.tokenizer
        self.eos_ids = _eos_ids(config, self.tokenizer)
        self.max_positions = int(config.text_config.max_position_embeddings or 32768)

    # -- prefill -----------------------------------------------------------------------------

    def prefill(self, prompt: PreparedPrompt, chunk_tokens: int, cancelled: Callable[[], bool]) -> PrefillResult:
        from mlx_vlm.models.cache import make_prompt_cache

        start = time.perf_counter()
        ids = mx.array(prompt.token_ids, dtype=mx.int32)[None]
        features, vision_ms = self._image_features(prompt)
        embeds = self._embed(ids, prompt, features)
        positions, rope_delta = self._positions(ids, prompt)
        cache = make_prompt_cache(self.lm)
        hidden = None
        for begin in range(0, prompt.num_tokens, chunk_tokens):
            if cancelled():
                raise Cancelled()
            end = min(begin + chunk_tokens, prompt.num_tokens)
            hidden = self.lm.model(ids[:, begin:end], inputs_embeds=embeds[:, begin:end], cache=cache, position_ids=positions[..., begin:end])
            mx.eval([c.state for c in cache])
        logits = self._logits(hidden[:, -1, :])[0]
        mx.eval(logits)
        prefill_ms = (time.perf_counter() - start) * 1000 - vision_ms
        return PrefillResult(logits, cache, rope_delta, 0, prefill_ms, vision_ms)

    def _image_features(self, prompt: PreparedPrompt) -> tuple[list[mx.array], float]:
        if not prompt.images:
            return [], 0.0
        start = time.perf_counter()
        features = []
        for image in prompt.images:
            pixels = mx.array(image.pixel_values)
            grid = mx.array([image.grid_thw])
            features.append(self.model.vision_tower(pixels, grid, output_hidden_states=False))
        mx.eval(features)
        return features, (time.perf_counter() - start) * 1000

    def _embed(self, ids: mx.array, prompt: PreparedPrompt, features: list[mx.array]) -> mx.array:
        text = self.lm.model.embed_tokens(ids)[0]
        pieces, cursor = [], 0
        for image, feature in zip(prompt.images, features):
            pieces += [text[cursor : image.token_start], feature.astype(text.dtype)]
            cursor = image.token_start + image.num_tokens
        pieces.append(text[cursor:])
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
        self.key = mx.random.key(seed)

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
