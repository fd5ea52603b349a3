"""One decode step's sampled draws: Strata's numpy draw against the same filters in MLX ops.

    python -m evals.bench_sampling [--rows 16] [--vocab 8192 151936] [--repeats 5]

Each setting draws every row's next token from the same logits: in MLX ops, and through Strata's
draw_all with the rows on one thread and split across the cores; alternated, medians and ratios. The MLX side is how Strata drew before (and what a draw written with
the library's own ops does): temperature, then top-k and the nucleus by sorting the vocabulary,
min-p against the largest logit, and `mx.random.categorical` with the row's key. Vocabularies: the
demo model's 8,192 and Qwen's 151,936 (Gemma's is 262,144).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import mlx.core as mx

from gateway.engine import Draw, Sampler, Sampling, draw_all, use_split_rows

SETTINGS = {
    "temperature 1": Sampling(64, 1.0, 1.0, 7, ()),
    "temperature 0.7, top_p 0.95": Sampling(64, 0.7, 0.95, 7, ()),
    "temperature 1, top_k 40": Sampling(64, 1.0, 1.0, 7, (), top_k=40),
    "temperature 1, min_p 0.05": Sampling(64, 1.0, 1.0, 7, (), min_p=0.05),
}


def mlx_filtered(logits: mx.array, sampling: Sampling) -> mx.array:
    """The logits scaled by the temperature, with the filters' dropped tokens at -inf, in MLX ops."""
    scaled = logits.astype(mx.float32) / sampling.temperature
    if sampling.top_k:
        kth = mx.sort(scaled)[-sampling.top_k]
        scaled = mx.where(scaled >= kth, scaled, -mx.inf)
    if sampling.min_p:
        scaled = mx.where(scaled >= mx.max(scaled) + math.log(sampling.min_p), scaled, -mx.inf)
    if sampling.top_p < 1.0:
        descending = -mx.sort(-scaled)
        probs = mx.softmax(descending)
        num_keep = mx.sum((mx.cumsum(probs) - probs) < sampling.top_p)
        scaled = mx.where(scaled >= descending[num_keep - 1], scaled, -mx.inf)
    return scaled


def mlx_draw(logits: mx.array, sampling: Sampling, key: int) -> mx.array:
    """The draw in MLX ops, lazy (a step evaluates its rows' draws together)."""
    return mx.random.categorical(mlx_filtered(logits, sampling), key=mx.random.key(key))


def _median_ms(step, repeats: int) -> float:
    times = []
    for index in range(repeats):
        start = time.perf_counter()
        step(index)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def run(rows: int, vocab: int, repeats: int) -> None:
    # Logits shaped like a trained model's: a few likely tokens over a long tail.
    logits = mx.random.normal((rows, vocab), key=mx.random.key(0)) * 3.0
    mx.eval(logits)
    print(f"\n{rows} rows, vocabulary {vocab:,}: one step's draws, median of {repeats} (ms)")
    print("| setting | MLX ops | Strata, one thread | Strata, split | MLX / Strata split | one thread / split |")
    print("|---|---|---|---|---|---|")
    for name, sampling in SETTINGS.items():
        samplers = [Sampler(sampling) for _ in range(rows)]

        def theirs(index: int, sampling=sampling) -> None:
            mx.eval(*[mlx_draw(logits[row], sampling, index * rows + row) for row in range(rows)])

        def ours(index: int, samplers=samplers) -> None:
            draw_all([Draw(sampler, logits[row], (index,)) for row, sampler in enumerate(samplers)])

        times: dict[str, list[float]] = {"mlx": [], "whole": [], "split": []}
        for _ in range(3):  # alternated, a third of the repeats at a time
            times["mlx"].append(_median_ms(theirs, repeats))
            use_split_rows(False)
            times["whole"].append(_median_ms(ours, repeats))
            use_split_rows(True)
            times["split"].append(_median_ms(ours, repeats))
        mlx_ms, whole_ms, split_ms = (statistics.median(times[key]) for key in ("mlx", "whole", "split"))
        print(
            f"| {name} | {mlx_ms:.2f} | {whole_ms:.2f} | {split_ms:.2f} | {mlx_ms / split_ms:.1f}x | {whole_ms / split_ms:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 151936])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for vocab in args.vocab:
        run(args.rows, vocab, args.repeats)


if __name__ == "__main__":
    main()
