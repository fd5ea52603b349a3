"""The false-hit bound in the gateway: a tenant's own bound applies to its partition only; a scope
whose bound the evidence cannot certify says `miss; reason=uncalibrated`; the bound, the estimate
and the calibration state are in /admin/stats and /metrics; an admin's review becomes evidence."""

from __future__ import annotations

import dataclasses

from litestar.testing import TestClient

from gateway.http.app import create_app
from tests.conftest import TINY

ADMIN = {"Authorization": "Bearer admin-key"}
QUESTION, PARAPHRASE = "How do I reset my password?", "What is the way to reset my password?"


def _ask(client, key: str, text: str):
    body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response


def test_each_tenant_is_served_under_its_own_bound_and_an_uncertified_one_refuses(cached_settings, engine, embedder):
    settings = dataclasses.replace(
        cached_settings,
        api_keys={"key-a": "tenant-a", "key-b": "tenant-b"},
        semantic_max_false_hit_rate=0.10,
        semantic_tenant_bounds={"tenant-b": 0.001},  # more than its evidence can ever certify
    )
    with TestClient(create_app(settings, engine=engine, embedder=embedder)) as client:
        for key in ("key-a", "key-b"):
            _ask(client, key, QUESTION)
        served = _ask(client, "key-a", PARAPHRASE)
        refused = _ask(client, "key-b", PARAPHRASE)
        assert served.headers["x-cache-semantic"].startswith("hit"), served.headers["x-cache-semantic"]
        assert (
            refused.headers["x-cache-semantic"].startswith("miss")
            and "uncalibrated" in refused.headers["x-cache-semantic"]
        )
        stats = client.get("/admin/stats", headers=ADMIN).json()["response_caches"]["semantic"]["bounds"]
        assert stats["*"]["bound"] == 0.10 and stats["*"]["calibrated"] and stats["*"]["evidence"] > 100
        assert stats["*"]["estimated_false_hit_upper"] <= 0.10
        assert stats["tenant-b"]["bound"] == 0.001 and not stats["tenant-b"]["calibrated"]
        metrics = client.get("/metrics").text
        assert 'strata:semantic_false_hit_bound{scope="tenant-b"} 0.001' in metrics
        assert 'strata:semantic_calibrated{scope="tenant-b"} 0.0' in metrics
        assert 'strata:semantic_calibrated{scope="*"} 1.0' in metrics
        entries = client.get("/admin/semantic/entries?tenant=tenant-a", headers=ADMIN).json()["data"]
        assert client.post(f"/admin/semantic/entries/{entries[0]['id']}/approve", headers=ADMIN).status_code == 200
        after = client.get("/admin/stats", headers=ADMIN).json()["response_caches"]["semantic"]["bounds"]
        assert after["tenant-a"]["evidence"] == stats["*"]["evidence"] + 1  # the hit it served, now judged right
