"""The third round of hostile-client findings, each with the test that failed before its fix: budgets
keyed by tenant (never by an end user's salt), SSD pins inside the SSD capacity, ..."""

from __future__ import annotations

import dataclasses

import pytest
from litestar.testing import TestClient

from gateway.engine import CacheConfig, Engine, EngineConfig
from gateway.http.app import create_app
from tests.conftest import TINY

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
BUDGET = 16 << 20  # ~8,000 tokens of the tiny model's KV: a quarter of it pins ~2,000
SYSTEM = "You answer questions about the harbour timetable and the ferries. " * 100  # ~1,500 tokens


@pytest.fixture
def pinning(tiny_model_path, settings):
    caches = CacheConfig(BUDGET, 0, 16, pin_budget_bytes=BUDGET // 4)
    engine = Engine(tiny_model_path, TINY, EngineConfig(max_queue=8, step_prompt_tokens=64, caches=caches))
    engine.start()
    limits = dataclasses.replace(settings.limits, max_context_tokens=None)
    apart = dataclasses.replace(settings, api_keys=KEYS, isolated_end_user_tenants=("*",), limits=limits)
    try:
        with TestClient(create_app(apart, engine=engine)) as client:
            yield client, engine
    finally:
        engine.stop()


def _pinned_turn(client, key: str, user: str, question: str = "When does the first ferry leave?"):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    body = {
        "model": TINY,
        "max_tokens": 2,
        "system": system,
        "messages": [{"role": "user", "content": question}],
        "metadata": {"user_id": user},
    }
    answer = client.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert answer.status_code == 200, answer.text
    return answer


def test_a_tenants_end_users_pin_within_the_tenants_budget_not_each_their_own(pinning):
    """Found: six end users of one tenant, kept apart, pinned 1.10x the whole KV budget (the budget
    was keyed by each chain's root) and evicted another tenant's prefix."""
    client, engine = pinning
    other = _pinned_turn(client, "key-b", "someone")
    for user in range(6):
        _pinned_turn(client, "key-a", f"user-{user}")
    pool = engine.runner.caches.prefix.pool
    assert pool.pinned_bytes.get("tenant-a", 0) <= BUDGET // 4
    assert sum(pool.pinned_bytes.values()) <= BUDGET // 2
    again = _pinned_turn(client, "key-b", "someone", "And the last one?")
    created = other.json()["usage"]["cache_creation_input_tokens"]
    assert created > 1000 and again.json()["usage"]["cache_read_input_tokens"] >= created
    pool.check()
