"""Drawing a row's next token: greedy, or sampled at a temperature with top-k, min-p and nucleus.

A sampled draw runs on numpy over the row's evaluated logits, with one uniform number u per token:
the token is the first whose cumulative probability (over the tokens the filters keep) passes u, an
exact draw from their distribution. u comes from the request's seed and the token's index alone
(SplitMix64), so a seeded row draws the same tokens alone, in a batch, or verifying drafts.

Why not MLX's own ops on the CPU: `mx.random.categorical` draws a Gumbel number for every entry of
the vocabulary, and the nucleus and top-k sort all of it, per row. Measured on a 2-core EPYC, 16 rows
of a 151,936-token vocabulary (Qwen's; the demo model has 8,192), one step's draws: temperature 1
alone 64 ms, with top_p 0.95 392 ms, with top_k 40 339 ms, where the step's model call takes ~30;
here 8, 16 and 12 ms. The exponential, the sums and a partition over the vocabulary are numpy's
vectorised loops, and the nucleus sorts only the most likely tokens (all of them only when those do
not reach top_p, as on a random-init model's flat logits). evals.bench_sampling prints both.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np

from .constraint import MAX_CLOSING_TOKENS, Grammars
from .threads import split_rows
from .types import Sampling

CLOSING_CHECK_TOKENS = 8  # how often a grammar's distance to closing is measured (and the margin kept)
NUCLEUS_CANDIDATES = 1024  # the nucleus is looked for among this many most likely tokens first (x8 until found)
MASK64 = (1 << 64) - 1
PICK_BLOCK = 1024  # tokens summed together when finding where u falls
# A step's sampled rows are split across the cores from this many vocabulary entries in all
# (evals.bench_sampling, 2 cores: 16 rows of 8,192 entries split 0.65-0.98x as fast as on one thread,
# 16 rows of 151,936 1.3-1.6x).
SPLIT_FROM_ENTRIES = 1 << 19


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log probability and the most likely alternatives (token id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


Generated = list[int] | tuple[int, ...]  # the tokens a sequence has generated so far


KEY_STRIDE = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: token indices spread over the key space


class Sampler:
    """Greedy at temperature 0; otherwise temperature, then top-k, min-p and nucleus sampling, seeded
    when asked. Penalties, logit bias and the grammar's mask apply first, in both cases. Log
    probabilities are those of the distribution after them, before temperature (what was choosable)."""

    def __init__(self, sampling: Sampling, grammars: Grammars | None = None):
        self.sampling = sampling
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed = seed % 2**64  # negative seeds are valid in the API
        self.bias = None
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            self.bias = (mx.array(ids, dtype=mx.int32), mx.array(values, dtype=mx.float32))
        if sampling.grammar and grammars is None:
            raise ValueError("a request with a grammar needs the model's Grammars")
        self.matcher = grammars.matcher(sampling.grammar) if sampling.grammar and grammars else None
        self.closing = False  # under a grammar: the tokens left are needed to close the output
        self.tokens_to_close = 0  # as last measured
        # With top_logprobs: the last draw's (chosen logprob, top ids, top logprobs), evaluated.
        self.last_logprobs: tuple[mx.array, mx.array, mx.array] | None = None

    def __call__(self, logits: mx.array, generated: Generated = ()) -> int:
        """The next token after the tokens this sequence has generated so far (logprobs kept when asked)."""
        [(token, logprobs)] = draw_all([Draw(self, logits, generated)])
        self.last_logprobs = logprobs or None
        return token

    def prepare(self, logits: mx.array, generated: Generated) -> mx.array:
        """The logits this row draws from, lazily: penalties, bias and the grammar's mask applied."""
        logits = self._adjusted(logits, generated)
        if self.matcher is not None:
            logits = self.matcher.mask(logits, closing=self._closing(len(generated)))
        return logits

    def choose(self, logits: np.ndarray, index: int) -> int:
        """Token `index` of the reply, sampled from prepared logits with u from the seed and the
        index alone, so a token is the same draw however many positions a step verified
        (speculative decoding). numpy only: any thread may run it."""
        return sample(logits, self.sampling, uniform(self.seed + index * KEY_STRIDE))

    def plain_greedy(self, generated: Generated) -> bool:
        """Its next draw is the logits' argmax as they are: temperature 0 and nothing that changes
        them (bias, penalties after some output, a grammar) or asks for more (logprobs)."""
        sampling = self.sampling
        untouched = not self._adjusts(generated) and self.matcher is None
        return sampling.temperature == 0.0 and untouched and sampling.top_logprobs is None

    def _adjusts(self, generated: Generated) -> bool:
        """A logit bias, or penalties once there is output to penalise (_adjusted() applies them)."""
        sampling = self.sampling
        return bool(self.bias or (generated and (sampling.presence_penalty or sampling.frequency_penalty)))

    def _closing(self, num_generated: int) -> bool:
        """Whether the grammar's output must close now (gateway/engine/constraint.py). The tokens
        closing takes are measured (a dry run of ~0.1 ms a token) every CLOSING_CHECK_TOKENS tokens,
        and at every token once the budget left is within 3 intervals of them (one token, an escape
        such as \\u, can add several); closing starts with one interval to spare."""
        left = self.sampling.max_tokens - num_generated
        if self.closing or left > MAX_CLOSING_TOKENS:
            return self.closing
        near = left <= self.tokens_to_close + 3 * CLOSING_CHECK_TOKENS
        if self.matcher is not None and (near or num_generated % CLOSING_CHECK_TOKENS == 0):
            self.tokens_to_close = self.matcher.tokens_to_close()
            self.closing = left <= self.tokens_to_close + CLOSING_CHECK_TOKENS
        return self.closing

    @property
    def closed_early(self) -> bool:
        """The grammar's output was closed before the model ended it: cut by the token budget."""
        return self.closing

    def accept(self, token: int) -> None:
        """The row took `token` (not an end-of-sequence token): the grammar moves past it."""
        if self.matcher is not None:
            self.matcher.accept(token)

    def logprobs(self, token: int) -> TokenLogprob:
        """The last draw's log probability of `token` (the drawn one) and its top_logprobs alternatives."""
        assert self.last_logprobs is not None, "asked only of rows that want top_logprobs, after a draw"
        chosen, ids, values = self.last_logprobs
        top: list[tuple[int, float]] = list(zip(ids.tolist(), values.tolist()))  # type: ignore[arg-type]  # 1-D arrays
        return TokenLogprob(token, float(cast(float, chosen.item())), tuple(top))

    def _adjusted(self, logits: mx.array, generated: Generated) -> mx.array:
        sampling = self.sampling
        if not self._adjusts(generated):
            return logits
        logits = logits.astype(mx.float32)
        if self.bias is not None:
            logits = logits.at[self.bias[0]].add(self.bias[1])
        if generated and sampling.frequency_penalty:
            logits = logits.at[mx.array(generated, dtype=mx.int32)].add(-sampling.frequency_penalty)  # once per use
        if generated and sampling.presence_penalty:
            logits = logits.at[mx.array(sorted(set(generated)), dtype=mx.int32)].add(-sampling.presence_penalty)
        return logits


