"""Agent sessions over the Anthropic Messages API: Strata and mlx-vlm's own server, one run.

    python -m evals.bench_agent [--model demo] [--turns 20] [--system-words 2000] [--variants ...]

A session is what a coding agent sends: a long system prompt (--system-words words, ~6,000 tokens
on the demo tokenizer) with 15 tool definitions, then turns that each add the assistant's tool call,
a tool result of ~400 tokens and a short user message; every request is a stream through the
official `anthropic` client (max_tokens 8, greedy). The conversation is fixed, not the model's own
replies, so both servers see the same prompts. Three variants of Claude Code's attribution line
(`x-anthropic-billing-header: ...; cch=<5 hex>;`, first in the system prompt):
- changing: a new cch on every request (clients before 2.1.181);
- stable: one cch per session, and a second session (another cch) after the first;
- none: no line (CLAUDE_CODE_ATTRIBUTION_HEADER=0).
Per turn: TTFT (request sent to first text delta) and the prompt tokens each server reports read
from cache (`cache_read_input_tokens`); the system prompt and the last message carry a cache_control
breakpoint, as Claude Code sends them. The summary: the least and median share read from turn 2
on, the last turn's TTFT and the median of the last five turns' (one turn alone is noisy). Strata runs with its response layers off (engine caches
on), mlx-vlm with its prefix cache (APC) on and an empty disk tier. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anthropic

from gateway.checkpoints import resolve_model_path

from . import corpus_lines
from .bench_load import Server, start_mlx_vlm, start_strata

SENTENCES = corpus_lines()
TOOL_NAMES = [
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "glob",
    "grep",
    "run_shell",
    "run_tests",
    "git_status",
    "git_diff",
    "git_commit",
    "web_fetch",
    "todo_write",
    "ask_user",
    "notebook_edit",
]
VARIANTS = ("changing", "stable", "none")


def words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < count:
        out += rng.choice(SENTENCES).split()
    return " ".join(out[:count])


def tools() -> Any:
    return [
        {
            "name": name,
            "description": f"{name.replace('_', ' ').capitalize()}. " + words(100 + i, 40),
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": words(200 + i, 12)}},
                "required": ["path"],
            },
        }
        for i, name in enumerate(TOOL_NAMES)
    ]


def system_blocks(system_words: int, cch: str | None) -> list[dict]:
    text = "You are a coding agent in a large repository.\n" + words(1, system_words)
    blocks: list[dict] = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]
    if cch is None:
        return blocks
    line = f"x-anthropic-billing-header: cc_version=2.1.37.8f1; cc_entrypoint=cli; cch={cch};"
    return [{"type": "text", "text": line}, *blocks]


def turn_messages(session: int, turns: int) -> list[dict]:
    """The conversation after `turns` turns, ending with the user's message of the last one."""
    messages: list[dict] = [{"role": "user", "content": f"Session {session}: fix the failing build."}]
    for turn in range(1, turns):
        call_id = f"toolu_{session:03d}{turn:03d}"
        name = TOOL_NAMES[turn % len(TOOL_NAMES)]
        messages.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call_id, "name": name, "input": {"path": f"src/mod{turn}.py"}}],
            }
        )
        result = {"type": "tool_result", "tool_use_id": call_id, "content": words(1000 * session + turn, 300)}
        ask = {"type": "text", "text": f"Turn {turn}: what next?"}
        messages.append({"role": "user", "content": [result, ask]})
    messages[-1]["content"] = _marked(messages[-1]["content"])  # as Claude Code: a breakpoint on the last message
    return messages


def _marked(content: str | list[dict]) -> list[dict]:
    blocks: list[dict] = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(b) for b in content]
    blocks[-1]["cache_control"] = {"type": "ephemeral"}
    return blocks


def request(
    client: anthropic.Anthropic, model: str, system: list[dict], messages: list[dict]
) -> tuple[float, int, int]:
    """(TTFT in seconds, prompt tokens, of them read from cache)."""
    params: dict[str, Any] = {"model": model, "max_tokens": 8, "system": system, "messages": messages}
    started = time.perf_counter()
    ttft = None
    with client.messages.stream(**params, tools=tools(), extra_body={"temperature": 0}) as stream:
        for event in stream:
            if ttft is None and event.type in ("content_block_delta", "content_block_start"):
                ttft = time.perf_counter() - started
        usage = stream.get_final_message().usage
    read = usage.cache_read_input_tokens or 0
    prompt = usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
    return ttft if ttft is not None else time.perf_counter() - started, prompt, read


