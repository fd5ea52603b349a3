"""Synthetic block traces with stated parameters, for the cache simulator (`evals.cache_sim`).

    python -m evals.trace_gen KIND --out FILE [--seed N]      KIND: chat | agent | rag | scan | mix

Every kind is a function of its parameters and a seed (numpy's default_rng): the same call gives the
same trace. Block hashes chain as the server's do: a block's id is a hash of its parent's and of what
it holds (a system prompt's i-th block, a session's i-th block, a document's i-th block), so two
requests share exactly the blocks of the prefix they share. Blocks hold BLOCK tokens; a prompt's
partial last block is never hashed (as in the server).

- chat: sessions of a few turns (geometric, mean TURNS), each turn adding a user message and a reply
  to the conversation; each session opens with one of SYSTEMS system prompts, Zipf-popular; think
  times exponential.
- agent: coding-agent sessions over one of three long system prompts with tool lists, whose context
  grows by a tool result and a reply each step to tens of thousands of tokens.
- rag: one system prompt, then one of DOCUMENTS retrieved documents (Zipf-popular), then a question.
- scan: chat traffic with floods of one-off long prompts (a batch job's scan) in between.
- mix: three tenants (chat, agent, rag) interleaved in time, each with its own salt.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcache.blocktrace import TraceRecord

BLOCK = 32


def block_id(parent: str, content: str) -> str:
    return hashlib.blake2b(f"{parent}|{content}".encode(), digest_size=8).hexdigest()


def chain(parent: str, prefix: str, num_blocks: int, start: int = 0) -> list[str]:
    """Blocks start..num_blocks-1 of a run whose blocks hold `prefix`:<index>, chained from `parent`."""
    blocks = []
    for index in range(start, num_blocks):
        parent = block_id(parent, f"{prefix}:{index}")
        blocks.append(parent)
    return blocks


@dataclass(frozen=True, slots=True)
class Chat:
    sessions: int = 600
    systems: int = 20
    system_tokens: int = 1024
    zipf: float = 1.2
    turns: float = 4.0  # mean turns per session
    turn_tokens: tuple[int, int] = (96, 384)  # a user message and its reply, together
    think_s: float = 30.0
    arrival_s: float = 6.0  # mean gap between new sessions


def session(
    rng: np.random.Generator,
    tenant: str,
    base: tuple[list[str], int],
    key: str,
    steps: int,
    grow: tuple[int, int],
    think_s: float,
    t: float,
) -> list[TraceRecord]:
    """One conversation over `base` (its blocks, and the tokens they stand for): each step adds
    `grow` tokens and asks again."""
    records: list[TraceRecord] = []
    base_blocks, context = base
    for _ in range(steps):
        context += int(rng.integers(*grow))
        own = chain(base_blocks[-1], key, context // BLOCK, len(base_blocks))
        records.append(TraceRecord(t, tenant, tuple(base_blocks + own), BLOCK))
        t += rng.exponential(think_s)
    return records


def chat(params: Chat, rng: np.random.Generator, tenant: str = "t0", start: float = 0.0) -> list[TraceRecord]:
    records: list[TraceRecord] = []
    t = start
    for number in range(params.sessions):
        t += rng.exponential(params.arrival_s)
        system = min(int(rng.zipf(params.zipf)), params.systems) - 1
        base = chain(tenant, f"system-{system}", params.system_tokens // BLOCK)
        turns = int(rng.geometric(1 / params.turns))
        start_at = (base, params.system_tokens)
        records += session(rng, tenant, start_at, f"{tenant}-s{number}", turns, params.turn_tokens, params.think_s, t)
    return records


@dataclass(frozen=True, slots=True)
class Agent:
    sessions: int = 40
    prompt_tokens: int = 6000  # system prompt and tool list: one of three agents
    steps: tuple[int, int] = (20, 60)
    step_tokens: tuple[int, int] = (300, 1500)
    think_s: float = 8.0
    arrival_s: float = 45.0


def agent(params: Agent, rng: np.random.Generator, tenant: str = "t0", start: float = 0.0) -> list[TraceRecord]:
    records: list[TraceRecord] = []
    t = start
    for number in range(params.sessions):
        t += rng.exponential(params.arrival_s)
        base = chain(tenant, f"agent-{number % 3}", params.prompt_tokens // BLOCK)
        steps = int(rng.integers(*params.steps))
        start_at = (base, params.prompt_tokens)
        records += session(rng, tenant, start_at, f"{tenant}-a{number}", steps, params.step_tokens, params.think_s, t)
    return records


@dataclass(frozen=True, slots=True)
class Rag:
    requests: int = 3000
    documents: int = 400
    zipf: float = 1.1
    system_tokens: int = 512
    document_tokens: int = 1536
    question_tokens: int = 64
    arrival_s: float = 1.0


def rag(params: Rag, rng: np.random.Generator, tenant: str = "t0", start: float = 0.0) -> list[TraceRecord]:
    system = chain(tenant, "rag-system", params.system_tokens // BLOCK)
    records: list[TraceRecord] = []
    t = start
    for request in range(params.requests):
        t += rng.exponential(params.arrival_s)
        document = min(int(rng.zipf(params.zipf)), params.documents) - 1
        docs = chain(system[-1], f"doc-{document}", params.document_tokens // BLOCK)
        total = (params.system_tokens + params.document_tokens + params.question_tokens) // BLOCK
        question = chain(docs[-1], f"{tenant}-q{request}", total, len(system) + len(docs))
        records.append(TraceRecord(t, tenant, tuple(system + docs + question), BLOCK))
    return records


@dataclass(frozen=True, slots=True)
class Scan:
    floods: int = 6
    flood_prompts: int = 150
    flood_tokens: int = 4096
    gap_s: float = 0.5  # between a flood's prompts


def scan(params: Scan, rng: np.random.Generator, tenant: str = "t0") -> list[TraceRecord]:
    steady = chat(Chat(), rng, tenant)
    end = max(r.t for r in steady)
    records = list(steady)
    for flood in range(params.floods):
        t = end * (flood + 0.5) / params.floods
        for prompt in range(params.flood_prompts):
            blocks = chain(tenant, f"scan-{flood}-{prompt}", params.flood_tokens // BLOCK)
            records.append(TraceRecord(t + prompt * params.gap_s, tenant, tuple(blocks), BLOCK))
    return records


def mix(rng: np.random.Generator) -> list[TraceRecord]:
    return (
        chat(Chat(sessions=300), rng, "t1") + agent(Agent(sessions=20), rng, "t2") + rag(Rag(requests=1500), rng, "t3")
    )


KINDS = {
    "chat": lambda rng: chat(Chat(), rng),
    "agent": lambda rng: agent(Agent(), rng),
    "rag": lambda rng: rag(Rag(), rng),
    "scan": lambda rng: scan(Scan(), rng),
    "mix": mix,
}


def generate(kind: str, seed: int = 0) -> list[TraceRecord]:
    return sorted(KINDS[kind](np.random.default_rng(seed)), key=lambda record: record.t)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = generate(args.kind, args.seed)
    args.out.write_text("".join(record.line() + "\n" for record in records))
    print(f"{len(records)} requests, {sum(len(r.blocks) for r in records)} block lookups -> {args.out}")


if __name__ == "__main__":
    main()
