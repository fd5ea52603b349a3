"""Purges that reach every replica sharing a Redis (STRATA_REDIS_URL).

The exact and semantic entries live in Redis, so a purge through any replica removes them for all.
What each replica keeps for itself — prefix KV blocks in RAM, image features, stored Responses
conversations, an SSD tier of its own — is reached through a Redis stream: the replica that took the
purge appends it (`announce`), and every other replica's follower thread runs the same purge on its
own layers. A stream, not pub/sub: a replica that lost Redis for a moment reads the purges it missed
when the connection returns (the stream keeps the last MAX_PURGES). A replica started later has
nothing of the past in RAM and starts from the stream's end.

    PurgeFeed(url, apply)   apply(tenant, session, user, layers) runs one purge here
    announce(...)           StoreUnavailable when Redis cannot be reached (the caller answers 503)
    close()
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable

from semantic.redis_store import SOCKET_TIMEOUT_S, RedisLink
from semantic.store import StoreUnavailable

log = logging.getLogger("strata.purges")
STREAM = "strata:purges"
MAX_PURGES = 10_000
WAIT_S = 1.0  # a follower blocks this long for news, then checks whether the server is stopping


class PurgeFeed:
    def __init__(self, url: str, apply: Callable[[str, str | None, str | None, list[str]], None]):
        self.origin = uuid.uuid4().hex  # this process: its own announcements are not applied twice
        self.link = RedisLink(url)
        self.follow_link = RedisLink(url, socket_timeout_s=WAIT_S + SOCKET_TIMEOUT_S)
        self.apply = apply
        self.closing = threading.Event()
        try:
            position = self.link.stream_end(STREAM)
        except StoreUnavailable:
            position = "$"  # Redis is down: follow from whatever comes once it is back
        self.follower = threading.Thread(target=self._follow, args=(position,), name="strata-purge-feed", daemon=True)
        self.follower.start()

    def announce(self, tenant: str, session: str | None, user: str | None, layers: list[str]) -> None:
        purge = json.dumps(
            {"origin": self.origin, "tenant": tenant, "session": session, "user": user, "layers": layers}
        )
        self.link.call(self.link.client.xadd, STREAM, {"purge": purge}, maxlen=MAX_PURGES, approximate=True)

    def close(self) -> None:
        self.closing.set()
        self.follower.join(timeout=WAIT_S + 2 * SOCKET_TIMEOUT_S)
        self.link.close()
        self.follow_link.close()

    def _follow(self, position: str) -> None:
        while not self.closing.is_set():
            try:
                if position == "$":
                    position = self.link.stream_end(STREAM)
                reply = self.follow_link.call(
                    self.follow_link.client.xread, {STREAM: position}, count=100, block=int(WAIT_S * 1000)
                )
            except StoreUnavailable:
                self.closing.wait(WAIT_S / 4)
                continue
            for record_id, fields in reply[0][1] if reply else []:
                position = record_id.decode()
                self._run(json.loads(fields[b"purge"]))

    def _run(self, purge: dict) -> None:
        if purge["origin"] == self.origin:
            return
        try:
            self.apply(purge["tenant"], purge["session"], purge["user"], purge["layers"])
        except Exception as exc:  # noqa: BLE001 - one failed purge must not stop the follower
            log.warning("a purge from another replica failed here: %s: %s", type(exc).__name__, exc)