def run_variant(server: Server, variant: str, turns: int, system_words: int) -> list[dict]:
    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key or "none", max_retries=0, timeout=600)
    rows = []
    rng = random.Random(variant)
    sessions = (1, 2) if variant == "stable" else (1,)
    for session in sessions:
        session_cch = f"{rng.getrandbits(20):05x}"
        for turn in range(1, (turns if session == 1 else 1) + 1):
            cch = {"changing": f"{rng.getrandbits(20):05x}", "stable": session_cch, "none": None}[variant]
            ttft, prompt, read = request(
                client, server.model, system_blocks(system_words, cch), turn_messages(session, turn)
            )
            rows.append({"session": session, "turn": turn, "ttft_s": ttft, "prompt": prompt, "read": read})
            print(
                f"  {server.name:<8} {variant:<8} session {session} turn {turn:>2}: prompt {prompt:>6}  "
                f"read {read:>6} ({read / max(prompt, 1):6.1%})  TTFT {ttft * 1000:8.0f} ms",
                flush=True,
            )
    return rows


def summary(rows: list[dict]) -> dict:
    first = [r for r in rows if r["session"] == 1]
    last_five = [r["ttft_s"] for r in first[-5:]]
    later = [r for r in first if r["turn"] >= 2]
    second = [r for r in rows if r["session"] == 2]
    return {
        "min_read_from_turn_2": min((r["read"] / r["prompt"] for r in later), default=None),
        "median_read_from_turn_2": statistics.median([r["read"] / r["prompt"] for r in later]) if later else None,
        "last_turn_ttft_s": first[-1]["ttft_s"],
        "last_five_turns_median_ttft_s": statistics.median(last_five),
        "last_turn_prompt": first[-1]["prompt"],
        "second_session_first_turn_read": second[0]["read"] if second else None,
        "second_session_first_turn_prompt": second[0]["prompt"] if second else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument(
        "--system-words", type=int, default=2000, help="with the tools, ~6,000 tokens on the demo tokenizer"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    model_dir = resolve_model_path(args.model, args.data_dir)
    work = Path(tempfile.mkdtemp(prefix="strata-bench-agent-"))
    print(f"model {model_dir}  turns {args.turns}  logs in {work}", flush=True)
    results: dict[str, dict] = {}
    for variant in args.variants:
        for name in ("strata", "mlx-vlm"):  # each starts fresh for each variant: no cache from before
            server = (
                start_strata("strata", model_dir, work, None)
                if name == "strata"
                else start_mlx_vlm(model_dir, work, None, prefix_cache=True)
            )
            try:
                rows = run_variant(server, variant, args.turns, args.system_words)
            finally:
                server.stop()
            results.setdefault(variant, {})[name] = {"summary": summary(rows), "turns": rows}
        print_variant(variant, results[variant])
    print(json.dumps({"model": args.model, "turns": args.turns, "results": results}))


def print_variant(variant: str, result: dict) -> None:
    strata, peer = result["strata"]["summary"], result["mlx-vlm"]["summary"]
    print(f"\n{variant}: {'':<28} {'strata':>10} {'mlx-vlm':>10}")
    for key in ("min_read_from_turn_2", "median_read_from_turn_2"):
        print(f"  {key:<34} {strata[key]:>10.1%} {peer[key]:>10.1%}")
    print(
        f"  {'last turn TTFT (ms)':<34} {strata['last_turn_ttft_s'] * 1000:>10.0f} {peer['last_turn_ttft_s'] * 1000:>10.0f}"
    )
    print(f"  {'last turn TTFT, strata / mlx-vlm':<34} {strata['last_turn_ttft_s'] / peer['last_turn_ttft_s']:>10.2f}x")
    five_s, five_peer = strata["last_five_turns_median_ttft_s"], peer["last_five_turns_median_ttft_s"]
    print(f"  {'last 5 turns, median TTFT (ms)':<34} {five_s * 1000:>10.0f} {five_peer * 1000:>10.0f}")
    print(f"  {'last 5 turns, strata / mlx-vlm':<34} {five_s / five_peer:>10.2f}x")
    if strata["second_session_first_turn_read"] is not None:
        print(
            f"  {'second session, turn 1: read':<34} {strata['second_session_first_turn_read']:>10} "
            f"{peer['second_session_first_turn_read']:>10}  of {strata['second_session_first_turn_prompt']} tokens"
        )
    print(flush=True)


if __name__ == "__main__":
    main()
