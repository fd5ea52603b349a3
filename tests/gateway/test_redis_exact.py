"""The exact cache and semantic entries in Redis (STRATA_REDIS_URL) under the real app: two replicas
share answers, paraphrase hits and purges; a Redis that goes away degrades both layers to a bypass
with its reason, never an error, and the layers come back with it."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
from litestar.testing import TestClient

from gateway.http.app import create_app
from semantic.redis_store import RETRY_AFTER_S
from tests.conftest import TINY, RedisServer

ADMIN = {"Authorization": "Bearer admin-key"}


def _ask(client, text, session="s-1", headers=None):
    body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body, headers={"X-Strata-Session": session, **(headers or {})})
    assert response.status_code == 200, response.text
    return response


def _shared(settings, url):
    return dataclasses.replace(
        settings,
        redis_url=url,
        exact_store="sqlite",
        semantic_enabled=True,
        admin_key="admin-key",
        secret_file=settings.data_dir / "server.secret",  # replicas sharing Redis share the key that opens its keys
    )


@contextlib.contextmanager
def _two_replicas(engine, embedder, settings, redis_server, tmp_path, **overrides):
    """Two apps on one (emptied) Redis, each with its own data folder."""
    redis_server.flush()
    shared = dataclasses.replace(_shared(settings, redis_server.url), **overrides)
    replica_b = dataclasses.replace(shared, data_dir=tmp_path / "replica-b")
    with (
        TestClient(create_app(shared, engine=engine, embedder=embedder)) as a,
        TestClient(create_app(replica_b, engine=engine, embedder=embedder)) as b,
    ):
        yield a, b


@pytest.fixture
def replicas(engine, embedder, settings, redis_server, tmp_path):
    with _two_replicas(engine, embedder, settings, redis_server, tmp_path) as both:
        yield both


def test_two_replicas_share_exact_answers_and_purges(replicas, tmp_path):
    a, b = replicas
    stored = _ask(a, "Stored through replica A, served through B?")
    served = _ask(b, "Stored through replica A, served through B?")
    assert served.headers["x-cache-exact"].startswith("hit")
    assert served.json()["choices"][0]["message"] == stored.json()["choices"][0]["message"]
    removed = b.post(
        "/admin/purge", json={"tenant": "default", "session": "s-1", "layers": ["exact"]}, headers=ADMIN
    ).json()["removed"]
    assert removed["exact"]["entries"] == 1
    assert _ask(a, "Stored through replica A, served through B?").headers["x-cache-exact"].startswith("miss")
    assert not (tmp_path / "replica-b" / "responses.db").exists()  # nothing went to SQLite
    assert not (tmp_path / "replica-b" / "semantic.db").exists()


def test_a_paraphrase_stored_on_one_replica_hits_on_the_other(replicas):
    a, b = replicas
    stored = _ask(a, "How do I reset my password?")
    deadline = time.monotonic() + 2.0
    polls = {"Cache-Control": "no-store"}  # a missed poll stores nothing that a later poll could hit instead
    while (
        not (served := _ask(b, "What is the way to reset my password?", headers=polls))
        .headers["x-cache-semantic"]
        .startswith("hit")
    ):
        assert time.monotonic() < deadline, served.headers["x-cache-semantic"]
    assert served.json()["choices"][0]["message"]["content"] == stored.json()["choices"][0]["message"]["content"]
    entry = b.get("/admin/semantic/entries", headers=ADMIN).json()["data"][0]
    assert a.post(f"/admin/semantic/entries/{entry['id']}/reject", headers=ADMIN).status_code == 200
    assert _ask(b, "What is the way to reset my password?").headers["x-cache-semantic"].startswith("miss")
    removed = b.post("/admin/purge", json={"tenant": "default", "layers": ["semantic"]}, headers=ADMIN).json()
    assert removed["removed"]["semantic"]["entries"] == 2  # the rejected one and B's own answer to its miss
    assert a.get("/admin/semantic/entries", headers=ADMIN).json()["data"] == []


@pytest.fixture
def bounded_replicas(engine, embedder, settings, redis_server, tmp_path):
    """The two replicas under a 10% false-hit bound."""
    with _two_replicas(engine, embedder, settings, redis_server, tmp_path, semantic_max_false_hit_rate=0.10) as both:
        yield both


def test_a_verdict_on_one_replica_calibrates_the_other_and_a_purge_clears_both(bounded_replicas, tmp_path):
    a, b = bounded_replicas

    def evidence(client) -> int:
        bounds = client.get("/admin/stats", headers=ADMIN).json()["response_caches"]["semantic"]["bounds"]
        return bounds.get("default", bounds["*"])["evidence"]

    base = evidence(a)
    _ask(a, "How do I reset my password?")
    deadline = time.monotonic() + 2.0
    while (
        not _ask(b, "What is the way to reset my password?", headers={"Cache-Control": "no-store"})
        .headers["x-cache-semantic"]
        .startswith("hit")
    ):
        assert time.monotonic() < deadline
    entry = a.get("/admin/semantic/entries", headers=ADMIN).json()["data"][0]
    assert a.post(f"/admin/semantic/entries/{entry['id']}/approve", headers=ADMIN).status_code == 200
    assert evidence(b) == evidence(a) == base + 1  # B served the hit, A judged it: both learn
    assert not (tmp_path / "replica-b" / "calibration.db").exists()
    b.post("/admin/purge", json={"tenant": "default", "layers": ["semantic"]}, headers=ADMIN)
    assert evidence(a) == base


def test_an_unreachable_redis_is_a_bypass_and_the_layers_recover(engine, embedder, settings, tmp_path):
    servers = [RedisServer(tmp_path / "redis")]
    try:
        _outage_and_recovery(engine, embedder, settings, tmp_path, servers)
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop()


def _outage_and_recovery(engine, embedder, settings, tmp_path, servers: list[RedisServer]) -> None:
    server = servers[0]
    live = _shared(settings, server.url)
    with TestClient(create_app(live, engine=engine, embedder=embedder)) as client:
        _ask(client, "Will Redis keep this?")
        assert _ask(client, "Will Redis keep this?").headers["x-cache-exact"].startswith("hit")
        server.stop()
        down = _ask(client, "Will Redis keep this?")
        assert down.headers["x-cache-exact"] == "bypass; reason=store_unavailable"
        assert down.headers["x-cache-semantic"] == "bypass; reason=store_unavailable"
        assert down.json()["choices"][0]["message"]["content"]  # answered by the engine
        stats = client.get("/admin/stats", headers=ADMIN).json()["response_caches"]
        assert stats["exact"] == stats["semantic"] == {"unavailable": True}
        listing = client.get("/admin/semantic/entries", headers=ADMIN)
        assert listing.status_code == 503 and listing.json()["error"]["code"] == "store_unavailable"
        assert client.get("/metrics").status_code == 200
        purge = client.post("/admin/purge", json={"tenant": "default"}, headers=ADMIN)
        assert purge.status_code == 503 and purge.json()["error"]["code"] == "store_unavailable"
        servers.append(RedisServer(tmp_path / "redis", server.port))  # back, empty
        time.sleep(RETRY_AFTER_S)
        assert _ask(client, "Will Redis keep this?").headers["x-cache-exact"].startswith("miss")
        assert _ask(client, "Will Redis keep this?").headers["x-cache-exact"].startswith("hit")
        deadline = time.monotonic() + 5  # the semantic follower rebuilds its index from Redis first
        polls = {"Cache-Control": "no-store"}  # a poll stores nothing: its answer must not become an exact hit
        while (
            semantic := _ask(client, "Would Redis keep this?", headers=polls).headers["x-cache-semantic"]
        ).startswith("bypass"):
            assert semantic == "bypass; reason=store_unavailable" and time.monotonic() < deadline
            time.sleep(0.1)
        assert semantic.startswith("hit"), semantic


def test_under_a_bound_an_unreachable_redis_is_a_bypass_and_stats_say_so(engine, embedder, settings, tmp_path):
    server = RedisServer(tmp_path / "redis")
    bounded = dataclasses.replace(_shared(settings, server.url), semantic_max_false_hit_rate=0.10)
    try:
        with TestClient(create_app(bounded, engine=engine, embedder=embedder)) as client:
            _ask(client, "How do I reset my password?")
            server.stop()
            down = _ask(client, "What is the way to reset my password?")
            assert down.headers["x-cache-semantic"] == "bypass; reason=store_unavailable"
            stats = client.get("/admin/stats", headers=ADMIN).json()["response_caches"]["semantic"]
            assert stats == {"unavailable": True, "bounds_unavailable": True}
            metrics = client.get("/metrics")
            assert metrics.status_code == 200 and "strata:semantic_false_hit_bound" not in metrics.text
    finally:
        if server.process.poll() is None:
            server.stop()
