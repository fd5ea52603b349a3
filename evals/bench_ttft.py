"""TTFT across ten-turn chats: Strata's cache off, Strata's cache on, and mlx-vlm's own APC.

    python -m evals.bench_ttft [--model demo] [--runs 3] [--turns 10]
    python -m evals.bench_ttft --family gemma3|...|all [--turns 10]
    python -m evals.bench_ttft --family qwen3_5|...|all --snapshot-split


Two chats on the same model: (a) text only, (b) a 448x448 image in turn 1. Each user turn adds
~200 new tokens; each assistant turn is the mode's own greedy reply (24 tokens), sent back as the
next turn's history, as a real client does. TTFT is measured in-process from the messages to the
first sampled token (prompt building and image preprocessing included, HTTP excluded) for all three
modes alike. Each run starts every mode with empty caches; the table shows medians over runs.
Also printed: hashing cost per token, block-gather cost, and bytes held for 100 sessions that
share a 1,000-token system prompt. Ends with one JSON line.

With --family, the same two chats run on each family's demo-size model (built on first use), Strata
on against APC (medians of --runs runs), and one table compares the families (the image chat only
for families that take images).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from PIL import Image

from gateway.checkpoints import BUILDABLE_FAMILIES, resolve_model_path
from gateway.engine import (
    VISION_FAMILIES,
    CacheConfig,
    ImagePart,
    Message,
    ModelRunner,
    Sampler,
    Sampling,
    TextPart,
    decode_alone,
    model_fingerprint,
)
from kvcache import PrefixCache, TenantSalt, chain_root, hash_blocks
from vision import DecodedImage, pixel_hash

from . import as_the_server_runs, corpus_lines

REPLY_TOKENS = 24
SALT = TenantSalt(b"bench-tenant-salt-000000000000000")
GREEDY = Sampling(REPLY_TOKENS, 0.0, 1.0, None, ())


def user_turns(tokenizer, num_turns: int, tokens_per_turn: int = 200) -> list[str]:
    lines = corpus_lines()
    turns, current = [], []
    for line in lines:
        current.append(line)
        if len(tokenizer.encode(" ".join(current), add_special_tokens=False)) >= tokens_per_turn:
            turns.append(" ".join(current))
            current = []
            if len(turns) == num_turns:
                return turns
    raise ValueError("corpus too short")


def chat_image() -> Image.Image:
    pixels = (np.random.default_rng(7).random((448, 448, 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


class StrataMode:
    def __init__(self, name: str, model_path: Path, caches: CacheConfig):
        self.name = name
        self.runner = ModelRunner(model_path, caches, model_fingerprint(model_path))
        self.runner.warm_up()  # as `strata serve` does before it takes requests (touches no cache)
        self.cached_tokens: list[int] = []
        self.prompt_tokens: list[int] = []

    def held_bytes(self) -> int:
        prefix = self.runner.caches.prefix
        return prefix.pool.num_bytes if prefix is not None else 0

    def turn(self, history: list[Message], image: Image.Image | None) -> tuple[float, str]:
        start = time.perf_counter()
        images = [DecodedImage(image, pixel_hash(image), image.width, image.height)] if image else []
        prompt = self.runner.prompts.build(tuple(history), images)
        prefill = self.runner.prefill(prompt, SALT, 512, lambda: False)
        first = Sampler(GREEDY)(prefill.logits)
        ttft = time.perf_counter() - start
        generated = list(decode_alone(self.runner, prefill, GREEDY, lambda: False))
        self.runner.finish(prefill, generated)
        self.cached_tokens.append(prefill.prefix.num_cached_tokens)
        self.prompt_tokens.append(prompt.num_tokens)
        assert not generated or generated[0] == first
        return ttft, self.runner.tokenizer.decode(generated, skip_special_tokens=True)


def without_mtp(model_path: Path) -> Path:
    """The model folder as mlx-vlm's stock loader can read it: Strata's builds of Qwen3.5 and
    Qwen3-Next carry their MTP drafting layers in `mtp.safetensors`, which mlx-vlm's Qwen3-Next
    refuses ("parameters not in model"). The comparison sets that one file aside: a folder of links
    to every other file, in the temporary directory (not beside the model, where it would look like
    another model), named after the model folder's full path (two checkouts build folders of the
    same name)."""
    if not (model_path / "mtp.safetensors").exists():
        return model_path
    source = model_path.resolve()
    digest = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    view = Path(tempfile.gettempdir()) / "strata-bench" / f"{model_path.name}-{digest}-without-mtp"
    view.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        link = view / entry.name
        if entry.name != "mtp.safetensors" and not link.is_symlink():
            link.symlink_to(entry)
    return view


class ApcMode:
    """mlx-vlm 0.7.10's automatic prefix cache, RAM tier only, through its own stream_generate, on
    its own stock load of the same model folder (Strata's runner swaps in its CPU attention)."""

    name = "mlx-vlm APC"

    def __init__(self, model_path: Path):
        import mlx_vlm
        from mlx_vlm import apc

        # its annotations name fewer processor kinds than it loads
        loaded: Any = mlx_vlm.load(str(without_mtp(model_path)))
        self.model, self.processor = loaded
        self.manager = apc.from_env(overrides={"enabled": True, "disk_enabled": False})
        # the same first-call warm-up Strata's runner gets, outside the prefix cache
        mlx_vlm.generate(self.model, self.processor, "warm up " * 8, max_tokens=2, verbose=False)

    def held_bytes(self) -> int:
        assert self.manager is not None, "from_env was asked for an enabled manager"
        return self.manager.resident_bytes()

    def turn(self, history: list[Message], image: Image.Image | None) -> tuple[float, str]:
        import mlx_vlm

        start = time.perf_counter()
        messages = [
            {
                "role": m.role,
                "content": [
                    {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in m.parts
                ],
            }
            for m in history
        ]
        tokenizer = getattr(self.processor, "tokenizer", self.processor)  # text models load a bare tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ttft, pieces = None, []
        for response in mlx_vlm.stream_generate(
            self.model,
            self.processor,
            text,
            image=[image] if image else None,  # type: ignore[list-item]  # PIL images are accepted as paths are
            max_tokens=REPLY_TOKENS,
            temperature=0.0,
            apc_manager=self.manager,
        ):
            ttft = ttft or time.perf_counter() - start
            pieces.append(response.text)
        assert ttft is not None, "stream_generate yielded nothing"
        return ttft, "".join(pieces)


def run_chat(mode, turns: list[str], image: Image.Image | None) -> list[float]:
    history: list[Message] = []
    ttfts = []
    for index, text in enumerate(turns):
        parts = (ImagePart("img"), TextPart(text)) if image is not None and index == 0 else (TextPart(text),)
        history.append(Message("user", parts))
        ttft, reply = mode.turn(history, image)
        ttfts.append(ttft)
        history.append(Message("assistant", (TextPart(reply),)))
    return ttfts


def measure(model_path: Path, turns: list[str], runs: int) -> dict:
    image = chat_image()
    warm_up = StrataMode("warm-up", model_path, CacheConfig(0, 0, 64))  # MLX compiles kernels on first use
    run_chat(warm_up, turns[:2], image)
    run_chat(ApcMode(model_path), turns[:2], image)
    results: dict = {"text": {}, "image": {}}
    for _ in range(runs):
        for chat, chat_picture in (("text", None), ("image", image)):
            off = StrataMode("strata off", model_path, CacheConfig(0, 0, 64))
            on = StrataMode("strata on", model_path, CacheConfig(4 << 30, 512 << 20, 32))
            for mode in (off, on, ApcMode(model_path)):  # every mode starts with empty caches
                results[chat].setdefault(mode.name, []).append(run_chat(mode, turns, chat_picture))
    return results


def block_size_sweep(model_path: Path, turns: list[str]) -> dict:
    """Mean Strata-on TTFT over turns 2..N of the text chat, per block size (the default's basis)."""
    sweep = {}
    for block_size in (16, 32, 64, 128):
        samples = []
        for _ in range(2):
            mode = StrataMode("sweep", model_path, CacheConfig(4 << 30, 0, block_size))
            samples += run_chat(mode, turns, None)[1:]
        sweep[block_size] = statistics.mean(samples) * 1000
    return sweep


def micro_costs() -> dict:
    """Hashing ns/token, gather ms for 2k/8k cached tokens and shared-prompt bytes, on demo shapes
    (4 layers, 2 KV heads, head_dim 64, fp32)."""
    layers, heads, dim = 4, 2, 64
    out: dict = {"hash_ns_per_token": {}, "gather_ms": {}}
    tokens = list(np.random.default_rng(0).integers(0, 8000, 8192))
    for block_size in (16, 32, 64, 128):
        cache = PrefixCache(8 << 30, block_size)
        root = chain_root(SALT, f"bench|block={block_size}")
        start = time.perf_counter()
        for _ in range(5):
            hash_blocks(tokens, block_size, root)
        out["hash_ns_per_token"][block_size] = (time.perf_counter() - start) / 5 / len(tokens) * 1e9
        kv = [(mx.random.normal((1, heads, 8192, dim)), mx.random.normal((1, heads, 8192, dim))) for _ in range(layers)]
        with cache.open(SALT, "bench", tokens) as session:
            session.match(8192)
            session.store(tokens, kv, 8192)
            out["gather_ms"][block_size] = {n: _gather_ms(session, n) for n in (2048, 8192)}
        out.setdefault("store_ms_8k", {})[block_size] = _store_ms(cache, tokens, kv)
    out["shared_prompt"] = shared_prompt_bytes(layers, heads, dim)
    return out


def _store_ms(cache: PrefixCache, tokens, kv) -> float:
    """Cost of caching 8k tokens of KV as new blocks (slice + copy + pool insert)."""
    fresh = PrefixCache(8 << 30, cache.block_size)
    with fresh.open(SALT, "bench", tokens) as session:
        start = time.perf_counter()
        session.store(tokens, kv, 8192)
        return (time.perf_counter() - start) * 1000


def _gather_ms(session, num_tokens: int) -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(session.gather(num_tokens))
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def shared_prompt_bytes(layers: int, heads: int, dim: int, sessions: int = 100) -> dict:
    cache = PrefixCache(8 << 30, 64)
    system = list(range(1000))
    for index in range(sessions):
        tokens = system + [5000 + index] * 100
        kv = [(mx.zeros((1, heads, len(tokens), dim)), mx.zeros((1, heads, len(tokens), dim))) for _ in range(layers)]
        with cache.open(SALT, "bench", tokens) as session:
            session.match(len(tokens))
            session.store(tokens, kv, len(tokens))
    per_token = layers * 2 * heads * dim * 4
    unshared = sessions * (1100 // 64 * 64) * per_token
    return {
        "sessions": sessions,
        "held_bytes": cache.pool.num_bytes,
        "unshared_bytes": unshared,
        "ratio": cache.pool.num_bytes / unshared,
    }


def family_rows(family: str, data_dir: Path, num_turns: int, runs: int) -> list[dict]:
    """The text chat (and the image chat, for vision families) on the family's demo model: `runs`
    runs, each starting both modes with empty caches; per-turn medians."""
    model_path = resolve_model_path(f"{family}-demo", data_dir)
    on_config = CacheConfig(4 << 30, 512 << 20, 32)
    turns = user_turns(StrataMode("probe", model_path, CacheConfig(0, 0, 64)).runner.tokenizer, num_turns)
    image = chat_image() if family in VISION_FAMILIES else None
    run_chat(StrataMode("warm-up", model_path, CacheConfig(0, 0, 64)), turns[:2], image)  # MLX builds kernels
    run_chat(ApcMode(model_path), turns[:2], image)
    rows = []
    for chat, picture in (("text", None), ("image", image)):
        if chat == "image" and picture is None:
            continue
        on_runs, apc_runs = [], []
        for _ in range(runs):
            on, apc = StrataMode("strata on", model_path, on_config), ApcMode(model_path)
            on_runs.append(run_chat(on, turns, picture))
            apc_runs.append(run_chat(apc, turns, picture))
        on_ms = [statistics.median(run[t] for run in on_runs) * 1000 for t in range(num_turns)]
        apc_ms = [statistics.median(run[t] for run in apc_runs) * 1000 for t in range(num_turns)]
        rows.append(
            {
                "family": family,
                "chat": chat,
                "runs": runs,
                "on_ms": on_ms,
                "apc_ms": apc_ms,
                "turn10_over_turn1": on_ms[-1] / on_ms[0],
                "max_on_over_apc": max(o / a for o, a in zip(on_ms, apc_ms)),
                "reused_at_last_turn": on.cached_tokens[-1] / on.prompt_tokens[-1],
                "prompt_tokens_last_turn": on.prompt_tokens[-1],
                # what each holds in RAM for the one conversation: KV blocks (and a hybrid's state
                # snapshots) against APC's resident blocks and checkpoints
                "held_bytes": on.held_bytes(),
                "apc_held_bytes": apc.held_bytes(),
            }
        )
    return rows


def snapshot_split(family: str, data_dir: Path, repeats: int = 12) -> dict | None:
    """A cold ~260-token prompt on a hybrid family's demo model, whose one chunk holds a snapshot
    point (the last block boundary before its end): its pieces packed in one model call (the
    engine's way) against one call per piece (the way chunks used to stop at each point),
    alternated in one process, each run under a fresh tenant salt (nothing reused). Medians after
    the first two of each. None for a family without recurrent layers (no snapshot points)."""
    runner = ModelRunner(resolve_model_path(f"{family}-demo", data_dir), CacheConfig(256 << 20, 0, 32), "split")
    if not runner.recurrent:
        return None
    runner.warm_up()
    text = "The committee met in the old library to discuss the river crossing, the budget and the bridge. " * 10
    prompt = runner.prompts.build((Message("user", (TextPart(text),)),), [])

    pieces: list[int] = []

    def run(salt: TenantSalt, packed: bool) -> float:
        start = time.perf_counter()
        admission = runner.open_prefill(prompt, salt)
        parts = runner.chunk_parts(admission, admission.first, prompt.num_tokens)
        if packed:
            runner.run_step(parts)
        else:
            for part in parts:
                part.states = None  # alone in its call: the cache holds its state afterwards
                runner.run_step([part])
        pieces.append(len(parts))
        runner.finish(admission.result(), [])
        return (time.perf_counter() - start) * 1000

    times: dict[str, list[float]] = {"packed": [], "per piece": []}
    for index in range(repeats):
        order = (True, False) if index % 2 else (False, True)
        for packed in order:
            times["packed" if packed else "per piece"].append(run(TenantSalt(os.urandom(32)), packed))
    medians = {name: statistics.median(values[2:]) for name, values in times.items()}
    return {"family": family, "prompt_tokens": prompt.num_tokens, "pieces": max(pieces), "median_ms": medians}


def family_table(rows: list[dict], num_turns: int) -> None:
    print(
        f"\nTTFT ms per family, Strata on vs mlx-vlm APC, medians of {rows[0]['runs']} runs, demo-size models, "
        f"{num_turns}-turn chats"
    )
    print(
        f"{'family':<16} {'chat':<5} | {'on t1':>7} {'on tN':>7} | {'APC t1':>7} {'APC tN':>7} | "
        f"{'tN/t1 on':>8} | {'max on/APC':>10} | {'reused tN':>9} | {'prompt tN':>9} | {'held MB':>7} {'APC MB':>7}"
    )
    for row in rows:
        on, apc = row["on_ms"], row["apc_ms"]
        print(
            f"{row['family']:<16} {row['chat']:<5} | {on[0]:7.1f} {on[-1]:7.1f} | {apc[0]:7.1f} {apc[-1]:7.1f} | "
            f"{row['turn10_over_turn1']:8.2f} | {row['max_on_over_apc']:10.2f} | {row['reused_at_last_turn']:8.1%} | "
            f"{row['prompt_tokens_last_turn']:9d} | {row['held_bytes'] / 1e6:7.2f} {row['apc_held_bytes'] / 1e6:7.2f}"
        )
    print("targets: text tN/t1 <= 2.5; text max on/APC <= 1.0; image reused at tN >= 80%")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument(
        "--family",
        choices=list(BUILDABLE_FAMILIES) + ["all"],
        default=None,
        help="run the ten-turn chats on this family's demo model (or every family's) instead",
    )
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument(
        "--snapshot-split",
        action="store_true",
        help="with --family: a cold hybrid prompt's pieces packed in one call against one call per piece",
    )
    args = parser.parse_args()
    as_the_server_runs("evals.bench_ttft")
    families = list(BUILDABLE_FAMILIES) if args.family == "all" else [args.family]
    if args.family and args.snapshot_split:
        for row in filter(None, (snapshot_split(family, args.data_dir) for family in families)):
            packed, apart = row["median_ms"]["packed"], row["median_ms"]["per piece"]
            print(
                f"{row['family']:<12} {row['prompt_tokens']} tokens, {row['pieces']} pieces: packed {packed:.1f} ms, "
                f"one call per piece {apart:.1f} ms, per piece / packed {apart / packed:.2f}x",
                flush=True,
            )
            print(json.dumps({"snapshot_split": row}))
        return
    if args.family:
        rows = [row for family in families for row in family_rows(family, args.data_dir, args.turns, args.runs)]
        family_table(rows, args.turns)
        print(json.dumps({"families": rows}))
        return
    model_path = resolve_model_path(args.model, args.data_dir)
    probe = ModelRunner(model_path, CacheConfig(0, 0, 64), "probe")
    turns = user_turns(probe.tokenizer, args.turns)
    del probe
    results = measure(model_path, turns, args.runs)
    costs = micro_costs()
    costs["block_size_sweep_ttft_ms"] = block_size_sweep(model_path, turns)
    summary = report(results, costs, args)
    print(json.dumps({"model": args.model, "runs": args.runs, "ttft_s": results, "costs": costs, "summary": summary}))


def report(results: dict, costs: dict, args) -> dict:
    summary = {}
    for chat in ("text", "image"):
        medians = {
            mode: [statistics.median(run[t] for run in runs) for t in range(args.turns)]
            for mode, runs in results[chat].items()
        }
        print(f"\n({'a' if chat == 'text' else 'b'}) {chat} chat, TTFT ms (median of {args.runs} runs)")
        print(
            f"{'turn':>4} | {'strata off':>10} | {'strata on':>9} | {'mlx-vlm APC':>11} | {'on/APC':>6} | {'APC/on':>6}"
        )
        for t in range(args.turns):
            off, on, apc = (medians[m][t] * 1000 for m in ("strata off", "strata on", "mlx-vlm APC"))
            print(f"{t + 1:>4} | {off:10.1f} | {on:9.1f} | {apc:11.1f} | {on / apc:6.2f} | {apc / on:6.2f}")
        on = medians["strata on"]
        apc = medians["mlx-vlm APC"]
        ratios_per_run = [run[-1] / run[0] for run in results[chat]["strata on"]]
        summary[chat] = {
            "turn10_over_turn1_on": on[-1] / on[0],
            "turn10_over_turn1_on_per_run": ratios_per_run,
            "max_on_over_apc": max(o / a for o, a in zip(on, apc)),
            "apc_over_on_turn10": apc[-1] / on[-1],
        }
        print(f"turn-{args.turns} / turn-1 with Strata on: {on[-1] / on[0]:.2f}x (target <= 2.5)")
        print(f"worst Strata-on / APC ratio over turns: {summary[chat]['max_on_over_apc']:.2f} (target <= 1.0 on text)")
        print(f"APC / Strata-on at turn {args.turns}: {apc[-1] / on[-1]:.1f}x (target >= 5 on the image chat)")
    print(
        "\nhashing cost, ns per token (SHA-256 chain):", {k: round(v, 1) for k, v in costs["hash_ns_per_token"].items()}
    )
    print(
        "block gather, ms for 2k / 8k cached tokens:",
        {bs: f"{v[2048]:.2f} / {v[8192]:.2f}" for bs, v in costs["gather_ms"].items()},
    )
    print("block store, ms for 8k new tokens:", {bs: round(v, 1) for bs, v in costs["store_ms_8k"].items()})
    print(
        "mean TTFT ms over text-chat turns 2-10 by block size:",
        {bs: round(ms, 1) for bs, ms in costs["block_size_sweep_ttft_ms"].items()},
    )
    shared = costs["shared_prompt"]
    print(
        f"100 sessions sharing a 1,000-token system prompt: {shared['held_bytes'] / 1e6:.1f} MB held vs "
        f"{shared['unshared_bytes'] / 1e6:.1f} MB unshared ({shared['ratio']:.3f}x)"
    )
    return summary


if __name__ == "__main__":
    main()
