"""Speculative decoding: draft tokens a row may generate next, verified by the model in the step that
feeds them (gateway/engine/worker.py), so an answer only comes faster, never different.

    Proposer.propose(generated, k) -> up to k draft tokens       (one per row, holds its own index)
      prompt   prompt lookup: the tokens that followed the latest earlier occurrence of the row's last
               few tokens in its prompt and reply (Saxena's prompt-lookup decoding; LLMA, Yang et al. 2023)
      cache    a reference answer, from the caches the gateway looked in for this very request (the
               exact entry of the same prompt under other decoding parameters, a semantic candidate
               its guards refused, the reply to the same question earlier in the conversation)
    Drafter    a row's proposers, its adaptive k and its counts per proposer

Verification (the worker) draws each fed position as plain decoding would (the sampler's key is the
seed's and the token's index: Sampler.draw) and keeps the drafts while they equal those draws; the
draw at the first mismatch is the row's next token. Greedy, that is the longest matching prefix plus
one token. Sampled, a draft is kept with probability p(draft) and otherwise the token is a draw from p
without it, which is speculative sampling (Leviathan et al. 2023: accept with min(1, p/q), resample
from the residual) for a draft distribution q that puts all its mass on the draft: the answer is the
one plain decoding draws, token for token, seeded or not.

Drafts are for rows without an output grammar (its matcher moves one token at a time). A recurrent
state cannot be trimmed back past a rejected draft: where a hybrid model's layers keep a state after
each fed token (ModelRunner.draft_states), each row of a batch takes the one after its last kept
token; elsewhere a hybrid model drafts for a lone row, which on a rejection goes back to its state
before the step and runs the tokens it keeps again (DecodeRows._drop_rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

MAX_DRAFT = 8  # tokens a row drafts at most in one step
FIRST_DRAFT = 4  # k of a row's first draft
NGRAM_SIZES = (4, 3, 2)  # prompt lookup matches the longest of these tail lengths first
RATE_MEMORY = 0.8  # the weight of a row's earlier drafts in its acceptance rate, at each verification
MAX_PAUSE_STEPS = 63  # the longest pause of a row whose drafts keep failing
# What verifying costs, in rows' decode steps (a row-step: a plain step's time over its rows),
# measured on the demo model (2 CPU cores, medians of 21 calls, rows of 200 tokens). A step that
# feeds drafts leaves the one-token path: one row fed 1, 2, 4, 8 drafts took 13.2, 17.4, 17.5,
# 20.5 ms against 10.9 plain, about 0.3 of a step plus 0.1 a token; 4 rows fed 4 each 27.4 against
# 16.4 ms, 16 rows fed 4 each 56.1 against 20.7 ms (0.43 a token, compute-bound). A batch's ragged
# trim rolls every row's KV: 10 ms at 16 rows of ~300 tokens against a 27 ms step (0.37 of a
# row-step per row); a lone row's trim is a cut.
VERIFY_COST = 0.3  # per row, for any step that feeds drafts
FED_TOKEN_COST = 0.25  # per token fed beyond the rows' pending ones
TRIM_COST = 0.35  # per row, for a batch's trim
REPLAY_COST = 1.0  # a hybrid model's rejected draft: the row's kept tokens run again, about one step
ENGINE_MEMORY = 0.99  # the weight of the engine's earlier verifications in a proposer's rate
PRIOR_WEIGHT = 2.0  # the engine's rate counts as this many draft tokens in a row's own
STEP_FADE = 0.999  # the engine's record of a proposer halves in ~700 steps without verifications


class Proposer(Protocol):
    name: str  # as metrics and the X-Strata-Speculative header say it: prompt | cache
    first_rate: float  # the share of its draft tokens expected to be kept, before any was verified

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the row may generate after `generated` (its reply so far); [] for none."""
        ...


