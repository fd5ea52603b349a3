"""The engine's two caches for one request: which prefix KV to reuse, which image features to reuse.

Turns the libraries' results (kvcache.PrefixMatch, vision cache hits) into typed reports that the
gateway renders as X-Cache-Prefix / X-Cache-Vision. Runs on the engine's worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Literal

import mlx.core as mx

from kvcache import ExtraSpan, PrefixCache, PrefixSession, TenantSalt, cacheability, is_recurrent
from kvcache.prefix import Tier
from kvcache.quant import QuantConfig
from kvcache.ssd import SsdConfig, SsdTier
from vision import ImageKey, VisionCache, image_key

from .caches import CacheLayer, Removed
from .mapped_kv import first_own_token
from .prompt import PreparedPrompt, PromptImage
from .types import Pin

log = logging.getLogger("strata.engine")


@dataclass(frozen=True, slots=True)
class PrefixReport:
    status: Literal["hit", "miss", "bypass"]
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    tier: Tier = ""
    reason: str = ""  # a bypass: "disabled", or "uncacheable:<cache classes>" (kvcache.Cacheability)
    num_ssd_tokens: int = 0  # of the reused tokens, promoted from SSD
    miss_reason: str = ""  # why reuse stopped short (kvcache.PrefixMatch.miss_reason): "" when it did not
    miss_at_token: int = 0  # for "diverged": the first token that differs from what was cached
    miss_tier: str = ""  # evicted / expired / purged: from "ram" or "ssd" ...
    miss_lived_s: float = 0.0  # ... after this many seconds there
    miss_in_image: bool = False  # diverged inside an image (same tokens, other pixels)
    num_public_tokens: int = 0  # the prompt's leading tokens in public blocks (a declared public text)
    chain: tuple[bytes, ...] = ()  # the prompt's full blocks' hashes (STRATA_TRACE_FILE, what-if curves)
    num_tokens_without_state: int = 0  # a hybrid's matched tokens recomputed: no snapshot held where they end


@dataclass(frozen=True, slots=True)
class VisionReport:
    num_images: int = 0
    num_hits: int = 0
    num_misses: int = 0  # the encoder ran
    num_skipped: int = 0  # the image's tokens were all in the reused prefix: no features needed
    enabled: bool = True


@dataclass(slots=True)
class PrefixPlan:
    """One request's prefix-cache state, from lookup to the final store."""

    session: PrefixSession  # owns the chain: root, hashes, image spans
    num_cached_tokens: int
    pins: tuple[Pin, ...] = ()  # pinned once the request ends (its prompt's blocks are all stored then)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    prefix_budget_bytes: int  # 0 turns the prefix cache off
    vision_budget_bytes: int  # 0 turns the vision cache off
    block_size: int
    ssd: SsdConfig | None = None  # the SSD tier under the data dir; None: RAM only
    quant: QuantConfig | None = None  # quantise stored blocks; None: full precision
    # Retention of the RAM tiers: entries nobody used for this long are dropped (0: kept until evicted).
    prefix_idle_s: float = 0.0
    vision_idle_s: float = 0.0
    # What one tenant's pinned prefix blocks (cache breakpoints) may hold of the prefix budget.
    pin_budget_bytes: int = 0
    # A hybrid model's recurrent state is snapshotted every this many blocks of a prompt (besides
    # its end, its cache breakpoints and its images' ends); 0: only there; None: the runner picks the
    # spacing from the model's measured bytes (ModelRunner.snapshot_blocks).
    snapshot_blocks: int | None = None


