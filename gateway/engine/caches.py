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

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class Removed(Protocol):
    """What a purge removed. Each library returns its own frozen `Purged` of these three fields (the
    libraries never import each other, so they share this shape, not a class)."""

    @property
    def num_entries(self) -> int: ...
    @property
    def num_bytes(self) -> int: ...
    @property
    def num_files(self) -> int: ...


@runtime_checkable
class CacheLayer(Protocol):
    name: str

    def stats(self) -> DataclassInstance: ...

    def purge(self) -> Removed: ...

    def close(self) -> None: ...
