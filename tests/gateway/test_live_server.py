"""A real `strata serve` process on loopback, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.blas import better_core_type
from gateway.engine import cpu_features, vector_products_library
from tests.conftest import TINY, png_data_url

KEYS = "key-a:tenant-a,key-b:tenant-b"
ADMIN = "admin-secret"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, model_path: Path, data_dir: Path, extra_env: dict[str, str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the CLI must find OpenBLAS itself
        env.update(extra_env)
        self.log = (data_dir.parent / f"server-{self.port}.log").open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--model",
                str(model_path),
                "--port",
                str(self.port),
                "--data-dir",
                str(data_dir),
                "--log-level",
                "info",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 180) -> None:  # ~13 s here; a loaded CI machine took over 90
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, Path(self.log.name).read_text()
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise TimeoutError("server did not start")

    def stop(self) -> bool:
        """SIGTERM; True when the server shut down cleanly (uvicorn re-raises the signal at the end)."""
        self.process.terminate()
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a server that does not stop fails its test, never outlives it
            self.process.kill()
            self.process.wait()
            return False
        return code in (0, -signal.SIGTERM) and "engine stopped" in Path(self.log.name).read_text()


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("live") / "data"
    # one sequence on the model at a time and a queue of one: the queue-full test can fill both
    live = LiveServer(
        tiny_model_path,
        data_dir,
        {
            "STRATA_API_KEYS": KEYS,
            "STRATA_ADMIN_KEY": ADMIN,
            "STRATA_MAX_QUEUE": "1",
            "STRATA_MAX_NUM_SEQS": "1",
            "STRATA_MODEL_NAME": TINY,
        },
    )
    yield live
    assert live.stop()


def _client(server, key="key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_openai_sync_client_plain_and_stream(server):
    client = _client(server)
    reply = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Say something"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(
        client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "Say something"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_openai_async_client_with_image(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(80, 80)}},
                    {"type": "text", "text": "Describe it"},
                ],
            }
        ]
        plain = await client.chat.completions.create(model=TINY, messages=messages, max_tokens=5, temperature=0)
        stream = await client.chat.completions.create(
            model=TINY, messages=messages, max_tokens=5, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return plain.choices[0].message.content, text

    plain, streamed = asyncio.run(run())
    assert plain == streamed


def test_api_keys_are_required_and_map_to_tenants(server, tiny_model_path):
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    missing = httpx.post(
        server.url + "/v1/chat/completions", json={"model": TINY, "messages": [{"role": "user", "content": "x"}]}
    )
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/admin/stats", headers={"Authorization": "Bearer key-a"}).status_code == 401


def test_admin_stats_count_each_layer(server):
    """Self-contained (it once passed only after the tests before it had made the traffic it counts)."""
    before = _admin_stats(server)
    client = _client(server)
    messages = [{"role": "user", "content": "Count me in the stats, please."}]
    client.chat.completions.create(model=TINY, messages=messages, max_tokens=4, temperature=0)
    list(client.chat.completions.create(model=TINY, messages=messages, max_tokens=4, temperature=0, stream=True))
    stats = httpx.get(server.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"})
    layers, old = stats.json()["layers"], before["layers"]
    assert stats.status_code == 200
    assert layers["exact"]["miss"] == old["exact"]["miss"] + 1 and layers["exact"]["hit"] == old["exact"]["hit"] + 1
    assert layers["prefix"]["miss"] + layers["prefix"]["hit"] == old["prefix"]["miss"] + old["prefix"]["hit"] + 1
    assert stats.json()["served_by"]["exact"] == before["served_by"].get("exact", 0) + 1
    caches = stats.json()["engine_caches"]
    assert caches["prefix"]["num_lookups"] >= 1 and caches["prefix"]["num_bytes"] > 0
    assert caches["ssd"]["num_write_errors"] == 0 and "num_quarantined" in caches["ssd"]


def test_tenants_never_share_prefix_blocks(server):
    messages = [{"role": "user", "content": "An identical prompt from two tenants, long enough to fill blocks. " * 4}]
    skip_response_caches = {"Cache-Control": "no-cache"}  # exercise the engine's prefix cache itself
    for key in ("key-a", "key-a"):
        _client(server, key).chat.completions.create(
            model=TINY, messages=messages, max_tokens=2, temperature=0, extra_headers=skip_response_caches
        )
    warm_a = _client(server, "key-a").chat.completions.with_raw_response.create(
        model=TINY, messages=messages, max_tokens=2, temperature=0, extra_headers=skip_response_caches
    )
    first_b = _client(server, "key-b").chat.completions.with_raw_response.create(
        model=TINY, messages=messages, max_tokens=2, temperature=0, extra_headers=skip_response_caches
    )
    assert warm_a.headers["x-cache-prefix"].startswith("hit; cached=")
    assert first_b.headers["x-cache-prefix"].startswith("miss; cached=0")
    assert first_b.parse().usage.prompt_tokens_details.cached_tokens == 0


def test_server_secret_is_created_private(server):
    secret = Path(server.log.name).parent / "data" / "server.secret"
    assert secret.stat().st_size == 32
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_cli_runs_on_openblas_without_ld_preload(server):
    health = httpx.get(server.url + "/healthz", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert health["blas"] == "openblas"
    # and before OpenBLAS, the one-row products library, where this machine can compile it
    assert health["one_row_products"] is (vector_products_library() is not None)
    # on OpenBLAS kernels as wide as the CPU's flags allow (named where OpenBLAS would pick older ones)
    assert health["blas_core"] and better_core_type(cpu_features(), health["blas_core"]) is None


def _admin_stats(server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()


def _health(server) -> dict:
    return httpx.get(server.url + "/healthz", headers={"Authorization": f"Bearer {ADMIN}"}).json()


def test_client_disconnect_mid_stream_frees_the_engine(server):
    cancelled_before = _admin_stats(server)["engine"]["num_cancelled"]
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "go on forever"}],
        "max_tokens": 512,
        "temperature": 1.0,
        "seed": 1,
        "stream": True,
    }
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=30
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        _health(server)["engine_busy"] or _admin_stats(server)["engine"]["num_cancelled"] == cancelled_before
    ):
        time.sleep(0.05)
    assert _admin_stats(server)["engine"]["num_cancelled"] == cancelled_before + 1
    assert not _health(server)["engine_busy"]
    ok = _client(server).chat.completions.create(model=TINY, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_full_queue_answers_429_with_retry_after(server):
    """With the engine busy and a queue of one, of five more requests one waits and four get 429."""
    # greedy: this prompt runs all 500 tokens on the tiny model (~1.8 s); a sampled one may stop early
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
        "max_tokens": 500,
        "temperature": 0,
    }
    headers = {"Authorization": "Bearer key-a"}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            running = asyncio.ensure_future(
                client.post(server.url + "/v1/chat/completions", json=body, headers=headers)
            )
            deadline = time.monotonic() + 30
            while not _health(server)["engine_busy"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            others = await asyncio.gather(
                *[client.post(server.url + "/v1/chat/completions", json=body, headers=headers) for _ in range(5)]
            )
            return [await running, *others]

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 429, 429, 429, 429], statuses
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["code"] == "queue_full"


def test_full_queue_raises_the_anthropic_clients_rate_limit_error(server):
    """The same burst through the Anthropic client: its own RateLimitError, Anthropic's error shape."""
    import anthropic

    body = {"model": TINY, "messages": [{"role": "user", "content": "Tell a very long story."}], "max_tokens": 500}

    async def burst():
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key="key-a", max_retries=0, timeout=120)
        fresh = {
            "extra_body": {"temperature": 0},
            "extra_headers": {"Cache-Control": "no-cache"},
        }  # not a stored answer
        running = asyncio.ensure_future(client.messages.create(**body, **fresh))
        deadline = time.monotonic() + 30
        while not _health(server)["engine_busy"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        others = [client.messages.create(**body, **fresh) for _ in range(5)]
        outcomes = await asyncio.gather(running, *others, return_exceptions=True)
        await client.close()
        return outcomes

    outcomes = asyncio.run(burst())
    limited = [o for o in outcomes if isinstance(o, anthropic.RateLimitError)]
    assert len(limited) == 4 and sum(isinstance(o, anthropic.types.Message) for o in outcomes) == 2, outcomes
    assert limited[0].body["error"]["type"] == "rate_limit_error" and limited[0].response.headers["retry-after"] == "1"


def test_single_tenant_mode_is_announced(tiny_model_path, tmp_path):
    live = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {"STRATA_MODEL_NAME": TINY, "STRATA_SEMANTIC": "0", "STRATA_ADMIN_KEY": ADMIN},
    )
    try:
        health = httpx.get(live.url + "/healthz", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert health["multi_tenant"] is False
        reply = _client(live, key="anything").chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        assert reply.choices
    finally:
        assert live.stop()
    assert "single-tenant mode" in Path(live.log.name).read_text()


def test_conversation_resumes_from_ssd_after_a_restart(tiny_model_path, tmp_path):
    env = {"STRATA_MODEL_NAME": TINY, "STRATA_SEMANTIC": "0"}
    no_response_cache = {"Cache-Control": "no-cache"}
    turn1 = [
        {"role": "system", "content": "You are the archive's guide to old maps and charts. " * 6},
        {"role": "user", "content": "Which charts show the northern coast?"},
    ]
    live = LiveServer(tiny_model_path, tmp_path / "data", env)
    try:
        client = _client(live)
        reply = (
            client.chat.completions.create(
                model=TINY, messages=turn1, max_tokens=8, temperature=0, extra_headers=no_response_cache
            )
            .choices[0]
            .message.content
        )
        turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the southern one?"}]
        second = client.chat.completions.with_raw_response.create(
            model=TINY, messages=turn2, max_tokens=8, temperature=0, extra_headers=no_response_cache
        )
        assert second.headers["x-cache-prefix"].startswith("hit;") and "tier=ram" in second.headers["x-cache-prefix"]
    finally:
        assert live.stop()  # SIGTERM: blocks that were reused are persisted, the writer drains
    assert list((tmp_path / "data" / "kv").glob("*/*/*.safetensors"))
    restarted = LiveServer(tiny_model_path, tmp_path / "data", env)
    try:
        turn3 = turn2 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Thanks."}]
        third = _client(restarted).chat.completions.with_raw_response.create(
            model=TINY, messages=turn3, max_tokens=4, temperature=0, extra_headers=no_response_cache
        )
        header = third.headers["x-cache-prefix"]
        assert header.startswith("hit;") and "tier=ssd" in header and "; ssd=" in header, header
    finally:
        assert restarted.stop()
