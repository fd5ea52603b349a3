"""Engine speed: prefill and decode tok/s on the demo model, OpenBLAS vs MLX's reference BLAS.

    python -m evals.bench_engine [--model demo] [--lengths 500 2000] [--repeats 3]

Each BLAS runs in its own child process (LD_PRELOAD only takes effect at process start); both are
measured in the same run and printed side by side, with medians and the speed-up ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gateway.blas import env_with_openblas, openblas_library

from . import CORPUS

DECODE_TOKENS = 64


def _child(model: str, data_dir: Path, lengths: list[int], repeats: int) -> dict:
    from gateway.blas import blas_in_use
    from gateway.checkpoints import resolve_model_path
    from gateway.engine import CacheConfig, ModelRunner, PreparedPrompt, Sampling, decode_alone
    from kvcache import TenantSalt

    runner = ModelRunner(resolve_model_path(model, data_dir), CacheConfig(0, 0, 64), "bench")
    corpus = CORPUS.read_text()
    ids = runner.tokenizer.encode(corpus, add_special_tokens=False)

    def never() -> bool:
        return False

    salt = TenantSalt(b"salt")
    runner.prefill(PreparedPrompt(tuple(ids[:64]), ()), salt, 512, never)  # warm-up
    lengths_out: dict[str, dict] = {}
    results = {"blas": blas_in_use(), "lengths": lengths_out}
    for length in lengths:
        prompt = PreparedPrompt(tuple(ids[:length]), ())
        prefill_s, decode_tps = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            prefill = runner.prefill(prompt, salt, 512, never)
            prefill_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            count = sum(1 for _ in decode_alone(runner, prefill, Sampling(DECODE_TOKENS, 0.0, 1.0, None, ()), never))
            decode_tps.append(count / (time.perf_counter() - start))
        lengths_out[str(length)] = {
            "prefill_s": statistics.median(prefill_s),
            "prefill_tok_s": length / statistics.median(prefill_s),
            "decode_tok_s": statistics.median(decode_tps),
        }
    return results


def _run_child(env: dict[str, str], args: argparse.Namespace, repeats: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "evals.bench_engine",
        "--child",
        "--model",
        args.model,
        "--data-dir",
        str(args.data_dir),
        "--repeats",
        str(repeats),
        "--lengths",
        *map(str, args.lengths),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-repeats", type=int, default=1, help="the reference BLAS is ~10x slower")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.model, args.data_dir, args.lengths, args.repeats)))
        return
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    runs = {}
    with_openblas = env_with_openblas(base) if openblas_library() else None
    if with_openblas is not None:
        runs["openblas"] = _run_child(with_openblas, args, args.repeats)
    runs["reference"] = _run_child({**base, "STRATA_BLAS": "reference"}, args, args.reference_repeats)
    _print_table(runs, args)
    print(json.dumps({"model": args.model, "runs": runs}))


def _print_table(runs: dict, args: argparse.Namespace) -> None:
    print(
        f"model={args.model}  decode={DECODE_TOKENS} tokens  medians of {args.repeats} (openblas) / "
        f"{args.reference_repeats} (reference) runs"
    )
    print(f"{'prompt':>7} | {'BLAS':>9} | {'prefill s':>9} | {'prefill tok/s':>13} | {'decode tok/s':>12}")
    for length in map(str, args.lengths):
        for run in runs.values():
            row = run["lengths"][length]
            print(
                f"{length:>7} | {run['blas']:>9} | {row['prefill_s']:9.3f} | "
                f"{row['prefill_tok_s']:13.1f} | {row['decode_tok_s']:12.1f}"
            )
        if "openblas" in runs:
            fast, slow = runs["openblas"]["lengths"][length], runs["reference"]["lengths"][length]
            print(
                f"{length:>7} | {'ratio':>9} | prefill {slow['prefill_s'] / fast['prefill_s']:.1f}x faster, "
                f"decode {fast['decode_tok_s'] / slow['decode_tok_s']:.1f}x faster on OpenBLAS"
            )


if __name__ == "__main__":
    main()
