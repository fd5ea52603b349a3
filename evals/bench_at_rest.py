"""Data at rest: what encryption costs, what crypto-shredding saves, what public prefixes share.

    python -m evals.bench_at_rest [--model demo] [--prefix-tokens 8192] [--purge-mib 64 256 1024]
                                  [--tenants 100] [--public-tokens 6000] [--json FILE]

1. Cost of encryption, on vs off in one run, alternating:
   - an SSD hit of an --prefix-tokens prefix on --model: the prefix's blocks persisted, a fresh
     runner over the files (each dropped from the page cache), TTFT of prefix + a 24-token follow-up;
     and the verified block reads alone (read, checksum, and with encryption, AES-256-GCM open);
   - exact-hit latency over HTTP: two `strata serve` processes (tiny model), one sealing and one not,
     the same stored answer asked for again and again.
   Target: on <= 10% slower than off.
2. Purge time vs SSD bytes: a tenant holding half of every segment (the other tenant the rest), purged
   today's way (its blocks cut out of every file, which the worker thread waited for) vs shredded (its
   key deleted: everything unreadable at once; the same rewriting then runs off the worker thread).
3. Bytes held by --tenants tenants that each send one --public-tokens public system prompt (plus a
   question of their own), tiny model: each tenant's own copy vs the declared public prefix shared.
Medians throughout; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from gateway.checkpoints import resolve_model_path
from gateway.engine import CacheConfig, ModelRunner, PreparedPrompt, model_fingerprint
from kvcache import tenant_salt
from kvcache.sealing import FileKeys, Keyring
from kvcache.ssd import AdmissionPolicy, SpillRequest, SsdConfig, SsdTier

from .bench_layers import start_server
from .bench_ssd import BLOCK, FOLLOW_UP, block_read_mb_s, corpus_ids, drop_from_page_cache, prefix_of, ssd_of, ttft

TRIALS = 3
EXACT_HITS = 200


def _runner(model_path: Path, folder: Path, keyring: Keyring | None, budget: int = 8 << 30) -> ModelRunner:
    ssd = SsdConfig(folder, queue_blocks=100000, admission=AdmissionPolicy(min_hits=0), sealer=keyring)
    return ModelRunner(model_path, CacheConfig(budget, 0, BLOCK, ssd), model_fingerprint(model_path))


def ssd_hit(model_path: Path, length: int, work: Path) -> dict:
    """TTFT of an SSD hit and the block reads alone, sealed vs plain, TRIALS each, alternating."""
    keyring = Keyring(FileKeys(work / "keys.json"), bytes(32))
    folders = {"on": work / "kv-on", "off": work / "kv-off"}
    ids: list[int] = []
    for mode, folder in folders.items():
        warm = _runner(model_path, folder, keyring if mode == "on" else None)
        ids = corpus_ids(warm, length + FOLLOW_UP)
        ttft(warm, ids[:length] + [ids[0]])
        prefix_of(warm).persist()
        ssd_of(warm).drain(600)
        warm.caches.shutdown(60)
    times: dict[str, dict[str, list[float]]] = {mode: {"ttft": [], "read": []} for mode in folders}
    for _ in range(TRIALS):
        for mode, folder in folders.items():
            files = sorted(folder.glob("*/*/*.safetensors"))
            cold = _runner(model_path, folder, keyring if mode == "on" else None)
            drop_from_page_cache(files)
            elapsed, report = ttft(cold, ids)
            assert report.num_ssd_tokens >= length - BLOCK, f"{mode}: only {report.num_ssd_tokens} tokens from SSD"
            times[mode]["ttft"].append(elapsed)
            disk_bytes = sum(path.stat().st_size for path in files)  # the verified reads of them all, timed:
            times[mode]["read"].append(disk_bytes / (block_read_mb_s(cold, files, ids) * 1e6))
            cold.caches.shutdown(10)
    return {mode: {k: statistics.median(v) for k, v in kinds.items()} for mode, kinds in times.items()}


def exact_hits(data_dir: Path) -> dict:
    """Median exact-hit latency (ms) of a sealing and a plain server, asked in turns."""
    servers = {
        mode: start_server("tiny", data_dir / f"exact-{mode}", {"STRATA_ENCRYPT_AT_REST": flag})
        for mode, flag in (("on", "1"), ("off", "0"))
    }
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": "Which ferry leaves first?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    latencies: dict[str, list[float]] = {mode: [] for mode in servers}
    try:
        with httpx.Client(timeout=60) as client:
            for _, url in servers.values():
                client.post(url + "/v1/chat/completions", json=body).raise_for_status()
            for _ in range(EXACT_HITS):
                for mode, (_, url) in servers.items():
                    start = time.perf_counter()
                    reply = client.post(url + "/v1/chat/completions", json=body)
                    latencies[mode].append((time.perf_counter() - start) * 1000)
                    assert reply.headers["x-cache-layer"] == "exact", reply.headers
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
    return {mode: statistics.median(values) for mode, values in latencies.items()}


def purge_times(mib: int, work: Path) -> dict:
    """One tenant's purge from a tier of `mib` MiB where it holds half of every segment."""
    result: dict[str, float] = {"mib": mib}
    for how in ("today", "shredded"):
        folder = work / f"purge-{mib}-{how}"
        keyring = Keyring(FileKeys(folder / "keys.json"), bytes(32))
        tier = SsdTier(
            SsdConfig(folder, queue_blocks=100000, admission=AdmissionPolicy(min_hits=0), sealer=keyring), "n"
        )
        _fill(tier, mib)
        start = time.perf_counter()
        if how == "today":
            purged = tier.purge_owned(lambda owner: owner == "acme")
            result["today_s"] = time.perf_counter() - start
        else:
            keyring.shred("acme")
            result["shred_ms"] = (time.perf_counter() - start) * 1000
            start = time.perf_counter()
            purged = tier.purge_owned(lambda owner: owner == "acme")  # the reclaim, off the worker thread
            result["reclaim_s"] = time.perf_counter() - start
        result["blocks"] = purged.num_entries
        tier.close()
        shutil.rmtree(folder)
    return result


