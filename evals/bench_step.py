"""One engine step, separate calls against one mixed call, and how far a step is from its floor.

    python -m evals.bench_step [--model demo] [--rows 16] [--chunks 64 128 256 512] [--repeats 7]

On the demo model, in one process (the server's BLAS: run under the Makefile's OpenBLAS preload):
- a decode step of `--rows` sequences alone, and each prompt chunk length alone;
- the same decode rows and chunk in one packed call (gateway/engine/mixed.py), and two admissions'
  chunks of half the length each with the decode rows (batched admissions);
- the floor of each: the time to stream the model's weights once at this machine's measured memory
  bandwidth, plus the step's matmul FLOPs at its measured GFLOP/s;
- a decode step of one row and of `--rows` rows at contexts of 40, 200 and 800 tokens (what the
  rows' KV reads add to the weights' pass);
- a decode step of `--rows` rows at 200 and 800 tokens of context with the rows' attention through
  the C kernel (gateway/engine/decode_attention.c) and through numpy's batched products, alternated,
  on the library's batched cache (a model whose rows keep their KV in segments takes neither:
  evals.bench_rows);
- attention on the engine's thread alone and split across the cores (gateway/engine/threads.py),
  alternated: a decode step of `--rows` rows at 800 and 2,000 tokens of context, a 2,000-token prefill;
- a prompt's prefill of 256, 512 and 2,000 tokens with the chunks' causal softmax through numpy
  and through C (decode_attention.c's causal_softmax), alternated;
- a lone row's decode step at 2,000 and 8,000 tokens of context, its attention through MLX's kernel
  and through the C kernel, alternated;
- where a decode step's time goes at 200 tokens of context: the step against its matrix products
  alone (every linear layer and the output head at the step's row count, in one graph) and its floor;
  the rest is attention, activations, norms, rope and synchronisation;
- the rows' greedy draws from one step's logits: each row's sampler in turn, and one argmax over
  them all (what the worker does for rows that draw greedily with nothing to adjust);
- decode steps of 1-4 rows with their matrix products through OpenBLAS's sgemm and through sgemv
  (the one-row products library, gateway/engine/vector_products.c), alternated.
Medians of --repeats; ratios are measured side by side. It runs as the server does: on OpenBLAS
after the one-row products library (it starts itself again so where it was started otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from gateway.blas import core_in_use
from gateway.checkpoints import resolve_model_path
from gateway.engine import (
    CacheConfig,
    DecodeBatch,
    Draw,
    ModelRunner,
    PreparedPrompt,
    Sampler,
    Sampling,
    draw_all,
    use_decode_kernel,
    use_lone_row_kernel,
    use_split_rows,
    use_vector_products,
    vector_products_loaded,
)
from kvcache import TenantSalt

from . import CORPUS, as_the_server_runs

SALT = TenantSalt(b"bench-step")
FEW_ROWS = (1, 2, 3, 4)  # the rows the one-row products library sends to sgemv


def _median_ms(run, make_parts, repeats: int) -> float:
    """Median of `run(parts)` over fresh parts each time (building them is not timed)."""
    times = []
    for _ in range(repeats):
        parts = make_parts()
        start = time.perf_counter()
        run(parts)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def memory_bandwidth_gb_s() -> float:
    """Read bandwidth: the sum of a 512 MB array (one pass over memory) by one thread per core, as
    OpenBLAS streams a step's weights, best of five. (One thread read 9.8 GB/s where two read 19.3 on
    a 2-core Xeon: a floor from one thread's let a lone decode row's step come in under it.)"""
    data = np.ones(64 << 20, dtype=np.float64)
    slices = np.array_split(data, os.cpu_count() or 1)
    with ThreadPoolExecutor(len(slices)) as pool:  # numpy's sum lets go of the GIL
        best = min(_timed(lambda: list(pool.map(np.sum, slices))) for _ in range(5))
    return data.nbytes / best / 1e9


def matmul_gflop_s() -> float:
    """MLX float32 matmul at a prefill's shape (512 tokens x 512 x 1536), best of five."""
    a, b = mx.random.normal((512, 512)), mx.random.normal((512, 1536))
    mx.eval(a, b)
    best = min(_timed(lambda: mx.eval(a @ b)) for _ in range(5))
    return 2 * 512 * 512 * 1536 / best / 1e9


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class Setup:
    """The demo model, a batch of decoding rows, and prompts to chunk."""

    def __init__(self, runner: ModelRunner, num_rows: int):
        self.runner = runner
        ids = runner.tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
        self.ids = ids
        self.batch = DecodeBatch(runner)
        for row in range(num_rows):
            start = 300 * row
            prefill = runner.prefill(PreparedPrompt(tuple(ids[start : start + 200]), ()), SALT, 512, lambda: False)
            self.batch.join(prefill)
        flat = cast(list[tuple[str, object]], tree_flatten(runner.lm.parameters()))
        weights = {name: array for name, array in flat if isinstance(array, mx.array)}
        self.weight_bytes = sum(array.nbytes for array in weights.values())
        self.num_params = sum(array.size for array in weights.values())
        # the token embedding is a lookup, not a matmul (a tied output head is counted once, as the lookup)
        self.embed_params = sum(array.size for name, array in weights.items() if name.endswith("embed_tokens.weight"))
        linears = [(name, module) for name, module in runner.lm.named_modules() if isinstance(module, nn.Linear)]
        self.product_weights = [module.weight for _, module in linears]
        self.tied_head_params = 0
        if not any(name.endswith("lm_head") for name, _ in linears):  # tied: the embedding is the output head
            self.product_weights += [array for name, array in weights.items() if name.endswith("embed_tokens.weight")]
            self.tied_head_params = self.embed_params

    def decode_part(self):
        return self.batch.part([[11] for _ in self.batch.rows])

    def chunk_part(self, length: int, offset: int = 0):
        prompt = PreparedPrompt(tuple(self.ids[offset : offset + length]), ())
        admission = self.runner.open_prefill(prompt, SALT)
        return admission, self.runner.chunk_part(admission, admission.first, length)

    def run(self, parts) -> None:
        """One call, then the KV it appended trimmed away, so every repeat sees the same state."""
        mx.eval(self.runner.run_step(parts))  # a decode-only call's logits stay lazy until evaluated
        if any(part.cache is self.batch.cache for part in parts):
            self.batch.trim([1] * len(self.batch.rows))


