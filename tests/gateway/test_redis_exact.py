"""The exact cache in Redis (STRATA_REDIS_URL) under the real app: two replicas share answers and
purges; a Redis that goes away degrades the layer to a bypass with its reason, never an error, and
the layer comes back with it."""

from __future__ import annotations

import dataclasses
import time

from litestar.testing import TestClient

from gateway.app import create_app
from semantic.redis_store import RETRY_AFTER_S
from tests.conftest import TINY, RedisServer

ADMIN = {"Authorization": "Bearer admin-key"}


def _ask(client, text, session="s-1"):
    body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body, headers={"X-Strata-Session": session})
    assert response.status_code == 200, response.text
    return response


def test_two_replicas_share_exact_answers_and_purges(engine, settings, redis_server, tmp_path):
    shared = dataclasses.replace(settings, redis_url=redis_server.url, exact_store="sqlite", admin_key="admin-key")
    replica_b = dataclasses.replace(shared, data_dir=tmp_path / "replica-b")
    with TestClient(create_app(shared, engine=engine)) as a, TestClient(create_app(replica_b, engine=engine)) as b:
        stored = _ask(a, "Stored through replica A, served through B?")
        served = _ask(b, "Stored through replica A, served through B?")
        assert served.headers["x-cache-exact"].startswith("hit")
        assert served.json()["choices"][0]["message"] == stored.json()["choices"][0]["message"]
        removed = b.post("/admin/purge", json={"tenant": "default", "session": "s-1", "layers": ["exact"]},
                         headers=ADMIN).json()["removed"]
        assert removed["exact"]["entries"] == 1
        assert _ask(a, "Stored through replica A, served through B?").headers["x-cache-exact"].startswith("miss")
        assert not (tmp_path / "replica-b" / "responses.db").exists()  # nothing went to SQLite


def test_an_unreachable_redis_is_a_bypass_and_the_layer_recovers(engine, settings, tmp_path):
    servers = [RedisServer(tmp_path / "redis")]
    try:
        _outage_and_recovery(engine, settings, tmp_path, servers)
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop()


def _outage_and_recovery(engine, settings, tmp_path, servers: list[RedisServer]) -> None:
    server = servers[0]
    live = dataclasses.replace(settings, redis_url=server.url, exact_store="sqlite", admin_key="admin-key")
    with TestClient(create_app(live, engine=engine)) as client:
        _ask(client, "Will Redis keep this?")
        assert _ask(client, "Will Redis keep this?").headers["x-cache-exact"].startswith("hit")
        server.stop()
        down = _ask(client, "Will Redis keep this?")
        assert down.headers["x-cache-exact"] == "bypass; reason=store_unavailable"
        assert down.json()["choices"][0]["message"]["content"]  # answered by the engine
        assert client.get("/admin/stats", headers=ADMIN).json()["response_caches"]["exact"] == {"unavailable": True}
        assert client.get("/metrics").status_code == 200
        purge = client.post("/admin/purge", json={"tenant": "default"}, headers=ADMIN)
        assert purge.status_code == 503 and purge.json()["error"]["code"] == "store_unavailable"
        servers.append(RedisServer(tmp_path / "redis", server.port))  # back, empty
        time.sleep(RETRY_AFTER_S)
        assert _ask(client, "Will Redis keep this?").headers["x-cache-exact"].startswith("miss")
        assert _ask(client, "Will Redis keep this?").headers["x-cache-exact"].startswith("hit")
