"""Expiry made real: a background sweep deletes what outlived its TTL from every store that keeps
entries on disk or in memory between requests (exact entries, semantic entries, stored Responses
conversations). Lookups already refuse expired entries; without the sweep they would still fill
`responses.db`, `semantic.db` and `conversations.db` for ever.

    Sweeper(stores, interval_s).run()    the loop (an asyncio task of the app's lifespan)
    Sweeper.sweep(now) -> {layer: removed}   one pass, in the caller's thread
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import anyio

log = logging.getLogger("strata")


class Sweeper:
    def __init__(self, stores: dict[str, Callable[[float], int]], interval_s: float):
        """`stores`: layer name -> its purge_expired(now) (the number of entries it removed)."""
        self.stores = stores
        self.interval_s = interval_s
        self.removed: Counter[str] = Counter()  # by layer, since start
        self.num_sweeps = 0

    def sweep(self, now: float) -> dict[str, int]:
        removed = {}
        for layer, purge_expired in self.stores.items():
            try:
                removed[layer] = purge_expired(now)
            except Exception as exc:  # noqa: BLE001 - a locked or full database must not end the loop
                log.warning("sweeping expired %s entries failed: %s: %s", layer, type(exc).__name__, exc)
                removed[layer] = 0
        self.removed.update(removed)
        self.num_sweeps += 1
        return removed

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval_s)
            await anyio.to_thread.run_sync(self.sweep, time.time())

    def snapshot(self) -> dict:
        return {"interval_s": self.interval_s, "num_sweeps": self.num_sweeps, "removed": dict(self.removed)}