class EngineCaches:
    def __init__(self, config: CacheConfig, model_fingerprint: str, processor_fingerprint: str):
        self.prefix = _prefix_cache(config, model_fingerprint) if config.prefix_budget_bytes else None
        self.vision = VisionCache(config.vision_budget_bytes) if config.vision_budget_bytes else None
        self.model_fingerprint = model_fingerprint
        self.processor_fingerprint = processor_fingerprint
        self.config = config

    # -- prefix ------------------------------------------------------------------------------

    def open_prefix(
        self, prompt: PreparedPrompt, salt: TenantSalt, kv_cache: list, owner: str | None = None, tenant: str = ""
    ) -> tuple[PrefixPlan | None, PrefixReport]:
        if self.prefix is None:
            return None, PrefixReport("bypass", num_prompt_tokens=prompt.num_tokens, reason="disabled")
        verdict = cacheability(kv_cache)
        if not verdict.ok:
            return None, PrefixReport("bypass", num_prompt_tokens=prompt.num_tokens, reason=verdict.reason)
        session = self._session(prompt, salt, owner, verdict.snapshots, tenant)
        match = session.match(prompt.num_tokens)
        plan = PrefixPlan(session, match.num_cached_tokens)
        status: Literal["hit", "miss"] = "hit" if match.num_cached_tokens else "miss"
        ssd_tokens = min(match.num_ssd_tokens, match.num_cached_tokens)
        return plan, PrefixReport(
            status,
            match.num_cached_tokens,
            prompt.num_tokens,
            match.tier,
            "",
            ssd_tokens,
            match.miss_reason,
            match.miss_at_token,
            match.miss_tier,
            match.miss_lived_s,
            match.miss_in_image,
            match.num_public_tokens,
            match.chain,
            match.num_tokens_without_state,
        )

    def prefix_chain(self, prompt: PreparedPrompt, salt: TenantSalt) -> PrefixSession | None:
        """A session over the prompt's chain that holds nothing, for lookups (its
        num_tokens_in_use); None with no prefix cache."""
        return self._session(prompt, salt) if self.prefix is not None else None

    def _session(
        self,
        prompt: PreparedPrompt,
        salt: TenantSalt,
        owner: str | None = None,
        snapshots: bool = False,
        tenant: str = "",
    ) -> PrefixSession:
        spans = tuple(
            ExtraSpan(i.token_start, i.token_start + i.num_tokens, self._image_key(i, salt).encode())
            for i in prompt.images
        )
        return self.prefix.open(  # type: ignore[union-attr]
            salt, self.model_fingerprint, prompt.token_ids, spans, owner, snapshots, tenant, prompt.public_tokens
        )

    def judge_ssd(self, time_prefill: Callable[[], float], bytes_per_token: int) -> None:
        """At start-up: restore from the SSD tier only if reading a token's KV (measured here, from
        the disk) is faster than computing it again (`time_prefill()`: seconds per token)."""
        if self.prefix is None or self.prefix.ssd is None or not bytes_per_token:
            return
        prefill_s_per_token = time_prefill()
        read_s_per_byte = self.prefix.ssd.read_s_per_byte()
        restore = self.prefix.judge_ssd(read_s_per_byte, prefill_s_per_token, bytes_per_token)
        log.info(
            "SSD tier: reading a token's KV takes %.1f us, computing it %.1f us: %s",
            read_s_per_byte * bytes_per_token * 1e6,
            prefill_s_per_token * 1e6,
            "restoring from SSD" if restore else "recomputing instead of reading the SSD tier",
        )

    def reserve_running(self, nbytes: int) -> bool:
        """Hold nbytes of the prefix cache's budget for a running sequence's KV (see
        PrefixCache.reserve). With the prefix cache off there is no shared budget: always True."""
        return self.prefix is None or self.prefix.reserve(nbytes)

    def release_running(self, nbytes: int) -> None:
        if self.prefix is not None:
            self.prefix.unreserve(nbytes)

    def running_budget_bytes(self) -> int | None:
        """The most a running sequence may reserve (the whole budget); None: no bound."""
        return self.prefix.pool.budget_bytes if self.prefix is not None else None

    def layers(self) -> list[CacheLayer]:
        """The engine's cache layers that are on (each speaks the cache protocol, gateway/engine/caches.py)."""
        ssd = self.prefix.ssd if self.prefix is not None else None
        return [layer for layer in (self.prefix, ssd, self.vision) if layer is not None]

    def stats(self) -> dict:
        """The layers' snapshots for operators, counters flattened beside sizes (any thread)."""
        out: dict = {}
        for layer in self.layers():
            snapshot = asdict(layer.stats())
            nested = [value for value in snapshot.values() if isinstance(value, dict)]
            out[layer.name] = {k: v for part in nested for k, v in part.items()} | {
                k: v for k, v in snapshot.items() if not isinstance(v, dict)
            }
        return out

    def expire(self) -> dict:
        """Drop what the RAM tiers' retention no longer allows (worker thread): {layer: Purged}."""
        removed: dict[str, Removed] = {}
        if self.prefix is not None:
            self.prefix.pool.expire_pins()  # first: an expired pin's block may be idle long enough to go
        if self.prefix is not None and self.config.prefix_idle_s:
            removed["prefix"] = self.prefix.pool.expire(self.config.prefix_idle_s)
        if self.vision is not None and self.config.vision_idle_s:
            removed["vision"] = self.vision.expire(self.config.vision_idle_s)
        return removed

    def purge_owned(self, selects: Callable[[str], bool], layers: Collection[str]) -> dict[str, Removed | None]:
        """Take the owners `selects(owner)` picks off the named layers' entries ("prefix", "ssd",
        "vision"); what each removed, by layer (None: the layer is off). Worker thread."""
        ssd = self.prefix.ssd if self.prefix is not None else None
        owned: dict[str, PrefixCache | SsdTier | VisionCache | None] = {
            "prefix": self.prefix,
            "ssd": ssd,
            "vision": self.vision,
        }
        return {name: _purge_owned(owned[name], selects) for name in layers}

    def shutdown(self, drain_s: float) -> None:
        """Persist admissible RAM blocks to SSD and let the writer drain, at most drain_s."""
        if self.prefix is not None and self.prefix.ssd is not None:
            self.prefix.persist()
            self.prefix.ssd.close(drain_s)

    def pin(self, plan: PrefixPlan) -> None:
        """Pin what the request's breakpoints cover (pins past their TTL end first)."""
        if plan.pins:
            plan.session.pool.expire_pins()
        for pin in plan.pins:
            if pin.on_ssd:
                plan.session.pin_on_ssd(pin.num_tokens, pin.ttl_s)
            else:
                plan.session.pin(pin.num_tokens, pin.ttl_s)

    def store(
        self,
        plan: PrefixPlan,
        token_ids: tuple[int, ...],
        kv_cache: list,
        num_tokens: int,
        snapshot: tuple[int, tuple] | None = None,
        passing: bool = False,
    ) -> None:
        """Cache the full blocks of token_ids[:num_tokens] (a prompt, or prompt + generated tokens):
        the KV layers' keys and values (buffers: tokens [0, offset) valid), and a hybrid model's
        recurrent-state `snapshot` (tokens, state) at the block it ends; `passing`: a snapshot only
        of where this request ended, dropped once a later request resumes past it. A prompt's
        MappedKV layers hold their tokens from their first own token on (the rest are mapped blocks)."""
        kv = [(c.keys, c.values) for c in kv_cache if not is_recurrent(c)]
        plan.session.store(token_ids, kv, num_tokens, snapshot, passing, first_own_token(kv_cache))

    # -- vision ------------------------------------------------------------------------------

    def image_features(
        self,
        prompt: PreparedPrompt,
        salt: TenantSalt,
        first_needed_token: int,
        encode: Callable[[PromptImage], mx.array],
        owner: str | None = None,
    ) -> tuple[dict[int, mx.array], VisionReport]:
        """Features of each image with tokens at or after `first_needed_token`, by image index."""
        features: dict[int, mx.array] = {}
        hits = misses = 0
        for index, image in enumerate(prompt.images):
            if image.token_start + image.num_tokens <= first_needed_token:
                continue
            key = self._image_key(image, salt)
            cached = self.vision.get(key, owner) if self.vision else None
            if cached is None:
                cached = encode(image)
                misses += 1
                if self.vision:
                    self.vision.put(key, cached, owner)
            else:
                hits += 1
            features[index] = cached
        skipped = len(prompt.images) - hits - misses
        return features, VisionReport(len(prompt.images), hits, misses, skipped, self.vision is not None)

    def _image_key(self, image: PromptImage, salt: TenantSalt) -> ImageKey:
        return image_key(image.pixel_hash, self.processor_fingerprint, self.model_fingerprint, salt)


