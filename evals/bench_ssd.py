"""The KV SSD tier: TTFT from SSD vs recompute vs RAM, read and spill throughput, bytes per token.

    python -m evals.bench_ssd [--model demo] [--lengths 1024 4096 8192]

Throughputs are medians of 3 reads. For each prefix length, a prompt = prefix + a 24-token follow-up
(the next turn) is timed three ways on the same model in one run: recompute (no cache), prefix in
RAM, and prefix on SSD only (a fresh engine over the files, each file dropped from the page cache
with posix_fadvise first, so reads come from the disk). Read throughput of the block files is
printed beside a plain sequential read of one file of the same size (also dropped from the page
cache): the physical limit. Then bytes per token on disk with and without 8/4-bit quantisation, and
quantisation's greedy agreement and max logit drift against full precision on the tiny and demo
models. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from gateway.checkpoints import resolve_model_path
from gateway.engine import (
    CacheConfig,
    ModelRunner,
    PrefixReport,
    PreparedPrompt,
    Sampling,
    decode_alone,
    model_fingerprint,
)
from kvcache import PrefixCache, TenantSalt
from kvcache.quant import QuantConfig
from kvcache.ssd import AdmissionPolicy, SsdConfig, SsdTier

from . import CORPUS

SALT = TenantSalt(b"bench-ssd-salt-00000000000000000")
BLOCK = 32
FOLLOW_UP = 24


def corpus_ids(runner: ModelRunner, count: int) -> list[int]:
    text = CORPUS.read_text()
    ids = runner.tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def runner_for(model_path: Path, folder: Path | None, quant: QuantConfig | None = None) -> ModelRunner:
    ssd = SsdConfig(folder, queue_blocks=100000, admission=AdmissionPolicy(min_hits=0)) if folder else None
    budget = 8 << 30 if folder is not None or quant is not None else 0
    return ModelRunner(model_path, CacheConfig(budget, 0, BLOCK, ssd, quant), model_fingerprint(model_path))


def prefix_of(runner: ModelRunner) -> PrefixCache:
    assert runner.caches.prefix is not None, "runner_for() gives every runner measured here a prefix cache"
    return runner.caches.prefix


def ssd_of(runner: ModelRunner) -> SsdTier:
    ssd = prefix_of(runner).ssd
    assert ssd is not None, "runner_for() was given a folder"
    return ssd


def ttft(runner: ModelRunner, ids: list[int]) -> tuple[float, PrefixReport]:
    start = time.perf_counter()
    prefill = runner.prefill(PreparedPrompt(tuple(ids), ()), SALT, 512, lambda: False)
    int(np.argmax(np.array(prefill.logits)))
    elapsed = time.perf_counter() - start
    runner.finish(prefill, [])
    return elapsed, prefill.prefix


def drop_from_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_mb_s(folder: Path, nbytes: int) -> float:
    path = folder / "raw-read-probe.bin"
    with open(path, "wb") as out:
        out.write(os.urandom(nbytes))
        out.flush()
        os.fsync(out.fileno())
    drop_from_page_cache([path])
    start = time.perf_counter()
    with open(path, "rb") as source:
        while source.read(1 << 20):
            pass
    elapsed = time.perf_counter() - start
    path.unlink()
    return nbytes / elapsed / 1e6


def measure_length(model_path: Path, length: int, work: Path) -> dict:
    folder = work / f"kv-{length}"
    warm = runner_for(model_path, folder)
    ids = corpus_ids(warm, length + FOLLOW_UP)
    prefix, prompt = ids[:length], ids
    recompute_s, _ = ttft(runner_for(model_path, None), prompt)
    ttft(warm, prefix + [ids[0]])  # caches the prefix's blocks in RAM
    ram_s, ram_report = ttft(warm, prompt)
    start = time.perf_counter()
    prefix_of(warm).persist()
    ssd_of(warm).drain(600)
    spill_s = time.perf_counter() - start
    files = sorted(folder.glob("*/*/*.safetensors"))
    disk_bytes = sum(f.stat().st_size for f in files)
    warm.caches.shutdown(60)
    cold = runner_for(model_path, folder)
    drop_from_page_cache(files)
    ssd_s, ssd_report = ttft(cold, prompt)
    read_mb_s = statistics.median(block_read_mb_s(cold, files, prompt) for _ in range(3))
    cold.caches.shutdown(10)
    return {
        "tokens": length,
        "recompute_s": recompute_s,
        "ram_s": ram_s,
        "ssd_s": ssd_s,
        "ram_cached": ram_report.num_cached_tokens,
        "ssd_cached": ssd_report.num_ssd_tokens,
        "spill_mb_s": disk_bytes / spill_s / 1e6,
        "read_mb_s": read_mb_s,
        "raw_read_mb_s": statistics.median(raw_read_mb_s(work, disk_bytes) for _ in range(3)),
        "disk_bytes_per_token": disk_bytes / length,
    }


def block_read_mb_s(runner: ModelRunner, files: list[Path], ids: list[int]) -> float:
    """Verified reads (open, read, parse, per-block checksum) of every block on disk: the chain of
    the prompt's full blocks (those persisted at shutdown), from the disk."""
    ssd = ssd_of(runner)
    with prefix_of(runner).open(SALT, runner.caches.model_fingerprint, ids) as session:
        chain = [h.hex() for h in session.hashes]
    chain = [h for h in chain if ssd.contains(h)]
    assert len(chain) == ssd.stats().num_blocks, "blocks on disk that the prompt's chain does not name"
    drop_from_page_cache(files)
    start = time.perf_counter()
    blocks = ssd.read_chain(chain)
    elapsed = time.perf_counter() - start
    assert chain and len(blocks) == len(chain), "a block failed verification"
    return sum(path.stat().st_size for path in files) / elapsed / 1e6


