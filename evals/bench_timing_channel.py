"""Can one end user tell, by timing, whether another end user of the same tenant sent a prompt? The
side channel of a shared prefix cache (vLLM's CVE-2025-46570), measured from outside as ROC AUC.

    python -m evals.bench_timing_channel [--model demo] [--trials 40] [--lines 40]

One `strata serve` with two tenants: `shared` (end users share the tenant's caches, the default) and
`apart` (STRATA_ISOLATE_END_USERS). Each trial makes a fresh secret system prompt (`--lines` corpus
sentences behind a random nonce, so no two trials share a block); on half of the trials, chosen at
random, the victim end user asks a question under it; then the attacker, another end user of the
same tenant, asks a different question under it (one token) and times the answer. AUC is the chance
that a trial where the victim did not send the secret took longer than one where it did (ties half):
0.5 means the timing says nothing, 1.0 that it tells every time. Prints one line per tenant and a
JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from . import corpus_lines
from .bench_layers import start_server

# Between the victim's turn (or the pause that stands for it) and the attacker's probe: the server's
# work after an answer (storing it in the response layers) ends first, so only the caches differ.
SETTLE_S = 0.5
KEYS = {"shared": "key-shared", "apart": "key-apart"}
API_KEYS = "key-shared:shared,key-apart:apart"


def secret_prompt(lines: list[str], rng: random.Random, num_lines: int) -> str:
    start = rng.randrange(len(lines) - num_lines)
    return f"[{secrets.token_hex(8)}] " + " ".join(lines[start : start + num_lines])


def ask(
    client: httpx.Client, model: str, key: str, user: str, system: str, question: str
) -> tuple[float, httpx.Response]:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
        "user": user,
    }
    start = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response


def auc(sent: list[float], unsent: list[float]) -> float:
    """P(an unsent trial took longer than a sent one), ties counting half (the Mann-Whitney U over n1 n2)."""
    wins = sum((u > s) + 0.5 * (u == s) for u in unsent for s in sent)
    return wins / (len(sent) * len(unsent))


def measure(
    url: str, tenant: str, trials: int, num_lines: int, seed: int = 0, model: str = "bench", settle_s: float = SETTLE_S
) -> dict:
    """`trials` trials on the tenant; the attacker's times when the victim sent the secret and when not.
    `settle_s`: the pause before each probe (shorter only makes a leftover of the victim's work more
    likely to show in the probe's time, so a run that passes with it passes with the default too)."""
    rng, lines = random.Random(seed), corpus_lines()
    times: dict[bool, list[float]] = {True: [], False: []}
    reused: dict[bool, list[int]] = {True: [], False: []}
    sent_flags = [True, False] * (trials // 2)
    rng.shuffle(sent_flags)
    with httpx.Client(base_url=url, timeout=120) as client:
        for sent in sent_flags:
            system = secret_prompt(lines, rng, num_lines)
            if sent:
                ask(client, model, KEYS[tenant], "victim", system, "What is the first word of the text above?")
            time.sleep(settle_s)
            elapsed, response = ask(
                client, model, KEYS[tenant], "attacker", system, f"Summarise it ({rng.random():.6f})."
            )
            times[sent].append(elapsed)
            reused[sent].append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return {
        "tenant": tenant,
        "auc": auc(times[True], times[False]),
        "median_ms_sent": 1000 * statistics.median(times[True]),
        "median_ms_unsent": 1000 * statistics.median(times[False]),
        "cached_tokens_when_sent": statistics.median(reused[True]),
        "trials": trials,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        env = {"STRATA_API_KEYS": API_KEYS, "STRATA_ISOLATE_END_USERS": "apart"}
        process, url = start_server(args.model, Path(folder), env)
        try:
            rows = [measure(url, tenant, args.trials, args.lines) for tenant in ("shared", "apart")]
        finally:
            process.terminate()
            process.wait(30)
    print(f"{args.model} model; {args.trials} trials per tenant, half with the victim's prompt sent")
    print("| tenant | attacker's median ms (victim sent) | (not sent) | cached tokens (sent) | ROC AUC |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['tenant']} | {row['median_ms_sent']:.1f} | {row['median_ms_unsent']:.1f} | "
            f"{row['cached_tokens_when_sent']:.0f} | {row['auc']:.2f} |"
        )
    print(json.dumps({"model": args.model, "rows": rows}))


if __name__ == "__main__":
    main()
