"""Retention: the background sweep deletes expired entries from every response store (real SQLite
files), so they stay bounded however long the server runs; one bad answer can be deleted by the key
its response carried."""

from __future__ import annotations

import dataclasses
import time

from litestar.testing import TestClient

from gateway.http.app import EXACT_KEY_HEADER, create_app
from gateway.operations.sweeper import Sweeper
from gateway.serving.conversations import ConversationStore
from gateway.serving.responses import ResponseCaches
from semantic import Answer, CacheControl, Scope, StoredResponse
from tests.conftest import TINY

ADMIN = {"Authorization": "Bearer admin-key"}


def test_writing_far_past_the_ttl_keeps_every_store_bounded(settings, embedder):
    """3,000 exact entries, 300 semantic entries and 600 conversations, each living 10 s of a fake
    clock, written over 300 s with a sweep every 10 s: what stays is one TTL's worth plus one sweep
    interval's, not everything written."""
    caches = ResponseCaches(dataclasses.replace(settings, exact_store="sqlite", semantic_enabled=True), embedder)
    conversations = ConversationStore(settings.data_dir / "conversations.db", retention_s=10)
    sweeper = Sweeper({**caches.expiring(), "conversations": conversations.purge_expired}, interval_s=10)
    scope = Scope("tenant-a", "model")
    try:
        for second in range(300):
            for index in range(10):
                key = f"{second}-{index}"
                caches.exact.store_response(
                    key, "tenant-a", StoredResponse("x", "stop", 1, 1, second, second + 10), CacheControl(), True
                )
            conversations.save(f"resp_{second}_a", "tenant-a", None, None, [], {}, now=second)
            conversations.save(f"resp_{second}_b", "tenant-a", None, None, [], {}, now=second)
            caches.semantic.insert(
                f"question number {second} about topic {second % 7}", Answer("y"), scope, "ctx", second, ttl_s=10
            )
            if second % 10 == 9:
                sweeper.sweep(second + 1)
        assert caches.exact.store.count() <= 20 * 10
        assert caches.semantic.stats().num_entries <= 20
        (rows,) = conversations.db.execute("SELECT COUNT(*) FROM responses").fetchone()
        assert rows <= 40
        assert sweeper.removed["exact"] >= 3000 - 200 and sweeper.num_sweeps == 30
    finally:
        caches.close()
        conversations.close()


def test_the_server_sweeps_in_the_background(settings, engine, embedder):
    fast = dataclasses.replace(settings, exact_store="sqlite", admin_key="admin-key", sweep_interval_s=0.2)
    with TestClient(create_app(fast, engine=engine)) as client:
        reply = client.post(
            "/v1/chat/completions",
            headers={"X-Strata-Cache-TTL": "1"},
            json={
                "model": TINY,
                "messages": [{"role": "user", "content": "sweep me"}],
                "max_tokens": 2,
                "temperature": 0,
            },
        )
        assert reply.status_code == 200
        deadline = time.monotonic() + 10
        while client.get("/admin/stats", headers=ADMIN).json()["sweeps"]["removed"].get("exact", 0) < 1:
            assert time.monotonic() < deadline, "the expired entry was never swept"
            time.sleep(0.2)
        assert client.get("/admin/stats", headers=ADMIN).json()["response_caches"]["exact"]["num_entries"] == 0


def test_one_bad_answer_is_deleted_by_its_key(settings, engine):
    with TestClient(
        create_app(dataclasses.replace(settings, exact_store="sqlite", admin_key="admin-key"), engine=engine)
    ) as client:
        body = {
            "model": TINY,
            "messages": [{"role": "user", "content": "a bad answer"}],
            "max_tokens": 3,
            "temperature": 0,
        }
        first = client.post("/v1/chat/completions", json=body)
        key = first.headers[EXACT_KEY_HEADER]
        assert client.post("/v1/chat/completions", json=body).headers["x-cache-exact"].startswith("hit")
        assert client.delete(f"/admin/exact/{key}").status_code == 401  # admins only
        assert client.delete(f"/admin/exact/{key}", headers=ADMIN).json() == {"key": key, "deleted": True}
        again = client.post("/v1/chat/completions", json=body)
        assert again.headers["x-cache-exact"].startswith("miss") and again.headers[EXACT_KEY_HEADER] == key
        assert client.delete("/admin/exact/nope", headers=ADMIN).status_code == 404


def _chat(client, text, session=None, user=None, **extra):
    headers = {"X-Strata-Session": session} if session else {}
    body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0, **extra}
    if user:
        body["user"] = user
    return client.post("/v1/chat/completions", json=body, headers=headers)


