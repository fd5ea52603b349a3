"""The HTTP API in-process (Litestar TestClient) on the real tiny model."""

from __future__ import annotations

import dataclasses
import json

import pytest
from litestar.testing import TestClient

from gateway.http.app import create_app
from tests.conftest import TINY, png_data_url


@pytest.fixture
def client(settings, engine):
    with TestClient(create_app(settings, engine=engine)) as test_client:
        yield test_client


def chat(client, **body):
    body.setdefault("model", TINY)
    body.setdefault("messages", [{"role": "user", "content": "Hello, who are you?"}])
    return client.post("/v1/chat/completions", json=body)


def test_chat_completion_shape_usage_and_trace_headers(client):
    messages = [{"role": "user", "content": "A question nobody asked before in this suite?"}]
    response = chat(client, max_tokens=6, temperature=0, messages=messages)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 5
    assert 1 <= usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert response.headers["x-cache-layer"] == "engine"
    for layer in ("exact", "semantic"):
        assert response.headers[f"x-cache-{layer}"] == "bypass; reason=disabled"
    assert response.headers["x-cache-vision"] == "bypass; reason=no_images"
    assert response.headers["x-cache-prefix"] in (
        f"miss; cached=0; prompt={usage['prompt_tokens']}",  # under a block
        f"miss; cached=0; prompt={usage['prompt_tokens']}; why=cold; at=0",
    )
    timing = response.headers["server-timing"]
    assert "prefill;dur=" in timing and "decode;dur=" in timing


def test_greedy_is_deterministic_and_max_tokens_gives_length(client):
    first = chat(client, max_tokens=12, temperature=0).json()
    second = chat(client, max_completion_tokens=12, temperature=0).json()
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    if first["usage"]["completion_tokens"] == 12:
        assert first["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_repeats_and_differs_by_seed(client):
    runs = [chat(client, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed).json() for seed in (7, 7, 8)]
    texts = [r["choices"][0]["message"]["content"] for r in runs]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_stop_sequence_truncates_output(client):
    full = chat(client, max_tokens=24, temperature=1.0, seed=11).json()["choices"][0]["message"]["content"]
    assert len(full) > 6
    stop = full[3:6]
    cut = chat(client, max_tokens=24, temperature=1.0, seed=11, stop=[stop]).json()
    assert cut["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_stream_sends_role_deltas_usage_and_done(client):
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": TINY,
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-cache-layer"] == "engine"
        assert "prefill;dur=" in response.headers["server-timing"]
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert "decode;dur=" in chunks[-1]["usage"]["strata"]["server_timing"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = chat(client, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10, temperature=0).json()
    assert streamed == plain["choices"][0]["message"]["content"]


def test_image_parts_are_accepted_and_counted(client):
    url = png_data_url(96, 64)
    response = chat(
        client,
        max_tokens=4,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    )
    assert response.status_code == 200
    text_only = chat(
        client, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "What is in this picture?"}]
    )
    image_tokens = response.json()["usage"]["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"]
    # 96x64 is resized to 84x56 (multiples of 28): a 6x4 patch grid, merged 2x2 -> 6 tokens,
    # plus <|vision_start|> and <|vision_end|>
    assert image_tokens == 8
    assert "vision;dur=" in response.headers["server-timing"]


def test_models_and_healthz_and_openapi(settings, engine):
    with TestClient(create_app(dataclasses.replace(settings, admin_key="admin-key"), engine=engine)) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [TINY, "all-MiniLM-L6-v2"]
        assert client.get("/healthz").json() == {"status": "ok"}  # the public answer tells nothing more
        wrong_key = client.get("/healthz", headers={"Authorization": "Bearer nope"}).json()
        assert wrong_key == {"status": "ok"}
        health = client.get("/healthz", headers={"Authorization": "Bearer admin-key"}).json()
        assert health["status"] == "ok" and health["blas"] in ("openblas", "reference", "accelerate")
        assert health["model_fingerprint"] == engine.info.fingerprint
    schema = client.get("/schema/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]


def test_repeat_request_hits_the_prefix_cache_with_equal_output(client):
    messages = [
        {"role": "system", "content": "You answer about rivers and bridges in great detail. " * 6},
        {"role": "user", "content": "Which bridge is the oldest one on this river?"},
    ]
    cold = chat(client, max_tokens=8, temperature=0, messages=messages)
    warm = chat(client, max_tokens=8, temperature=0, messages=messages)
    assert cold.headers["x-cache-prefix"].startswith("miss; cached=0")
    cached = warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = warm.json()["usage"]["prompt_tokens"]
    assert 0 < cached < prompt
    assert warm.headers["x-cache-prefix"] == f"hit; cached={cached}; prompt={prompt}; tier=ram"
    assert warm.json()["choices"][0]["message"]["content"] == cold.json()["choices"][0]["message"]["content"]


def test_vision_header_reports_encoder_use_and_reuse(client):
    url = png_data_url(112, 112, seed=42)
    first_turn = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}],
        }
    ]
    first = chat(client, max_tokens=4, temperature=0, messages=first_turn)
    assert first.headers["x-cache-vision"] == "miss; images=1; hits=0; misses=1; skipped=0"
    other_system = [{"role": "system", "content": "Be brief."}] + first_turn  # new prefix, same image
    second = chat(client, max_tokens=4, temperature=0, messages=other_system)
    assert second.headers["x-cache-vision"] == "hit; images=1; hits=1; misses=0; skipped=0"
    repeat = chat(client, max_tokens=4, temperature=0, messages=other_system)
    assert repeat.headers["x-cache-vision"] == "hit; images=1; hits=0; misses=0; skipped=1"


def test_file_image_urls_work_only_below_the_allowed_folder(settings, engine, tmp_path):
    import base64
    import dataclasses

    allowed = tmp_path / "images"
    allowed.mkdir()
    picture = base64.b64decode(png_data_url(64, 64).split(",", 1)[1])
    (allowed / "cat.png").write_bytes(picture)
    (tmp_path / "secret.png").write_bytes(picture)  # a real, readable image outside the folder
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")  # inside by name, outside in fact
    open_settings = dataclasses.replace(settings, allow_file_images_under=allowed)
    with TestClient(create_app(open_settings, engine=engine)) as client:

        def with_image(url):
            return chat(
                client,
                max_tokens=2,
                temperature=0,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
                    }
                ],
            )

        assert with_image(f"file://{allowed}/cat.png").status_code == 200
        for url in (
            f"file://{allowed}/../secret.png",
            f"file://{tmp_path}/secret.png",
            f"file://{allowed}/link.png",
            f"file://{allowed}/missing.png",
        ):
            refused = with_image(url)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "image_url_not_allowed", url
