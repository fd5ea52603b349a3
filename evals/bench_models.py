"""Several models in one server, measured from outside: one `strata serve` with three demo models of
three families under a memory limit that holds two of them (the first, pinned, and one other).

    python -m evals.bench_models [--models qwen2_5_vl-demo gemma3-demo llama-demo] [--runs 7]

- TTFT of the loaded model while another loads: streamed requests to the first model, one after
  another, while nothing else runs (idle) and while a request for an unloaded model loads it; median
  of each and their ratio.
- Load time from disk: the first request to an unloaded model (load, warm-up, answer) against the
  same request once it is loaded.
- Turn after reload: a conversation on the third model (a ~1,500-token prompt), then the second model
  takes the room (the third is unloaded, its blocks written to SSD), then the third is loaded again
  and the conversation goes on: its TTFT against the same turn prefilled cold.
- Memory: a switching workload (24 requests over the three models, seeded); after each, what the
  loaded models hold by the server's booking and the process's resident memory, against the limit.
Response layers off (engine caches on), greedy, max_tokens 8. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from evals.bench_agent import words
from evals.bench_layers import start_server
from gateway.checkpoints import resolve_model_path
from gateway.engine import weights_bytes

ADMIN = {"Authorization": "Bearer bench-admin"}
KV_BYTES = 256 << 20
VISION_BYTES = 64 << 20


def ttft(client: httpx.Client, url: str, model: str, text: str) -> float:
    """Seconds from sending to the first streamed text."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():  # read to the end: the next request must find the engine idle
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{model}: no text streamed")
    return first


def states(client: httpx.Client, url: str) -> dict[str, str]:
    data = client.get(url + "/v1/models").json()["data"]
    return {m["id"]: m["state"] for m in data}


def held(client: httpx.Client, url: str) -> int:
    return sum(m["nbytes"] for m in client.get(url + "/admin/stats", headers=ADMIN).json()["models"])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def loaded_pace(client: httpx.Client, url: str, first: str, others: list[str], runs: int) -> dict:
    """The first model's TTFT idle, then while the others (unloaded in turn) load, `runs` loads."""
    idle = [ttft(client, url, first, f"Idle question {i}: " + words(i, 40)) for i in range(runs)]
    during: list[float] = []
    for load in range(runs):
        other = others[load % len(others)]
        assert states(client, url)[other] == "unloaded", states(client, url)
        loading = threading.Thread(target=lambda other=other: ttft(httpx.Client(), url, other, "Load this model."))
        loading.start()
        while loading.is_alive():
            during.append(
                ttft(client, url, first, f"Question during a load {len(during)}: " + words(100 + len(during), 40))
            )
        loading.join()
    return {
        "idle_ttft_ms": statistics.median(idle) * 1000,
        "during_load_ttft_ms": statistics.median(during) * 1000,
        "ratio": statistics.median(during) / statistics.median(idle),
        "samples_during_load": len(during),
        "loads": runs,
    }


def load_time(client: httpx.Client, url: str, model: str) -> dict:
    assert states(client, url)[model] == "unloaded", states(client, url)
    cold = ttft(client, url, model, "The first question to this model.")
    warm = ttft(client, url, model, "The second question to this model.")
    return {"first_request_s": cold, "loaded_request_s": warm, "load_s": cold - warm}


def reload_turn(client: httpx.Client, url: str, third: str, second: str) -> dict:
    """TTFT of a conversation's next turn on a model loaded again (from SSD) vs the same turn cold."""
    history = words(7, 1100)  # ~1,500 tokens on the demo tokenizers
    ttft(client, url, third, "Load me first.")  # loading is not what is measured here
    cold_first = ttft(client, url, third, history)
    ttft(client, url, second, "Take the room.")  # the third model is unloaded: its blocks go to SSD
    assert states(client, url)[third] == "unloaded", states(client, url)
    ttft(client, url, third, "Load me again.")
    follow_up = history + " And what came after that?"
    from_ssd = ttft(client, url, third, follow_up)
    cold = ttft(client, url, third, words(8, 1100) + " And what came after that?")  # same length, nothing cached
    return {
        "first_turn_cold_ms": cold_first * 1000,
        "turn_after_reload_ms": from_ssd * 1000,
        "same_turn_cold_ms": cold * 1000,
        "ratio": from_ssd / cold,
    }


