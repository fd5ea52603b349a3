"""/metrics, X-Request-Id, Cache-Status and JSON request logs on the real app and engine: the numbers
equal the traffic sent, labels never carry client values, every response has an id."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.app import create_app
from gateway.observability.requestlog import JsonFormatter
from tests.conftest import TINY

ADMIN = {"Authorization": "Bearer admin-key"}


def _body(text: str, **extra) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, **extra}


def scrape(client) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def live_settings(settings):
    return dataclasses.replace(settings, exact_store="sqlite", admin_key="admin-key")


def test_metrics_count_the_traffic_sent(engine, live_settings):
    with TestClient(create_app(live_settings, engine=engine)) as client:
        first = client.post("/v1/chat/completions", json=_body("Count me once, then from the exact cache."))
        again = client.post("/v1/chat/completions", json=_body("Count me once, then from the exact cache."))
        assert client.post("/v1/chat/completions", content=b"{broken").status_code == 400
        samples = scrape(client)
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert value(samples, "strata:requests_total", served_by="engine") == 1
    assert value(samples, "strata:requests_total", served_by="exact") == 1
    assert value(samples, "strata:cache_lookups_total", layer="exact", outcome="miss") == 1
    assert value(samples, "strata:cache_lookups_total", layer="exact", outcome="hit") == 1
    assert value(samples, "strata:cache_lookups_total", layer="prefix", outcome="bypass") == 1  # the exact hit
    assert value(samples, "strata:prefix_cache_queries_total") == prompt_tokens  # in tokens, as vLLM counts
    cached = first.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert value(samples, "strata:prefix_cache_hits_total", tier="ram") == cached
    assert value(samples, "strata:prompt_tokens_total") == 2 * prompt_tokens
    assert value(samples, "strata:generation_tokens_total") == 2 * first.json()["usage"]["completion_tokens"]
    assert value(samples, "strata:time_to_first_token_seconds_count", served_by="exact") == 1
    assert value(samples, "strata:e2e_request_latency_seconds_count", served_by="engine") == 1
    assert value(samples, "strata:inter_token_latency_seconds_count") >= 1
    assert value(samples, "strata:cache_lookup_seconds_count", layer="exact") == 2
    assert value(samples, "strata:http_requests_total", route="/v1/chat/completions", method="POST", status="200") == 2
    assert value(samples, "strata:http_requests_total", route="/v1/chat/completions", method="POST", status="400") == 1
    assert value(samples, "strata:engine_up") == 1 and value(samples, "strata:engine_ready") == 1
    assert value(samples, "strata:cache_bytes", tier="kv_ram") == engine.cache_stats()["prefix"]["num_bytes"]
    assert value(samples, "strata:cache_budget_bytes", tier="kv_ram") == 256 << 20
    assert value(samples, "strata:cache_bytes", tier="exact") > 0  # responses.db on disk
    assert again.headers["x-cache-exact"].startswith("hit")


def test_labels_never_carry_client_values(engine, live_settings):
    tenants = dataclasses.replace(live_settings, api_keys={"key-a": "tenant-a"})
    headers = {"Authorization": "Bearer key-a", "X-Strata-Session": "session-SECRET-1"}
    with TestClient(create_app(tenants, engine=engine)) as client:
        client.post(
            "/v1/chat/completions",
            json=_body("a prompt with PROMPT-SECRET inside", user="user-SECRET"),
            headers=headers,
        )
        client.get("/v1/does-not-exist-SECRET")
        text = client.get("/metrics").text
    assert "SECRET" not in text and "tenant-a" not in text  # no tenant label unless asked for
    assert 'route="unmatched"' in text
    with TestClient(create_app(dataclasses.replace(tenants, metrics_tenant_label=True), engine=engine)) as client:
        client.post("/v1/chat/completions", json=_body("another prompt"), headers=headers)
        samples = scrape(client)
    assert value(samples, "strata:requests_total", served_by="engine", tenant="tenant-a") == 1


def test_every_response_carries_a_request_id(engine, live_settings):
    with TestClient(create_app(live_settings, engine=engine)) as client:
        mine = client.post("/v1/chat/completions", json=_body("Which id?"), headers={"X-Request-Id": "req-42.a"})
        assert mine.headers["x-request-id"] == "req-42.a"
        for hostile in ("has spaces", "x" * 129, "semi;colon"):
            replaced = client.get("/health", headers={"X-Request-Id": hostile}).headers["x-request-id"]
            assert replaced != hostile and len(replaced) == 32
        answers = [
            client.post("/v1/chat/completions", content=b"{"),
            client.get("/admin/stats"),
            client.get("/nope"),
            client.post("/v1/chat/completions", json=_body("stream it", stream=True)),
        ]
        assert [a.status_code for a in answers] == [400, 401, 404, 200]
        ids = [a.headers["x-request-id"] for a in answers]
        assert len(set(ids)) == 4 and all(len(i) == 32 for i in ids)


def test_cache_status_follows_rfc_9211(engine, live_settings):
    with TestClient(create_app(live_settings, engine=engine)) as client:
        miss = client.post("/v1/chat/completions", json=_body("Cache-Status, please.")).headers["cache-status"]
        hit = client.post("/v1/chat/completions", json=_body("Cache-Status, please.")).headers["cache-status"]
    members = [m.strip() for m in miss.split(", strata-")]
    assert [m.split(";")[0].removeprefix("strata-") for m in members] == ["prefix", "vision", "semantic", "exact"]
    assert miss.startswith('strata-prefix; fwd=miss; detail="cached=0;') and miss.endswith("strata-exact; fwd=miss")
    assert 'strata-exact; hit; detail="age=' in hit
    assert 'strata-prefix; fwd=bypass; detail="reason=answered_by_exact"' in hit


def test_json_logs_write_one_line_per_request_without_prompt_text(engine, live_settings, caplog):
    settings = dataclasses.replace(live_settings, log_format="json")
    with (
        caplog.at_level(logging.INFO, logger="strata.access"),
        TestClient(create_app(settings, engine=engine)) as client,
    ):
        client.post(
            "/v1/chat/completions", json=_body("PRIVATE words of the prompt"), headers={"X-Request-Id": "log-me"}
        )
        client.get("/nope")
    records = [r for r in caplog.records if r.name == "strata.access"]
    assert len(records) == 2
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == "log-me" and line["status"] == 200 and line["route"] == "/v1/chat/completions"
    assert line["tenant"] == "default" and line["served_by"] == "engine" and line["duration_ms"] > 0
    assert line["cache"]["exact"] == "miss" and "prefill" in line["timings_ms"] and line["prompt_tokens"] > 0
    assert "PRIVATE" not in json.dumps(line)
    assert json.loads(JsonFormatter().format(records[1]))["status"] == 404
    with TestClient(create_app(live_settings, engine=engine)) as client:  # text logs: no access lines
        caplog.clear()
        client.get("/health")
        assert not [r for r in caplog.records if r.name == "strata.access"]
