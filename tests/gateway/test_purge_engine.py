"""Purge through every layer and tier on the real engine: exact and semantic entries (SQLite), vision
features and prefix KV blocks in RAM, and the SSD tier's files, across a restart; shared blocks stay
for the sessions that still own them; a purge while the session's request runs is safe."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from litestar.testing import TestClient

from gateway.engine import CacheConfig, Engine, EngineConfig
from gateway.http.app import create_app
from kvcache.ssd import AdmissionPolicy, SsdConfig
from tests.conftest import TINY, key_store_down, png_data_url

ADMIN = {"Authorization": "Bearer admin-key"}
SYSTEM = (
    "You are the archive assistant of the harbour museum. Answer from the catalogue only, cite the "
    "shelf numbers, and say so when a record is missing. "
) * 4


def _engine(tiny_model_path, kv_dir) -> Engine:
    ssd = SsdConfig(kv_dir, admission=AdmissionPolicy(min_hits=0))
    engine = Engine(
        tiny_model_path,
        TINY,
        EngineConfig(
            max_queue=8,
            step_prompt_tokens=64,
            caches=CacheConfig(prefix_budget_bytes=256 << 20, vision_budget_bytes=64 << 20, block_size=16, ssd=ssd),
        ),
    )
    engine.start()
    return engine


def _ask(client, session, user, question, image=None, **extra):
    content = [{"type": "text", "text": question}]
    if image:
        content.append({"type": "image_url", "image_url": {"url": image}})
    body = {
        "model": TINY,
        "user": user,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        **extra,
    }
    response = client.post("/v1/chat/completions", json=body, headers={"X-Strata-Session": session})
    assert response.status_code == 200, response.text
    return response


def _to_ssd(engine) -> None:
    """Copy every RAM block to the SSD tier now (as a shutdown does), on the worker thread."""
    engine.worker.call(engine.runner.caches.prefix.persist).result(30)
    assert engine.runner.caches.prefix.ssd.drain(30)


def _segment_files(kv_dir) -> set:
    return {path.name for path in kv_dir.rglob("seg-*.safetensors")}


@pytest.fixture
def app_settings(settings):
    return dataclasses.replace(settings, exact_store="sqlite", semantic_enabled=True, admin_key="admin-key")


def test_a_purged_session_misses_everywhere_while_the_shared_system_prompt_stays(
    tiny_model_path, tmp_path, app_settings, embedder
):
    kv_dir, image = tmp_path / "kv", png_data_url(seed=11)
    engine = _engine(tiny_model_path, kv_dir)
    with TestClient(create_app(app_settings, engine=engine, embedder=embedder)) as client:
        _ask(client, "A", "ann", "Which shelf holds the 1911 harbour ledger?", image)
        _ask(client, "B", "bob", "Who donated the lighthouse lens?")
        _to_ssd(engine)
        files_before = _segment_files(kv_dir)
        purged = client.post("/admin/purge", json={"tenant": "default", "session": "A"}, headers=ADMIN)
        assert purged.status_code == 200, purged.text
        removed = purged.json()["removed"]
        assert removed["exact"]["entries"] == 1 and removed["semantic"]["entries"] == 1
        assert removed["vision"]["entries"] == 1 and removed["vision"]["bytes"] > 0
        assert removed["prefix"]["blocks"] > 0 and removed["ssd"]["blocks"] == removed["prefix"]["blocks"]
        assert removed["ssd"]["files"] >= 1 and not files_before & _segment_files(kv_dir) - files_before
        gone = files_before - _segment_files(kv_dir)
        assert len(gone) == removed["ssd"]["files"]  # the files that held A's blocks were replaced

        again = _ask(client, "A", "ann", "Which shelf holds the 1911 harbour ledger?", image).headers
        assert again["x-cache-exact"].startswith("miss") and again["x-cache-semantic"].startswith("miss")
        assert again["x-cache-vision"].startswith("miss")
        assert "why=purged" in again["x-cache-prefix"]
        shared = _ask(client, "B", "bob", "Are the 1850 ship logs kept on site?").headers["x-cache-prefix"]
        assert shared.startswith("hit") and _cached(shared) >= 96  # B still reuses the system prompt
        assert (
            client.post("/admin/sessions/A/end?tenant=default", headers=ADMIN).status_code == 200
        )  # what A stored since
        _to_ssd(engine)
    engine.stop()

    restarted = _engine(tiny_model_path, kv_dir)  # RAM is empty: only the SSD tier and its index remain
    try:
        assert not gone & _segment_files(kv_dir)  # reconcile did not bring them back
        with TestClient(create_app(app_settings, engine=restarted, embedder=embedder)) as client:
            prefix = _ask(client, "C", "cy", "Which shelf holds the 1911 harbour ledger?", image, max_tokens=5).headers[
                "x-cache-prefix"
            ]  # another exact key
            system_blocks = _cached(_ask(client, "D", "di", "Anything on sail makers?").headers["x-cache-prefix"])
            assert (
                "tier=ssd" in prefix and _cached(prefix) <= system_blocks + 16
            )  # nothing of A's past the system prompt
    finally:
        restarted.stop()


def test_purging_a_tenant_empties_every_layer_and_tier(tiny_model_path, tmp_path, app_settings, embedder):
    kv_dir, image = tmp_path / "kv", png_data_url(seed=12)
    engine = _engine(tiny_model_path, kv_dir)
    try:
        with TestClient(create_app(app_settings, engine=engine, embedder=embedder)) as client:
            _ask(client, "A", "ann", "List the ship models on display.", image)
            _ask(client, "B", "bob", "When does the archive open?")
            _to_ssd(engine)
            removed = client.post("/admin/purge", json={"tenant": "default"}, headers=ADMIN).json()["removed"]
            assert removed["ssd"] == {"shredded": True, "reclaiming": True}  # the key first, the files after
            engine.reclaimer.submit(lambda: None).result(60)  # the reclaim thread runs one purge at a time
            assert not _segment_files(kv_dir)
            caches = engine.cache_stats()
            assert caches["prefix"]["num_blocks"] == 0 and caches["vision"]["num_entries"] == 0
            assert caches["ssd"]["num_blocks"] == 0
            headers = _ask(client, "B", "bob", "When does the archive open?").headers
            assert headers["x-cache-exact"].startswith("miss") and "why=purged" in headers["x-cache-prefix"]
            assert headers["x-cache-prefix"].startswith("miss")
            only_vision = client.post("/admin/purge", json={"tenant": "default", "layers": ["vision"]}, headers=ADMIN)
            assert set(only_vision.json()["removed"]) == {"vision"}
    finally:
        engine.stop()


def test_a_purge_while_the_key_store_is_down_says_so_and_purges_nothing(
    tiny_model_path, tmp_path, app_settings, embedder, monkeypatch
):
    """A session's id is matched as a digest under the tenant's key: with the key store out of reach
    the digest would match nothing, and the purge answered 200 having purged nothing. It is a 503
    now, and the same purge once the store is back removes the session's entries."""
    engine = _engine(tiny_model_path, tmp_path / "kv")
    with TestClient(create_app(app_settings, engine=engine, embedder=embedder)) as client:
        _ask(client, "A", "ann", "Which shelf holds the 1911 harbour ledger?")
        down = key_store_down(monkeypatch, client.app.state.services.keyring)
        purge = {"tenant": "default", "session": "A"}
        refused = client.post("/admin/purge", json=purge, headers=ADMIN)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "store_unavailable", refused.text
        down[0] = False
        purged = client.post("/admin/purge", json=purge, headers=ADMIN)
        assert purged.status_code == 200 and purged.json()["removed"]["exact"]["entries"] == 1, purged.text


