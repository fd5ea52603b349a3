"""A slow store delays only the requests that wait on it: no store call runs on the event loop.

Two real stores made slow from outside, each in front of a real `strata serve` process:
- a redis-server behind a TCP proxy that holds every reply for 300 ms (a slow link);
- the SQLite exact store, whose writes wait on another process's write lock, held for a second (a
  slow or busy disk): every slow request's answer is written, so each of them waits for it.
While requests wait on the slow store, a stream that is already running keeps its inter-token pace
and /health keeps answering at once. Before the store calls left the event loop, every slow call
stalled every stream on the replica and every health check for its whole duration."""

from __future__ import annotations

import dataclasses
import gc
import json
import socket
import sqlite3
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise

import anyio
import httpx
import pytest

from gateway.serving.pipeline import OFF_LOOP_BYTES, off_loop
from gateway.serving.responses import ResponseCaches
from tests.conftest import TINY, RedisServer
from tests.gateway.test_live_server import LiveServer

# Inter-token gaps and /health latency under slow stores: run alone.
pytestmark = pytest.mark.serial

STORE_DELAY_S = 0.3
LOCK_HOLD_S = 1.0  # the SQLite file's write lock, taken before the slow requests start
NUM_SLOW_REQUESTS = 4
STREAM_TOKENS = 12000  # far longer than the slow requests take: the stream is closed once they are done