def measure(setup: Setup, chunks: list[int], repeats: int, floor: dict) -> list[dict]:
    decode_ms = _median_ms(setup.run, lambda: [setup.decode_part()], repeats)
    return [_one_length(setup, length, repeats, decode_ms, floor) for length in chunks]


def _one_length(setup: Setup, length: int, repeats: int, decode_ms: float, floor: dict) -> dict:
    half = length // 2
    chunk_ms = _median_ms(setup.run, lambda: [setup.chunk_part(length)[1]], repeats)
    mixed_ms = _median_ms(setup.run, lambda: [setup.decode_part(), setup.chunk_part(length)[1]], repeats)
    two_ms = _median_ms(
        setup.run, lambda: [setup.decode_part(), setup.chunk_part(half)[1], setup.chunk_part(half, 5000)[1]], repeats
    )
    tokens = len(setup.batch.rows) + length
    flops = 2 * (setup.num_params - setup.embed_params) * tokens
    floor_ms = (setup.weight_bytes / floor["bandwidth_gb_s"] / 1e9 + flops / floor["gflop_s"] / 1e9) * 1000
    return {
        "chunk_tokens": length,
        "decode_alone_ms": decode_ms,
        "chunk_alone_ms": chunk_ms,
        "separate_ms": decode_ms + chunk_ms,
        "mixed_ms": mixed_ms,
        "mixed_two_admissions_ms": two_ms,
        "floor_ms": floor_ms,
    }


def decode_by_context(runner: ModelRunner, ids: list[int], num_rows: int, repeats: int) -> dict[str, float]:
    """A decode step's median ms for one row and for num_rows rows, at each context length."""
    times = {}
    for context in (40, 200, 800):
        for rows in (1, num_rows):
            batch = _decode_batch(runner, ids, rows, context)

            def step(parts, batch=batch, rows=rows):
                mx.eval(runner.run_step(parts))
                batch.trim([1] * rows)

            times[f"{rows}x{context}"] = _median_ms(step, lambda b=batch, r=rows: [b.part([[11]] * r)], repeats)
    return times


