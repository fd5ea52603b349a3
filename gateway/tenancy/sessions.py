"""Sessions end by themselves: one idle past STRATA_SESSION_TTL_S is purged from every layer and
tier by the background sweep, as if an operator had called POST /admin/sessions/{id}/end.

    SessionClock(ttl_s).touch(tenant, session, now)    every request that names a session
    SessionClock.idle(now) -> [(tenant, session)]      those idle past the TTL, forgotten as returned

Invariant: `last_seen` holds exactly the sessions seen within the last TTL that were not yet ended
(its size is bounded by the sessions active in one TTL). `lock` guards it: requests touch it on the
event loop, the sweep reads it in a worker thread.
"""

from __future__ import annotations

import threading


class SessionClock:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s  # 0: sessions never end by themselves
        self.last_seen: dict[tuple[str, str], float] = {}
        self.lock = threading.Lock()

    def touch(self, tenant: str, session: str, now: float) -> None:
        if self.ttl_s and session:
            with self.lock:
                self.last_seen[(tenant, session)] = now

    def idle(self, now: float) -> list[tuple[str, str]]:
        with self.lock:
            ended = [key for key, seen in self.last_seen.items() if now - seen > self.ttl_s]
            for key in ended:
                del self.last_seen[key]
        return ended
