"""A hybrid model's lone row with drafts it partly rejects: the recurrent state kept per fed token
against the replay of the kept tokens, and plain decoding, side by side in one engine.

    python -m evals.bench_hybrid_drafts [--model qwen3_5-demo] [--tokens 200] [--rounds 3] [--right 3 --of 4]
                                        [--prompts 3] [--batch]

Each prompt's greedy answer is decoded once plainly; then a proposer drafts that answer with every
`of`-th token wrong (so `right` in `of` drafted tokens can be kept), and the same prompts are answered
three ways, taking turns: no drafts; drafts whose rejections run the kept tokens again (the engine's
path where a model's recurrent layers keep no state per token: a lone row's only); drafts whose
rejections take the state after the last kept token (mlx-vlm's speculative transaction, where the
layers record one). Every answer must equal the plain one. Prints tok/s (the answers' tokens over
their wall time, medians over rounds) and the ratios. Only a model whose layers keep states per token
(runner.draft_states) measures the third way. `--batch`: the prompts are asked at once and decode
as one batch (with the replay, a batch drafts nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from gateway.checkpoints import resolve_model_path
from gateway.engine import CacheConfig, Engine, EngineConfig, Message, Sampling, TextPart
from kvcache import TenantSalt

from . import as_the_server_runs

SALT = TenantSalt(b"H" * 32)
WAYS = ("plain", "replay", "states")


class Answer:
    """Drafts the next tokens of a fixed answer (k of them), whatever the row generated."""

    name = "answer"
    first_rate = 0.9

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, generated, k):
        return self.tokens[len(generated) : len(generated) + k]


def answers(engine: Engine, prompts: list, sampling: Sampling, together: bool) -> list[list[int]]:
    """Each prompt's answer (token ids), one prompt at a time or all at once."""

    async def one(prompt) -> list[int]:
        tokens: list[int] = []
        async for event in engine.events(engine.submit(prompt, sampling, SALT)):
            tokens += [entry.token for entry in getattr(event, "logprobs", ())]
        return tokens

    async def run() -> list[list[int]]:
        if together:
            return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))
        return [await one(prompt) for prompt in prompts]

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3_5-demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--right", type=int, default=3)
    parser.add_argument("--of", type=int, default=4)
    parser.add_argument("--batch", action="store_true", help="ask the prompts at once: they decode as one batch")
    args = parser.parse_args()
    as_the_server_runs("evals.bench_hybrid_drafts")
    engine = Engine(
        resolve_model_path(args.model, args.data_dir),
        "bench",
        EngineConfig(16, 256, CacheConfig(0, 0, 16), max_num_seqs=max(4, args.prompts)),
    )
    engine.start()
    try:
        rows = measure(engine, args)
    finally:
        engine.stop()
    print(json.dumps(rows))


def measure(engine: Engine, args) -> dict:
    if not engine.runner.recurrent:
        raise SystemExit(f"{args.model} has no recurrent layers: its drafts are trimmed like any KV")
    greedy = Sampling(args.tokens, 0.0, 1.0, None, (), top_logprobs=0)
    words = "where does the tide turn, and why does it turn there? "
    prompts = [
        engine.prepare((Message("user", (TextPart(f"Question {i}: {words * 3}"),)),), []) for i in range(args.prompts)
    ]
    engine.worker.proposers = None
    plain = dict(zip((p.token_ids for p in prompts), answers(engine, prompts, greedy, together=False)))
    vocab = engine.runner.vocab_size

    def drafts(sequence):
        tokens = plain[sequence.job.prompt.token_ids]
        wrong = [(t + 1) % vocab if i % args.of >= args.right else t for i, t in enumerate(tokens)]
        return [Answer(wrong)]

    ways = WAYS if engine.runner.draft_states else WAYS[:2]
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    counts = {way: [0, 0] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            engine.worker.proposers = None if way == "plain" else drafts
            engine.runner.draft_states = way == "states"
            before = engine.snapshot().counters
            started = time.perf_counter()
            got = answers(engine, prompts, greedy, together=args.batch)
            seconds[way].append((time.perf_counter() - started) / len(prompts))
            after = engine.snapshot().counters
            assert got == [plain[p.token_ids] for p in prompts], f"{way}: an answer differs from plain decoding"
            counts[way][0] += after.num_drafted_tokens - before.num_drafted_tokens
            counts[way][1] += after.num_accepted_drafts - before.num_accepted_drafts
    tok_s = {way: args.tokens / statistics.median(seconds[way]) for way in ways}
    how = f"{len(prompts)} rows at once" if args.batch else "a lone row"
    print(f"{args.model}, {how}, greedy, {args.tokens} tokens, drafts right {args.right} in {args.of}; medians")
    print("| way | tok/s | drafted | kept | vs plain |")
    print("|---|---|---|---|---|")
    for way in ways:
        print(
            f"| {way} | {tok_s[way]:.1f} | {counts[way][0]} | {counts[way][1]} | {tok_s[way] / tok_s['plain']:.2f}x |"
        )
    if "states" in tok_s:
        print(f"states / replay: {tok_s['states'] / tok_s['replay']:.2f}x")
    return {"model": args.model, "tok_s": tok_s, "drafted_kept": counts}


if __name__ == "__main__":
    main()
