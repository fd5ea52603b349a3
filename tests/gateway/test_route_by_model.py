"""The shipped by-model HAProxy config (deploy/haproxy/by-model.cfg) in front of two real replicas that
serve different models: each request reaches the replica serving the model its body names, whichever
client sends it, and a model no replica serves is the default replica's 404."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from evals.bench_layers import start_server
from gateway.checkpoints import BuildSpec
from tests.conftest import built_model

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "by-model.cfg"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.fail("haproxy is not installed: `make test` installs it from Debian")
    folder = tmp_path_factory.mktemp("by-model")
    coders, coders_url = start_server(
        str(built_model(BuildSpec("qwen2_5_vl", "tiny"))), folder / "a", {"STRATA_MODEL_NAME": "qwen"}
    )
    vision, vision_url = start_server(
        str(built_model(BuildSpec("gemma3", "tiny"))), folder / "b", {"STRATA_MODEL_NAME": "gemma"}
    )
    (folder / "models.map").write_text("qwen coders\ngemma vision\n")
    port = _free_port()
    env = {
        "STRATA_PROXY_BIND": f"127.0.0.1:{port}",
        "STRATA_MODEL_MAP": str(folder / "models.map"),
        "STRATA_CODERS_REPLICA": coders_url.removeprefix("http://"),
        "STRATA_VISION_REPLICA": vision_url.removeprefix("http://"),
    }
    checked = subprocess.run([haproxy, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    process = subprocess.Popen([haproxy, "-db", "-f", str(CONFIG)], env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    time.sleep(1.5)  # both health checks up
    yield url
    for child in (process, coders, vision):
        child.terminate()
        child.wait(30)


def test_each_request_reaches_the_replica_serving_its_model(proxy):
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0)
    for model in ("gemma", "qwen", "gemma"):
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Where am I?"}], max_tokens=4
        )
        assert answer.model == model
    messages = anthropic.Anthropic(base_url=proxy, api_key="unused", max_retries=0)
    reply = messages.messages.create(model="gemma", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "gemma"


def test_a_model_no_replica_serves_is_the_default_replicas_clear_404(proxy):
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert missing.value.code == "model_not_found" and "'qwen'" in missing.value.message