def test_purging_a_session_misses_its_answers_and_keeps_what_another_session_shares(settings, engine, embedder):
    live = dataclasses.replace(settings, exact_store="sqlite", semantic_enabled=True, admin_key="admin-key")
    with TestClient(create_app(live, engine=engine, embedder=embedder)) as client:
        _chat(client, "What are the opening hours of the library?", session="A")
        hit = _chat(client, "What are the opening hours of the library?", session="B")  # a hit: now A's and B's
        assert hit.headers["x-cache-exact"].startswith("hit")
        _chat(client, "Summarise my last order please", session="A")
        response = client.post(
            "/v1/responses",
            json={"model": TINY, "input": "hi", "max_output_tokens": 2},
            headers={"X-Strata-Session": "A"},
        )
        assert response.status_code == 200
        purged = client.post("/admin/purge", json={"tenant": "default", "session": "A"}, headers=ADMIN)
        assert purged.status_code == 200, purged.text
        removed = purged.json()["removed"]
        # A's own: its order question (its sampled Responses turn was never an exact entry) and its conversation
        assert removed["exact"]["entries"] == 1 and removed["conversations"]["entries"] == 1
        assert removed["exact"]["bytes"] > 0
        assert _chat(client, "Summarise my last order please", session="A").headers["x-cache-exact"].startswith("miss")
        assert (
            _chat(client, "What are the opening hours of the library?", session="B")
            .headers["x-cache-exact"]
            .startswith("hit")
        )
        response_id = response.json()["id"]
        assert client.get(f"/v1/responses/{response_id}").status_code == 404
        assert (
            client.post("/admin/sessions/B/end?tenant=default", headers=ADMIN).json()["removed"]["exact"]["entries"]
            >= 1
        )
        assert (
            _chat(client, "What are the opening hours of the library?", session="B")
            .headers["x-cache-exact"]
            .startswith("miss")
        )


def test_purge_requests_are_checked(settings, engine):
    with TestClient(create_app(dataclasses.replace(settings, admin_key="admin-key"), engine=engine)) as client:
        assert client.post("/admin/purge", json={"session": "A"}).status_code == 401
        assert client.post("/admin/purge", json={"session": "A"}, headers=ADMIN).json()["error"]["param"] == "tenant"
        bad = client.post("/admin/purge", json={"tenant": "t", "layers": ["kv-of-everyone"]}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "layers"
        off = client.post("/admin/purge", json={"tenant": "t", "user": "u"}, headers=ADMIN).json()["removed"]
        assert off["exact"] is None and off["conversations"] == {"entries": 0, "bytes": 0}  # exact is off here


def test_idle_kv_blocks_and_image_features_expire_from_ram(tiny_model_path, monkeypatch):
    """An idle worker still wakes to drop what outlived the RAM tiers' retention; the next request
    then recomputes (prefix miss, vision miss)."""
    import asyncio

    from gateway.engine import CacheConfig, Engine, EngineConfig, ImagePart, Message, Sampling, TextPart, worker
    from tests.conftest import png_data_url
    from vision import ImageLimits, decode_data_url

    monkeypatch.setattr(worker, "EXPIRY_INTERVAL_S", 0.1)
    caches = CacheConfig(64 << 20, 16 << 20, 16, prefix_idle_s=0.5, vision_idle_s=0.5)
    engine = Engine(tiny_model_path, TINY, EngineConfig(max_queue=4, step_prompt_tokens=64, caches=caches))
    engine.start()
    image = decode_data_url(png_data_url(), ImageLimits(1 << 20, 1 << 22))
    messages = (Message("user", (ImagePart("x"), TextPart("Describe this picture in great detail, please. " * 4))),)

    async def run():
        job = engine.submit(engine.prepare(messages, [image]), Sampling(2, 0.0, 1.0, None, ()), b"t" * 16)
        events = [event async for event in engine.events(job)]  # drained: the job has ended
        return events[0]

    try:
        asyncio.run(run())
        stats = engine.cache_stats()
        assert stats["prefix"]["num_blocks"] > 0 and stats["vision"]["num_entries"] == 1
        deadline = time.monotonic() + 10
        while engine.cache_stats()["prefix"]["num_blocks"] or engine.cache_stats()["vision"]["num_entries"]:
            assert time.monotonic() < deadline, engine.cache_stats()
            time.sleep(0.1)
        assert engine.cache_stats()["prefix"]["num_expired"] > 0
        started = asyncio.run(run())
        assert started.num_cached_tokens == 0 and started.vision.num_misses == 1
    finally:
        engine.stop()
