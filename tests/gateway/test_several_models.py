"""Three tiny models in one `strata serve` process, called with the official clients: a qwen2.5-VL
loaded at start, a gemma3 and a float16 twin of the default model (same tokenizer and template, so a
block of one would be readable by the other were the model not in its hash) loaded when first asked
for, under a memory limit that holds the default model and one other.

Each model answers with its own caches, a load does not stall the loaded model's stream, the least
recently used idle model is unloaded to make room (never the pinned default one), a model loaded again
restores its conversation from the shared SSD folder, a burst to an unloaded model leaves the loaded one
serving, and bad names and a model that cannot load are clear errors that leave the others serving."""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from evals.bench_layers import start_server
from gateway.checkpoints import BuildSpec
from gateway.engine import weights_bytes
from tests.conftest import built_model

KV_BYTES = 16 << 20
TEXT = "The lighthouse keeper wrote down every ship that passed the point, its flag and its cargo. " * 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    default = built_model(BuildSpec("qwen2_5_vl", "tiny"))
    gemma = built_model(BuildSpec("gemma3", "tiny"))
    twin = built_model(BuildSpec("qwen2_5_vl", "tiny", "float16"))
    broken = folder / "broken"
    shutil.copytree(twin, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    models = [
        {"name": "gemma", "path": str(gemma), "max_context_tokens": 256, "defaults": {"max_tokens": 3}},
        {"name": "twin", "path": str(twin)},
        {"name": "broken", "path": str(broken)},
    ]
    (folder / "models.json").write_text(json.dumps({"models": models}))
    # the default model and the larger of the others fit; the two others never fit together with it
    sizes = sorted(weights_bytes(path) + KV_BYTES for path in (default, gemma, twin))
    limit = sizes[-1] + sizes[-2] + sizes[0] // 2
    env = {
        "STRATA_MODEL_NAME": "qwen",
        "STRATA_MODELS_FILE": str(folder / "models.json"),
        "STRATA_MODEL_MEMORY_BYTES": str(limit),
        "STRATA_KV_BUDGET_BYTES": str(KV_BYTES),
        "STRATA_VISION_BUDGET_BYTES": "0",
        "STRATA_SSD_MIN_HITS": "0",
        "STRATA_EXACT_STORE": "sqlite",
        "STRATA_SEMANTIC": "0",
        "STRATA_API_KEYS": "key-a:tenant-a",
        "STRATA_MODEL_LOAD_TIMEOUT_S": "60",
    }
    process, url = start_server(str(default), folder / "data", env, log=folder / "server.log")
    yield url
    process.terminate()
    process.wait(30)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0, timeout=120)


def _ask(url: str, model: str, text: str = TEXT, max_tokens: int = 8):
    return _client(url).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0
    )


def _states(url: str) -> dict[str, str]:
    models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key-a"}).json()["data"]
    return {m["id"]: m["state"] for m in models if m["id"] != "all-MiniLM-L6-v2"}


def _prefix(raw) -> str:
    return raw.headers["X-Cache-Prefix"]


@pytest.mark.serial  # the module's server: two of its tests time a stream while a model loads
def test_the_models_are_listed_with_their_state_and_each_answers_as_itself(server):
    assert _states(server) == {"qwen": "loaded", "gemma": "unloaded", "twin": "unloaded", "broken": "unloaded"}
    answers = {}
    for model in ("qwen", "gemma", "qwen"):
        raw = _ask(server, model, "Name three rivers.")
        answer = raw.parse()
        assert answer.model == model
        answers.setdefault(model, []).append(answer.choices[0].message.content)
    assert _states(server)["gemma"] == "loaded"
    client = _client(server)
    unbounded = [{"role": "user", "content": "Tell me everything."}]
    short = client.chat.completions.create(model="gemma", messages=unbounded, temperature=0)
    assert short.usage.completion_tokens <= 3  # gemma's default max_tokens, from the models file
    longer = client.chat.completions.create(model="gemma", messages=unbounded, temperature=0, max_tokens=12)
    assert longer.usage.completion_tokens > 3  # a request's own value wins
    # the second qwen question is the exact layer's (its scope holds the model), never gemma's answer
    assert answers["qwen"][0] == answers["qwen"][1]


@pytest.mark.serial
def test_a_model_never_gets_another_models_answer_or_kv_blocks(server):
    """The twin shares the default model's tokenizer and template: only the model's fingerprint in the
    response scope and in the KV blocks' keys keeps the twin's answer and SSD blocks from it."""
    text = "Twins: " + TEXT
    twin = _ask(server, "twin", text, max_tokens=12)
    assert twin.headers["X-Cache-Layer"] == "engine" and twin.parse().model == "twin"
    _ask(server, "gemma", "Make room.")  # the twin is unloaded: its blocks go to the SSD tier
    assert _states(server)["twin"] == "unloaded"
    first = _ask(server, "qwen", text, max_tokens=12)
    assert first.headers["X-Cache-Layer"] == "engine" and first.headers["X-Cache-Exact"].startswith("miss")
    assert "ssd=" not in _prefix(first), (_prefix(first), _prefix(twin))
    again = _ask(server, "qwen", text, max_tokens=12)  # its own answer, kept: warm == cold
    assert again.headers["X-Cache-Layer"] == "exact"
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content