def _prefix_cache(config: CacheConfig, model_fingerprint: str) -> PrefixCache:
    ssd = None
    if config.ssd is not None:
        ssd = SsdTier(config.ssd, ssd_namespace(config, model_fingerprint))
    return PrefixCache(
        config.prefix_budget_bytes,
        config.block_size,
        ssd,
        config.quant,
        write_through=config.ssd is not None and bool(config.ssd.writer),
        pin_budget_bytes=config.pin_budget_bytes,
    )


def ssd_namespace(config: CacheConfig, model_fingerprint: str) -> str:
    """What a model's SSD blocks are filed under (a folder of their own): model, block size, quantisation."""
    quant = f"{config.quant.bits}bit/g{config.quant.group_size}" if config.quant else "none"
    return f"{model_fingerprint}|block={config.block_size}|quant={quant}"


def purge_ssd_of(config: CacheConfig, model_fingerprint: str, selects: Callable[[str], bool]) -> Removed | None:
    """Take the selected owners off the SSD blocks of a model that is not loaded (None: no SSD tier)."""
    if config.ssd is None:
        return None
    tier = SsdTier(config.ssd, ssd_namespace(config, model_fingerprint))
    try:
        return tier.purge_owned(selects)
    finally:
        tier.close()


def _purge_owned(layer: PrefixCache | SsdTier | VisionCache | None, selects: Callable[[str], bool]) -> Removed | None:
    return layer.purge_owned(selects) if layer is not None else None
