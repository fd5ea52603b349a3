"""Decode rows in segments against the library's batched cache: a row joining, a row leaving, a step.

    python -m evals.bench_rows [--model demo] [--rows 16] [--repeats 9]

A batch of `--rows` rows with prompts of 300-450 tokens (the load benchmark's size) on the demo model,
its KV held either in segments (gateway/engine/rows_kv.py: each row's prefill buffers and blocks of
its own, read through pointer tables) or in the library's left-padded BatchKVCache. For each, alternated
three times: one more row joining (its prefill not timed; the batch's arrays evaluated, since MLX
copies lazily), a row leaving (its KV handed back as plain caches, evaluated), and a decode step.
Medians of --repeats; ratios side by side. Run under the server's BLAS (`make` preloads OpenBLAS).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from gateway.checkpoints import resolve_model_path
from gateway.engine import CacheConfig, DecodeBatch, ModelRunner, PreparedPrompt
from kvcache import TenantSalt

from . import CORPUS, as_the_server_runs

SALT = TenantSalt(b"bench-rows")
PATHS = {"library": False, "segments": True}


class Rows:
    """A batch of rows on one path and the prompts it takes rows from."""

    def __init__(self, runner: ModelRunner, ids: list[int], num_rows: int):
        self.runner, self.ids, self.next = runner, ids, 0
        self.batch = DecodeBatch(runner)
        for _ in range(num_rows):
            self.batch.join(self.prefill())
        _settle(self.batch)

    def prefill(self):
        start, length = 450 * self.next % (len(self.ids) - 450), 300 + 37 * self.next % 150
        self.next += 1
        return self.runner.prefill(
            PreparedPrompt(tuple(self.ids[start : start + length]), ()), SALT, 512, lambda: False
        )

    def join_ms(self) -> float:
        prefill = self.prefill()

        def join() -> None:
            self.batch.join(prefill)
            _settle(self.batch)

        return _timed(join)

    def leave_ms(self) -> float:
        def leave() -> None:
            row = self.batch.leave(0)
            mx.eval([array for layer in row.cache for array in (layer.keys, layer.values)])
            _settle(self.batch)

        return _timed(leave)

    def step_ms(self) -> float:
        rows = len(self.batch)
        elapsed = _timed(lambda: mx.eval(self.batch.step([11] * rows)))
        self.batch.trim([1] * rows)
        return elapsed


def _settle(batch: DecodeBatch) -> None:
    """Evaluate what the batch holds lazily (the library's padded arrays after a join or a leave)."""
    mx.eval(
        [
            array
            for layer in batch.cache
            for array in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if array is not None
        ]
    )


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    as_the_server_runs("evals.bench_rows")
    runner = ModelRunner(resolve_model_path(args.model, args.data_dir), CacheConfig(0, 0, 32), "bench")
    runner.warm_up()
    if not runner.rows_kv:
        print("this model's rows cannot keep their KV in segments here (see ModelRunner.rows_kv)")
        return
    ids = runner.tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
    times: dict[str, dict[str, list[float]]] = {path: {"join": [], "leave": [], "step": []} for path in PATHS}
    for _ in range(3):
        for path, segments in PATHS.items():
            runner.rows_kv = segments  # the batch below decides its path at its second row
            rows = Rows(runner, ids, args.rows)
            for _ in range(args.repeats):
                times[path]["join"].append(rows.join_ms())
                times[path]["leave"].append(rows.leave_ms())
                times[path]["step"].append(rows.step_ms())
    print(f"\n{args.rows} rows of 300-450 tokens, medians of {3 * args.repeats} (ms):")
    print("| | a row joins | a row leaves | a decode step |\n|---|---|---|---|")
    medians = {
        path: {what: statistics.median(values) for what, values in kinds.items()} for path, kinds in times.items()
    }
    for path in PATHS:
        print(f"| {path} | " + " | ".join(f"{medians[path][what]:.2f}" for what in ("join", "leave", "step")) + " |")
    print(
        "| library / segments | "
        + " | ".join(f"{medians['library'][w] / medians['segments'][w]:.1f}x" for w in ("join", "leave", "step"))
        + " |"
    )


if __name__ == "__main__":
    main()
