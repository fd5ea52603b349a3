"""Retention: the background sweep deletes expired entries from every response store (real SQLite
files), so they stay bounded however long the server runs; one bad answer can be deleted by the key
its response carried."""

from __future__ import annotations

import dataclasses
import time

from litestar.testing import TestClient

from gateway.app import EXACT_KEY_HEADER, create_app
from gateway.conversations import ConversationStore
from gateway.responses import ResponseCaches
from gateway.sweeper import Sweeper
from semantic import Answer, CacheControl, Scope, StoredResponse
from tests.conftest import TINY

ADMIN = {"Authorization": "Bearer admin-key"}


def test_writing_far_past_the_ttl_keeps_every_store_bounded(settings, embedder):
    """3,000 exact entries, 300 semantic entries and 600 conversations, each living 10 s of a fake
    clock, written over 300 s with a sweep every 10 s: what stays is one TTL's worth plus one sweep
    interval's, not everything written."""
    caches = ResponseCaches(dataclasses.replace(settings, exact_store="sqlite", semantic_enabled=True), "model", embedder)
    conversations = ConversationStore(settings.data_dir / "conversations.db", retention_s=10)
    sweeper = Sweeper({**caches.expiring(), "conversations": conversations.purge_expired}, interval_s=10)
    scope = Scope("tenant-a", "model")
    try:
        for second in range(300):
            for index in range(10):
                key = f"{second}-{index}"
                caches.exact.store_response(key, "tenant-a", StoredResponse("x", "stop", 1, 1, second, second + 10),
                                            CacheControl(), True)
            conversations.save(f"resp_{second}_a", "tenant-a", None, None, [], {}, now=second)
            conversations.save(f"resp_{second}_b", "tenant-a", None, None, [], {}, now=second)
            caches.semantic.insert(f"question number {second} about topic {second % 7}", Answer("y"), scope, "ctx",
                                   second, ttl_s=10)
            if second % 10 == 9:
                sweeper.sweep(second + 1)
        assert caches.exact.store.count() <= 20 * 10
        assert caches.semantic.stats().num_entries <= 20
        (rows,) = conversations.db.execute("SELECT COUNT(*) FROM conversations").fetchone()
        assert rows <= 40
        assert sweeper.removed["exact"] >= 3000 - 200 and sweeper.num_sweeps == 30
    finally:
        caches.close()
        conversations.close()


def test_the_server_sweeps_in_the_background(settings, engine, embedder):
    fast = dataclasses.replace(settings, exact_store="sqlite", admin_key="admin-key", sweep_interval_s=0.2)
    with TestClient(create_app(fast, engine=engine)) as client:
        reply = client.post("/v1/chat/completions", headers={"X-Strata-Cache-TTL": "1"}, json={
            "model": TINY, "messages": [{"role": "user", "content": "sweep me"}], "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200
        deadline = time.monotonic() + 10
        while client.get("/admin/stats", headers=ADMIN).json()["sweeps"]["removed"].get("exact", 0) < 1:
            assert time.monotonic() < deadline, "the expired entry was never swept"
            time.sleep(0.2)
        assert client.get("/admin/stats", headers=ADMIN).json()["response_caches"]["exact"]["num_entries"] == 0


def test_one_bad_answer_is_deleted_by_its_key(settings, engine):
    with TestClient(create_app(dataclasses.replace(settings, exact_store="sqlite", admin_key="admin-key"),
                               engine=engine)) as client:
        body = {"model": TINY, "messages": [{"role": "user", "content": "a bad answer"}], "max_tokens": 3,
                "temperature": 0}
        first = client.post("/v1/chat/completions", json=body)
        key = first.headers[EXACT_KEY_HEADER]
        assert client.post("/v1/chat/completions", json=body).headers["x-cache-exact"].startswith("hit")
        assert client.delete(f"/admin/exact/{key}").status_code == 401  # admins only
        assert client.delete(f"/admin/exact/{key}", headers=ADMIN).json() == {"key": key, "deleted": True}
        again = client.post("/v1/chat/completions", json=body)
        assert again.headers["x-cache-exact"].startswith("miss") and again.headers[EXACT_KEY_HEADER] == key
        assert client.delete("/admin/exact/nope", headers=ADMIN).status_code == 404