def test_purge_while_the_sessions_request_is_running_is_safe(tiny_model_path, tmp_path, app_settings, embedder):
    engine = _engine(tiny_model_path, tmp_path / "kv")
    try:
        with TestClient(create_app(app_settings, engine=engine, embedder=embedder)) as client:
            alone = _ask(client, "A", "ann", "Describe the harbour in detail.", max_tokens=300).json()
            client.post("/admin/purge", json={"tenant": "default", "session": "A"}, headers=ADMIN)  # a cold start again
            answers, started = [], threading.Event()

            def long_request():
                started.set()
                answers.append(
                    _ask(client, "A", "ann", "Describe the harbour in detail.", max_tokens=300, seed=1).json()
                )

            runner = threading.Thread(target=long_request)
            runner.start()
            started.wait(5)
            purged_while_running = 0
            while runner.is_alive():
                purged = client.post("/admin/purge", json={"tenant": "default", "session": "A"}, headers=ADMIN)
                assert purged.status_code == 200, purged.text
                if runner.is_alive():  # the request had not returned when the purge answered
                    purged_while_running += purged.json()["removed"]["prefix"]["blocks"]
            runner.join(60)
            assert purged_while_running > 0  # blocks its prefill had stored went while it decoded
            answer = answers[0]["choices"][0]
            assert answer["message"]["content"] == alone["choices"][0]["message"]["content"]  # greedy: the same
            engine.worker.call(engine.runner.caches.prefix.pool.check).result(10)
            assert client.get("/healthz").status_code == 200
    finally:
        engine.stop()


