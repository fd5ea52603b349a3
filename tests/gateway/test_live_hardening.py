"""Hardening regressions that need a real `strata serve` process: sockets, time, files."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import TINY
from tests.gateway.test_live_server import ADMIN, LiveServer, _admin_stats, _health

# Most tests here time what a client waits for (read and header deadlines, stalls, the event loop): run alone.
pytestmark = pytest.mark.serial

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


def _response_status(sock: socket.socket) -> int:
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection instead of answering: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(
        next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1]
    )
    while len(rest) < length:
        rest += sock.recv(4096)
    return int(head.split(b" ")[1])


def test_a_kept_alive_connection_older_than_the_read_deadline_still_takes_a_request_in_pieces(server):
    """An agent keeps one connection for a whole session; its later requests, whose bodies arrive in
    several reads, were once cut at once: the body's deadline ran from the connection's first request."""
    body = {"model": TINY, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "temperature": 0}
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_raw_post(body))
        assert _response_status(sock) == 200
        for _ in range(2):  # the connection outlives the read deadline, never idle past keep-alive
            time.sleep(READ_TIMEOUT_S * 0.8)
            sock.sendall(_raw_post(body))
            assert _response_status(sock) == 200
        request = _raw_post(body)
        split = request.index(b"\r\n\r\n") + 8  # the headers and the body's first bytes, then the rest
        sock.sendall(request[:split])
        time.sleep(0.2)
        sock.sendall(request[split:])
        assert _response_status(sock) == 200


def test_connections_over_the_limit_are_refused_but_health_checks(server):
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 503
        for path in ("/health", "/healthz", "/health/ready"):  # a full server still says it is alive
            assert httpx.get(server.url + path, timeout=5).status_code == 200, path
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def _raw_post(body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


def test_an_abandoned_plain_request_is_cancelled(server):
    """Two clients that left after 0.5 s once held the engine for 80 s."""
    before = _admin_stats(server)["engine"]["num_cancelled"]
    # greedy: this prompt runs all 500 tokens on the tiny model (~1.8 s); a sampled one may stop early
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
        "max_tokens": 500,
        "temperature": 0,
    }
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_raw_post(body))
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _admin_stats(server)["engine"]["num_cancelled"] == before:
        time.sleep(0.05)
    assert _admin_stats(server)["engine"]["num_cancelled"] == before + 1
    assert not _health(server)["engine_busy"]


def test_abandoned_requests_for_several_choices_cancel_every_job(server):
    """Three n: 8, max_tokens: 4096 requests closed after 2 s once kept the engine busy for 20 s:
    the client's leaving was noticed only once every choice had been admitted and prefilled."""
    before = _admin_stats(server)["engine"]["num_cancelled"]
    sockets = []
    for index, stream in enumerate((True, True, False)):
        body = {
            "model": TINY,
            "messages": [{"role": "user", "content": f"Tell {index} very long stories."}],
            "max_tokens": 4096,
            "n": 8,
            "temperature": 1.0,
            "logit_bias": {"8184": -100, "8186": -100},  # the tiny model's end-of-sequence ids: never ends early
            "stream": stream,
        }
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(_raw_post(body))
        sockets.append(sock)
    time.sleep(2)
    for sock in sockets:
        sock.close()
    left = time.monotonic()
    while _health(server)["engine_busy"] or _admin_stats(server)["engine"]["num_running"]:
        assert time.monotonic() - left < 10, "the engine kept decoding for clients that had left"
        time.sleep(0.1)
    idle_after_s = time.monotonic() - left
    # every job started was cancelled (choices not yet submitted when the client left never are)
    cancelled = _admin_stats(server)["engine"]["num_cancelled"] - before
    assert 8 <= cancelled <= 24 and idle_after_s < 5, (cancelled, idle_after_s)
    print(json.dumps({"engine_idle_after_s": idle_after_s, "jobs_cancelled": cancelled}))


def test_logprob_buffers_are_bounded(server):
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4096,
        "n": 8,
        "logprobs": True,
        "top_logprobs": 20,
    }
    refused = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    assert "262144" in refused.json()["error"]["message"]
    body.update(n=1, max_tokens=64)
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


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


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class SlowHeaderFlood:
    """`num_sockets` connections from `source` (by default another loopback address: another client),
    each sending one header byte every `every_s`; a connection the server closes is opened again, so
    the pressure lasts until stop()."""

    def __init__(self, port: int, num_sockets: int, every_s: float, source: str = "127.0.0.2"):
        self.port, self.num_sockets, self.every_s, self.source = port, num_sockets, every_s, source
        self.stopped = threading.Event()
        self.num_opened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket | None:
        sock = socket.socket()
        sock.bind((self.source, 0))
        sock.settimeout(1)
        try:
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return None
        self.num_opened += 1
        return sock

    def _run(self) -> None:
        sockets: list[socket.socket | None] = [None] * self.num_sockets
        while not self.stopped.is_set():
            for index, sock in enumerate(sockets):
                if sock is None or _closed_by_peer(sock):
                    if sock is not None:
                        sock.close()
                    sock = sockets[index] = self._open()
                try:
                    if sock is not None:
                        sock.send(b"G")  # one byte of "GET / HTTP/1.1...", never the rest
                except OSError:
                    sock.close()
                    sockets[index] = None
            self.stopped.wait(self.every_s)
        for sock in sockets:
            if sock is not None:
                sock.close()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)