def attention_paths_ms(runner: ModelRunner, ids: list[int], num_rows: int, repeats: int) -> dict[str, float]:
    """A decode step's median ms with the rows' attention through numpy and through the C kernel, on
    the library's batched cache (the path of models whose rows do not keep their KV in segments:
    evals.bench_rows compares the two)."""
    batches = {context: (num_rows, context) for context in (200, 800)}
    segments, runner.rows_kv = runner.rows_kv, False
    try:
        return _batch_paths_ms(runner, ids, batches, use_decode_kernel, ("numpy", "kernel"), repeats)
    finally:
        runner.rows_kv = segments


def split_paths_ms(runner: ModelRunner, ids: list[int], num_rows: int, repeats: int) -> dict[str, float]:
    """Attention on the engine's thread alone and split across the cores, alternated: a decode step
    of num_rows rows at 800 and 2,000 tokens of context, and a 2,000-token prompt's prefill."""
    names = ("one thread", "split")
    batches = {context: (num_rows, context) for context in SPLIT_CONTEXTS}
    times = _batch_paths_ms(runner, ids, batches, use_split_rows, names, repeats)
    prompt = PreparedPrompt(tuple(ids[:SPLIT_PROMPT_TOKENS]), ())

    def prefill(_parts) -> None:
        runner.prefill(prompt, SALT, 512, lambda: False)

    prefills = _alternated_ms(use_split_rows, names, prefill, list, max(1, repeats // 3))
    return times | {f"{path}xprefill": ms for path, ms in prefills.items()}


def lone_row_paths_ms(runner: ModelRunner, ids: list[int], repeats: int) -> dict[str, float]:
    """A lone row's decode step at long contexts, its attention through MLX's kernel and through the
    C kernel (its KV heads split across the cores), alternated."""
    batches = {context: (1, context) for context in LONE_CONTEXTS}
    return _batch_paths_ms(runner, ids, batches, use_lone_row_kernel, ("MLX", "C kernel"), repeats)


def prefill_softmax_paths_ms(runner: ModelRunner, ids: list[int], repeats: int) -> dict[str, float]:
    """A prompt's prefill (chunks of 512 tokens) with the chunks' causal softmax through numpy and
    through C (decode_attention.c's causal_softmax), alternated: prompts of PREFILL_LENGTHS tokens."""
    times: dict[str, float] = {}
    for length in PREFILL_LENGTHS:
        prompt = PreparedPrompt(tuple(ids[:length]), ())

        def prefill(_parts, prompt=prompt) -> None:
            runner.prefill(prompt, SALT, 512, lambda: False)

        paths = _alternated_ms(use_decode_kernel, ("numpy", "C"), prefill, list, max(1, repeats // 2))
        times |= {f"{path}x{length}": ms for path, ms in paths.items()}
    return times


PREFILL_LENGTHS = (256, 512, 2000)
LONE_CONTEXTS = (2000, 8000)
SPLIT_CONTEXTS = (800, 2000)
SPLIT_PROMPT_TOKENS = 2000


def few_rows_paths_ms(runner: ModelRunner, ids: list[int], repeats: int) -> dict[str, float]:
    """Decode steps of 1-4 rows at 200 tokens of context, their products through sgemm and through sgemv."""
    batches = {rows: (rows, 200) for rows in FEW_ROWS}
    return _batch_paths_ms(runner, ids, batches, use_vector_products, ("sgemm", "sgemv"), repeats)


def _batch_paths_ms(
    runner: ModelRunner, ids: list[int], batches: dict, switch, names: tuple[str, str], repeats: int
) -> dict[str, float]:
    """For each labelled (rows, context) decode batch, its step with `switch` off and on
    (_alternated_ms), keyed by path name + "x" + label."""
    times: dict[str, float] = {}
    for label, (rows, context) in batches.items():
        batch = _decode_batch(runner, ids, rows, context)

        def step(parts, batch=batch, rows=rows) -> None:
            mx.eval(runner.run_step(parts))
            batch.trim([1] * rows)

        paths = _alternated_ms(switch, names, step, lambda b=batch, r=rows: [b.part([[11]] * r)], repeats)
        times |= {f"{path}x{label}": ms for path, ms in paths.items()}
    return times


def _decode_batch(runner: ModelRunner, ids: list[int], rows: int, context: int) -> DecodeBatch:
    batch = DecodeBatch(runner)
    for row in range(rows):
        prompt = PreparedPrompt(tuple(ids[300 * row : 300 * row + context]), ())
        batch.join(runner.prefill(prompt, SALT, 512, lambda: False))
    return batch


def _alternated_ms(switch, names: tuple[str, str], run, make_parts, repeats: int) -> dict[str, float]:
    """`run` with `switch` off (names[0]) and on (names[1]), three alternations of each (_median_ms);
    the median of each path's medians. The switch is left on."""
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(3):
        for name in names:
            switch(name == names[1])
            rounds[name].append(_median_ms(run, make_parts, repeats))
    switch(True)
    return {name: statistics.median(values) for name, values in rounds.items()}


def products_alone_ms(setup: Setup, rows: int, repeats: int) -> float:
    """A decode step's matrix products alone for `rows` rows, in one graph: each linear layer and the
    output head against a (rows, inputs) operand."""
    operands = {weight.shape[1]: mx.random.normal((rows, weight.shape[1])) for weight in setup.product_weights}
    mx.eval(list(operands.values()))

    def products(_parts) -> None:
        mx.eval([operands[weight.shape[1]] @ weight.T for weight in setup.product_weights])

    return _median_ms(products, list, repeats)


def decode_floor_ms(setup: Setup, rows: int, floor: dict) -> float:
    """The weights streamed once, plus every row's products (its output head included) at the
    measured GFLOP/s."""
    flops = 2 * (setup.num_params - setup.embed_params + setup.tied_head_params) * rows
    return (setup.weight_bytes / floor["bandwidth_gb_s"] / 1e9 + flops / floor["gflop_s"] / 1e9) * 1000


def draw_ms(setup: Setup, repeats: int) -> tuple[float, float]:
    """One step's greedy draws for the batch's rows: each row's sampler (draw_all: one evaluation for
    all), and one argmax over the step's logits."""
    logits = setup.runner.run_step([setup.decode_part()])[0]
    mx.eval(logits)
    setup.batch.trim([1] * len(setup.batch.rows))
    samplers = [Sampler(Sampling(48, 0.0, 1.0, None, ())) for _ in setup.batch.rows]

    def one_by_one(_parts) -> None:
        draw_all([Draw(sampler, logits[row], ()) for row, sampler in enumerate(samplers)])

    together = _median_ms(lambda _parts: mx.argmax(logits, axis=-1).tolist(), list, repeats * 5)
    return _median_ms(one_by_one, list, repeats * 5), together


def print_paths(heading: str, columns: dict[str, str], times: dict[str, float], names: tuple[str, str]) -> None:
    """Two paths' times (keyed name + column key) as a table, one column per heading, and their ratio."""
    print(f"\n| {heading} | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{times[name + key]:.1f} ms" for key in columns.values()) + " |")
    ratios = (times[names[0] + key] / times[names[1] + key] for key in columns.values())
    print(f"| {names[0]} / {names[1]} | " + " | ".join(f"{ratio:.2f}x" for ratio in ratios) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    as_the_server_runs("evals.bench_step")
    runner = ModelRunner(resolve_model_path(args.model, args.data_dir), CacheConfig(0, 0, 16), "bench")
    runner.warm_up()
    setup = Setup(runner, args.rows)
    floor = {"bandwidth_gb_s": memory_bandwidth_gb_s(), "gflop_s": matmul_gflop_s()}
    print(
        f"demo model: {setup.weight_bytes / 1e6:.1f} MB of weights; this machine reads {floor['bandwidth_gb_s']:.1f} GB/s "
        f"and multiplies at {floor['gflop_s']:.0f} GFLOP/s (float32, OpenBLAS kernels: {core_in_use()})"
    )
    results = measure(setup, args.chunks, args.repeats, floor)
    print(f"\n{args.rows} decode rows + one prompt chunk, medians of {args.repeats}:")
    print(
        "| chunk | decode alone | chunk alone | separate (sum) | mixed, one call | mixed / separate | "
        "two admissions of half, mixed | floor | mixed / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['chunk_tokens']} | {row['decode_alone_ms']:.1f} ms | {row['chunk_alone_ms']:.1f} ms | "
            f"{row['separate_ms']:.1f} ms | {row['mixed_ms']:.1f} ms | {row['mixed_ms'] / row['separate_ms']:.2f}x | "
            f"{row['mixed_two_admissions_ms']:.1f} ms | {row['floor_ms']:.1f} ms | {row['mixed_ms'] / row['floor_ms']:.1f}x |"
        )
    contexts = decode_by_context(runner, setup.ids, args.rows, args.repeats)
    print("\n| decode step | context 40 | context 200 | context 800 |\n|---|---|---|---|")
    for rows in (1, args.rows):
        print(f"| {rows} row(s) | " + " | ".join(f"{contexts[f'{rows}x{c}']:.1f} ms" for c in (40, 200, 800)) + " |")
    paths = attention_paths_ms(runner, setup.ids, args.rows, args.repeats)
    print_paths(
        f"{args.rows}-row decode step, the rows' attention through",
        {f"context {c}": f"x{c}" for c in (200, 800)},
        paths,
        ("numpy", "kernel"),
    )
    split = split_paths_ms(runner, setup.ids, args.rows, args.repeats)
    columns = {f"{args.rows}-row decode step, context {c}": f"x{c}" for c in SPLIT_CONTEXTS}
    columns[f"{SPLIT_PROMPT_TOKENS}-token prefill"] = "xprefill"
    print_paths("attention", columns, split, ("one thread", "split"))
    softmax = prefill_softmax_paths_ms(runner, setup.ids, args.repeats)
    print_paths(
        "prefill, the chunks' causal softmax through",
        {f"{n}-token prompt": f"x{n}" for n in PREFILL_LENGTHS},
        softmax,
        ("numpy", "C"),
    )
    lone = lone_row_paths_ms(runner, setup.ids, args.repeats)
    print_paths(
        "1-row decode step, attention through",
        {f"context {c}": f"x{c}" for c in LONE_CONTEXTS},
        lone,
        ("MLX", "C kernel"),
    )
    print("\n| decode step, context 200 | step | matrix products alone | the rest | floor | step / floor |")
    print("|---|---|---|---|---|---|")
    breakdown = {}
    for rows in (1, args.rows):
        products, floor_ms = products_alone_ms(setup, rows, args.repeats), decode_floor_ms(setup, rows, floor)
        step = contexts[f"{rows}x200"]
        breakdown[rows] = {"step_ms": step, "products_ms": products, "floor_ms": floor_ms}
        print(
            f"| {rows} row(s) | {step:.1f} ms | {products:.1f} ms | {step - products:.1f} ms | {floor_ms:.1f} ms | "
            f"{step / floor_ms:.1f}x |"
        )
    few: dict[str, float] = {}
    if vector_products_loaded():
        few = few_rows_paths_ms(runner, setup.ids, args.repeats)
        print_paths(
            "decode step, context 200, products through",
            {f"{r} row(s)": f"x{r}" for r in FEW_ROWS},
            few,
            ("sgemm", "sgemv"),
        )
    else:
        print("\n(the one-row products library is not preloaded here: its comparison is left out)")
    one_by_one, together = draw_ms(setup, args.repeats)
    print(
        f"\ngreedy draws of {args.rows} rows: one by one {one_by_one:.2f} ms, one argmax {together:.2f} ms "
        f"({one_by_one / together:.1f}x)"
    )
    print(
        json.dumps(
            {
                "floor": floor,
                "rows": args.rows,
                "results": results,
                "decode_by_context_ms": contexts,
                "decode_breakdown": breakdown,
                "attention_paths_ms": paths,
                "split_paths_ms": split,
                "prefill_softmax_paths_ms": softmax,
                "lone_row_paths_ms": lone,
                "few_rows_paths_ms": few,
                "draws_ms": {"one_by_one": one_by_one, "one_argmax": together},
            }
        )
    )


if __name__ == "__main__":
    main()
