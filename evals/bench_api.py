"""What the API's output shaping costs the engine: decode tok/s of free text vs a JSON-schema grammar
(llguidance's mask, unpacked on the CPU), a forced tool call, and logprobs, at 1 and 8 sequences
decoding together, measured side by side in one run on one engine.

    python -m evals.bench_api [--model demo] [--rows 1 8] [--tokens 64] [--repeats 3]

Every request runs the same prompt shape (a distinct prompt per row: no prefix reuse); tok/s is the
decode rate summed over the rows (each row's tokens over its own decode time, prefill excluded:
constrained replies end sooner, so wall time would count their prefill more), medians over repeats. mlx-vlm's
own structured output cannot run here: its mask is a Metal kernel ("No Metal back-end" on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import replace
from pathlib import Path

from gateway.checkpoints import resolve_model_path
from gateway.engine import (
    CacheConfig,
    Engine,
    EngineConfig,
    Finished,
    Message,
    Sampling,
    TextPart,
    Tool,
    json_schema_grammar,
)

from . import corpus_lines

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 200},
        "score": {"type": "integer", "minimum": 0, "maximum": 100000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 40}},
    },
    "required": ["title", "score", "tags"],
    "additionalProperties": False,
}
TOOL = Tool(
    "lookup",
    "Look a word up",
    json.dumps(
        {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
            "additionalProperties": False,
        }
    ),
)


def _modes(engine: Engine, tokens: int) -> dict[str, Sampling]:
    free = Sampling(tokens, 1.0, 1.0, 1, ())
    return {
        "free text": free,
        "json_schema": replace(free, grammar=json_schema_grammar(SCHEMA)),
        "forced tool call": replace(free, grammar=engine.tools.grammar((TOOL,), "lookup")),
        "logprobs (top 5)": replace(free, top_logprobs=5),
    }


async def _run(engine: Engine, prompts, sampling: Sampling, seed: int) -> float:
    """The rows' decode rates summed: tok/s of the batch while it decodes."""

    async def one(index, prompt):
        job = engine.submit(prompt, replace(sampling, seed=seed * 1000 + index), index.to_bytes(16, "little"))
        rate = 0.0
        async for event in engine.events(job):
            if isinstance(event, Finished):
                rate = event.num_completion_tokens / (event.decode_ms / 1000)
        return rate

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    caches = CacheConfig(prefix_budget_bytes=256 << 20, vision_budget_bytes=0, block_size=32)
    engine = Engine(resolve_model_path(args.model, args.data_dir), args.model, EngineConfig(caches=caches))
    engine.start()
    lines = corpus_lines()
    results = {}
    try:
        modes = _modes(engine, args.tokens)
        for rows in args.rows:
            for name, sampling in modes.items():
                rates = []
                for repeat in range(args.repeats):
                    offset = (repeat * len(args.rows) + rows) * 16
                    prompts = [
                        engine.prepare((Message("user", (TextPart(lines[(offset + i) % len(lines)]),)),), [])
                        for i in range(rows)
                    ]
                    rates.append(asyncio.run(_run(engine, prompts, sampling, repeat)))
                results[(rows, name)] = statistics.median(rates)
    finally:
        engine.stop()
    _print(results, args)


def _print(results: dict, args: argparse.Namespace) -> None:
    print(f"model {args.model}; {args.tokens} tokens at most per sequence; medians of {args.repeats}")
    print(f"{'rows':>4}  {'mode':<18} {'tok/s':>8}  {'vs free text':>12}")
    for (rows, name), rate in results.items():
        print(f"{rows:>4}  {name:<18} {rate:>8.1f}  {rate / results[(rows, 'free text')]:>11.2f}x")
    print(json.dumps({f"{rows}:{name}": round(rate, 1) for (rows, name), rate in results.items()}))


if __name__ == "__main__":
    main()
