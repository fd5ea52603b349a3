"""What observability costs a request: exact-hit latency with metrics and JSON request logs on vs off.

    python -m evals.bench_observability [--model demo] [--requests 1000]

Three real `strata serve` processes on loopback, side by side in one run: `on` with /metrics
accounting (STRATA_METRICS=1) and one JSON log line per request (STRATA_LOG_FORMAT=json, written to
a file); `off` with both off and the default text logs (uvicorn's own access line per request);
`quiet` with both off and no access line at all (log level warning). Each stores the same answer
once, then the exact hits go round the three (so drift of the machine hits all alike). While they
run, a scraper reads /metrics once a second from `on`, as Prometheus would. Prints p50/p90/p99 per
server, the p50 differences and ratios, and one JSON line. Target: on costs < 5% of the p50, or
< 0.2 ms, against `off` and against `quiet`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from .bench_layers import start_server

QUESTION = "How do I export my project to a CSV file?"


def scrape_now_and_then(url: str, stop: threading.Event) -> int:
    scrapes = 0
    with httpx.Client(timeout=10) as client:
        while not stop.wait(1.0):
            assert client.get(url + "/metrics").status_code == 200
            scrapes += 1
    return scrapes


def measure(model: str, requests: int, folder: Path) -> dict:
    setups = {
        "on": ({"STRATA_METRICS": "1", "STRATA_LOG_FORMAT": "json"}, "info"),
        "off": ({"STRATA_METRICS": "0", "STRATA_LOG_FORMAT": "text"}, "info"),
        "quiet": ({"STRATA_METRICS": "0", "STRATA_LOG_FORMAT": "text"}, "warning"),
    }
    servers = {
        name: start_server(model, folder / name, env, folder / f"{name}.log", level)
        for name, (env, level) in setups.items()
    }
    body = {"model": "bench", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0}
    times: dict[str, list[float]] = {name: [] for name in servers}
    stop = threading.Event()
    scraper = threading.Thread(target=scrape_now_and_then, args=(servers["on"][1], stop), daemon=True)
    try:
        clients = {name: httpx.Client(base_url=url, timeout=60) for name, (_, url) in servers.items()}
        for client in clients.values():  # store the answer, then warm the connection and the path
            for _ in range(20):
                client.post("/v1/chat/completions", json=body)
        scraper.start()
        for _ in range(requests):
            for name, client in clients.items():
                start = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body)
                times[name].append((time.perf_counter() - start) * 1000)
                assert response.headers["x-cache-layer"] == "exact", response.headers
        stop.set()
        scraper.join(timeout=5)
        log_lines = sum(
            1 for line in (folder / "on.log").read_text().splitlines() if '"logger": "strata.access"' in line
        )
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
    return {name: {q: float(np.percentile(samples, q)) for q in (50, 90, 99)} for name, samples in times.items()} | {
        "requests": requests,
        "access_log_lines": log_lines,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.bench_observability")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="strata-bench-obs-") as folder:
        result = measure(args.model, args.requests, Path(folder))
    print(f"exact hits over loopback HTTP, {args.requests} each, taking turns")
    print(f"{'':<44} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for name, label in (
        ("on", "on: metrics + JSON request logs"),
        ("off", "off: default text logs (uvicorn access)"),
        ("quiet", "quiet: no metrics, no access log"),
    ):
        print(f"{label:<44} {result[name][50]:8.3f} {result[name][90]:8.3f} {result[name][99]:8.3f}")
    for base in ("off", "quiet"):
        delta, ratio = result["on"][50] - result[base][50], result["on"][50] / result[base][50]
        result[f"p50_delta_ms_vs_{base}"], result[f"p50_ratio_vs_{base}"] = delta, ratio
        met = ratio < 1.05 or delta < 0.2
        print(
            f"p50 on - {base}: {delta:+.3f} ms, ratio {ratio:.3f} (target < 5% or < 0.2 ms: "
            f"{'met' if met else 'NOT met'})"
        )
    print(f"{result['access_log_lines']} JSON access lines written by `on`")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
