"""Another tenant's chat latency while two 96-tool `tool_choice: required` calls run.

    python -m evals.bench_forced_tools [--model tiny] [--tools 96]

One `strata serve` process, two tenants (API keys). Tenant A sends two forced tool calls at once,
each offering `--tools` functions (an agent's tool list: ~11,000 prompt tokens each on the tiny
model) with a compiled grammar; tenant B meanwhile sends short chats (8 tokens) one after another
until both have ended. Printed: B's latency alone and while A's calls run (median, p90, max), and
A's times. Target: B's chat <= 1 s while A's calls run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from .bench_layers import start_server

KEYS = {"a": "key-a", "b": "key-b"}


def tool(index: int) -> dict:
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "count": {"type": "integer"},
            "mode": {"type": "string", "enum": ["read", "write", "list"]},
            "options": {
                "type": "object",
                "properties": {"deep": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
            },
        },
        "required": ["path", "mode"],
    }
    return {
        "type": "function",
        "function": {"name": f"tool_{index}", "description": f"Runs step {index}.", "parameters": parameters},
    }


def _chat(client: httpx.Client, text: str) -> float:
    body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    start = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS['b']}"})
    assert response.status_code == 200, response.text
    return time.perf_counter() - start


def _forced(client: httpx.Client, tools: list[dict], n: int, took: list[float]) -> None:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": f"Do step {n}."}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 200,
    }
    start = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS['a']}"})
    assert response.status_code == 200, response.text
    took.append(time.perf_counter() - start)


def run(model: str, num_tools: int) -> tuple[list[float], list[float], list[float]]:
    tools = [tool(i) for i in range(num_tools)]
    env = {"STRATA_API_KEYS": ",".join(f"{key}:tenant-{name}" for name, key in KEYS.items())}
    with tempfile.TemporaryDirectory() as folder:
        process, url = start_server(model, Path(folder), env)
        try:
            with httpx.Client(base_url=url, timeout=600, headers={"Cache-Control": "no-cache"}) as client:
                alone = [_chat(client, f"Say hello, number {n}.") for n in range(10)]
                heavy: list[float] = []
                threads = [threading.Thread(target=_forced, args=(client, tools, n, heavy)) for n in range(2)]
                for thread in threads:
                    thread.start()
                during: list[float] = []
                while any(thread.is_alive() for thread in threads):
                    during.append(_chat(client, f"Say hello again, number {len(during)}."))
                for thread in threads:
                    thread.join()
        finally:
            process.terminate()
            process.wait(30)
    return alone, during, heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tools", type=int, default=96)
    args = parser.parse_args()
    alone, during, heavy = run(args.model, args.tools)
    print("tenant B's 8-token chat (s)      | n   | median |   p90 |   max")
    for name, samples in (("alone", alone), (f"while two {args.tools}-tool calls run", during)):
        p90 = float(np.percentile(samples, 90))
        print(f"{name:32} | {len(samples):3} | {statistics.median(samples):6.2f} | {p90:5.2f} | {max(samples):5.2f}")
    print(f"tenant A's forced tool calls (s): {', '.join(f'{t:.1f}' for t in sorted(heavy))}")


if __name__ == "__main__":
    main()
