"""Agent sessions over the Anthropic Messages API: Strata and mlx-vlm's own server, one run.

    python -m evals.bench_agent [--model demo] [--turns 20] [--system-words 2000] [--variants ...]
    python -m evals.bench_agent --client claude-code [--model demo-agent] [--turns 10]

With `--client claude-code`, the agent itself (the release pinned in tests/agents/package.json, `make
agents` installs it) holds a session: `claude -p` for the first turn, `claude -p --resume` for each
next one, in a scratch project, on a model whose answers end after a few tokens (`demo-agent`: the
demo model with its end-of-turn token favoured, 128k positions). Both servers get the same turns; each
is named by its model path (ANTHROPIC_MODEL), as mlx-vlm's server needs. Per turn: the share of the
prompt Claude Code reports read from the cache, and its own time to first token (`ttft_ms`); an error
it reports is printed and counted. Ends with one JSON line.

Without it:

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
from .agent_clients import ClaudeCode, Recorder, Scratch, installed_versions
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


CLAUDE_PROMPTS = (
    "What does hello.py print?",
    "How would I make it print twice?",
    "And in upper case?",
    "Could it read the text from a file instead?",
    "What would a test for it look like?",
    "How do I run that test?",
    "Where would I add logging?",
    "What if the file is missing?",
    "Summarise what we changed.",
    "Anything else worth doing?",
)


def claude_code_session(server: Server, turns: int, folder: Path) -> list[dict]:
    """Claude Code's own report of each turn of one session against `server` (through a recording
    proxy, which also times each request's first byte and counts the requests of a turn)."""
    agent = ClaudeCode(named=True)
    recorder = Recorder(server.url.removeprefix("http://"))
    scratch = Scratch(folder / server.name, recorder.url, api_key=server.api_key or "none", model=server.model)
    rows = []
    try:
        for turn in range(1, turns + 1):
            usage = agent.turn(scratch, CLAUDE_PROMPTS[(turn - 1) % len(CLAUDE_PROMPTS)], first=turn == 1)
            sent = recorder.take()
            first_byte = sent[-1].first_byte_s * 1000 if sent else None
            row: dict = {
                "turn": turn,
                "prompt": usage.prompt_tokens,
                "read": usage.read_tokens,
                "ttft_ms": usage.ttft_ms,
            }
            rows.append(row | {"first_byte_ms": first_byte, "requests": len(sent), "error": usage.error[:300]})
            shown = f"{usage.read_share:6.1%}" if usage.prompt_tokens else "   n/a"
            print(
                f"  {server.name:<8} turn {turn:>2}: prompt {usage.prompt_tokens:>6}  read {usage.read_tokens:>6} "
                f"({shown})  TTFT {_ms(rows[-1]):>9}  first byte {first_byte or 0:8.0f} ms  requests {len(sent)}  "
                f"{('ERROR ' + usage.error[:120]) if usage.error else ''}{'' if usage.answer else 'EMPTY ANSWER'}",
                flush=True,
            )
    finally:
        recorder.close()
    return rows


def run_claude_code(model: str, data_dir: Path, turns: int) -> None:
    model_dir = resolve_model_path(model, data_dir)
    work = Path(tempfile.mkdtemp(prefix="strata-bench-claude-code-"))
    print(f"model {model_dir}  turns {turns}  Claude Code {installed_versions()[ClaudeCode.package]}  logs in {work}")
    results = {}
    for name in ("strata", "mlx-vlm"):
        server = (
            start_strata("strata", model_dir, work, None)
            if name == "strata"
            else start_mlx_vlm(model_dir, work, None, prefix_cache=True)
        )
        try:
            results[name] = claude_code_session(server, turns, work)
        finally:
            server.stop()
    print_claude_code(results)
    print(json.dumps({"client": "claude-code", "model": model, "turns": turns, "results": results}))


def _share(row: dict) -> float | None:
    return row["read"] / row["prompt"] if row["prompt"] and not row["error"] else None


def print_claude_code(results: dict[str, list[dict]]) -> None:
    """Per turn: the share read and the TTFT on each server, and their ratio (Claude Code's own
    TTFT; where it reports none, the turn's last request's first byte, marked *)."""
    strata, peer = results["strata"], results["mlx-vlm"]
    heading = f"{'turn':>4} {'strata read':>12} {'mlx-vlm read':>13} {'strata TTFT':>12} {'mlx-vlm TTFT':>13}"
    print(f"\n{heading} {'ratio':>7}")
    for ours, theirs in zip(strata, peer):
        mine, their = _latency(ours), _latency(theirs)
        ratio = f"{mine / their:.2f}x" if mine and their else "n/a"
        print(
            f"{ours['turn']:>4} {_pct(_share(ours)):>12} {_pct(_share(theirs)):>13} {_ms(ours):>12} "
            f"{_ms(theirs):>13} {ratio:>7}"
        )
    print("* Claude Code reported no TTFT: the turn's last request's first byte")
    later = [_share(row) for row in strata[1:]]
    print(f"\nstrata: least share read from turn 2: {_pct(min(later, key=lambda v: v or 0.0)) if later else 'n/a'}")
    for name, rows in results.items():
        errors, requests = sum(bool(r["error"]) for r in rows), sum(r["requests"] for r in rows)
        print(f"{name}: turns with an error: {errors} of {len(rows)}; requests: {requests}")
    print(flush=True)


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "n/a"


def _latency(row: dict) -> float | None:
    return None if row["error"] else row["ttft_ms"] or row["first_byte_ms"]


def _ms(row: dict) -> str:
    latency = _latency(row)
    shown = f"{latency:.0f} ms" if latency else "n/a"
    return shown + ("" if row["ttft_ms"] or not latency else "*")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--client", choices=("sdk", "claude-code"), default="sdk")
    parser.add_argument("--model", default=None, help="default: demo (sdk), demo-agent (claude-code)")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"))
    parser.add_argument("--turns", type=int, default=None, help="default: 20 (sdk), 10 (claude-code)")
    parser.add_argument(
        "--system-words", type=int, default=2000, help="with the tools, ~6,000 tokens on the demo tokenizer"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    if args.client == "claude-code":
        run_claude_code(args.model or "demo-agent", args.data_dir, args.turns or 10)
        return
    args.model, args.turns = args.model or "demo", args.turns or 20
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
