"""Per-layer counters for operators: how often each layer hit, missed or was bypassed; and the
recent requests the miss diagnosis reads (gateway/observability/diagnosis.py)."""

from __future__ import annotations

import time
from collections import Counter, deque

from .diagnosis import RECENT_REQUESTS, RequestRecord, sampled_chain
from .trace import LAYERS, Trace


class LayerCounters:
    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.served_by: Counter[str] = Counter()
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)  # oldest first

    def add(self, trace: Trace) -> None:
        self.served_by[trace.served_by] += 1
        for layer in LAYERS:
            self.outcomes[(layer, trace.outcomes[layer].status)] += 1
        statuses = tuple(trace.outcomes[layer].status for layer in LAYERS)
        self.recent.append(RequestRecord(time.time(), statuses, trace.prefix, sampled_chain(trace.chain)))

    def snapshot(self) -> dict:
        layers = {}
        for layer in LAYERS:
            counts = {status: self.outcomes[(layer, status)] for status in ("hit", "miss", "bypass")}
            looked_up = counts["hit"] + counts["miss"]
            layers[layer] = {**counts, "hit_rate": counts["hit"] / looked_up if looked_up else None}
        return {"served_by": dict(self.served_by), "layers": layers}
