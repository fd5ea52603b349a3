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


def test_purge_deletes_features_only_once_no_owner_is_left():
    cache = VisionCache(budget_bytes=1 << 20)
    cache.put("shared", np.zeros(100, dtype=np.float32), owner="A")
    assert cache.get("shared", owner="B") is not None  # B's request reused A's image: both own it
    cache.put("private", np.zeros(50, dtype=np.float32), owner="A")
    removed = cache.purge_owned(lambda owner: owner == "A")
    assert (removed.num_entries, removed.num_bytes) == (1, 200)
    assert cache.get("private") is None and cache.get("shared") is not None
    assert cache.purge_owned(lambda owner: owner == "B").num_entries == 1
    assert not cache.entries and not cache.owners and cache.num_bytes == 0