@pytest.mark.serial
def test_lru_unloading_under_the_limit_never_the_pinned_default_and_a_reloaded_model_restores_from_ssd(server):
    text = "A conversation to come back to: " + TEXT
    cold = _ask(server, "gemma", text, max_tokens=6)
    _ask(server, "twin", "Make room.")  # gemma is the least recently used idle model: it goes
    states = _states(server)
    assert states["qwen"] == "loaded" and states["twin"] == "loaded" and states["gemma"] == "unloaded"
    follow_up = text + " And then?"
    warm = _ask(server, "gemma", follow_up, max_tokens=6)
    assert "ssd=" in _prefix(warm), _prefix(warm)  # its blocks waited on SSD while it was unloaded
    assert _states(server) == {"qwen": "loaded", "gemma": "loaded", "twin": "unloaded", "broken": "unloaded"}
    assert cold.parse().model == warm.parse().model == "gemma"
    stats = httpx.get(server + "/metrics").text
    assert 'strata:model_state{model="qwen",state="loaded"} 1.0' in stats
    assert 'strata:model_state{model="twin",state="unloaded"} 1.0' in stats


@pytest.mark.serial
def test_a_load_does_not_stall_the_stream_of_a_loaded_model(server):
    """qwen streams while twin (unloaded) loads: its gaps between tokens stay at their pace."""
    _ask(server, "gemma", "Warm.")  # twin is unloaded now (gemma took the room)
    assert _states(server)["twin"] == "unloaded"

    def stream(text: str) -> list[float]:
        """Greedy, so no sampled stop token ends it early; each call's own text, so no exact-layer replay."""
        stamps = []
        chunks = _client(server).chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": text}], max_tokens=160, temperature=0, stream=True
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(stamps)]

    alone = stream("Tell a long story.")
    with ThreadPoolExecutor(2) as pool:
        during = pool.submit(stream, "While a model loads, tell a long story.")
        time.sleep(0.3)
        loading = pool.submit(_ask, server, "twin", "Load me.")
        gaps = during.result(120)
        assert loading.result(120).parse().model == "twin"
    assert len(gaps) > 50
    assert statistics.median(gaps) < 3 * statistics.median(alone) + 0.01, (statistics.median(alone), gaps)
    assert max(gaps) < 5.0


@pytest.mark.serial
def test_bad_names_and_a_model_that_cannot_load_are_clear_errors_that_leave_the_others_serving(server):
    with pytest.raises(openai.NotFoundError) as missing:
        _ask(server, "no-such-model")
    assert missing.value.code == "model_not_found" and "'qwen'" in missing.value.message
    messages = anthropic.Anthropic(base_url=server, api_key="key-a", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        messages.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.InternalServerError) as broken:
        _ask(server, "broken")
    assert broken.value.code == "model_load_failed" and "failed to load" in broken.value.message
    assert _states(server)["broken"] == "unloaded"
    assert _ask(server, "qwen", "Still here?").parse().model == "qwen"
    with pytest.raises(openai.BadRequestError) as too_long:  # gemma's own bound (the models file's), not qwen's
        _ask(server, "gemma", TEXT * 4)
    assert too_long.value.code == "context_length_exceeded" and "256" in too_long.value.message
    reply = messages.messages.create(model="gemma", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "gemma"


@pytest.mark.serial
def test_a_burst_to_an_unloaded_model_does_not_starve_the_loaded_one(server):
    _ask(server, "gemma", "Warm.")
    assert _states(server)["twin"] == "unloaded"
    results: list = []

    def burst(index: int):
        try:
            results.append(_ask(server, "twin", f"Burst question {index}.").parse().model)
        except openai.APIStatusError as exc:
            results.append(exc.status_code)

    threads = [threading.Thread(target=burst, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    assert _ask(server, "qwen", "Are you there?", max_tokens=4).parse().model == "qwen"
    loaded_latency = time.perf_counter() - started
    for thread in threads:
        thread.join(120)
    assert loaded_latency < 10, loaded_latency
    assert results.count("twin") >= 8 and all(r in ("twin", 429) for r in results), results


def test_a_model_idle_past_its_ttl_is_unloaded_by_the_sweep(tmp_path):
    models = [{"name": "brief", "path": str(built_model(BuildSpec("llama", "tiny"))), "idle_ttl_s": 1}]
    (tmp_path / "models.json").write_text(json.dumps({"models": models}))
    env = {
        "STRATA_MODEL_NAME": "qwen",
        "STRATA_MODELS_FILE": str(tmp_path / "models.json"),
        "STRATA_SWEEP_INTERVAL_S": "0.5",
        "STRATA_KV_BUDGET_BYTES": str(KV_BYTES),
        "STRATA_API_KEYS": "key-a:tenant-a",
    }
    process, url = start_server(str(built_model(BuildSpec("qwen2_5_vl", "tiny"))), tmp_path / "data", env)
    try:
        assert _ask(url, "brief", "Hello?").parse().model == "brief"
        deadline = time.monotonic() + 30
        while _states(url)["brief"] != "unloaded":
            assert time.monotonic() < deadline, _states(url)
            time.sleep(0.25)
        assert _states(url)["qwen"] == "loaded"  # the default model has no TTL: it stays
        assert _ask(url, "brief", "Back again?").parse().model == "brief"  # and it loads again on demand
    finally:
        process.terminate()
        process.wait(30)
