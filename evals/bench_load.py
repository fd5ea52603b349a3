"""Load: Strata and mlx-vlm's own server on the same model, driven over HTTP in one run.

    python -m evals.bench_load [--model demo] [--clients 1 4 16 64] [--workloads distinct mix]
    python -m evals.bench_load --fairness

Closed-loop streaming clients (each sends its next request when the last one ended), at each client
count: output tok/s (completion tokens over the level's wall time), TTFT p50/p99, inter-token
latency p50/p99 (gaps between content chunks), errors. Two workloads:
- distinct: every request a new ~250-token prompt (no cache can help), max_tokens 48;
- mix: sessions of 3 turns sharing one ~1,000-token system prompt; each turn adds ~100 new tokens
  and sends back the server's own reply; every 4th session shows an image in its first turn.
Both servers start fresh for each workload, each with its own default batch cap unless
--max-num-seqs sets both: Strata with an empty data dir, its engine caches on and its response
layers (exact, semantic) off, so the engines are compared; mlx-vlm on OpenBLAS too and, for the
mix, once with its prefix cache (APC) on and an empty disk tier (`APC_DISK_PATH`: it would otherwise
answer from an earlier run's disk) and once with it off. "strata seqs=1" is Strata
decoding one sequence at a time: the single-stream speed batching must not tax.

Then (or alone, with --fairness) Strata with two tenants: tenant B's TTFT (one client, 2 x
--requests sequential requests) alone, then while tenant A keeps 32 streams open. Ends with one JSON
line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from gateway.blas import env_with_openblas
from gateway.checkpoints import resolve_model_path
from gateway.engine import family_of

from . import corpus_lines
from .bench_ttft import without_mtp

SENTENCES = corpus_lines()
MAX_TOKENS = 48
ADMIN_KEY = "bench-admin"  # the Strata servers' admin key: /healthz and /admin/stats for the reports


# -- servers -------------------------------------------------------------------------------------


class Server:
    """A server process on a free loopback port, ready once GET /v1/models answers."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path, api_key: str | None = None):
        self.name = name
        self.api_key = api_key
        self.admin_key = env.get("STRATA_ADMIN_KEY")  # Strata's: /healthz then shows the engine's state
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (log_dir / f"{name.replace(' ', '_').replace('=', '')}-{self.port}.log").open("w")
        self.process = subprocess.Popen(
            [part.replace("{port}", str(self.port)) for part in command],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            self.model = self._wait_ready()
        except BaseException:  # a server that never got ready must not outlive the run
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                answer = httpx.get(self.url + "/v1/models", headers=headers, timeout=2)
                if answer.status_code == 200:
                    return answer.json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not start")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_strata(
    name: str,
    model_dir: Path,
    work: Path,
    max_num_seqs: int | None,
    extra_env: dict | None = None,
    api_key: str | None = None,
) -> Server:
    """max_num_seqs None: Strata's default. The queue is deep enough for 64 closed-loop clients."""
    data_dir = Path(tempfile.mkdtemp(dir=work))
    env = (
        {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "STRATA_MAX_NUM_SEQS")}
        | {
            "STRATA_MAX_QUEUE": "256",
            "STRATA_SEMANTIC": "0",
            "STRATA_EXACT_STORE": "off",
            "STRATA_MODEL_NAME": str(model_dir),
            "STRATA_ADMIN_KEY": ADMIN_KEY,
            # one load generator stands for many clients: its connections are not one client's
            "STRATA_MAX_CONNECTIONS_PER_CLIENT": "0",
        }
        | (extra_env or {})
    )  # (the CLI finds OpenBLAS itself)
    if max_num_seqs is not None:
        env["STRATA_MAX_NUM_SEQS"] = str(max_num_seqs)
    command = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "{port}",
        "--data-dir",
        str(data_dir),
        "--log-level",
        "warning",
    ]
    return Server(name, command, env, work, api_key)


def start_mlx_vlm(model_dir: Path, work: Path, max_num_seqs: int | None, prefix_cache: bool) -> Server:
    """max_num_seqs None: mlx-vlm's default (no --max-num-seqs cap: its batch generator's own limits)."""
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    # OpenBLAS alone, as mlx-vlm runs on Linux (the one-row products library is Strata's own), on the
    # same OpenBLAS kernels as Strata's: the engines are compared, not the BLAS kernels they get
    env = (env_with_openblas(base, one_row_products=False) or base) | {
        "APC_DISK_PATH": tempfile.mkdtemp(dir=work),
        "APC_ENABLED": "1" if prefix_cache else "0",
    }
    command = [
        sys.executable,
        "-m",
        "mlx_vlm.server",
        "--model",
        str(without_mtp(model_dir)),  # mlx-vlm's loader refuses Strata's MTP layers
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--log-level",
        "WARNING",
    ]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    return Server("mlx-vlm", command, env, work)


