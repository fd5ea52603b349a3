"""The cluster of `strata cluster up` measured: Redis, two replicas and HAProxy, side by side in one run.

    python -m evals.bench_cluster [--model demo] [--requests 48] [--clients 8] [--hits 500]
                                  [--conversations 9] [--propagations 30]

(a) Throughput on distinct prompts (every request a miss in every response layer), the same load
    sent to one replica directly and to the proxy in front of two; requests/s, tokens/s, ratio.
(b) Exact-hit latency over loopback HTTP: replica `a` (exact cache in Redis) against a replica of
    its own with the default SQLite exact cache, hits taking turns; p50/p99, target Redis < 3 ms.
(c) Failover: conversations of five turns on replica a, then turn 6 sent to replica b, which has
    never seen them and continues from the shared KV tier; against the TTFT of the same turn-6
    prompt computed cold on b (another tenant: its salt shares no block). Median of `conversations`,
    target <= 0.3x. Streaming TTFT to the first content chunk; response layers skipped (no-cache).
    Replica a's own TTFT from RAM for the same prompt is printed for reference.
(d) Semantic propagation: a question answered (and stored) through replica a, then a paraphrase
    asked through b (no-store, so b's misses store nothing) until b serves a's entry; the delay from
    a's response to b's first hit, p50/p99 over `propagations`, target p99 < 1 s. Each poll is a
    real request, so the delay is measured to within one poll (~the time of a 1-token miss).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

from gateway.checkpoints import resolve_model_path
from gateway.operations.cluster import Cluster, free_ports

from .bench_layers import start_server

QUESTION = "How do I export my project to a CSV file?"
KEYS = {"acme": "key-acme", "cold": "key-cold"}  # "cold" is another tenant: nothing it asks is cached for it
AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
TURNS_BEFORE_FAILOVER = 5
PARAPHRASES = [
    ("How do I rename the project {n}?", "What is the way to rename the project {n}?"),
    ("Where can I download the invoice {n}?", "Where do I download the invoice {n}?"),
    ("How can I change the password of account {n}?", "How do I change the password of account {n}?"),
]


def distinct_load(url: str, requests: int, clients: int, max_tokens: int) -> dict:
    """`requests` distinct prompts from `clients` threads, each in its own session: requests/s, tokens/s."""

    def one(index: int) -> int:
        body = {
            "model": "bench",
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Request {index} ({uuid.uuid4().hex[:8]}): tell a story."}],
        }
        response = httpx.post(
            url + "/v1/chat/completions",
            json=body,
            timeout=600,
            headers={"X-Strata-Session": f"bench-{index}-{uuid.uuid4().hex[:6]}", **AUTH},
        )
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(requests)))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "requests_per_s": requests / seconds, "tokens_per_s": tokens / seconds}


def exact_hits(urls: dict[str, str], hits: int) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0}
    times: dict[str, list[float]] = {name: [] for name in urls}
    clients = {name: httpx.Client(base_url=url, timeout=60, headers=AUTH) for name, url in urls.items()}
    for client in clients.values():
        for _ in range(20):  # store, then warm the path
            client.post("/v1/chat/completions", json=body)
    for _ in range(hits):
        for name, client in clients.items():
            start = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body)
            times[name].append((time.perf_counter() - start) * 1000)
            assert response.headers["x-cache-exact"].startswith("hit"), response.headers
    return {name: {"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99))} for name, t in times.items()}


def streamed_ttft(url: str, messages: list[dict], tenant: str = "acme", max_tokens: int = 8) -> tuple[float, str, dict]:
    """Seconds to the first content chunk, the whole answer, and the response headers."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "Cache-Control": "no-cache"}
    start, first, parts = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter()
                parts.append(delta)
        return (first or time.perf_counter()) - start, "".join(parts), dict(response.headers)


def failover(cluster: Cluster, conversations: int) -> dict:
    """Turn 6 on b from the shared tier against the same prompt cold on b (module docstring)."""
    shared, cold, warm, cached, same = [], [], [], [], 0
    for index in range(conversations):
        system = f"Archive {uuid.uuid4().hex}. " + "You answer questions about the archive's shelves in detail. " * 20
        messages = [{"role": "system", "content": system}]
        for turn in range(TURNS_BEFORE_FAILOVER):
            messages.append({"role": "user", "content": f"Conversation {index}: what is on shelf {turn}? " * 3})
            _, answer, _ = streamed_ttft(cluster.replica_url("a"), messages, max_tokens=16)
            messages.append({"role": "assistant", "content": answer})
        time.sleep(1.0)  # a's SSD writer drains its queue
        messages.append({"role": "user", "content": "And on the last shelf, after all of those?"})
        ttft_b, answer_b, headers = streamed_ttft(cluster.replica_url("b"), messages)
        ttft_cold, answer_cold, _ = streamed_ttft(cluster.replica_url("b"), messages, tenant="cold")
        warm.append(streamed_ttft(cluster.replica_url("a"), messages)[0])  # where the conversation lives, in RAM
        shared.append(ttft_b)
        cold.append(ttft_cold)
        cached.append(headers["x-cache-prefix"])
        same += answer_b == answer_cold
    return {
        "shared_ttft_ms": float(np.median(shared)) * 1000,
        "cold_ttft_ms": float(np.median(cold)) * 1000,
        "warm_ram_ttft_ms": float(np.median(warm)) * 1000,
        "ratio": float(np.median(shared) / np.median(cold)),
        "answers_equal": same,
        "conversations": conversations,
        "prefix_headers": cached,
    }