@dataclass(slots=True)
class NgramIndex:
    """A token list and, for each n-gram of the sizes asked (longest first), the index of the token that
    followed its latest occurrence. An n-gram is indexed once a token follows it, so the list's own tail
    never matches itself."""

    sizes: tuple[int, ...] = NGRAM_SIZES
    tokens: list[int] = field(default_factory=list)
    after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            self.tokens.append(token)
            for n in self.sizes:
                if end >= n:
                    self.after[tuple(self.tokens[end - n : end])] = end

    def continuation(self, tail: Sequence[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest indexed n-gram ending `tail`."""
        for n in self.sizes:
            if len(tail) >= n and (at := self.after.get(tuple(tail[-n:]))) is not None:
                return self.tokens[at : at + k]
        return []


class PromptLookup:
    """Drafts from the row's own prompt and reply: what followed the same few tokens before."""

    name = "prompt"
    first_rate = 0.6  # a guess, soon replaced by what this engine's rows measure

    def __init__(self, prompt: Sequence[int]):
        self.index = NgramIndex()
        self.index.extend(prompt)
        self.num_prompt_tokens = len(prompt)

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        seen = len(self.index.tokens) - self.num_prompt_tokens
        self.index.extend(generated[seen:])
        return self.index.continuation(self.index.tokens[-max(NGRAM_SIZES) :], k)


class ReferenceLookup:
    """Drafts from a reference answer: its next tokens while the reply follows it from the start, else
    what followed the reply's last few tokens in it (the reply diverged and may join it again)."""

    name = "cache"
    first_rate = 0.9  # an answer the caches kept for this very question (or one much like it)

    def __init__(self, reference: Sequence[int]):
        self.index = NgramIndex((4, 3, 2, 1))
        self.index.extend(reference)
        self.num_followed = 0  # the reply's first tokens, checked equal to the reference's
        self.diverged = False  # the reply left the reference (it never follows it from the start again)

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        reference, done = self.index.tokens, len(generated)
        if not self.diverged:  # only the tokens generated since the last call are compared
            self.diverged = reference[self.num_followed : done] != list(generated[self.num_followed :])
            self.num_followed = done
        if not self.diverged:
            return reference[done : done + k]
        return self.index.continuation(generated[-4:], k)


@dataclass(slots=True)
class ProposerCounts:
    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # of them, those the model's draws confirmed


@dataclass(slots=True)
class Acceptance:
    """What each proposer's drafts have been worth lately over every row of the engine: the rate a
    new row's drafts start from. ENGINE_MEMORY weighs the earlier verifications at each one, and
    every step fades the record by STEP_FADE, so a proposer that stopped paying is tried again after
    a while (the text served changes)."""

    num_seen: dict[str, float] = field(default_factory=dict)
    num_kept: dict[str, float] = field(default_factory=dict)

    def rate(self, proposer: Proposer) -> float:
        """The proposer's rate lately, starting from its first_rate (weighing PRIOR_WEIGHT tokens)."""
        name = proposer.name
        kept = self.num_kept.get(name, 0.0) + PRIOR_WEIGHT * proposer.first_rate
        return kept / (self.num_seen.get(name, 0.0) + PRIOR_WEIGHT)

    def fade(self) -> None:
        for counts in (self.num_seen, self.num_kept):
            for proposer in counts:
                counts[proposer] *= STEP_FADE

    def record(self, proposer: str, num_seen: int, num_kept: int) -> None:
        self.num_seen[proposer] = ENGINE_MEMORY * self.num_seen.get(proposer, 0.0) + num_seen
        self.num_kept[proposer] = ENGINE_MEMORY * self.num_kept.get(proposer, 0.0) + num_kept


@dataclass(slots=True)
class Drafter:
    """One row's proposers (asked in order, the first with a draft drafts), its k, its acceptance
    rate and its counts.

    k adapts to the row's last draft: all of it accepted doubles k (up to MAX_DRAFT), otherwise k
    becomes what was accepted plus one. The rate estimates the chance that a draft token is kept when
    the ones before it were, from the row's recent drafts (each verification weighs RATE_MEMORY of
    the ones before) and, weighing PRIOR_WEIGHT tokens, the engine's rate for the proposer (shared;
    for the row's first draft, the proposer's first_rate, so that every row tries once): batch_width()
    feeds drafts only where the tokens they are expected to save pay for verifying them. A draft with
    nothing kept pauses the row's drafting for its next 1, 3, 7, ... chances to draft (up to
    MAX_PAUSE_STEPS), doubling with each such draft in a row; the row then starts again from the
    engine's rate. On text no proposer predicts, a row soon costs what plain decoding does."""

    proposers: list[Proposer]
    k: int = FIRST_DRAFT
    num_seen: float = 0.0  # draft tokens judged lately (weighed): kept ones and first rejections
    num_kept: float = 0.0  # of them, kept
    num_misses: int = 0  # drafts in a row with nothing kept
    num_paused_steps: int = 0  # chances to draft the row lets pass before it drafts again
    last: Proposer | None = None  # the proposer of the draft being verified
    counts: dict[str, ProposerCounts] = field(default_factory=dict)
    shared: Acceptance = field(default_factory=Acceptance)  # the engine's, over all rows

    @property
    def rate(self) -> float:
        proposers = [self.last] if self.last is not None else self.proposers  # none drafted yet: the best
        # the row's first verified draft is judged by what its proposer promises (every row tries),
        # the later ones by the engine's record of the proposer
        prior = max((p.first_rate if not self.counts else self.shared.rate(p) for p in proposers), default=0.0)
        return (self.num_kept + PRIOR_WEIGHT * prior) / (self.num_seen + PRIOR_WEIGHT)

    def draft(self, generated: Sequence[int], room: int) -> list[int]:
        """The row's drafts for the next step, at most `room` tokens."""
        if self.num_paused_steps:
            self.num_paused_steps -= 1
            if not self.num_paused_steps:
                self.num_seen = self.num_kept = 0.0
            return []
        limit = min(self.k, room)
        for proposer in self.proposers:
            tokens = list(proposer.propose(generated, limit))[:limit]
            if tokens:
                self.last = proposer
                return tokens
        return []

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        """The step verified num_drafted of the row's drafts (fewer than drafted when the batch's
        width was cut) and kept num_accepted."""
        if not num_drafted or self.last is None:
            return
        counts = self.counts.setdefault(self.last.name, ProposerCounts())
        counts.num_drafted += num_drafted
        counts.num_accepted += num_accepted
        rejected = num_accepted < num_drafted
        self.shared.record(self.last.name, num_accepted + rejected, num_accepted)
        self.num_kept = RATE_MEMORY * self.num_kept + num_accepted
        self.num_seen = RATE_MEMORY * self.num_seen + num_accepted + rejected
        self.k = num_accepted + 1 if rejected else min(2 * self.k, MAX_DRAFT)
        self.num_misses = 0 if num_accepted else self.num_misses + 1
        if self.num_misses:
            self.num_paused_steps = min(2**self.num_misses - 1, MAX_PAUSE_STEPS)


def batch_width(drafts: list[list[int]], rates: list[float], max_width: int, replay: bool = False) -> int:
    """How many draft tokens each row of the step is fed (rows with fewer are padded): the width whose
    expected kept tokens, less what verifying, the step's extra tokens and a batch's trim cost, is the
    largest; 0 when no width pays. A draft's j-th token is expected to be kept with probability rate^j.
    `replay`: a rejection runs the kept tokens again (a hybrid model's lone row): about a step, paid
    unless the whole draft is kept."""
    rows, longest = len(drafts), max(0, min(max(map(len, drafts), default=0), max_width))
    fixed = VERIFY_COST * rows + (TRIM_COST * rows if rows > 1 and not replay else 0.0)
    kept = [0.0] * (longest + 1)  # kept[w]: expected tokens kept over the rows at width w
    for own, rate in zip(drafts, rates):
        expected = 0.0
        for width in range(1, longest + 1):
            if width <= len(own):
                expected += rate**width
            kept[width] += expected
    replays = [REPLAY_COST * (1 - min(rates, default=0.0) ** width) if replay else 0.0 for width in range(longest + 1)]
    gains = [kept[width] - FED_TOKEN_COST * rows * width - fixed - replays[width] for width in range(longest + 1)]
    best = max(range(longest + 1), key=gains.__getitem__)
    return best if gains[best] > 0 else 0


@dataclass(frozen=True, slots=True)
class SpeculativeReport:
    """What speculation did for one answer: per proposer that drafted, (drafted, accepted) tokens."""

    counts: tuple[tuple[str, int, int], ...] = ()

    @property
    def num_drafted(self) -> int:
        return sum(drafted for _, drafted, _ in self.counts)

    @property
    def num_accepted(self) -> int:
        return sum(accepted for _, _, accepted in self.counts)

    @classmethod
    def of(cls, drafter: Drafter | None) -> SpeculativeReport:
        if drafter is None:
            return cls()
        return cls(tuple((name, c.num_drafted, c.num_accepted) for name, c in sorted(drafter.counts.items())))


def default_proposers(prompt: Sequence[int], references: Sequence[Sequence[int]]) -> list[Proposer]:
    """A row's proposers: its references first (a whole answer to follow), then prompt lookup."""
    return [*(ReferenceLookup(reference) for reference in references if reference), PromptLookup(prompt)]
