"""The one protocol every cache layer and tier speaks: exact, semantic, vision features, prefix KV in
RAM, and the SSD tier. The libraries conform structurally (they never import this module).

    layer.name        "exact" | "semantic" | "vision" | "prefix" | "ssd"
    layer.stats()     a frozen, typed snapshot (ExactSnapshot, SemanticSnapshot, VisionSnapshot,
                      PrefixSnapshot, SsdSnapshot): everything operators read comes from these
    layer.purge()     removes what the layer holds; returns what it removed (num_entries,
                      num_bytes, num_files). Purges by owner are each layer's own:
                      `purge_owned(Selector)` for the response stores, `purge_owned(selects)` (a
                      predicate over owner labels) for vision, prefix and ssd.
    layer.close()     releases files, connections and memory

The engine's layers (vision, prefix) belong to its worker thread: purge and close them there.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class Removed(Protocol):
    num_entries: int
    num_bytes: int
    num_files: int


@runtime_checkable
class CacheLayer(Protocol):
    name: str

    def stats(self) -> object: ...

    def purge(self) -> Removed: ...

    def close(self) -> None: ...
