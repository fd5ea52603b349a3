"""Purges announced through Redis reach the other replicas (gateway/operations/purge_feed.py), on a real
redis-server: the feed alone, then two apps whose own layers (here: stored Responses conversations,
which live in each replica's data folder) are purged through the other."""

from __future__ import annotations

import dataclasses
import queue
import time

from litestar.testing import TestClient

from gateway.http.app import create_app
from gateway.operations.purge_feed import PurgeFeed
from semantic.redis_store import RETRY_AFTER_S
from semantic.store import StoreUnavailable
from tests.conftest import TINY, RedisServer

ADMIN = {"Authorization": "Bearer admin-key"}


def test_an_announced_purge_runs_on_every_other_replica_once(redis_server):
    heard_a, heard_b = queue.Queue(), queue.Queue()
    a = PurgeFeed(redis_server.url, lambda *purge: heard_a.put(purge))
    b = PurgeFeed(redis_server.url, lambda *purge: heard_b.put(purge))
    try:
        a.announce("acme", "s-1", None, ["prefix", "vision"])
        assert heard_b.get(timeout=5) == ("acme", "s-1", None, ["prefix", "vision"])
        b.announce("acme", None, "u-7", ["conversations"])
        assert heard_a.get(timeout=5) == ("acme", None, "u-7", ["conversations"])
        time.sleep(0.3)
        assert heard_a.empty() and heard_b.empty()  # nobody runs its own announcement again
    finally:
        a.close()
        b.close()


def test_the_feed_survives_a_redis_restart(tmp_path):
    server = RedisServer(tmp_path / "redis")
    heard = queue.Queue()
    listener = PurgeFeed(server.url, lambda *purge: heard.put(purge))
    speaker = PurgeFeed(server.url, lambda *purge: None)
    try:
        server.stop()
        time.sleep(0.5)
        server = RedisServer(tmp_path / "redis", port=server.port)
        deadline = time.monotonic() + 10
        while True:  # the speaker's own window after the outage, then the announcement goes through
            try:
                speaker.announce("acme", "s-2", None, ["prefix"])
                break
            except StoreUnavailable:  # while the client reconnects
                assert time.monotonic() < deadline
                time.sleep(RETRY_AFTER_S / 4)
        assert heard.get(timeout=10) == ("acme", "s-2", None, ["prefix"])
    finally:
        listener.close()
        speaker.close()
        server.stop()


def test_a_purge_through_one_replica_removes_what_another_keeps_for_itself(
    engine, embedder, settings, redis_server, tmp_path
):
    redis_server.flush()  # keys another test's server secret wrapped do not open under this one's
    shared = dataclasses.replace(
        settings,
        redis_url=redis_server.url,
        exact_store="sqlite",
        admin_key="admin-key",
        secret_file=settings.data_dir / "server.secret",  # replicas sharing Redis share the key that opens its keys
    )
    replica_b = dataclasses.replace(shared, data_dir=tmp_path / "replica-b")
    with (
        TestClient(create_app(shared, engine=engine, embedder=embedder)) as a,
        TestClient(create_app(replica_b, engine=engine, embedder=embedder)) as b,
    ):
        stored = b.post(
            "/v1/responses",
            json={"model": TINY, "input": "Remember me.", "max_output_tokens": 2},
            headers={"X-Strata-Session": "s-9"},
        )
        assert stored.status_code == 200
        kept = b.post(
            "/v1/responses",
            json={"model": TINY, "input": "Keep me.", "max_output_tokens": 2},
            headers={"X-Strata-Session": "s-10"},
        )
        purged = a.post("/admin/purge", json={"tenant": "default", "session": "s-9"}, headers=ADMIN)
        assert purged.status_code == 200 and purged.json()["announced"] is True
        assert purged.json()["removed"]["conversations"]["entries"] == 0  # A itself kept nothing of s-9
        deadline = time.monotonic() + 5
        while b.get(f"/v1/responses/{stored.json()['id']}").status_code != 404:
            assert time.monotonic() < deadline, "replica b never purged its conversation"
            time.sleep(0.05)
        assert b.get(f"/v1/responses/{kept.json()['id']}").status_code == 200  # another session's stays
