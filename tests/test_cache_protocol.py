"""Every cache layer and tier speaks the same protocol (gateway/engine/caches.py): a name, a typed frozen
snapshot from stats(), purge() reporting what it removed, close(). One contract, run over the real
exact (SQLite and memory), semantic (MiniLM, faiss, SQLite), vision, prefix-in-RAM and SSD caches."""

from __future__ import annotations

import dataclasses
import time

import mlx.core as mx
import numpy as np
import pytest

from gateway.engine import CacheLayer
from kvcache import PrefixCache, TenantSalt
from kvcache.ssd import AdmissionPolicy, SpillRequest, SsdConfig, SsdTier
from semantic import (
    Answer,
    ExactCache,
    MemoryStore,
    Scope,
    SemanticCache,
    SemanticSettings,
    SqliteEntries,
    SqliteStore,
    StoredResponse,
)
from vision import VisionCache

SALT = TenantSalt(b"s" * 32)


def _exact(tmp_path, store):
    cache = ExactCache(store, 3600.0)
    for i in range(3):
        cache.store.put(f"key-{i}", "tenant-a", StoredResponse(f"answer {i}", "stop", 1, 1, time.time(), None))
    return cache, 3


def _semantic(tmp_path, embedder):
    cache = SemanticCache(embedder, SqliteEntries(tmp_path / "semantic.db"), SemanticSettings())
    for question in ("How do I reset my password?", "Where are the invoices?"):
        cache.insert(question, Answer("..."), Scope("tenant-a", "model"), "ctx", time.time())
    return cache, 2


def _vision(tmp_path, _):
    cache = VisionCache(1 << 20)
    for i in range(4):
        cache.put(f"image-{i}", mx.zeros((8, 16)))
    return cache, 4


def _prefix(tmp_path, _):
    cache = PrefixCache(1 << 24, 16)
    tokens = list(range(64))
    kv = [(mx.ones((1, 2, 64, 8)), mx.ones((1, 2, 64, 8)))]
    with cache.open(SALT, "model", tokens) as session:
        session.match(len(tokens))
        session.store(tokens, kv, len(tokens))
    return cache, 4


def _ssd(tmp_path, _):
    tier = SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0)), "model|block=4|quant=none")
    for i in range(1, 4):
        tensors = {"0.k": np.full((1, 2, 4, 8), i, np.float32), "0.v": np.full((1, 2, 4, 8), -i, np.float32)}
        assert tier.offer(SpillRequest(i.to_bytes(32, "big"), (i - 1).to_bytes(32, "big"), 4, "scope", tensors))
        assert tier.drain(10)
    return tier, 3


LAYERS = {
    "exact-sqlite": (lambda tmp, emb: _exact(tmp, SqliteStore(tmp / "responses.db")), "exact"),
    "exact-memory": (lambda tmp, emb: _exact(tmp, MemoryStore()), "exact"),
    "semantic": (_semantic, "semantic"),
    "vision": (_vision, "vision"),
    "prefix": (_prefix, "prefix"),
    "ssd": (_ssd, "ssd"),
}


def _held(snapshot) -> int:
    """Entries in the response and vision caches; blocks in the KV tiers."""
    return snapshot.num_entries if hasattr(snapshot, "num_entries") else snapshot.num_blocks


@pytest.mark.parametrize("kind", LAYERS)
def test_every_layer_speaks_the_cache_protocol(kind, tmp_path, embedder):
    build, name = LAYERS[kind]
    layer, num_stored = build(tmp_path, embedder)
    assert isinstance(layer, CacheLayer) and layer.name == name
    before = layer.stats()
    assert dataclasses.is_dataclass(before) and before.__dataclass_params__.frozen
    assert _held(before) == num_stored
    removed = layer.purge()
    assert removed.num_entries == num_stored and removed.num_bytes >= 0 and removed.num_files >= 0
    assert _held(layer.stats()) == 0
    assert layer.purge().num_entries == 0  # nothing left to remove
    layer.close()


def test_ssd_purge_removes_its_files(tmp_path):
    tier, _ = _ssd(tmp_path, None)
    files = list(tier.folder.glob("*/*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    removed = tier.purge()
    assert removed.num_files == len(files) > 0 and not any(f.exists() for f in files)
    assert removed.num_bytes == on_disk
    tier.close()
    again = SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0)), "model|block=4|quant=none")
    assert again.stats().num_blocks == 0  # a restart finds nothing to reindex
    again.close()


def test_prefix_purge_keeps_blocks_a_running_request_holds(tmp_path):
    cache, _ = _prefix(tmp_path, None)
    tokens = list(range(64))
    with cache.open(SALT, "model", tokens) as running:
        running.match(len(tokens))
        assert cache.purge().num_entries == 0  # all four are in use
        assert cache.stats().num_blocks == 4
    assert cache.purge().num_entries == 4
