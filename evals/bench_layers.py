"""Latency of each response layer against the engine, measured side by side in one run.

    python -m evals.bench_layers [--model demo] [--requests 300]

1. An exact hit end to end over loopback HTTP (a real `strata serve` process, keep-alive client).
2. A semantic lookup (MiniLM embedding + faiss search + guards + entry read) at 1k, 10k, 100k and
   1M entries in the query's partition (bulk-loaded with MiniLM vectors of varied questions; past
   20k entries the partition's index is inverted lists, measured once its rebuild has finished).
3. The engine's TTFT for the same request over HTTP (Cache-Control: no-cache skips both layers).
Prints a table and one JSON line. Targets: exact p50 < 3 ms; semantic p50 < 20 ms at 100k; the
lookup must not grow with the entries: p50 at 100k <= 1.2x and at 1M <= 1.5x the p50 at 1k.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from semantic import Answer, MiniLMEmbedder, Scope, SemanticCache, SemanticSettings, SqliteEntries

from . import corpus_lines

QUESTION = "How do I export my project to a CSV file?"


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def start_server(
    model: str, data_dir: Path, env: dict[str, str] | None = None, log: Path | None = None, log_level: str = "warning"
) -> tuple[subprocess.Popen, str]:
    """A `strata serve` process on a free loopback port, once its warm-up has ended (/health/ready)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    output = log.open("w") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--log-level",
            log_level,
        ],
        env={**os.environ, "STRATA_MODEL_NAME": "bench", **(env or {})},
        stdout=output,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError("server did not start")


def http_layers(model: str, data_dir: Path, requests: int) -> dict:
    process, url = start_server(model, data_dir)
    body = {"model": "bench", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1, "temperature": 0}
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            engine_ttft = []
            for _ in range(5):  # max_tokens=1: the whole request is prefill + first token
                start = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"})
                engine_ttft.append((time.perf_counter() - start) * 1000)
                assert response.headers["x-cache-layer"] == "engine"
            full = []
            for _ in range(3):  # what a cache hit replaces: the whole answer
                start = time.perf_counter()
                client.post(
                    "/v1/chat/completions", json={**body, "max_tokens": 64}, headers={"Cache-Control": "no-cache"}
                )
                full.append((time.perf_counter() - start) * 1000)
            exact = []
            for _ in range(requests):
                start = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body)
                exact.append((time.perf_counter() - start) * 1000)
                assert response.headers["x-cache-layer"] == "exact", response.headers
    finally:
        process.terminate()
        process.wait(30)
    return {
        "exact_ms": {"p50": percentile(exact, 50), "p99": percentile(exact, 99), "n": len(exact)},
        "engine_ttft_ms": {"p50": percentile(engine_ttft, 50), "n": len(engine_ttft)},
        "engine_64_tokens_ms": {"p50": percentile(full, 50), "n": len(full)},
    }


def corpus_vectors(embedder: MiniLMEmbedder, size: int) -> tuple[list[str], np.ndarray]:
    """`size` varied questions: corpus sentences turned into questions, embedded by MiniLM in
    batches (the base set), then tiled with small perturbations up to `size`."""
    lines = corpus_lines()
    base = [f"What happened when {line[:120]}?" for line in lines[:2000]]
    vectors = embedder.embed(base)
    rng = np.random.default_rng(0)
    reps = -(-size // len(base))
    tiled = np.concatenate([vectors + rng.normal(0, 0.02, vectors.shape).astype(np.float32) for _ in range(reps)])[
        :size
    ]
    tiled /= np.linalg.norm(tiled, axis=1, keepdims=True)
    prompts = [base[i % len(base)] for i in range(size)]
    return prompts, tiled.astype(np.float32)


def semantic_lookups(sizes: list[int], queries: int) -> dict:
    embedder = MiniLMEmbedder()
    scope = Scope("bench-tenant", "bench-model")
    prompts, vectors = corpus_vectors(embedder, max(sizes))
    results = {}
    probe = [
        "How can I export my project as a CSV file?",
        "Why is my export to CSV failing?",
        "What happened when the war ended?",
        "How do I import a CSV file into my project?",
    ]
    for size in sizes:
        with tempfile.TemporaryDirectory() as folder:
            cache = SemanticCache(embedder, SqliteEntries(Path(folder) / "s.db"), SemanticSettings())
            cache.insert(QUESTION, Answer("Use File > Export."), scope, "ctx", time.time())
            cache.insert_many(
                prompts[: size - 1], ["answer"] * (size - 1), vectors[: size - 1], scope, "ctx", time.time()
            )
            cache.index.settle()
            samples, statuses = [], []
            for i in range(queries):
                start = time.perf_counter()
                result = cache.lookup(probe[i % len(probe)], scope, "ctx", time.time())
                samples.append((time.perf_counter() - start) * 1000)
                statuses.append(result.status)
            cache.close()
        results[size] = {
            "p50": percentile(samples, 50),
            "p99": percentile(samples, 99),
            "hits": statuses.count("hit"),
            "n": queries,
            "index": cache.index.kind(scope.partition("ctx")),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data_dir = Path(folder) / "data"
        model = args.model if Path(args.model).exists() else str(_built_model(args.model, args.data_dir))
        http = http_layers(model, data_dir, args.requests)
    semantic = semantic_lookups([1000, 10000, 100000, 1000000], args.queries)
    print(f"{'layer':<34} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{'exact hit, HTTP loopback':<34} {http['exact_ms']['p50']:8.2f} {http['exact_ms']['p99']:8.2f}")
    for size, row in semantic.items():
        print(
            f"{f'semantic lookup, {size:,} entries':<34} {row['p50']:8.2f} {row['p99']:8.2f}   "
            f"{row['hits']}/{row['n']} hits, {row['index']}"
        )
    print(f"{'engine TTFT (same request), HTTP':<34} {http['engine_ttft_ms']['p50']:8.2f}")
    print(f"{'engine 64-token answer, HTTP':<34} {http['engine_64_tokens_ms']['p50']:8.2f}")
    ttft, full = http["engine_ttft_ms"]["p50"], http["engine_64_tokens_ms"]["p50"]
    exact, sem = http["exact_ms"]["p50"], semantic[100000]["p50"]
    print(
        f"exact hit p50 {exact:.2f} ms (target < 3: {'met' if exact < 3 else 'NOT met'}); "
        f"TTFT/exact = {ttft / exact:.1f}x, answer/exact = {full / exact:.0f}x"
    )
    print(
        f"semantic p50 at 100k {sem:.2f} ms (target < 20: {'met' if sem < 20 else 'NOT met'}); "
        f"TTFT/semantic = {ttft / sem:.2f}x, answer/semantic = {full / sem:.1f}x"
    )
    base = semantic[1000]["p50"]
    for size, limit in ((100000, 1.2), (1000000, 1.5)):
        ratio = semantic[size]["p50"] / base
        print(
            f"semantic p50 at {size:,} / at 1,000: {ratio:.2f}x (target <= {limit}x: "
            f"{'met' if ratio <= limit else 'NOT met'})"
        )
    print(json.dumps({"model": args.model, "http": http, "semantic": semantic}))


def _built_model(name: str, data_dir: Path) -> Path:
    from gateway.checkpoints import resolve_model_path

    return resolve_model_path(name, data_dir)


if __name__ == "__main__":
    main()