def _logprobs(logits: mx.array, token: int, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """(logprob of token, the k most likely ids, their logprobs), lazily."""
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits)
    k = min(k, logp.shape[-1])
    top = mx.argpartition(-logp, k - 1)[:k] if k else mx.zeros((0,), dtype=mx.int32)
    top = top[mx.argsort(-logp[top])]  # most likely first
    return logp[token], top, logp[top]


@dataclass(frozen=True, slots=True)
class Draw:
    """One token to draw: the row's sampler, its logits at the position, and what it generated before."""

    sampler: Sampler
    logits: mx.array
    generated: Generated


def draw_all(draws: list[Draw]) -> list[tuple[int, tuple]]:
    """Each draw's token and, when its request asks for top_logprobs, their (chosen logprob, top ids,
    top logprobs) arrays, evaluated (else ()), with one evaluation of every row's prepared logits.
    Greedy rows take their argmax; sampled rows are drawn on numpy, split across the cores
    (threads.split_rows)."""
    prepared = [draw.sampler.prepare(draw.logits, draw.generated) for draw in draws]
    greedy = {i: mx.argmax(p) for i, (p, d) in enumerate(zip(prepared, draws)) if d.sampler.sampling.temperature == 0.0}
    sampled = [i for i in range(len(draws)) if i not in greedy]
    rows = [prepared[i].astype(mx.float32) for i in sampled]
    mx.eval(*greedy.values(), *rows)
    tokens = {i: as_token(token) for i, token in greedy.items()}
    values = [np.asarray(row) for row in rows]  # on this thread: the helpers run numpy only

    def choose(first: int, last: int) -> None:
        for i, row in zip(sampled[first:last], values[first:last]):
            tokens[i] = draws[i].sampler.choose(row, len(draws[i].generated))

    entries = sum(row.size for row in values)
    split_rows(choose, len(sampled), entries if entries >= SPLIT_FROM_ENTRIES else 0)  # 0: one part
    logprobs = [
        _logprobs(p, tokens[i], d.sampler.sampling.top_logprobs) if d.sampler.sampling.top_logprobs is not None else ()
        for i, (p, d) in enumerate(zip(prepared, draws))
    ]
    mx.eval(*[a for arrays in logprobs for a in arrays])
    return [(tokens[i], logprobs[i]) for i in range(len(draws))]


