"""Exact and semantic layers through HTTP on the real tiny model, MiniLM and SQLite."""

from __future__ import annotations

import json
from collections import Counter

import anyio
import pytest
from litestar.testing import TestClient

from gateway.http.app import create_app
from gateway.observability.trace import Trace
from gateway.serving.responses import ExactLayer, RequestContext, StoreLane
from semantic import Answer, CacheControl, ExactCache, MemoryStore, Owner, Scope
from tests.conftest import TINY, key_store_down, png_data_url

ADMIN = {"Authorization": "Bearer admin-key"}


def ask(client, text, headers=None, **body):
    body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0, **body}
    return client.post("/v1/chat/completions", json=body, headers=headers or {})


def answer(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def test_exact_hit_replays_the_answer_without_the_engine(client):
    first = ask(client, "What colour is a ripe banana today?")
    second = ask(client, "What colour is a ripe banana today?")
    assert first.headers["x-cache-exact"] == "miss" and first.headers["x-cache-layer"] == "engine"
    assert second.headers["x-cache-layer"] == "exact"
    assert second.headers["x-cache-exact"].startswith("hit; age=")
    assert second.headers["x-cache-semantic"] == "bypass; reason=exact_hit"
    assert second.headers["x-cache-prefix"] == "bypass; reason=answered_by_exact"
    assert "exact;dur=" in second.headers["server-timing"] and "prefill" not in second.headers["server-timing"]
    assert answer(second) == answer(first)
    assert second.json()["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]


def test_streamed_request_is_served_from_cache_as_a_stream(client):
    plain = ask(client, "Name a river in Europe, please.")
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Name a river in Europe, please."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["x-cache-layer"] == "exact"
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == answer(plain)


def test_sampling_parameters_and_images_are_part_of_the_key(client):
    ask(client, "Describe the sea.")
    assert ask(client, "Describe the sea.", max_tokens=7).headers["x-cache-exact"] == "miss"
    assert ask(client, "Describe the sea.", seed=3, temperature=0.5).headers["x-cache-exact"] == "miss"
    for shaping in ({"presence_penalty": 1.0}, {"frequency_penalty": 0.5}, {"logit_bias": {"7": 5}}):
        assert ask(client, "Describe the sea.", **shaping).headers["x-cache-exact"] == "miss", shaping
        assert ask(client, "Describe the sea.", **shaping).headers["x-cache-layer"] == "exact", shaping
    assert ask(client, "Describe the sea.", top_k=5, min_p=0.2).headers["x-cache-layer"] == "exact"  # greedy: no-ops
    with_image = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(seed=1)}},
                {"type": "text", "text": "Describe the sea."},
            ],
        }
    ]
    first = client.post(
        "/v1/chat/completions", json={"model": TINY, "messages": with_image, "max_tokens": 4, "temperature": 0}
    )
    other_image = json.loads(json.dumps(with_image).replace(png_data_url(seed=1), png_data_url(seed=2)))
    second = client.post(
        "/v1/chat/completions", json={"model": TINY, "messages": other_image, "max_tokens": 4, "temperature": 0}
    )
    assert first.headers["x-cache-exact"] == "miss" and second.headers["x-cache-exact"] == "miss"
    same = client.post(
        "/v1/chat/completions", json={"model": TINY, "messages": with_image, "max_tokens": 4, "temperature": 0}
    )
    assert same.headers["x-cache-layer"] == "exact"


def test_nondeterministic_requests_bypass_both_layers(client):
    response = ask(client, "Tell me a joke about cats.", temperature=0.9)
    assert response.headers["x-cache-exact"] == "bypass; reason=nondeterministic"
    assert response.headers["x-cache-semantic"] == "bypass; reason=sampled"
    assert ask(client, "Tell me a joke about cats.", temperature=0.9).headers["x-cache-layer"] == "engine"


def test_cache_control_no_store_no_cache_and_max_age(client):
    ask(client, "What is a lighthouse for?", headers={"Cache-Control": "no-store"})
    assert ask(client, "What is a lighthouse for?").headers["x-cache-exact"] == "miss"  # nothing was stored
    skipped = ask(client, "What is a lighthouse for?", headers={"Cache-Control": "no-cache"})
    assert skipped.headers["x-cache-exact"] == "bypass; reason=no_cache"
    assert skipped.headers["x-cache-layer"] == "engine"
    too_old = ask(client, "What is a lighthouse for?", headers={"Cache-Control": "max-age=0"})
    assert too_old.headers["x-cache-exact"].startswith("miss")


