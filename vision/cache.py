"""The vision-embedding cache: projected image features by image key, LRU with a byte budget.

An ImageKey covers what changes the features: the decoded pixels (PixelHash), the image processor's
settings and the model's fingerprint, plus a scope (the tenant's salt by default), so tenant B never
reuses tenant A's features. Features are opaque to this module: anything with `.nbytes` (an MLX array).

Each entry records its owners (opaque labels: the gateway's tenant, session and end user): whoever
stored or reused it. `purge_owned` takes owners off and deletes entries left with none; a request
that holds features keeps its own reference, so a purge never pulls them from under it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, NewType

from .images import PixelHash

ImageKey = NewType("ImageKey", str)


def processor_fingerprint(settings: dict[str, Any]) -> str:
    """A stable digest of the image-processor settings that change pixel_values."""
    canonical = json.dumps({k: v for k, v in sorted(settings.items()) if _is_plain(v)}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def image_key(pixel_hash: PixelHash, processor: str, model: str, scope: bytes) -> ImageKey:
    digest = hashlib.sha256(b"strata-image-key-v1|")
    for part in (pixel_hash.encode(), processor.encode(), model.encode(), scope):
        digest.update(len(part).to_bytes(4, "little") + part)
    return ImageKey(digest.hexdigest())


def _is_plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool, type(None))) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str)) for v in value)
    )


@dataclass(slots=True)
class VisionCacheStats:
    num_hits: int = 0
    num_misses: int = 0
    num_evicted: int = 0
    num_expired: int = 0  # dropped by expire(): unused past the retention
    num_purged: int = 0  # entries whose last owner a purge removed


@dataclass(frozen=True, slots=True)
class VisionSnapshot:
    counters: VisionCacheStats
    num_entries: int
    num_bytes: int
    budget_bytes: int


@dataclass(frozen=True, slots=True)
class Purged:
    """What a purge removed (the cache protocol's result)."""

    num_entries: int = 0
    num_bytes: int = 0
    num_files: int = 0


class VisionCache:
    """Invariant: num_bytes == sum of the entries' nbytes <= budget_bytes; `used_at` and `owners`
    have the same keys as `entries`. Cache protocol: `name`,
    `stats()`, `purge()`, `close()`, all on the one thread that runs the model (features are MLX arrays)."""

    name = "vision"

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[ImageKey, Any] = OrderedDict()  # least recently used first; O(1) moves
        self.used_at: dict[ImageKey, float] = {}  # time.monotonic() of each entry's last get or put
        self.owners: dict[ImageKey, set[str]] = {}
        self.num_bytes = 0
        self.counters = VisionCacheStats()

    def get(self, key: ImageKey, owner: str | None = None) -> Any | None:
        """The features, or None; `owner` (when given) joins the entry's owners on a hit."""
        features = self.entries.get(key)
        if features is None:
            self.counters.num_misses += 1
            return None
        self.entries.move_to_end(key)
        self.used_at[key] = time.monotonic()
        if owner is not None:
            self.owners[key].add(owner)
        self.counters.num_hits += 1
        return features

    def stats(self) -> VisionSnapshot:
        return VisionSnapshot(replace(self.counters), len(self.entries), self.num_bytes, self.budget_bytes)

    def purge(self) -> Purged:
        removed = Purged(len(self.entries), self.num_bytes)
        self.entries.clear()
        self.used_at.clear()
        self.owners.clear()
        self.num_bytes = 0
        return removed

    def purge_owned(self, selects) -> Purged:
        """Take the owners `selects(owner)` picks off every entry; entries left with none go."""
        num_entries, num_bytes = 0, 0
        for key, owners in list(self.owners.items()):
            selected = {owner for owner in owners if selects(owner)}
            owners -= selected
            if selected and not owners:
                num_entries, num_bytes = num_entries + 1, num_bytes + self._drop(key)
        self.counters.num_purged += num_entries
        return Purged(num_entries, num_bytes)

    def _drop(self, key: ImageKey) -> int:
        """Remove one entry; its size."""
        size = int(self.entries.pop(key).nbytes)
        del self.used_at[key], self.owners[key]
        self.num_bytes -= size
        return size

    def expire(self, idle_s: float, now: float | None = None) -> Purged:
        """Drop the features nobody used for idle_s seconds (the retention), least recently used first."""
        cutoff = (time.monotonic() if now is None else now) - idle_s
        num_entries, num_bytes = 0, 0
        while self.entries and self.used_at[oldest := next(iter(self.entries))] < cutoff:
            num_entries, num_bytes = num_entries + 1, num_bytes + self._drop(oldest)
        self.counters.num_expired += num_entries
        return Purged(num_entries, num_bytes)

    def close(self) -> None:
        self.purge()

    def put(self, key: ImageKey, features: Any, owner: str | None = None) -> bool:
        """Store features (owned by `owner`, with the owners the key had); False if they alone exceed
        the budget."""
        size = int(features.nbytes)
        if size > self.budget_bytes:
            return False
        owners = self.owners.get(key, set()) | ({owner} if owner is not None else set())
        if key in self.entries:
            self._drop(key)
        while self.num_bytes + size > self.budget_bytes:
            self._drop(next(iter(self.entries)))
            self.counters.num_evicted += 1
        self.entries[key] = features
        self.used_at[key] = time.monotonic()
        self.owners[key] = owners
        self.num_bytes += size
        return True