def _cached(header: str) -> int:
    return int(header.split("cached=")[1].split(";")[0])


def test_a_session_idle_past_its_ttl_ends_by_itself(engine, settings):
    live = dataclasses.replace(
        settings, exact_store="sqlite", admin_key="admin-key", session_ttl_s=0.5, sweep_interval_s=0.2
    )
    with TestClient(create_app(live, engine=engine)) as client:
        question = "Is the reading room open on Sundays, and may visitors bring their own charts and notebooks? " * 3
        first = _ask(client, "idle-1", "ida", question).headers  # long enough for blocks of its own
        kept = _ask(client, "", "kim", "Who donated the lighthouse lens?").headers  # no session: never ends
        assert first["x-cache-exact"].startswith("miss") and kept["x-cache-exact"].startswith("miss")
        deadline = time.monotonic() + 10
        while client.app.state.sweeper.snapshot()["removed"].get("sessions", 0) < 1:
            assert time.monotonic() < deadline, "the idle session was never ended"
            time.sleep(0.1)
        again = _ask(client, "idle-1", "ida", question).headers
        assert again["x-cache-exact"].startswith("miss") and "why=purged" in again["x-cache-prefix"]
        assert _ask(client, "", "kim", "Who donated the lighthouse lens?").headers["x-cache-exact"].startswith("hit")


def test_a_purged_sessions_snapshots_leave_ram_and_ssd_on_a_hybrid_model(tmp_path, settings):
    """qwen3_next keeps recurrent-state snapshots with its blocks: purging session A takes A's
    snapshots (RAM and SSD) with its blocks, so A's turn misses past the shared system prompt even
    after a restart from the SSD tier, while B still resumes from the system prompt's snapshot."""
    from gateway.checkpoints import BuildSpec
    from tests.conftest import built_model

    path, kv_dir = built_model(BuildSpec("qwen3_next", "tiny")), tmp_path / "kv"
    ssd = SsdConfig(kv_dir, admission=AdmissionPolicy(min_hits=0))
    caches = CacheConfig(prefix_budget_bytes=256 << 20, vision_budget_bytes=0, block_size=16, ssd=ssd)

    def start() -> Engine:
        engine = Engine(path, "qwen3_next", EngineConfig(max_queue=8, step_prompt_tokens=64, caches=caches))
        engine.start()
        return engine

    live = dataclasses.replace(settings, model=str(path), model_name="qwen3_next", admin_key="admin-key")
    question = "Which shelf holds the 1911 harbour ledger, and who catalogued it first?"

    def ask(client, session, text, max_tokens=4):
        body = {
            "model": "qwen3_next",
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        }
        response = client.post("/v1/chat/completions", json=body, headers={"X-Strata-Session": session})
        assert response.status_code == 200, response.text
        return response.headers["x-cache-prefix"]

    engine = start()
    with TestClient(create_app(live, engine=engine)) as client:
        ask(client, "A", question)
        system = _cached(ask(client, "B", "Who donated the lighthouse lens?"))  # the system prompt's snapshot
        assert _cached(ask(client, "A", question, max_tokens=5)) > system  # A's own snapshot, before the purge
        _to_ssd(engine)
        removed = client.post("/admin/purge", json={"tenant": "default", "session": "A"}, headers=ADMIN).json()
        assert removed["removed"]["prefix"]["blocks"] > 0 and removed["removed"]["ssd"]["blocks"] > 0
        again = ask(client, "A", question, max_tokens=6)
        assert _cached(again) <= system and "why=purged" in again
        client.post("/admin/sessions/A/end?tenant=default", headers=ADMIN)  # what A stored since
        _to_ssd(engine)
    engine.stop()
    restarted = start()
    try:
        with TestClient(create_app(live, engine=restarted)) as client:
            after = ask(client, "C", question, max_tokens=7)
            assert "tier=ssd" in after and _cached(after) <= system
    finally:
        restarted.stop()
