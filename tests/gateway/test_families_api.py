"""The gateway over other families, through HTTP as a client sees it: the engine loads each family at
start-up, answers with its cache headers, and refuses what the family cannot take."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from litestar.testing import TestClient

from gateway.checkpoints import BuildSpec, parse_model_name, resolve_model_path
from gateway.http.app import create_app
from tests.conftest import built_model, png_data_url


def _client(settings, family: str) -> TestClient:
    path = built_model(BuildSpec(family, "tiny"))
    return TestClient(create_app(dataclasses.replace(settings, model=str(path), model_name=family)))


def _chat(client, family, content, **body):
    body = {
        "model": family,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    } | body
    return client.post("/v1/chat/completions", json=body)


IMAGE_CHAT = [
    {"type": "image_url", "image_url": {"url": png_data_url(96, 80, seed=11)}},
    {"type": "text", "text": "Describe this picture in a few words, please."},
]


@pytest.mark.parametrize("family", ["gemma3", "smolvlm", "mistral3", "llava_onevision", "qwen3_vl"])
def test_an_image_chat_twice_reuses_the_prefix_and_skips_the_encoder(settings, family):
    with _client(settings, family) as client:
        first = _chat(client, family, IMAGE_CHAT)
        second = _chat(client, family, IMAGE_CHAT)
    assert first.status_code == second.status_code == 200, first.text
    assert first.headers["x-cache-prefix"].startswith("miss")
    assert second.headers["x-cache-prefix"].startswith("hit")
    assert second.headers["x-cache-vision"].startswith("hit") or "skipped=1" in second.headers["x-cache-vision"]
    assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


def test_a_text_model_answers_text_and_refuses_images_with_a_400(settings):
    question = "Hello there, how are you today? Tell me about the harbour, the boats and the tide. " * 3
    with _client(settings, "llama") as client:
        text = _chat(client, "llama", question)
        image = _chat(client, "llama", IMAGE_CHAT)
        after = _chat(client, "llama", question)
    assert text.status_code == 200 and after.status_code == 200
    assert after.headers["x-cache-prefix"].startswith("hit")
    assert image.status_code == 400
    error = image.json()["error"]
    assert error["type"] == "invalid_request_error" and "does not take images" in error["message"]


def test_a_hybrid_model_reuses_its_prefix_from_a_state_snapshot(settings):
    """qwen3_next (gated-delta layers): the same question with another max_tokens (another exact key)
    resumes from the recurrent state snapshotted at the prompt's last block boundary."""
    question = "Tell me about the ferry across the river, the tide tables and the winter timetable. " * 3
    with _client(settings, "qwen3_next") as client:
        first = _chat(client, "qwen3_next", question)
        second = _chat(client, "qwen3_next", question, max_tokens=5)
    assert first.status_code == second.status_code == 200, first.text
    assert first.headers["x-cache-prefix"].startswith("miss")
    assert second.headers["x-cache-prefix"].startswith("hit")
    assert second.json()["choices"][0]["message"]["content"].startswith(
        first.json()["choices"][0]["message"]["content"]
    )


def test_a_hybrid_conversation_drops_the_snapshots_it_moved_past_and_counts_them(settings):
    """Each turn of a qwen3_next chat resumes at the end of an earlier one; the ends it resumed past
    are dropped, and /metrics counts them."""
    messages: list[dict] = []
    with _client(settings, "qwen3_next") as client:
        for turn in range(3):
            messages.append({"role": "user", "content": f"Turn {turn}: tell me about the ferry and the tide. " * 6})
            response = client.post(
                "/v1/chat/completions",
                json={"model": "qwen3_next", "messages": messages, "max_tokens": 6, "temperature": 0},
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-cache-prefix"].startswith("hit" if turn else "miss")
            messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        metrics = client.get("/metrics").text
    (line,) = [line for line in metrics.splitlines() if line.startswith("strata:kv_snapshots_superseded_total ")]
    assert float(line.split()[1]) >= 1
    assert "# TYPE strata:kv_snapshots_skipped_total counter" in metrics  # none skipped under a roomy budget
    assert not [line for line in metrics.splitlines() if line.startswith("strata:kv_snapshots_skipped_total{")]


def test_built_in_model_names_resolve_to_their_family(tmp_path):
    assert parse_model_name("demo") == BuildSpec("qwen2_5_vl", "demo")
    assert parse_model_name("gemma3-tiny") == BuildSpec("gemma3", "tiny")
    assert parse_model_name("llava_onevision-demo") == BuildSpec("llava_onevision", "demo")
    assert parse_model_name("mlx-community/gemma-3-4b-it-4bit") is None
    assert parse_model_name("nosuchfamily-tiny") is None
    path = resolve_model_path("qwen3-tiny", tmp_path)
    assert path == tmp_path / "models" / "strata-qwen3-tiny" and (path / "config.json").exists()


def test_strata_serve_refuses_an_unsupported_vision_family_with_one_line(tmp_path):
    folder = tmp_path / "made-up"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "made_up_vl", "vision_config": {}}')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--model",
            str(folder),
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("strata: cannot serve") and "made_up_vl" in done.stderr
    assert "supported vision families" in done.stderr and "Traceback" not in done.stderr


def test_a_model_whose_warm_up_fails_stops_the_start_up_with_the_reason(tiny_model_path):
    """Warm-up runs the text and vision paths once on the worker thread; if they fail, Engine.start
    raises with the reason instead of leaving a dead worker that requests would wait on."""
    from gateway.engine import Engine, EngineConfig

    engine = Engine(tiny_model_path, "tiny", EngineConfig())
    engine.runner.warm_up = lambda: (_ for _ in ()).throw(RuntimeError("the vision tower cannot run"))
    with pytest.raises(RuntimeError, match=r"warm-up failed.*the vision tower cannot run"):
        engine.start()


def test_anthropic_thinking_switches_a_template_that_has_one(settings):
    """Qwen3's template renders an empty think block when thinking is off (as the real checkpoints'
    does); Anthropic's `thinking` sets the switch, counted and cached apart; a template without the
    switch renders the same prompt either way."""
    ask = {"model": "qwen3", "messages": [{"role": "user", "content": "Think it over"}]}

    def count(client, **extra):
        response = client.post("/v1/messages/count_tokens", json=ask | extra)
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    with _client(settings, "qwen3") as client:
        default, off = count(client), count(client, thinking={"type": "disabled"})
        on = count(client, thinking={"type": "enabled", "budget_tokens": 2048})
        answered = client.post("/v1/messages", json=ask | {"max_tokens": 3, "thinking": {"type": "disabled"}})
    assert off > default == on
    assert answered.status_code == 200 and answered.json()["usage"]["input_tokens"] == off
    with _client(settings, "llama") as client:
        llama = {**ask, "model": "llama"}
        same = [
            client.post("/v1/messages/count_tokens", json=llama | extra).json()["input_tokens"]
            for extra in ({}, {"thinking": {"type": "disabled"}})
        ]
        refused = client.post("/v1/messages/count_tokens", json=llama | {"thinking": {"type": "sometimes"}})
    assert same[0] == same[1] and refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