def test_slow_header_connections_cannot_lock_out_other_clients(tiny_model_path, tmp_path):
    """300 connections sending one header byte every 2 s once filled the connection cap: every
    request, /health included, got 503 for 30 s. Now one client holds at most its share of the
    connections, slow headers are cut at the header deadline, and health checks pass the cap."""
    live = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {
            "STRATA_MODEL_NAME": TINY,
            "STRATA_MAX_CONNECTIONS": "64",
            "STRATA_MAX_CONNECTIONS_PER_CLIENT": "16",
            "STRATA_HTTP_HEADER_TIMEOUT_S": "2",
        },
    )
    flood = SlowHeaderFlood(live.port, 300, 2.0)
    try:
        time.sleep(3)  # the flood is at full pressure, past one header deadline
        served = []
        for index in range(4):
            started = time.monotonic()
            health = httpx.get(live.url + "/health", timeout=10)
            body = {"model": TINY, "messages": [{"role": "user", "content": f"hello {index}"}], "max_tokens": 2}
            chat = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=10)
            assert (health.status_code, chat.status_code) == (200, 200), chat.text
            served.append(time.monotonic() - started)
            time.sleep(0.5)
        assert flood.num_opened > 300  # the server cut connections and the flood opened them again
        assert max(served) < 2.0, served
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", live.port)) as dripping:
            dripping.sendall(b"GET /health HTTP/1.1\r\nHo")
            assert _closed_within(dripping, 10)
        assert time.monotonic() - started < 4  # the header deadline (2 s), not the read timeout (30 s)
        print(json.dumps({"served_s": served, "flood_connections_opened": flood.num_opened}))
    finally:
        flood.stop()
        assert live.stop()


def test_a_health_probe_from_the_flooding_host_is_answered_and_its_other_requests_get_429(tiny_model_path, tmp_path):
    """A liveness probe from the same host as 300 slow-header connections once got 429: the cap
    refused the connection before its path was known. Now a connection past the cap may ask for a
    health check (within OVER_CAP_HEADER_S); anything else gets the 429."""
    live = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {"STRATA_MODEL_NAME": TINY, "STRATA_MAX_CONNECTIONS_PER_CLIENT": "16", "STRATA_HTTP_HEADER_TIMEOUT_S": "2"},
    )
    flood = SlowHeaderFlood(live.port, 300, 0.5, source="127.0.0.1")
    try:
        time.sleep(3)
        for path in ("/health", "/healthz", "/health/ready"):
            assert httpx.get(live.url + path, timeout=10).status_code == 200, path
        body = {"model": TINY, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        refused = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=10)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_connections"
        with socket.create_connection(("127.0.0.1", live.port)) as silent:  # past the cap, sends nothing
            started = time.monotonic()
            assert _closed_within(silent, 5) and time.monotonic() - started < 2.5
        flood.stop()
        assert httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        flood.stop()
        assert live.stop()


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def test_bulk_embeddings_stall_no_other_tenant(tiny_model_path, tmp_path):
    """2,048 inputs of 2,000 characters once held MiniLM for ~80 s under the lock the semantic layer's
    lookups need: another tenant's plain chat waited as long. Now bulk work has a model of its own,
    runs in chunks with tenants in turn, and inputs are bounded as OpenAI bounds them."""
    keys = {"A": "key-a", "B": "key-b"}
    live = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {"STRATA_MODEL_NAME": TINY, "STRATA_API_KEYS": "key-a:tenant-a,key-b:tenant-b"},
    )
    auth = {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()}
    url = live.url

    def embed(who: str, texts: list[str], timeout: float = 300) -> httpx.Response:
        body = {"model": "all-MiniLM-L6-v2", "input": texts, "encoding_format": "float"}
        return httpx.post(url + "/v1/embeddings", json=body, headers=auth[who], timeout=timeout)

    try:
        assert embed("A", ["warm the bulk model up"]).status_code == 200
        before = _rss_bytes(live.process.pid)
        bulk = [f"Document {i}: " + "lorem ipsum dolor sit amet " * 74 for i in range(256)]  # ~2,000 characters
        done: list[httpx.Response] = []
        flood = threading.Thread(target=lambda: done.append(embed("A", bulk)))
        started = time.monotonic()
        flood.start()
        time.sleep(1.0)
        chat_started = time.monotonic()
        question = {
            "model": TINY,
            "messages": [{"role": "user", "content": "How do I export my data?"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        chat = httpx.post(url + "/v1/chat/completions", json=question, headers=auth["B"], timeout=120)
        chat_s = time.monotonic() - chat_started
        small_started = time.monotonic()
        small = embed("B", ["a short one", "and another"], timeout=120)
        small_s = time.monotonic() - small_started
        flood.join(300)
        bulk_s = time.monotonic() - started
        assert chat.status_code == 200 and small.status_code == 200 and done[0].status_code == 200
        assert len(done[0].json()["data"]) == 256
        assert chat.headers["x-cache-semantic"].startswith("miss")  # it did look up, with MiniLM
        assert small_s < 5.0 and chat_s < 3.0 and bulk_s > 3 * max(chat_s, small_s), (chat_s, small_s, bulk_s)
        grown = _rss_bytes(live.process.pid) - before
        print(
            json.dumps(
                {"chat_s": chat_s, "small_embeddings_s": small_s, "bulk_s": bulk_s, "rss_growth_mb": grown >> 20}
            )
        )
        assert grown < 400 << 20
        too_long = embed("B", ["word " * 9000])
        assert too_long.status_code == 400 and "8192" in too_long.json()["error"]["message"]
        too_many = embed("B", ["several words in a row " * 40] * 2048)  # ~200 tokens each, 400k in all
        assert too_many.status_code == 400 and "300000" in too_many.json()["error"]["message"]
    finally:
        assert live.stop()