def test_per_request_ttl_expires_entries(client):
    short = ask(client, "Why do owls hunt at night?", headers={"X-Strata-Cache-TTL": "1"})
    assert short.status_code == 200
    import time

    time.sleep(1.1)
    assert ask(client, "Why do owls hunt at night?").headers["x-cache-exact"] == "miss"
    for value in ("soon", "0", "-5"):
        bad = ask(client, "x", headers={"X-Strata-Cache-TTL": value})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_header"


def test_semantic_hit_for_a_paraphrase_and_guarded_miss_for_a_lookalike(client):
    ask(client, "How do I reset my password?")
    paraphrase = ask(client, "What is the way to reset my password?")
    assert paraphrase.headers["x-cache-layer"] == "semantic"
    assert paraphrase.headers["x-cache-semantic"].startswith("hit; score=0.")
    assert paraphrase.headers["x-cache-exact"] == "miss"
    lookalike = ask(client, "Why can't I reset my password?")
    assert lookalike.headers["x-cache-layer"] == "engine"
    assert lookalike.headers["x-cache-semantic"].startswith("miss; score=0.")
    assert lookalike.headers["x-cache-semantic"].endswith("reason=negation")  # a fact: the verifier is not asked


def test_the_verifier_refuses_a_role_swap_the_guards_let_through(client):
    ask(client, "Can a subsidiary own shares of its parent company?")
    swapped = ask(client, "Can a parent company own shares of its subsidiary?")
    assert swapped.headers["x-cache-layer"] == "engine"
    header = swapped.headers["x-cache-semantic"]
    assert header.startswith("miss; score=0.9") and "; reason=verifier; p=0." in header, header
    assert float(header.rsplit("p=", 1)[1]) < 0.5
    reworded = ask(client, "Is a subsidiary allowed to own shares of its parent company?")
    assert reworded.headers["x-cache-layer"] == "semantic"
    assert "; p=" in reworded.headers["x-cache-semantic"]


def test_scope_versions_from_metadata_or_headers_separate_entries(client):
    ask(client, "What is the return window?", metadata={"policy_version": "2026-01"})
    assert (
        ask(client, "What is the return window?", metadata={"policy_version": "2026-02"}).headers["x-cache-layer"]
        == "engine"
    )
    via_header = ask(client, "What is the return window?", headers={"X-Strata-Policy-Version": "2026-01"})
    assert via_header.headers["x-cache-layer"] == "exact"
    other_locale = ask(client, "What is the return window?", metadata={"policy_version": "2026-01", "locale": "fr-FR"})
    assert other_locale.headers["x-cache-layer"] == "engine"


def test_different_system_prompt_never_matches_semantically(client):
    base = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "How do I tie a knot?"}]
    client.post("/v1/chat/completions", json={"model": TINY, "messages": base, "max_tokens": 4, "temperature": 0})
    other = [{"role": "system", "content": "You are a lawyer."}, {"role": "user", "content": "How can I tie a knot?"}]
    response = client.post(
        "/v1/chat/completions", json={"model": TINY, "messages": other, "max_tokens": 4, "temperature": 0}
    )
    assert response.headers["x-cache-semantic"] == "miss; reason=no_candidate"


