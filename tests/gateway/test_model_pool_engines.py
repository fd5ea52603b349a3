"""ModelPool with real engines: two tiny models of different families under a memory limit that fits
one. Each answers as it does alone, the one unloaded to make room persists its prefix blocks to the
SSD tier, and when it is loaded again the same prompt restores its KV from SSD."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

from gateway.checkpoints import BuildSpec
from gateway.engine import CacheConfig, Engine, EngineConfig, Failed, Finished, Message, Sampling, Started, TextPart
from gateway.engine.model_pool import ModelPool, ModelSpec, weights_bytes
from kvcache import TenantSalt
from kvcache.ssd import AdmissionPolicy, SsdConfig
from tests.conftest import built_model

SALT = TenantSalt(b"P" * 32)
PREFIX_BYTES = 32 << 20
TEXT = "The lighthouse keeper wrote down every ship that passed the point, its flag and its cargo. " * 6


def _ask(engine: Engine, text: str) -> tuple[Started, str]:
    async def run():
        prompt = engine.prepare((Message("user", (TextPart(text),)),), [])
        started, answer = None, ""
        async for event in engine.events(engine.submit(prompt, Sampling(8, 0.0, 1.0, None, ()), SALT)):
            assert not isinstance(event, Failed), event.message
            if isinstance(event, Started):
                started = event
            if isinstance(event, Finished):
                return started, answer
            answer += getattr(event, "text", "")

    return asyncio.run(run())


def _pool_for_one(paths: dict, folder) -> tuple[ModelPool, int]:
    """The models in `paths` under a memory limit that holds one of them, their blocks on one SSD root."""
    config = EngineConfig(
        max_queue=4,
        step_prompt_tokens=64,
        caches=CacheConfig(PREFIX_BYTES, 0, 16, SsdConfig(folder, admission=AdmissionPolicy(min_hits=0))),
    )

    def load(spec: ModelSpec) -> Engine:
        engine = Engine(spec.path, spec.name, config)
        engine.start()
        return engine

    specs = [ModelSpec(name, str(path), weights_bytes(path) + PREFIX_BYTES) for name, path in paths.items()]
    limit = int(max(spec.estimate_bytes for spec in specs) * 1.5)
    return ModelPool(specs, load, limit), limit


def test_two_families_take_turns_under_a_limit_for_one_and_a_reloaded_model_restores_from_ssd(tmp_path):
    paths = {family: built_model(BuildSpec(family, "tiny")) for family in ("llama", "gemma3")}
    pool, limit = _pool_for_one(paths, tmp_path / "kv")
    threads_before = _engine_threads()
    try:
        with pool.use("llama", 120) as llama:
            cold, cold_answer = _ask(llama, TEXT)
        assert cold.num_cached_tokens == 0
        unloaded = weakref.ref(llama.runner)  # the model and its caches
        del llama
        with pool.use("gemma3", 120) as gemma:
            assert gemma.info.name == "gemma3" and gemma.nbytes <= limit
            _, gemma_answer = _ask(gemma, TEXT)
        gc.collect()
        assert unloaded() is None  # the unloaded engine, its model and caches are freed (its thread kept none)
        states = {s.name: s.state for s in pool.statuses()}
        assert states == {"llama": "unloaded", "gemma3": "loaded"}
        with pool.use("llama", 120) as llama_again:
            warm, warm_answer = _ask(llama_again, TEXT)
        assert warm_answer == cold_answer and gemma_answer  # each model answers as it does alone
        assert warm.prefix.num_ssd_tokens > 0 and warm.num_cached_tokens >= warm.prefix.num_ssd_tokens
        assert {s.name: s.state for s in pool.statuses()} == {"llama": "loaded", "gemma3": "unloaded"}
        assert sum(s.nbytes for s in pool.statuses()) <= limit
        # three loads, one engine at a time: one engine thread, reused (each load once parked one more)
        assert _engine_threads() - threads_before <= 1
        last = weakref.ref(llama_again.runner)
        del llama_again
        pool.close()
        gc.collect()
        assert last() is None  # the idle engine thread holds nothing of the last engine it ran
    finally:
        pool.close()


def _engine_threads() -> int:
    return sum(thread.name == "strata-engine" for thread in threading.enumerate())


def test_a_model_never_restores_another_models_blocks_even_with_the_same_tokens(tmp_path):
    """A float16 twin of a model has its tokenizer and chat template, so the same prompt makes the same
    tokens: only the model's fingerprint in the blocks' keys and SSD folder keeps them apart."""
    paths = {
        "model": built_model(BuildSpec("qwen2_5_vl", "tiny")),
        "twin": built_model(BuildSpec("qwen2_5_vl", "tiny", "float16")),
    }
    pool, _ = _pool_for_one(paths, tmp_path / "kv")
    try:
        with pool.use("twin", 120) as twin:
            _ask(twin, TEXT)
        with pool.use("model", 120) as model:  # the twin is unloaded first: its blocks are on SSD now
            started, _ = _ask(model, TEXT)
        assert started.num_cached_tokens == 0 and started.prefix.num_ssd_tokens == 0
        with pool.use("twin", 120) as twin_again:  # they are there, for the twin itself
            again, _ = _ask(twin_again, TEXT)
        assert again.prefix.num_ssd_tokens > 0
    finally:
        pool.close()