class DelayProxy:
    """A TCP proxy on loopback in front of `target_port` that holds each chunk the server sends for
    `delay_s` (0: passes at once): every reply of the store arrives that much later."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.delay_s = 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, delayed: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if delayed and self.delay_s:
                    time.sleep(self.delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()

    def close(self) -> None:
        self.listener.close()
        for end in self.sockets:
            end.close()


class WriteLocker:
    """Another process's writer on a SQLite file (a connection of the test process): hold() takes the
    file's write lock and keeps it for `hold_s` on a thread of its own, so every write the server
    makes in that time waits for it; wait_released() returns once it is let go."""

    def __init__(self, path, hold_s: float):
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.hold_s = hold_s
        self.thread: threading.Thread | None = None

    def hold(self) -> None:
        taken = threading.Event()

        def run() -> None:
            self.db.execute("BEGIN IMMEDIATE")
            taken.set()
            time.sleep(self.hold_s)
            self.db.execute("COMMIT")

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert taken.wait(10), "the write lock was not taken"

    def wait_released(self) -> None:
        assert self.thread is not None
        self.thread.join(10)

    def close(self) -> None:
        self.db.close()


def _body(text: str, **extra) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


def _stream_arrivals(url: str, arrivals: list[float], started: threading.Event, enough: threading.Event) -> None:
    """A long stream (EOS pushed out of reach by logit_bias), read until `enough` is set; the arrival
    time of each chunk."""
    body = _body(
        f"Tell me a long story, please ({time.time()}).",
        stream=True,
        max_tokens=STREAM_TOKENS,
        logit_bias={"8184": -100, "8186": -100},  # the tiny model's end-of-sequence ids
    )
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
                started.set()
            if enough.is_set():
                return  # closing the response leaves: the server cancels the job


def _slow_requests(url: str) -> list[float]:
    """NUM_SLOW_REQUESTS distinct plain requests at once (each looks up and stores an exact
    entry); how long each took."""
    durations: list[float] = []

    def one(index: int) -> None:
        start = time.perf_counter()
        body = _body(f"Question {index} {time.time()}?", max_tokens=4)
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        durations.append(time.perf_counter() - start)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_SLOW_REQUESTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return durations


@contextmanager
def _probing_health(url: str) -> Iterator[list[float]]:
    """GET /health every 50 ms while the block runs: the latency of each."""
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.get(url + "/health")
                latencies.append(time.perf_counter() - start)
                done.wait(0.05)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        yield latencies
    finally:
        done.set()
        thread.join(10)


@contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection in this process while the block runs: a collection stops every thread
    of the test (the stream reader, the /health probe) and its pause would be read as the server's."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _measure(url: str, slow_on: Callable[[], None], slow_off: Callable[[], None]) -> dict:
    """Start a stream, make the store slow, send the slow requests while probing /health."""
    arrivals: list[float] = []
    started, enough = threading.Event(), threading.Event()
    stream = threading.Thread(target=_stream_arrivals, args=(url, arrivals, started, enough))
    stream.start()
    assert started.wait(30), "the stream did not start"
    slow_on()
    with _probing_health(url) as health, _no_collection():
        window_start = time.perf_counter()
        durations = _slow_requests(url)
        window_end = time.perf_counter()
    slow_off()
    time.sleep(0.5)
    enough.set()
    stream.join(60)
    inside = [t for t in arrivals if window_start <= t <= window_end]
    gaps = [b - a for a, b in pairwise(inside)]
    assert arrivals[-1] > window_end, "the stream ended before the slow requests did: make it longer"
    return {"durations": durations, "gaps": gaps, "health": health}


def _assert_unaffected(result: dict, waited_s: float) -> None:
    """`waited_s`: the least mean time the slow requests must have spent (they did wait on the store)."""
    assert len(result["durations"]) == NUM_SLOW_REQUESTS
    assert statistics.mean(result["durations"]) >= waited_s, result["durations"]
    gaps, health = result["gaps"], result["health"]
    assert len(gaps) >= 10, gaps
    assert max(gaps) < STORE_DELAY_S * 2 / 3, f"the stream stalled: max gap {max(gaps):.3f} s"
    assert statistics.median(health) < 0.05, health
    assert max(health) < STORE_DELAY_S * 2 / 3, f"/health stalled: {max(health):.3f} s"


@pytest.mark.serial
def test_a_slow_redis_stalls_neither_streams_nor_health(tiny_model_path, tmp_path):
    redis = RedisServer(tmp_path / "redis")
    proxy = DelayProxy(redis.port)
    server = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {"STRATA_MODEL_NAME": TINY, "STRATA_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"},
    )
    try:

        def slow_on() -> None:
            proxy.delay_s = STORE_DELAY_S

        def slow_off() -> None:
            proxy.delay_s = 0.0

        result = _measure(server.url, slow_on, slow_off)
        _assert_unaffected(result, STORE_DELAY_S)  # the lookup alone waits for one delayed reply
        print(json.dumps({k: sorted(v)[-3:] for k, v in result.items()}))
    finally:
        server.stop()
        proxy.close()
        redis.stop()


@pytest.mark.serial
def test_slow_sqlite_writes_stall_neither_streams_nor_health(tiny_model_path, tmp_path):
    server = LiveServer(tiny_model_path, tmp_path / "data", {"STRATA_MODEL_NAME": TINY, "STRATA_SEMANTIC": "0"})
    locker = WriteLocker(tmp_path / "data" / "responses.db", LOCK_HOLD_S)
    try:
        result = _measure(server.url, locker.hold, locker.wait_released)
        _assert_unaffected(result, LOCK_HOLD_S * 0.8)  # each started just after the lock was taken
        print(json.dumps({k: sorted(v)[-3:] for k, v in result.items()}))
    finally:
        locker.close()
        server.stop()


def test_a_request_whose_digests_may_wait_on_a_shared_key_store_is_keyed_off_the_event_loop(settings):
    """The tenants' keys in Redis are read again every KEY_CACHE_S: a request's digests (its exact
    key, session, end user) may wait on that read, so they are never computed on the event loop,
    however small the body; a key kept in a file is checked by one stat and stays on the loop."""
    loop = threading.get_ident()

    async def threads() -> tuple[int, int, int]:
        return (
            await off_loop(10, threading.get_ident),
            await off_loop(10, threading.get_ident, may_wait=True),
            await off_loop(OFF_LOOP_BYTES + 1, threading.get_ident),
        )

    small, waits, large = anyio.run(threads)
    assert small == loop and waits != loop and large != loop
    with_redis = dataclasses.replace(settings, redis_url="redis://127.0.0.1:9/0")  # never reached here
    assert not ResponseCaches(settings).digests_may_wait
    assert ResponseCaches(dataclasses.replace(with_redis, exact_store="memory")).digests_may_wait
    assert not ResponseCaches(dataclasses.replace(with_redis, encrypt_at_rest=False)).digests_may_wait