def _fill(tier: SsdTier, mib: int) -> None:
    rng = np.random.default_rng(mib)
    block = rng.standard_normal((1, 4, 32, 128), dtype=np.float32)  # 64 KiB
    for i in range(mib * 16):
        tenant = "acme" if i % 2 else "globex"
        tensors = {"0.keys": block + i}
        request = SpillRequest(i.to_bytes(32, "big"), b"", BLOCK, "s", tensors, (tenant,), tenant)
        while not tier.offer(request):
            tier.drain(1)
    assert tier.drain(600)


def public_bytes(tenants: int, public_tokens: int, data_dir: Path) -> dict:
    """RAM the prefix cache holds after every tenant sent the public prompt and a question."""
    model_path = resolve_model_path("tiny", data_dir)
    result = {}
    for mode in ("own copies", "public shared"):
        runner = ModelRunner(model_path, CacheConfig(8 << 30, 0, BLOCK), model_fingerprint(model_path))
        ids = corpus_ids(runner, public_tokens + 64)
        for tenant in range(tenants):
            question = [ids[public_tokens + (tenant % 32)]] * 40  # 40 tokens of its own
            prompt = PreparedPrompt(
                tuple(ids[:public_tokens] + question), (), public_tokens=public_tokens if mode == "public shared" else 0
            )
            prefill = runner.prefill(prompt, tenant_salt(b"s" * 32, f"tenant-{tenant}"), 2048, lambda: False)
            runner.finish(prefill, [])
        stats = prefix_of(runner).stats()
        result[mode] = {"bytes": stats.num_bytes, "blocks": stats.num_blocks}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--purge-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--public-tokens", type=int, default=6000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-at-rest-", dir=args.data_dir))
    try:
        ssd = ssd_hit(resolve_model_path(args.model, args.data_dir), args.prefix_tokens, work)
        exact = exact_hits(work)
        purges = [purge_times(mib, work) for mib in args.purge_mib]
        public = public_bytes(args.tenants, args.public_tokens, args.data_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {"model": args.model, "ssd_hit": ssd, "exact_hit_ms": exact, "purges": purges, "public": public}
    report(results, args)
    line = json.dumps(results)
    if args.json:
        args.json.write_text(line)
    print(line)


def report(results: dict, args: argparse.Namespace) -> None:
    ssd, exact = results["ssd_hit"], results["exact_hit_ms"]
    print(f"1. encryption at rest, on vs off (medians of {TRIALS}; exact hits: of {EXACT_HITS})")
    print(f"{'':<34} | {'on':>9} | {'off':>9} | {'on/off':>6}")
    for label, on, off in (
        (f"SSD hit TTFT, {args.prefix_tokens} tokens, {args.model} (s)", ssd["on"]["ttft"], ssd["off"]["ttft"]),
        ("  of which the block reads (s)", ssd["on"]["read"], ssd["off"]["read"]),
        ("exact hit over HTTP, tiny (ms)", exact["on"], exact["off"]),
    ):
        print(f"{label:<34} | {on:9.3f} | {off:9.3f} | {on / off:6.2f}")
    print("\n2. a tenant's purge vs SSD bytes (it holds half of every segment)")
    print(f"{'SSD MiB':>7} | {'blocks':>6} | {'today: rewrite s':>16} | {'shred ms':>8} | {'then reclaim s':>14}")
    for row in results["purges"]:
        print(
            f"{row['mib']:>7} | {row['blocks']:>6} | {row['today_s']:16.2f} | {row['shred_ms']:8.2f} | "
            f"{row['reclaim_s']:14.2f}"
        )
    public = results["public"]
    own, shared = public["own copies"]["bytes"], public["public shared"]["bytes"]
    print(
        f"\n3. {args.tenants} tenants, one {args.public_tokens}-token public prompt each (tiny model): "
        f"own copies {own / 1e6:.1f} MB, shared {shared / 1e6:.1f} MB ({own / shared:.1f}x less)"
    )


if __name__ == "__main__":
    main()