# -- clients -------------------------------------------------------------------------------------


@dataclass
class Sample:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    error: str = ""


async def stream(
    client: httpx.AsyncClient,
    server: Server,
    messages: list,
    api_key: str | None = None,
    max_tokens: int = MAX_TOKENS,
) -> Sample:
    """One streaming chat completion; TTFT is the first content chunk's arrival."""
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sample, start, last = Sample(), time.perf_counter(), None
    chunks = 0
    try:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                sample.error = f"{response.status_code}"
                await response.aread()
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    sample.completion_tokens = chunk["usage"].get("completion_tokens", 0)
                    sample.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                for choice in chunk.get("choices", []):
                    if content := (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            sample.ttft_s = now - start
                        else:
                            sample.gaps_s.append(now - last)
                        last, chunks = now, chunks + 1
                        sample.text += content
    except httpx.HTTPError as exc:
        sample.error = type(exc).__name__
    sample.completion_tokens = sample.completion_tokens or chunks
    return sample


def distinct_conversations(tag: str, client: int):
    """Each request a new prompt: a unique opening line and ~250 tokens of corpus text."""
    index = 0
    while True:
        start = _seed(tag, client, index) % (len(SENTENCES) - 20)
        yield [
            {"role": "user", "content": f"Request {tag}-{client}-{index}. " + " ".join(SENTENCES[start : start + 10])}
        ]
        index += 1


def mix_conversations(tag: str, client: int, system_prompt: str, images: bool = True):
    """Sessions of three turns under the shared system prompt; every 4th session opens with an image
    (`images`: the model takes them). Each turn yields the session's history list itself: the caller
    appends the reply to it."""
    session = 0
    while True:
        history: list[dict] = [{"role": "system", "content": system_prompt}]
        with_image = images and (client + session) % 4 == 0
        for turn in range(3):
            start = _seed(tag, client, session, turn) % (len(SENTENCES) - 6)
            text = f"Session {tag}-{client}-{session}, turn {turn}: " + " ".join(SENTENCES[start : start + 4])
            content: str | list[dict] = text
            if with_image and turn == 0:
                content = [
                    {"type": "image_url", "image_url": {"url": _image_url(_seed(tag, client, session))}},
                    {"type": "text", "text": text},
                ]
            history.append({"role": "user", "content": content})
            yield history
        session += 1


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _image_url(seed: int) -> str:
    pixels = (np.random.default_rng(seed).random((224, 224, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def system_prompt_text(num_words: int = 700) -> str:
    """About 1,000 tokens of the demo tokenizer: the corpus's opening lines as house rules."""
    words = " ".join(SENTENCES[:80]).split()[:num_words]
    return "You are the harbour archive's assistant. Background notes: " + " ".join(words)


async def closed_loop(server: Server, num_clients: int, requests_per_client: int, conversations) -> dict:
    """num_clients clients, each sending requests_per_client requests back to back."""
    samples: list[Sample] = []

    async def one_client(client_index: int, client: httpx.AsyncClient):
        turns = conversations(client_index)
        for _ in range(requests_per_client):
            messages = next(turns)
            sample = await stream(client, server, list(messages))
            samples.append(sample)
            if not sample.error:  # a session's next turn sends the reply back
                messages.append({"role": "assistant", "content": sample.text})

    limits = httpx.Limits(max_connections=num_clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client, watching(server) as seen:
        start = time.perf_counter()
        await asyncio.gather(*(one_client(i, client) for i in range(num_clients)))
        wall = time.perf_counter() - start
    return summarise(samples, wall) | seen


@contextlib.asynccontextmanager
async def watching(server: Server):
    """Within the block, watch_running() keeps the server's peak number of decoding sequences in
    the dict it yields."""
    seen = {"peak_running": -1}
    watch = asyncio.ensure_future(watch_running(server, seen))
    try:
        yield seen
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def watch_running(server: Server, seen: dict) -> None:
    """seen["peak_running"]: the most sequences the server decoded at once, from its /healthz every
    100 ms, until cancelled (stays -1 for a server without one: mlx-vlm)."""
    if server.admin_key is None:
        return
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            try:
                running = (await client.get(server.url + "/healthz", headers=headers)).json()["engine_running"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return
            seen["peak_running"] = max(seen["peak_running"], int(running))
            await asyncio.sleep(0.1)


def summarise(samples: list[Sample], wall_s: float) -> dict:
    good = [s for s in samples if not s.error and s.ttft_s is not None]
    ttfts = sorted(s.ttft_s for s in good if s.ttft_s is not None)
    gaps = sorted(g for s in good for g in s.gaps_s)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(good),
        "wall_s": wall_s,
        "tok_s": sum(s.completion_tokens for s in good) / wall_s,
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p99": _pct(ttfts, 99),
        "itl_p50": _pct(gaps, 50),
        "itl_p99": _pct(gaps, 99),
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(values, q))


# -- runs ----------------------------------------------------------------------------------------


def requests_per_client(workload: str, num_clients: int, minimum_total: int) -> int:
    """At least minimum_total requests over all clients, at least two per client; whole sessions
    (three turns) in the mix."""
    per_client = max(2, -(-minimum_total // num_clients))
    return -(-per_client // 3) * 3 if workload == "mix" else per_client


def run_workload(
    workload: str, servers: list[tuple[str, Callable[[], Server]]], client_counts: list[int], args
) -> dict:
    """Each server in turn, started fresh, through every client count; a row per (server, count)."""
    system = system_prompt_text()
    images = family_of(args.model_dir).image_placeholder is not None  # text models get text sessions
    results = {}
    for name, start in servers:
        counts = [1] if name == "strata seqs=1" else client_counts
        server = start()
        try:
            asyncio.run(closed_loop(server, 1, 1, lambda c: distinct_conversations("warm", c)))  # kernels built
            for count in counts:
                tag = f"{workload}{count}"
                make = (
                    (lambda c, tag=tag: distinct_conversations(tag, c))
                    if workload == "distinct"
                    else (lambda c, tag=tag: mix_conversations(tag, c, system, images))
                )
                row = asyncio.run(closed_loop(server, count, requests_per_client(workload, count, args.requests), make))
                results[f"{name}@{count}"] = row
                print(f"  {workload:>8} {name:>14} {count:>3} clients: {_row(row)}", flush=True)
        finally:
            server.stop()
    return results


def _row(row: dict) -> str:
    return (
        f"{row['tok_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50']:6.2f} s p99 {row['ttft_p99']:6.2f} s  "
        f"ITL p50 {row['itl_p50'] * 1000:6.1f} ms p99 {row['itl_p99'] * 1000:7.1f} ms  "
        f"peak running {row.get('peak_running', -1):3d}  errors {row['errors']}/{row['requests']}"
    )


def print_table(workload: str, results: dict, client_counts: list[int]) -> None:
    print(f"\n{workload}: closed-loop streaming clients, max_tokens {MAX_TOKENS}")
    print(
        "| clients | server | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ITL p99/p50 | peak running | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    names = list(dict.fromkeys(key.rsplit("@", 1)[0] for key in results))
    for count in client_counts:
        for name in names:
            row = results.get(f"{name}@{count}")
            if row:
                print(
                    f"| {count} | {name} | {row['tok_s']:.1f} | {row['ttft_p50']:.2f} s | {row['ttft_p99']:.2f} s | "
                    f"{row['itl_p50'] * 1000:.0f} ms | {row['itl_p99'] * 1000:.0f} ms | "
                    f"{row['itl_p99'] / row['itl_p50']:.1f}x | {_peak(row)} | {row['errors']}/{row['requests']} |"
                )
        ours = results.get(f"strata@{count}")
        for name in (n for n in names if n.startswith("mlx-vlm")):
            theirs = results.get(f"{name}@{count}")
            if ours and theirs:
                print(
                    f"| {count} | **strata / {name}** | **{ours['tok_s'] / theirs['tok_s']:.2f}x** | "
                    ""
                    f"**{ours['ttft_p50'] / theirs['ttft_p50']:.2f}x** | {ours['ttft_p99'] / theirs['ttft_p99']:.2f}x | "
                    f"{ours['itl_p50'] / theirs['itl_p50']:.2f}x | {ours['itl_p99'] / theirs['itl_p99']:.2f}x | | | |"
                )
    lone, batched = results.get("strata seqs=1@1"), results.get("strata@1")
    if lone and batched:
        print(f"1 client: batching engine / one-at-a-time engine = {batched['tok_s'] / lone['tok_s']:.3f} (tok/s)")


def kv_budget(
    model_dir: Path, work: Path, num_clients: int, budget_bytes: int, max_tokens: int, preamble: str = ""
) -> dict:
    """num_clients requests at once, each with max_tokens, under a KV budget of budget_bytes: how
    many decode at once, how many a worst-case reservation ((prompt + max_tokens) x KV bytes per
    token each, as before the scheduler held only what sequences use) would have let in, how many
    whole prompts the budget holds (each row its own copy of its prompt, as before rows read their
    cached blocks in place), and the preemptions it took. Distinct prompts, or with `preamble` each
    one opening with that system prompt."""
    server = start_strata("strata kv budget", model_dir, work, None, {"STRATA_KV_BUDGET_BYTES": str(budget_bytes)})

    def opening(client: int):
        if not preamble:
            return distinct_conversations("budget", client)
        return mix_conversations("budget", client, preamble, images=False)

    async def run() -> tuple[list[Sample], float, int]:
        async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=num_clients + 4)) as client:
            conversations = [opening(i) for i in range(num_clients)]
            async with watching(server) as seen:
                start = time.perf_counter()
                samples = await asyncio.gather(
                    *(stream(client, server, next(c), max_tokens=max_tokens) for c in conversations)
                )
                wall = time.perf_counter() - start
            return list(samples), wall, seen["peak_running"]

    try:
        asyncio.run(closed_loop(server, 1, 1, lambda c: distinct_conversations("warm", c)))
        samples, wall, peak = asyncio.run(run())
        stats = httpx.get(server.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()[
            "engine"
        ]
    finally:
        server.stop()
    prompt_tokens = statistics.median(s.prompt_tokens for s in samples if not s.error)
    worst_case = budget_bytes // int((prompt_tokens + max_tokens) * stats["kv_bytes_per_token"])
    whole_prompts = budget_bytes // int(prompt_tokens * stats["kv_bytes_per_token"])
    out = summarise(samples, wall) | {
        "peak_running": peak,
        "engine_peak_running": stats["peak_running"],
        "worst_case_running": worst_case,
        "whole_prompts_fit": whole_prompts,
        "preemptions": stats["num_preemptions"],
        "resumed_tokens": stats["num_resumed_tokens"],
        "completion_tokens": sum(s.completion_tokens for s in samples),
    }
    print(
        f"\nkv budget {budget_bytes >> 20} MiB, {num_clients} clients with max_tokens {max_tokens} "
        f"(~{prompt_tokens:.0f}-token prompts{', one shared system prompt' if preamble else ''}, "
        f"{stats['kv_bytes_per_token']} B of KV per token):"
    )
    print(
        f"  decoding at once: {peak} (engine's own count {stats['peak_running']}); a worst-case reservation "
        f"would let {worst_case} run, the budget holds {whole_prompts} whole prompts; "
        f"{stats['num_preemptions']} preemptions, {stats['num_resumed_tokens']} "
        f"tokens resumed from cached blocks; {out['completion_tokens']} tokens in {wall:.1f} s, "
        f"errors {out['errors']}/{out['requests']}"
    )
    return out


def _peak(row: dict) -> str:
    return str(row["peak_running"]) if row.get("peak_running", -1) >= 0 else "n/a"


def fairness(model_dir: Path, work: Path, max_num_seqs: int | None, requests: int) -> dict:
    """Tenant B's TTFT alone, then with tenant A holding 32 streams open (Strata only)."""
    keys = "key-a:tenant-a,key-b:tenant-b"
    server = start_strata("strata", model_dir, work, max_num_seqs, {"STRATA_API_KEYS": keys}, "key-b")

    async def tenant_b(tag: str) -> list[Sample]:
        samples = []
        async with httpx.AsyncClient(timeout=600) as client:
            turns = distinct_conversations(tag, 0)
            for _ in range(requests):
                samples.append(await stream(client, server, next(turns), "key-b"))
        return samples

    flood_samples: list[Sample] = []

    async def under_load() -> list[Sample]:
        stop = asyncio.Event()

        async def tenant_a(index: int, client: httpx.AsyncClient):
            turns = distinct_conversations("flood", index)
            while not stop.is_set():
                flood_samples.append(await stream(client, server, next(turns), "key-a"))

        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=40)) as client:
            flood = [asyncio.ensure_future(tenant_a(i, client)) for i in range(32)]
            await asyncio.sleep(5)  # the batch is full and A's queue is deep
            samples = await tenant_b("loaded")
            stop.set()
            await asyncio.gather(*flood)
        return samples

    try:
        asyncio.run(tenant_b("warm"))
        idle = asyncio.run(tenant_b("idle"))
        loaded = asyncio.run(under_load())
    finally:
        server.stop()
    out: dict[str, dict] = {}
    for name, samples in (("idle", idle), ("with A at 32 streams", loaded)):
        ttfts = sorted(s.ttft_s for s in samples if s.ttft_s is not None)
        out[name] = {
            "ttft_p50": _pct(ttfts, 50),
            "ttft_p99": _pct(ttfts, 99),
            "errors": sum(1 for s in samples if s.error),
        }
    out["tenant A"] = {
        "requests": len(flood_samples),
        "errors": sum(1 for s in flood_samples if s.error),
        "ttft_p50": _pct(sorted(s.ttft_s for s in flood_samples if s.ttft_s is not None), 50),
    }
    ratio = out["with A at 32 streams"]["ttft_p99"] / out["idle"]["ttft_p99"]
    print(
        f"\nfairness (Strata, max_num_seqs {max_num_seqs or 'default'}): tenant B's TTFT over {requests} "
        "sequential requests"
    )
    for name in ("idle", "with A at 32 streams"):
        row = out[name]
        print(f"  B {name:>22}: TTFT p50 {row['ttft_p50']:.2f} s  p99 {row['ttft_p99']:.2f} s  errors {row['errors']}")
    flood = out["tenant A"]
    print(f"  A meanwhile: {flood['requests']} requests, TTFT p50 {flood['ttft_p50']:.2f} s, errors {flood['errors']}")
    print(f"  p99 ratio (loaded / idle): {ratio:.2f}x  (target <= 2x)")
    return {**out, "p99_ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--workloads", nargs="+", default=["distinct", "mix"], choices=["distinct", "mix"])
    parser.add_argument("--requests", type=int, default=16, help="at least this many requests per client count")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="both servers' batch cap (default: each server's own: Strata 16, mlx-vlm none)",
    )
    parser.add_argument("--fairness", action="store_true")
    parser.add_argument(
        "--kv-budget-mib",
        type=int,
        default=16,
        help="the KV-budget runs' budget (0: skip them); 16 clients, max_tokens 1,024: distinct prompts, "
        "then twice the budget for prompts that open with one ~1,000-token system prompt",
    )
    parser.add_argument("--only-kv-budget", action="store_true")
    args = parser.parse_args()
    model_dir = args.model_dir = resolve_model_path(args.model, args.data_dir)
    work = Path(tempfile.mkdtemp(prefix="strata-bench-load-"))
    print(f"model {model_dir}  max_num_seqs {args.max_num_seqs or 'each server default'}  logs in {work}", flush=True)
    if args.fairness:
        print(json.dumps({"fairness": fairness(model_dir, work, args.max_num_seqs, 2 * args.requests)}))
        return
    summary = {}
    if args.kv_budget_mib:
        summary["kv_budget"] = kv_budget(model_dir, work, 16, args.kv_budget_mib << 20, 1024)
        summary["kv_budget_shared"] = kv_budget(
            model_dir, work, 16, 2 * args.kv_budget_mib << 20, 1024, system_prompt_text()
        )
    if args.only_kv_budget:
        print(json.dumps({"model": args.model, "results": summary}))
        return
    for workload in args.workloads:
        servers: list[tuple[str, Callable[[], Server]]] = [
            ("strata", lambda: start_strata("strata", model_dir, work, args.max_num_seqs)),
            ("mlx-vlm", partial(start_mlx_vlm, model_dir, work, args.max_num_seqs, workload == "mix")),
        ]
        if workload == "distinct" and 1 in args.clients:
            servers.append(("strata seqs=1", lambda: start_strata("strata seqs=1", model_dir, work, 1)))
        if workload == "mix":  # its prefix cache off as well: APC's own costs show apart from batching's
            servers.append(("mlx-vlm apc=off", lambda: start_mlx_vlm(model_dir, work, args.max_num_seqs, False)))
        summary[workload] = run_workload(workload, servers, args.clients, args)
        print_table(workload, summary[workload], args.clients)
    summary["fairness"] = fairness(model_dir, work, args.max_num_seqs, 2 * args.requests)
    print(json.dumps({"model": args.model, "max_num_seqs": args.max_num_seqs, "results": summary}))


if __name__ == "__main__":
    main()
