"""`strata cluster up`'s cluster (gateway/operations/cluster.py): Debian's HAProxy with the shipped config in
front of two replicas sharing one real redis-server and one KV folder. A conversation sticks to one
replica; an exact answer and a paraphrase stored through one are served through the other; a purge
through either reaches both; a replica killed mid-conversation hands the session to the other, which
continues it from the shared KV tier with the answer a cold run gives; Redis restarted empty costs
the response layers nothing but a bypass, and they recover; `strata cluster up` starts a replica that
died again; stopping leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from gateway.operations.cluster import Cluster, free_ports, port_free
from kvcache.sealing import KEY_CACHE_S
from tests.conftest import TINY

KEYS = {"acme": "key-acme", "cold": "key-cold"}  # "cold" shares nothing with acme: its runs compute everything
ADMIN = {"Authorization": "Bearer admin-key"}


def _chat(
    url: str, messages: list[dict], session: str | None = None, tenant: str = "acme", max_tokens: int = 4
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} | ({"X-Strata-Session": session} if session else {})
    return httpx.post(
        url + "/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={"model": TINY, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
    )


def _ask(url: str, text: str, session: str | None = None, first: str = "Hello archive.") -> httpx.Response:
    messages = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": text},
    ]
    return _chat(url, messages, session)


def _cached(response: httpx.Response) -> int:
    return int(response.headers["x-cache-prefix"].split("cached=")[1].split(";")[0])


@pytest.fixture
def cluster(tiny_model_path, tmp_path):
    env = {
        "STRATA_MODEL_NAME": TINY,
        "STRATA_API_KEYS": ",".join(f"{k}:{t}" for t, k in KEYS.items()),
        "STRATA_ADMIN_KEY": "admin-key",
    }
    running = Cluster(str(tiny_model_path), tmp_path / "cluster", free_ports(3), env)
    running.start()
    yield running
    running.stop()


def test_sessions_stick_share_answers_and_survive_a_dead_replica(cluster):
    homes: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(set(homes.values())) < 2:  # until both replicas are up behind the proxy and took a session
        assert time.monotonic() < deadline, f"the proxy never used both replicas: {homes}"
        session = f"session-{len(homes)}"
        response = _ask(cluster.url, "Which replica am I on?", session)
        if response.status_code == 200:
            homes[session] = response.headers["x-strata-replica"]
    for session, home in homes.items():  # every later turn lands where the session began
        assert {_ask(cluster.url, f"Turn {turn}.", session).headers["x-strata-replica"] for turn in range(3)} == {home}
    no_session = {
        _ask(cluster.url, f"Turn {turn}.", first="Same first message.").headers["x-strata-replica"] for turn in range(3)
    }
    assert len(no_session) == 1  # no session: the API key and first message keep it on one replica

    on_a = next(s for s, home in homes.items() if home == "a")
    on_b = next(s for s, home in homes.items() if home == "b")
    stored = _ask(cluster.url, "Shared through Redis?", on_a)
    served = _ask(cluster.url, "Shared through Redis?", on_b)
    assert (stored.headers["x-strata-replica"], served.headers["x-strata-replica"]) == ("a", "b")
    assert served.headers["x-cache-exact"].startswith("hit")
    _semantic_and_purges_reach_both(cluster, on_a, on_b)
    _a_dead_replica_leaves_its_conversation_on_the_shared_tier(cluster, on_a)
    _redis_restarted_empty(cluster, on_b)


def _semantic_and_purges_reach_both(cluster, on_a: str, on_b: str) -> None:
    stored = _ask(cluster.url, "How do I reset my password?", on_a)
    deadline = time.monotonic() + 5
    while True:  # the entry reaches B's index through the Redis stream within a bounded delay
        served = _ask(cluster.url, "What is the way to reset my password?", on_b)
        if served.headers["x-cache-semantic"].startswith("hit"):
            break
        assert time.monotonic() < deadline, served.headers["x-cache-semantic"]
    assert served.headers["x-strata-replica"] == "b"
    assert served.json()["choices"][0]["message"] == stored.json()["choices"][0]["message"]
    _ask(cluster.url, "Purge me from every replica?", on_a)
    purge = httpx.post(
        cluster.replica_url("b") + "/admin/purge",
        headers=ADMIN,
        timeout=60,
        json={"tenant": "acme", "session": on_a, "layers": ["exact", "semantic"]},
    )
    assert purge.status_code == 200 and purge.json()["removed"]["exact"]["entries"] >= 1
    assert purge.json()["announced"] is True  # replica a purges its own layers (RAM KV, images) as well
    again = _ask(cluster.url, "Purge me from every replica?", on_a)
    assert again.headers["x-strata-replica"] == "a" and again.headers["x-cache-exact"].startswith("miss")


def _a_dead_replica_leaves_its_conversation_on_the_shared_tier(cluster, on_a: str) -> None:
    messages = [{"role": "system", "content": "You are the archive's patient assistant. " * 4}]
    for turn in range(3):  # a conversation on A, each turn's blocks written through to the shared folder
        messages.append({"role": "user", "content": f"Tell me about shelf {turn} of the archive."})
        reply = _chat(cluster.url, messages, on_a, max_tokens=8)
        assert reply.headers["x-strata-replica"] == "a"
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    time.sleep(1.0)  # the SSD writer's queue drains (a replica's last milliseconds may be lost, nothing more)
    cluster.processes["a"].kill()  # mid-conversation, no goodbye: nothing persisted at shutdown
    messages.append({"role": "user", "content": "And what is on the last shelf?"})
    moved = _chat(cluster.url, messages, on_a, max_tokens=8)
    assert moved.status_code == 200 and moved.headers["x-strata-replica"] == "b"
    assert _cached(moved) > 0 and "ssd" in moved.headers["x-cache-prefix"], moved.headers["x-cache-prefix"]
    cold = _chat(cluster.url, messages, tenant="cold", max_tokens=8)
    assert _cached(cold) == 0
    assert moved.json()["choices"][0]["message"]["content"] == cold.json()["choices"][0]["message"]["content"]


def _redis_restarted_empty(cluster, session: str) -> None:
    cluster.restart_redis()
    deadline = time.monotonic() + 10
    while True:  # the first requests find the old connection dead: a bypass, never an error
        response = _ask(cluster.url, "Does Redis remember this?", session)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
        if response.headers["x-cache-exact"].startswith("miss"):
            break
        assert response.headers["x-cache-exact"] == "bypass; reason=store_unavailable"
        assert time.monotonic() < deadline
    assert _ask(cluster.url, "Does Redis remember this?", session).headers["x-cache-exact"].startswith("hit")
    time.sleep(KEY_CACHE_S + 0.5)  # the replica reads the tenant's key again: the one it held is written back
    assert _ask(cluster.url, "Does Redis remember this?", session).headers["x-cache-exact"].startswith("hit")


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_cluster_up_restarts_a_dead_replica_and_stops_everything_on_sigint(tiny_model_path, tmp_path):
    port = free_ports(3)
    command = [
        sys.executable,
        "-m",
        "gateway.cli",
        "cluster",
        "up",
        "--model",
        str(tiny_model_path),
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "cluster"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"STRATA_MODEL_NAME": TINY}
    env.pop("STRATA_API_KEYS", None)
    # started as a shell's background job is (SIGINT ignored): Ctrl-C must stop it all the same
    up = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        line = up.stdout.readline()
        assert line.startswith(f"strata cluster: proxy http://127.0.0.1:{port}"), line + up.stdout.read()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        replica_a = f"http://127.0.0.1:{port + 1}/health/ready"
        pid = int(subprocess.check_output(["pgrep", "-f", "--", f"data-dir {tmp_path / 'cluster' / 'a'}"]).split()[0])
        os.kill(pid, signal.SIGKILL)  # a replica dies: it is started again, the cluster keeps serving
        assert _ask(f"http://127.0.0.1:{port}", "Still served?", "s").status_code == 200
        deadline = time.monotonic() + 120
        while not _ready(replica_a):
            assert time.monotonic() < deadline and up.poll() is None, "replica a was not started again"
            time.sleep(0.5)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0 and "strata cluster: stopped" in up.stdout.read()
        assert all(port_free(port + i) for i in range(3))  # proxy and replicas gone
    finally:
        if up.poll() is None:  # a failure above: SIGTERM stops the replicas, Redis and the proxy too
            up.terminate()
            up.wait(timeout=120)


def test_a_cache_key_sticks_and_a_hot_key_spills_under_bounded_load(cluster):
    """prompt_cache_key routes first (any first message, any session header); six streams of one hot
    key held open at once cannot all sit on one replica: hash-balance-factor sends the later ones on."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while len(seen) < 2:  # until the proxy has both replicas up
        assert time.monotonic() < deadline, f"the proxy never used both replicas: {seen}"
        response = _ask(cluster.url, "Which replica?", f"warm-{len(seen)}-{time.monotonic()}")
        if response.status_code == 200:
            seen.add(response.headers["x-strata-replica"])
    homes = set()
    for turn in range(4):
        body = {
            "model": TINY,
            "messages": [{"role": "user", "content": f"Different first message {turn}."}],
            "max_tokens": 2,
            "prompt_cache_key": "agent-hot",
        }
        headers = {"Authorization": "Bearer key-acme", "X-Strata-Session": f"session-{turn}"}
        homes.add(
            httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=60).headers[
                "x-strata-replica"
            ]
        )
    assert len(homes) == 1
    never_ending = {"8184": -100, "8186": -100}  # the tiny model's end-of-text tokens: each stream runs its max_tokens
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Stream for a while."}],
        "max_tokens": 400,
        "stream": True,
        "logit_bias": never_ending,
        "prompt_cache_key": "agent-hot",
    }
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as streams:
        replicas = []
        for _ in range(6):
            response = streams.enter_context(
                client.stream(
                    "POST",
                    cluster.url + "/v1/chat/completions",
                    json=body,
                    headers={"Authorization": "Bearer key-acme"},
                )
            )
            assert response.status_code == 200
            replicas.append(response.headers["x-strata-replica"])
    assert replicas[0] in homes and set(replicas) == {"a", "b"}, replicas
