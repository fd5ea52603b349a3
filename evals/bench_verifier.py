"""What the verifier costs a candidate, against one MiniLM query embedding, side by side in one run.

    python -m evals.bench_verifier [--rounds 3]

Over the pairs of the dev set and the PAWS sample (short questions and long Wikipedia sentences),
one CPU thread (torch's, as the gateway runs MiniLM): per pair, the query's embedding and the
verifier's probability, each timed alone and interleaved. Prints medians and the ratio; target:
verifier <= 0.25x an embedding, per candidate (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from semantic import MiniLMEmbedder
from semantic.verifier import Verifier

from .false_hits import load_pairs

DATA = Path(__file__).resolve().parent / "data"
TARGET_RATIO = 0.25


def measure(embedder: MiniLMEmbedder, verifier: Verifier, pairs, rounds: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"embed": [], "verify": []}
    for _ in range(rounds):
        for pair in pairs:
            started = time.perf_counter()
            embedder.embed([pair.query_prompt])
            timings["embed"].append(time.perf_counter() - started)
            started = time.perf_counter()
            verifier.probability(pair.query_prompt, pair.cached_prompt, 0.9)
            timings["verify"].append(time.perf_counter() - started)
    return timings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.bench_verifier")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    embedder = MiniLMEmbedder()  # sets torch to one thread
    verifier = Verifier.load(embedder)
    results = {}
    for name in ("dev", "paws_sample"):
        pairs = load_pairs([DATA / f"{name}.jsonl"])
        measure(embedder, verifier, pairs[:20], 1)  # warm both
        timings = measure(embedder, verifier, pairs, args.rounds)
        embed_ms, verify_ms = (statistics.median(timings[k]) * 1000 for k in ("embed", "verify"))
        results[name] = {
            "pairs": len(pairs),
            "embed_ms": round(embed_ms, 3),
            "verify_ms": round(verify_ms, 3),
            "ratio": round(verify_ms / embed_ms, 3),
        }
    print(f"{'pairs':<12} {'n':>5} {'embed p50 ms':>13} {'verifier p50 ms':>16} {'ratio':>7}")
    for name, row in results.items():
        print(f"{name:<12} {row['pairs']:>5} {row['embed_ms']:>13.2f} {row['verify_ms']:>16.2f} {row['ratio']:>6.2f}x")
    worst = max(row["ratio"] for row in results.values())
    print(
        f"verifier per candidate / one query embedding: {worst:.2f}x at most "
        f"(target <= {TARGET_RATIO}x: {'met' if worst <= TARGET_RATIO else 'NOT met'})"
    )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
