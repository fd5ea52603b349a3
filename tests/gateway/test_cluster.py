"""`strata cluster up`'s cluster (gateway/cluster.py): Debian's HAProxy with the shipped config in
front of two replicas sharing one real redis-server. A conversation sticks to one replica, an exact
answer stored through one is served through the other, a replica killed mid-conversation hands the
session to the other without an error, and stopping leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from gateway.cluster import Cluster, free_ports, port_free
from tests.conftest import TINY


def _ask(url: str, text: str, session: str | None = None, first: str = "Hello archive.") -> httpx.Response:
    messages = [{"role": "user", "content": first}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": text}]
    headers = {"X-Strata-Session": session} if session else {}
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": TINY, "messages": messages, "max_tokens": 4, "temperature": 0})


@pytest.fixture
def cluster(tiny_model_path, tmp_path):
    running = Cluster(str(tiny_model_path), tmp_path / "cluster", free_ports(3), {"STRATA_MODEL_NAME": TINY})
    running.start()
    yield running
    running.stop()


@pytest.mark.slow
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
    no_session = {_ask(cluster.url, f"Turn {turn}.", first="Same first message.").headers["x-strata-replica"]
                  for turn in range(3)}
    assert len(no_session) == 1  # no session: the API key and first message keep it on one replica

    on_a = next(s for s, home in homes.items() if home == "a")
    on_b = next(s for s, home in homes.items() if home == "b")
    stored = _ask(cluster.url, "Shared through Redis?", on_a)
    served = _ask(cluster.url, "Shared through Redis?", on_b)
    assert (stored.headers["x-strata-replica"], served.headers["x-strata-replica"]) == ("a", "b")
    assert served.headers["x-cache-exact"].startswith("hit")

    cluster.processes["a"].kill()  # mid-conversation, no goodbye
    moved = _ask(cluster.url, "Are you still there?", on_a)
    assert moved.status_code == 200 and moved.headers["x-strata-replica"] == "b"
    assert moved.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_cluster_up_stops_everything_on_sigint(tiny_model_path, tmp_path):
    port = free_ports(3)
    command = [sys.executable, "-m", "gateway.cli", "cluster", "up", "--model", str(tiny_model_path), "--port", str(port),
               "--data-dir", str(tmp_path / "cluster")]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"STRATA_MODEL_NAME": TINY}
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = up.stdout.readline()
    assert line.startswith(f"strata cluster: proxy http://127.0.0.1:{port}"), line + up.stdout.read()
    assert _ask(f"http://127.0.0.1:{port}", "Up?", "s").status_code == 200
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=90) == 0 and "strata cluster: stopped" in up.stdout.read()
    assert all(port_free(port + i) for i in range(3))  # proxy and replicas gone