def propagation(cluster: Cluster, trials: int) -> dict:
    """Seconds from a's stored answer to b's first semantic hit on a paraphrase (module docstring)."""
    delays, polls = [], []
    for trial in range(trials):
        name = f"{trial}-{uuid.uuid4().hex[:6]}"
        question, paraphrase = (text.format(n=name) for text in PARAPHRASES[trial % len(PARAPHRASES)])
        stored = httpx.post(
            cluster.replica_url("a") + "/v1/chat/completions",
            headers=AUTH,
            timeout=600,
            json={
                "model": "bench",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 1,
                "temperature": 0,
            },
        )
        stored.raise_for_status()
        answered, count = time.perf_counter(), 0
        while True:
            count += 1
            served = httpx.post(
                cluster.replica_url("b") + "/v1/chat/completions",
                timeout=600,
                headers={**AUTH, "Cache-Control": "no-store"},
                json={
                    "model": "bench",
                    "messages": [{"role": "user", "content": paraphrase}],
                    "max_tokens": 1,
                    "temperature": 0,
                },
            )
            if served.headers["x-cache-semantic"].startswith("hit"):
                break
            if count > 100:
                raise RuntimeError(f"b never served a's entry: {served.headers['x-cache-semantic']}")
        delays.append(time.perf_counter() - answered)
        polls.append(count)
    return {
        "p50_ms": float(np.percentile(delays, 50)) * 1000,
        "p99_ms": float(np.percentile(delays, 99)) * 1000,
        "max_ms": max(delays) * 1000,
        "median_polls": float(np.median(polls)),
        "trials": trials,
    }


def measure(
    model: str, requests: int, clients: int, hits: int, conversations: int, propagations: int, folder: Path
) -> dict:
    model_path = str(resolve_model_path(model, folder / "models"))  # built once, shared by every process
    env = {"STRATA_MODEL_NAME": "bench", "STRATA_API_KEYS": ",".join(f"{k}:{t}" for t, k in KEYS.items())}
    cluster = Cluster(model_path, folder / "cluster", port=free_ports(3), extra_env=env)
    sqlite_process = None
    try:
        cluster.start()
        sqlite_process, sqlite_url = start_server(model_path, folder / "sqlite")
        one = distinct_load(cluster.replica_url("a"), requests, clients, 32)
        two = distinct_load(cluster.url, requests, clients, 32)
        latency = exact_hits({"redis": cluster.replica_url("a"), "sqlite": sqlite_url}, hits)
        sqlite_process.terminate()  # (c) and (d) run on the cluster alone
        sqlite_process.wait(timeout=60)
        sqlite_process = None
        moved = failover(cluster, conversations)
        delay = propagation(cluster, propagations)
    finally:
        if sqlite_process is not None:
            sqlite_process.terminate()
            sqlite_process.wait(timeout=60)
        cluster.stop()
    return {
        "one_replica": one,
        "two_replicas": two,
        "throughput_ratio": two["tokens_per_s"] / one["tokens_per_s"],
        "exact_hit_ms": latency,
        "failover": moved,
        "semantic_propagation": delay,
        "requests": requests,
        "clients": clients,
        "hits": hits,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.bench_cluster")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--hits", type=int, default=500)
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--propagations", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="strata-bench-cluster-") as folder:
        result = measure(
            args.model, args.requests, args.clients, args.hits, args.conversations, args.propagations, Path(folder)
        )
    one, two = result["one_replica"], result["two_replicas"]
    print(f"(a) distinct prompts, {args.requests} requests of 32 tokens from {args.clients} clients")
    print(f"    one replica directly        {one['requests_per_s']:6.2f} req/s {one['tokens_per_s']:8.1f} tok/s")
    print(
        f"    two replicas behind HAProxy {two['requests_per_s']:6.2f} req/s {two['tokens_per_s']:8.1f} tok/s"
        f"   ratio {result['throughput_ratio']:.2f}x"
    )
    redis, sqlite = result["exact_hit_ms"]["redis"], result["exact_hit_ms"]["sqlite"]
    print(f"(b) exact hit over HTTP, {args.hits} each, taking turns")
    print(
        f"    Redis  p50 {redis['p50']:.2f} ms  p99 {redis['p99']:.2f} ms  (target < 3 ms: "
        f"{'met' if redis['p50'] < 3 else 'NOT met'})"
    )
    print(
        f"    SQLite p50 {sqlite['p50']:.2f} ms  p99 {sqlite['p99']:.2f} ms  (Redis/SQLite "
        f"{redis['p50'] / sqlite['p50']:.2f}x)"
    )
    moved, delay = result["failover"], result["semantic_propagation"]
    print(
        f"(c) failover: turn {TURNS_BEFORE_FAILOVER + 1} on replica b, median of {moved['conversations']} conversations"
    )
    print(f"    from the shared KV tier  TTFT {moved['shared_ttft_ms']:8.1f} ms   e.g. {moved['prefix_headers'][0]}")
    print(f"    cold prefill, same prompt TTFT {moved['cold_ttft_ms']:8.1f} ms")
    print(f"    (replica a, from RAM      TTFT {moved['warm_ram_ttft_ms']:8.1f} ms: no failover)")
    print(
        f"    ratio {moved['ratio']:.2f}x (target <= 0.3x: {'met' if moved['ratio'] <= 0.3 else 'NOT met'}); "
        f"answers equal to the cold run: {moved['answers_equal']} of {moved['conversations']}"
    )
    print(f"(d) semantic entry stored through a, served through b: {delay['trials']} trials")
    print(
        f"    delay p50 {delay['p50_ms']:.0f} ms  p99 {delay['p99_ms']:.0f} ms  max "
        f"{delay['max_ms']:.0f} ms "
        f"(median {delay['median_polls']:.0f} polls; target p99 < 1 s: {'met' if delay['p99_ms'] < 1000 else 'NOT met'})"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
