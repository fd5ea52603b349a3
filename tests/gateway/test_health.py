"""/health and /health/ready tell the truth: the engine worker is broken on purpose (a step that never
ends, a loop that dies, a warm-up that hangs or fails) and the answers follow, with the reason."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from litestar.testing import TestClient

from gateway.engine import CacheConfig, Engine, EngineConfig
from gateway.http.app import create_app
from tests.conftest import TINY

BODY = {"model": TINY, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 3, "temperature": 0}


def _engine(tiny_model_path) -> Engine:
    return Engine(
        tiny_model_path,
        TINY,
        EngineConfig(
            max_queue=8,
            step_prompt_tokens=64,
            caches=CacheConfig(prefix_budget_bytes=64 << 20, vision_budget_bytes=0, block_size=16),
        ),
    )


@pytest.fixture
def quick(settings):
    return dataclasses.replace(settings, stuck_after_s=0.5)


def _wait_for(check, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return result


def test_a_step_that_never_ends_is_reported_stuck_then_recovers(tiny_model_path, quick):
    engine = _engine(tiny_model_path)
    engine.start()
    gate, original = threading.Event(), engine.worker.steps.run
    engine.worker.steps.run = lambda plan: (gate.wait(30), original(plan))
    try:
        with TestClient(create_app(quick, engine=engine)) as client:
            assert client.get("/health").status_code == 200
            answer = []
            request = threading.Thread(target=lambda: answer.append(client.post("/v1/chat/completions", json=BODY)))
            request.start()
            stuck = _wait_for(lambda: (r := client.get("/health")).status_code == 503 and r, "never reported stuck")
            assert stuck.json()["reason"].startswith("stuck: no engine step ended for")
            assert client.get("/health/ready").status_code == 503
            assert client.get("/healthz").status_code == 503  # the old name answers the same
            gate.set()
            request.join(30)
            assert answer[0].status_code == 200  # the request itself was only late
            assert client.get("/health").status_code == 200 and client.get("/health/ready").status_code == 200
    finally:
        gate.set()
        engine.stop()


def test_a_dead_worker_loop_is_503_for_health_and_for_requests(tiny_model_path, quick):
    engine = _engine(tiny_model_path)
    engine.start()

    def broken_admit():
        raise RuntimeError("the admission broke")

    with TestClient(create_app(quick, engine=engine)) as client:
        engine.worker._admit = broken_admit
        engine.worker.jobs.nudge()  # wake the idle loop: it admits, and dies
        dead = _wait_for(lambda: (r := client.get("/health")).status_code == 503 and r, "death never reported")
        assert (
            "the engine worker has stopped" in dead.json()["reason"] and "the admission broke" in dead.json()["reason"]
        )
        start = time.monotonic()
        refused = client.post("/v1/chat/completions", json=BODY)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - start < 5  # refused at once, never left to hang
    engine.stop()


def test_readiness_waits_for_the_warm_up_and_reports_its_failure(tiny_model_path, settings):
    engine, gate = _engine(tiny_model_path), threading.Event()
    warm_up = engine.runner.warm_up
    engine.runner.warm_up = lambda: (gate.wait(30), warm_up())
    engine.launch()
    try:
        with TestClient(create_app(settings, engine=engine)) as client:
            waiting = client.get("/health/ready")
            assert waiting.status_code == 503 and waiting.json()["reason"] == "warming up"
            assert client.get("/health").status_code == 200  # alive while it warms up
            gate.set()
            _wait_for(lambda: client.get("/health/ready").status_code == 200, "never became ready")
            assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    finally:
        gate.set()
        engine.stop()

    failing = _engine(tiny_model_path)
    failing.runner.warm_up = lambda: (_ for _ in ()).throw(RuntimeError("the vision tower cannot run"))
    failing.launch()
    with TestClient(create_app(settings, engine=failing)) as client:
        ready = _wait_for(
            lambda: (r := client.get("/health/ready")).status_code == 503 and "failed" in r.text and r,
            "the failed warm-up was never reported",
        )
        assert "the vision tower cannot run" in ready.json()["reason"]
        assert client.get("/health").status_code == 503
        assert client.post("/v1/chat/completions", json=BODY).status_code == 503