def test_risky_topics_and_tool_conversations_bypass_the_semantic_layer(client):
    response = ask(client, "What dosage of aspirin should I take?")
    assert response.headers["x-cache-semantic"] == "bypass; reason=risk:medical"
    messages = [
        {"role": "user", "content": "What's the weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
        {"role": "user", "content": "So should I take an umbrella?"},
    ]
    with_tools = client.post(
        "/v1/chat/completions", json={"model": TINY, "messages": messages, "max_tokens": 4, "temperature": 0}
    )
    assert with_tools.headers["x-cache-semantic"] == "bypass; reason=tools"


def test_admin_routes_review_and_delete_semantic_entries(client):
    ask(client, "How do I plant a tree?")
    listing = client.get("/admin/semantic/entries", headers=ADMIN).json()["data"]
    entry = next(e for e in listing if e["prompt"] == "How do I plant a tree?")
    assert entry["status"] == "unreviewed" and entry["scope"]["tenant"] == "default"
    assert client.post(f"/admin/semantic/entries/{entry['id']}/reject", headers=ADMIN).json()["status"] == "rejected"
    paraphrase = ask(client, "What is the way to plant a tree?")
    assert paraphrase.headers["x-cache-layer"] == "engine"  # rejected entries are never served
    assert client.post(f"/admin/semantic/entries/{entry['id']}/approve", headers=ADMIN).status_code == 200
    assert client.delete(f"/admin/semantic/entries/{entry['id']}", headers=ADMIN).json()["deleted"] is True
    assert client.delete(f"/admin/semantic/entries/{entry['id']}", headers=ADMIN).status_code == 404
    assert client.get("/admin/semantic/entries", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/admin/semantic/entries?status=bogus", headers=ADMIN).status_code == 400


def test_admin_purges_one_tenants_exact_entries(client):
    ask(client, "What is the speed of sound?")
    purged = client.delete("/admin/exact?tenant=default", headers=ADMIN).json()
    assert purged["purged"] >= 1
    assert (
        ask(client, "What is the speed of sound?", headers={"Cache-Control": "no-store"}).headers["x-cache-exact"]
        == "miss"
    )


def test_response_caches_survive_a_restart(cached_settings, engine, embedder):
    with TestClient(create_app(cached_settings, engine=engine, embedder=embedder)) as first:
        original = answer(ask(first, "How do I brew good coffee?"))
    with TestClient(create_app(cached_settings, engine=engine, embedder=embedder)) as second:
        exact = ask(second, "How do I brew good coffee?")
        semantic = ask(second, "What is the way to brew good coffee?")
    assert exact.headers["x-cache-layer"] == "exact" and answer(exact) == original
    assert semantic.headers["x-cache-layer"] == "semantic" and answer(semantic) == original


class BrokenDrafts(MemoryStore):
    """A drafts store whose disk fails."""

    def get(self, key, now):
        raise OSError("disk I/O error")

    def put(self, key, tenant, response, owner=Owner()):
        raise OSError("disk I/O error")


def test_a_failing_drafts_store_costs_the_draft_only_never_the_exact_answer():
    """The exact layer reads the draft on a miss and writes it with each answer: a drafts store that
    fails (a full disk, a lost Redis) is counted and the answers keep coming from the exact store."""
    errors: Counter = Counter()
    layer = ExactLayer(ExactCache(MemoryStore(), 3600.0, drafts=BrokenDrafts()), errors, StoreLane())
    ctx = RequestContext("tenant-a", Scope("tenant-a", "m"), CacheControl(), True, True, "exact-1", None, "", None)
    ctx.draft_key = "draft-1"

    async def turn():
        missed = await layer.lookup(ctx, Trace())
        await layer.store(ctx, Answer("hello", token_ids=(1, 2)))
        return missed, await layer.lookup(ctx, Trace())

    missed, hit = anyio.run(turn)
    assert missed is None and ctx.draft == ()
    assert hit is not None and hit.text == "hello"
    assert errors["exact"] == 2  # the draft's read and its write


@pytest.mark.parametrize("lost", [b"", b"session|"])
def test_a_key_made_while_the_key_store_is_down_is_neither_looked_up_nor_written(client, monkeypatch, lost):
    """A request's exact key, session and end user are kept as digests under the tenant's key; one
    made while the key store is out of reach is unkeyed, and neither response layer looks up or
    writes for the request (the exact layer once answered "miss" and, the store being back by the end
    of the request, wrote the answer under a key no later request computes). `lost`: the digests the
    key store fails for, by the start of what they digest (every one, or the session's only)."""
    responses = client.app.state.services.responses
    down = key_store_down(monkeypatch, responses.sealer, lost)
    entries = responses.exact.store.count()
    question, session = f"Which way does the ferry turn at the harbour wall? ({lost!r})", {"X-Strata-Session": "s1"}
    first = ask(client, question, headers=session)
    assert first.status_code == 200
    assert first.headers["x-cache-exact"] == first.headers["x-cache-semantic"] == "bypass; reason=store_unavailable"
    assert responses.exact.store.count() == entries  # nothing written under an unkeyed digest
    down[0] = False
    assert ask(client, question, headers=session).headers["x-cache-exact"] == "miss"
    assert ask(client, question, headers=session).headers["x-cache-exact"].startswith("hit")
