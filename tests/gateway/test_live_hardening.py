"""Hardening regressions that need a real `strata serve` process: sockets, time, files."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import TINY
from tests.gateway.test_live_server import ADMIN, LiveServer, _admin_stats, _health

READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    live = LiveServer(
        tiny_model_path,
        tmp_path_factory.mktemp("hardening") / "data",
        {
            "STRATA_ADMIN_KEY": ADMIN,
            "STRATA_MODEL_NAME": TINY,
            "STRATA_HTTP_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
            "STRATA_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        },
    )
    yield live
    assert live.stop()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass  # a 4xx the server may send before closing
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model":',
    ],
    ids=["nothing", "half a header", "half a body"],
)
def test_slow_or_silent_connections_are_closed(server, sent):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(sent)
        assert _closed_within(sock, READ_TIMEOUT_S + 4)
    assert time.monotonic() - started < READ_TIMEOUT_S + 4
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def test_connections_over_the_limit_are_refused(server):
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        assert httpx.get(server.url + "/healthz", timeout=5).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def test_an_abandoned_plain_request_is_cancelled(server):
    """Two clients that left after 0.5 s once held the engine for 80 s."""
    before = _admin_stats(server)["engine"]["num_cancelled"]
    # greedy: this prompt runs all 500 tokens on the tiny model (~1.8 s); a sampled one may stop early
    body = json.dumps(
        {
            "model": TINY,
            "messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": 500,
            "temperature": 0,
        }
    ).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _admin_stats(server)["engine"]["num_cancelled"] == before:
        time.sleep(0.05)
    assert _admin_stats(server)["engine"]["num_cancelled"] == before + 1
    assert not _health(server)["engine_busy"]


def test_hostile_text_never_holds_the_event_loop(server):
    """73 KB of 'status ' once held every request, /healthz included, for 13 s."""
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "status " * 10_500}],
        "max_tokens": 1,
        "temperature": 0,
    }
    done = threading.Event()
    worst = []

    def poll():
        while not done.is_set():
            started = time.monotonic()
            httpx.get(server.url + "/healthz", timeout=30)
            worst.append(time.monotonic() - started)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(3):
            response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert response.status_code in (200, 400)
    finally:
        done.set()
        poller.join()
    assert max(worst) < 1.0, max(worst)


def test_openai_client_streams_real_engine_output(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Stream a few words about rivers."}]
    fresh = {"Cache-Control": "no-cache, no-store"}
    raw = client.chat.completions.with_raw_response.create(
        model=TINY, messages=messages, max_tokens=12, temperature=0, stream=True, extra_headers=fresh
    )
    assert raw.headers["x-cache-layer"] == "engine"
    chunks = list(raw.parse())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(
        model=TINY, messages=messages, max_tokens=12, temperature=0, extra_headers=fresh
    )
    assert streamed == plain.choices[0].message.content and streamed


def test_data_files_are_private(tiny_model_path, tmp_path):
    data_dir = tmp_path / "data"
    live = LiveServer(tiny_model_path, data_dir, {"STRATA_MODEL_NAME": TINY, "STRATA_SSD_MIN_HITS": "0"})
    try:
        for turn in range(2):
            httpx.post(
                live.url + "/v1/chat/completions",
                timeout=60,
                json={
                    "model": TINY,
                    "max_tokens": 4,
                    "temperature": 0,
                    "messages": [
                        {"role": "user", "content": "Remember this sentence about private files. " * (4 + turn)}
                    ],
                },
            )
    finally:
        assert live.stop()
    found = {path.name for path in data_dir.rglob("*")}
    assert {"responses.db", "semantic.db", "index.sqlite"} <= found
    assert any(name.endswith(".safetensors") for name in found)
    for path in [data_dir, *data_dir.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
