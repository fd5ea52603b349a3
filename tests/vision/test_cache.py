"""The vision-feature cache's retention (its budget and LRU are tested through the engine)."""

import time

import numpy as np

from vision import VisionCache


def test_expire_drops_features_unused_past_the_retention():
    cache = VisionCache(budget_bytes=1 << 20)
    for name in ("a", "b", "c"):
        cache.put(name, np.zeros(100, dtype=np.float32))
    cache.used_at["a"] = cache.used_at["b"] = time.monotonic() - 100
    assert cache.get("b") is not None  # used now: no longer idle, and moved to the back
    removed = cache.expire(idle_s=50)
    assert (removed.num_entries, removed.num_bytes) == (1, 400)
    assert cache.get("a") is None and cache.get("b") is not None and cache.get("c") is not None
    assert cache.num_bytes == 800 and cache.stats().counters.num_expired == 1
    assert cache.expire(idle_s=50, now=time.monotonic() + 100).num_entries == 2 and cache.num_bytes == 0
