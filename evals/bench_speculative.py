"""Speculative decoding, on against off, side by side in one run: two `strata serve` processes on the
demo model (one with STRATA_MAX_VERIFY_TOKENS=0), the same requests to each, taking turns.

    python -m evals.bench_speculative [--model demo] [--data-dir .strata] [--tokens 200] [--questions 6]
                                      [--clients 16] [--cases abcde]

(a) a request repeated with another max_tokens (its exact key differs; the answer kept under its
    draft key is the draft);
(b) near-hits the semantic guards refuse (pairs of the false-hit set that must not hit): the refused
    candidate's answer is the draft; whether the model gives that answer anyway is measured;
(c) a prompt whose reply should copy long spans of it (a text to repeat): prompt lookup;
(d) distinct prompts one at a time (no cache holds their answers);
(e) 16 concurrent clients of (d).
Decode tok/s is the answer's tokens over its decode time (Server-Timing `decode`, prefill excluded);
(e) is the tokens of all clients over the wall time. Every answer is compared on against off (greedy:
they must be equal). Prints a table and one JSON line. Targets: (a) >= 2.5x; (d) and (e) no slower
than 3%.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from gateway.checkpoints import resolve_model_path

from . import corpus_lines
from .bench_layers import start_server

DEV_SET = Path(__file__).resolve().parent / "data" / "dev.jsonl"
# After each answer: the server's work after the response (storing it in the exact and semantic layers,
# MiniLM's embedding) ends before the other server's next request is timed.
SETTLE_S = 1.0


class Server:
    def __init__(self, name: str, model: str, env: dict[str, str]):
        self.name = name
        self.folder = tempfile.TemporaryDirectory()
        self.process, url = start_server(model, Path(self.folder.name), env)
        self.client = httpx.Client(base_url=url, timeout=600)

    def ask(self, messages: list[dict], max_tokens: int, headers: dict | None = None) -> dict:
        body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        start = time.perf_counter()
        response = self.client.post("/v1/chat/completions", json=body, headers=headers or {})
        wall_s = time.perf_counter() - start
        response.raise_for_status()
        time.sleep(SETTLE_S)
        timing = dict(re.findall(r"(\w+);dur=([\d.]+)", response.headers.get("server-timing", "")))
        speculative = dict(re.findall(r"(\w+)=([\w,]+)", response.headers.get("x-strata-speculative", "")))
        tokens = response.json()["usage"]["completion_tokens"]
        return {
            "text": response.json()["choices"][0]["message"]["content"],
            "tokens": tokens,
            "decode_tok_s": tokens / max(float(timing.get("decode", 0.0)) / 1000, 1e-9),
            "wall_s": wall_s,
            "drafted": int(speculative.get("drafted", 0)),
            "accepted": int(speculative.get("accepted", 0)),
            "semantic": response.headers.get("x-cache-semantic", ""),
        }

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(30)
        self.folder.cleanup()


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _pairs(count: int) -> list[dict]:
    """Look-alike questions the guards must refuse (the false-hit set's `miss` pairs)."""
    rows = [json.loads(line) for line in DEV_SET.read_text().splitlines()]
    return [row for row in rows if row["expect"] == "miss"][::7][:count]


def case_repeated(servers, questions: list[str], tokens: int) -> list[dict]:
    """(a): each question asked once with max_tokens `tokens`, then again with one token less."""
    results = []
    for question in questions:
        for server in servers:
            server.ask(_user(question), tokens)
        results.append({server.name: server.ask(_user(question), tokens - 1) for server in servers})
    return results


def case_near_hits(servers, count: int, tokens: int) -> list[dict]:
    """(b): the cached question, then its refused look-alike."""
    results = []
    for pair in _pairs(count):
        for server in servers:
            server.ask(_user(pair["cached_prompt"]), tokens)
        results.append({server.name: server.ask(_user(pair["query_prompt"]), tokens) for server in servers})
    return results


def case_copy(servers, count: int, tokens: int) -> list[dict]:
    """(c): a text to repeat word for word."""
    lines = corpus_lines()
    results = []
    for index in range(count):
        text = " ".join(lines[40 + 9 * index : 46 + 9 * index])
        prompt = f"Repeat the following text exactly, word for word:\n\n{text}"
        results.append({server.name: server.ask(_user(prompt), tokens) for server in servers})
    return results


def case_distinct(servers, count: int, tokens: int, offset: int = 200) -> list[dict]:
    """(d): questions nothing holds an answer to."""
    lines = corpus_lines()
    results = []
    for index in range(count):
        prompt = f"Tell me more about this: {lines[offset + index]}"
        results.append({server.name: server.ask(_user(prompt), tokens) for server in servers})
    return results


def case_concurrent(server: Server, clients: int, tokens: int, offset: int) -> dict:
    """(e): `clients` closed-loop clients, each asking two distinct questions one after the other;
    the tokens of all answers over the wall time."""
    lines = corpus_lines()
    prompts = [f"Tell me more about this: {lines[offset + index]}" for index in range(2 * clients)]

    def client(index: int) -> list[dict]:
        return [server.ask(_user(prompt), tokens) for prompt in prompts[index::clients]]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [answer for own in pool.map(client, range(clients)) for answer in own]
    wall_s = time.perf_counter() - start
    return {
        "tok_s": sum(a["tokens"] for a in answers) / wall_s,
        "drafted": sum(a["drafted"] for a in answers),
        "accepted": sum(a["accepted"] for a in answers),
        "texts": [a["text"] for a in answers],
    }


def summarise(name: str, results: list[dict]) -> dict:
    on = [r["on"] for r in results]
    off = [r["off"] for r in results]
    drafted = sum(r["drafted"] for r in on)
    return {
        "case": name,
        "on_tok_s": statistics.median(r["decode_tok_s"] for r in on),
        "off_tok_s": statistics.median(r["decode_tok_s"] for r in off),
        "speedup": statistics.median(a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(on, off)),
        "drafted": drafted,
        "accepted": sum(r["accepted"] for r in on),
        "acceptance": sum(r["accepted"] for r in on) / drafted if drafted else 0.0,
        "tokens": sum(r["tokens"] for r in on),
        "same_answers": sum(a["text"] == b["text"] for a, b in zip(on, off)),
        "requests": len(results),
        "on_each": [round(r["decode_tok_s"], 1) for r in on],
        "off_each": [round(r["decode_tok_s"], 1) for r in off],
    }


def concurrent_rounds(servers, clients: int, tokens: int, rounds: int) -> dict:
    """(e), rounds taking turns (on, off, on, off, ...), each round new questions."""
    runs: dict[str, list[dict]] = {server.name: [] for server in servers}
    for round_index in range(rounds):
        for server in servers:
            runs[server.name].append(case_concurrent(server, clients, tokens, 1000 + 2 * round_index * clients))
            time.sleep(2)  # the other server's stores after its last answers
    on, off = runs["on"], runs["off"]
    drafted = sum(r["drafted"] for r in on)
    return {
        "case": f"(e) {clients} clients, distinct",
        "on_tok_s": statistics.median(r["tok_s"] for r in on),
        "off_tok_s": statistics.median(r["tok_s"] for r in off),
        "speedup": statistics.median(r["tok_s"] for r in on) / statistics.median(r["tok_s"] for r in off),
        "drafted": drafted,
        "accepted": sum(r["accepted"] for r in on),
        "acceptance": sum(r["accepted"] for r in on) / drafted if drafted else 0.0,
        "tokens": 0,
        "same_answers": sum(a == b for x, y in zip(on, off) for a, b in zip(x["texts"], y["texts"])),
        "requests": rounds * 2 * clients,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".strata"), help="where demo models are built")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="abcde", help="which cases to run, e.g. 'ad'")
    args = parser.parse_args()
    model = str(resolve_model_path(args.model, args.data_dir))  # built once, both servers load it
    servers = [Server("on", model, {}), Server("off", model, {"STRATA_MAX_VERIFY_TOKENS": "0"})]
    questions, tokens = args.questions, args.tokens
    cases = {
        "a": lambda: summarise(
            "(a) repeated, other max_tokens", case_repeated(servers, corpus_lines()[100 : 100 + questions], tokens)
        ),
        "b": lambda: summarise("(b) refused near-hit", case_near_hits(servers, questions, tokens)),
        "c": lambda: summarise("(c) reply copies the prompt", case_copy(servers, questions, tokens)),
        "d": lambda: summarise("(d) distinct, one client", case_distinct(servers, questions, tokens)),
        "e": lambda: concurrent_rounds(servers, args.clients, tokens, args.rounds),
    }
    try:
        for server in servers:  # warm both alike (first-call costs out of the way)
            server.ask(_user("Hello there."), 16)
        rows = [cases[name]() for name in args.cases]
    finally:
        for server in servers:
            server.close()
    print(
        f"{args.model} model, greedy, max_tokens {tokens}; medians; on = drafts verified, off = STRATA_MAX_VERIFY_TOKENS=0"
    )
    print("| case | on tok/s | off tok/s | on / off | drafted | accepted | acceptance | same answers |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['case']} | {row['on_tok_s']:.1f} | {row['off_tok_s']:.1f} | {row['speedup']:.2f}x | "
            f"{row['drafted']} | {row['accepted']} | {row['acceptance']:.0%} | {row['same_answers']}/{row['requests']} |"
        )
    print("targets: (a) >= 2.5x; (d), (e) >= 0.97x")
    print(json.dumps({"model": args.model, "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