def quant_quality(model_path: Path, work: Path, length: int = 2048) -> dict:
    results = {}
    full = runner_for(model_path, None)
    ids = corpus_ids(full, length + FOLLOW_UP)
    reference = _greedy(full, ids)
    for bits in (None, 8, 4):
        quant = QuantConfig(bits, group_size=32, min_tokens=0) if bits else None
        runner = runner_for(model_path, None, quant) if bits else runner_for(model_path, work / "q-none")
        _greedy(runner, ids[:length] + [ids[0]])  # stores the prefix's blocks (quantised or not)
        logits, tokens = _greedy(runner, ids)
        folder = work / f"q-{bits}"
        persisted = runner_for(model_path, folder, quant)
        persisted.prefill(PreparedPrompt(tuple(ids[:length]), ()), SALT, 512, lambda: False)
        persisted.caches.shutdown(60)
        disk = sum(f.stat().st_size for f in folder.glob("*/*/*.safetensors"))
        results[f"{bits or 32}-bit"] = {
            "ram_bytes": prefix_of(runner).stats().num_bytes,
            "disk_bytes_per_token": disk / (length // BLOCK * BLOCK),
            "max_logit_drift": float(np.abs(logits - reference[0]).max()),
            "greedy_agreement": sum(a == b for a, b in zip(tokens, reference[1])) / len(reference[1]),
        }
    return results


def _greedy(runner: ModelRunner, ids: list[int], num_tokens: int = 32):
    prefill = runner.prefill(PreparedPrompt(tuple(ids), ()), SALT, 512, lambda: False)
    logits = np.array(prefill.logits)
    tokens = list(decode_alone(runner, prefill, Sampling(num_tokens, 0.0, 1.0, None, ()), lambda: False))
    runner.finish(prefill, tokens)
    return logits, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--work-dir", type=Path, default=None, help="on the disk to measure (default: data dir)")
    args = parser.parse_args()
    model_path = resolve_model_path(args.model, args.data_dir)
    base = args.work_dir or args.data_dir
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-ssd-", dir=base))
    try:
        rows = [measure_length(model_path, n, work) for n in args.lengths]
        quality = {
            name: quant_quality(resolve_model_path(name, args.data_dir), work / name) for name in ("tiny", "demo")
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, quality)
    print(json.dumps({"model": args.model, "rows": rows, "quantisation": quality}))


def report(rows: list[dict], quality: dict) -> None:
    print(f"TTFT of a {FOLLOW_UP}-token follow-up after the prefix, demo model, block {BLOCK}")
    print(
        f"{'prefix':>6} | {'recompute s':>11} | {'RAM s':>7} | {'SSD s':>7} | {'recompute/SSD':>13} | "
        f"{'read MB/s':>9} | {'raw MB/s':>8} | {'raw/read':>8} | {'spill MB/s':>10} | {'B/token':>7}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6} | {r['recompute_s']:11.3f} | {r['ram_s']:7.3f} | {r['ssd_s']:7.3f} | "
            f"{r['recompute_s'] / r['ssd_s']:13.1f} | {r['read_mb_s']:9.0f} | {r['raw_read_mb_s']:8.0f} | "
            f"{r['raw_read_mb_s'] / r['read_mb_s']:8.2f} | {r['spill_mb_s']:10.0f} | {r['disk_bytes_per_token']:7.0f}"
        )
    last = rows[-1]
    print(
        f"target: SSD hit of {last['tokens']} tokens >= 10x faster than recompute: "
        f"{last['recompute_s'] / last['ssd_s']:.1f}x; block reads within 2x of raw: "
        f"{last['raw_read_mb_s'] / last['read_mb_s']:.2f}x"
    )
    print("\nKV quantisation (2048-token prefix, 32 greedy tokens, vs full precision):")
    for model, results in quality.items():
        for name, q in results.items():
            print(
                f"  {model:<5} {name:>7}: RAM {q['ram_bytes'] / 1e6:7.2f} MB, disk "
                f"{q['disk_bytes_per_token']:7.0f} B/token, "
                f"max logit drift {q['max_logit_drift']:.4f}, greedy agreement {q['greedy_agreement']:.0%}"
            )


if __name__ == "__main__":
    main()