def switching(client: httpx.Client, url: str, models: list[str], pid: int, limit: int) -> dict:
    rng = random.Random(5)
    booked, resident = [], []
    for i in range(24):
        ttft(client, url, rng.choice(models), f"Switching request {i}: " + words(200 + i, 30))
        booked.append(held(client, url))
        resident.append(rss_bytes(pid))
    return {
        "limit_bytes": limit,
        "max_booked_bytes": max(booked),
        "max_booked_over_limit": max(booked) / limit,
        "max_rss_bytes": max(resident),
        "median_rss_bytes": statistics.median(resident),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs=3, default=["qwen2_5_vl-demo", "gemma3-demo", "llama-demo"])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "data"
        paths = [resolve_model_path(model, data) for model in args.models]  # built once, before timing
        names = [path.name for path in paths]  # a built-in model's folder carries its name
        sizes = [weights_bytes(path) + KV_BYTES + VISION_BYTES for path in paths]
        limit = sizes[0] + max(sizes[1:]) + min(sizes[1:]) // 2  # the first and one other fit, never all three
        models_file = Path(folder) / "models.json"
        models_file.write_text(
            json.dumps({"models": [{"name": n, "path": str(p)} for n, p in zip(names[1:], paths[1:])]})
        )
        env = {
            "STRATA_MODEL_NAME": names[0],
            "STRATA_MODELS_FILE": str(models_file),
            "STRATA_MODEL_MEMORY_BYTES": str(limit),
            "STRATA_KV_BUDGET_BYTES": str(KV_BYTES),
            "STRATA_VISION_BUDGET_BYTES": str(VISION_BYTES),
            "STRATA_SSD_MIN_HITS": "0",
            "STRATA_EXACT_STORE": "off",
            "STRATA_SEMANTIC": "0",
            "STRATA_ADMIN_KEY": "bench-admin",
        }
        process, url = start_server(str(paths[0]), data, env)
        try:
            client = httpx.Client()
            first, second, third = names
            results = {"models": names, "limit_bytes": limit}
            start_rss = rss_bytes(process.pid)  # the first model loaded, nothing else
            results["load"] = load_time(client, url, second)
            ttft(client, url, third, "Make room.")  # the second is unloaded again, the third loaded
            ttft(client, url, second, "Make room.")  # and the other way round: the third is unloaded
            results["loaded_model_while_another_loads"] = loaded_pace(client, url, first, [third, second], args.runs)
            results["turn_after_reload"] = reload_turn(client, url, third, second)
            results["memory"] = switching(client, url, names, process.pid, limit) | {"start_rss_bytes": start_rss}
        finally:
            process.terminate()
            process.wait(60)
    report(results)


def report(results: dict) -> None:
    pace, load, turn, memory = (
        results["loaded_model_while_another_loads"],
        results["load"],
        results["turn_after_reload"],
        results["memory"],
    )
    print(
        f"models {', '.join(results['models'])}; limit {results['limit_bytes'] / 2**20:.0f} MiB (the first + one other)"
    )
    print(
        f"TTFT of the loaded model: idle {pace['idle_ttft_ms']:.0f} ms, while another loads "
        f"{pace['during_load_ttft_ms']:.0f} ms (median of {pace['samples_during_load']})   ratio {pace['ratio']:.2f}x"
    )
    print(
        f"load from disk: first request {load['first_request_s']:.2f} s, once loaded {load['loaded_request_s']:.2f} s"
        f"   load {load['load_s']:.2f} s"
    )
    print(
        f"turn after reload: {turn['turn_after_reload_ms']:.0f} ms from SSD vs {turn['same_turn_cold_ms']:.0f} ms cold"
        f"   ratio {turn['ratio']:.2f}x"
    )
    print(
        f"switching workload: booked at most {memory['max_booked_bytes'] / 2**20:.0f} MiB "
        f"({memory['max_booked_over_limit']:.2f} of the limit); process RSS at most {memory['max_rss_bytes'] / 2**20:.0f} MiB,"
        f" {(memory['max_rss_bytes'] - memory['start_rss_bytes']) / 2**20:.0f} MiB above its start with the first model"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
