"""Per-layer counters for operators: how often each layer hit, missed or was bypassed."""

from __future__ import annotations

from collections import Counter

from .trace import LAYERS, Trace


class LayerCounters:
    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.served_by: Counter[str] = Counter()

    def add(self, trace: Trace) -> None:
        self.served_by[trace.served_by] += 1
        for layer in LAYERS:
            self.outcomes[(layer, trace.outcomes[layer].status)] += 1

    def snapshot(self) -> dict:
        layers = {}
        for layer in LAYERS:
            counts = {status: self.outcomes[(layer, status)] for status in ("hit", "miss", "bypass")}
            looked_up = counts["hit"] + counts["miss"]
            layers[layer] = {**counts, "hit_rate": counts["hit"] / looked_up if looked_up else None}
        return {"served_by": dict(self.served_by), "layers": layers}