def uniform(key: int) -> float:
    """A number in [0, 1) from a 64-bit key: SplitMix64's finaliser, its top 53 bits."""
    z = (key + KEY_STRIDE) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) / 2**53


def sample(logits: np.ndarray, sampling: Sampling, u: float) -> int:
    """The token at u (in [0, 1)) of the distribution the sampling settings leave (weights())."""
    return pick(weights(logits, sampling), u)


def pick(kept: np.ndarray, u: float) -> int:
    """The first token whose cumulative weight passes u of the total. The sums run by blocks of
    PICK_BLOCK tokens (a pass of numpy's vectorised sum), then along the one block where u falls: a
    float64 cumulative sum over a whole vocabulary costs ~10x more."""
    whole = kept.size // PICK_BLOCK * PICK_BLOCK
    sums = kept[:whole].reshape(-1, PICK_BLOCK).sum(axis=1)
    if whole < kept.size:
        sums = np.append(sums, kept[whole:].sum())
    block_ends = np.cumsum(sums, dtype=np.float64)
    target = u * block_ends[-1]
    block = int(np.searchsorted(block_ends, target, side="right"))
    if block == block_ends.size:  # u * total rounded up to total: the last token with weight
        return int(np.flatnonzero(kept)[-1])
    start = block * PICK_BLOCK
    inside = kept[start : start + PICK_BLOCK]
    offset = int(
        np.searchsorted(
            np.cumsum(inside, dtype=np.float64), target - (block_ends[block - 1] if block else 0.0), side="right"
        )
    )
    if offset >= inside.size:  # the block's two sums differ in the last bit: its last token with weight
        offset = int(np.flatnonzero(inside)[-1])
    return start + offset


def weights(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Each token's probability up to one factor: softmax(logits / temperature) restricted as the
    filters' MLX versions did — top-k keeps logits at or above the k-th largest, min-p those within
    log(min_p) of the largest, then the nucleus the smallest set of the most likely whose probability
    reaches top_p (ties at its edge kept); the rest weigh 0. The result is this thread's scratch
    array: valid until its next draw."""
    size = logits.size
    scaled = np.multiply(logits, np.float32(1.0 / sampling.temperature), out=_scratch.get("weights", size, np.float32))
    largest = float(scaled.max())
    floor = -math.inf
    if 0 < sampling.top_k < size:
        floor = float(_partitioned(scaled, size - sampling.top_k)[size - sampling.top_k])
    if sampling.min_p:
        floor = max(floor, largest + math.log(sampling.min_p))
    dropped = np.less(scaled, floor, out=_scratch.get("dropped", size, np.bool_)) if floor > -math.inf else None
    kept = np.exp(np.subtract(scaled, np.float32(largest), out=scaled), out=scaled)
    if dropped is not None:
        kept[dropped] = 0.0
    if sampling.top_p < 1.0:
        kept[np.less(kept, _nucleus_edge(kept, sampling.top_p), out=_scratch.get("dropped", size, np.bool_))] = 0.0
    return kept


def _nucleus_edge(weights: np.ndarray, top_p: float) -> float:
    """The smallest weight the nucleus keeps: sorted by weight, a token is in while the weights
    before it sum to under top_p of the total. Looked for among the NUCLEUS_CANDIDATES heaviest
    first (eight times more while every one of them is in), the whole vocabulary at the last."""
    needed = top_p * float(weights.sum())
    size = weights.size
    count = NUCLEUS_CANDIDATES
    while True:
        count = min(count, size)
        heaviest = np.sort(_partitioned(weights, size - count)[size - count :])[::-1]
        before = np.cumsum(heaviest, dtype=np.float64) - heaviest
        inside = int(np.count_nonzero(before < needed))  # >= 1: the heaviest token always stays
        if inside < count or count == size:
            return float(heaviest[inside - 1])
        count *= 8


def _partitioned(values: np.ndarray, kth: int) -> np.ndarray:
    """A copy of `values` (in scratch) partitioned around its kth smallest."""
    copy = _scratch.get("partition", values.size, values.dtype)
    copy[:] = values
    copy.partition(kth)
    return copy


class _Scratch(threading.local):
    """This thread's work arrays, reused from draw to draw: a fresh array the size of a large
    vocabulary is a fresh mapping whose pages fault in at first touch (151,936 tokens: a draw that
    allocated its arrays took 1.6 ms, one reusing them ~0.6 ms). Every engine's thread has its own."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int, dtype) -> np.ndarray:
        array = self.arrays.get(name)
        if array is None or array.size != size or array.dtype != dtype:
            array = self.arrays[name] = np.empty(size, dtype)
        return array


_scratch = _Scratch()


def as_token(draw: mx.array) -> int:
    """A drawn token id (an integer scalar array; mlx types item() as any number) as an int."""
    return int(cast(int, draw.item()))
