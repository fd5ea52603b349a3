"""The verifier: a learned second opinion on a (cached question, new question) pair.

Rule guards catch what has a name (a number, a negation, a date). They cannot tell "A replaced B"
from "B replaced A", or "in 1846, X described it" (same meaning) from "X described it for Y" (a role
moved): MiniLM puts both kinds above 0.95. The verifier reads the two word-piece sequences jointly:

    word pieces -> MiniLM's own (frozen) input embeddings + 3 alignment bits per piece
      -> a 64-wide projection, two residual convolutions (each piece sees its neighbours: roles
         are local order) -> soft alignment of every piece with the other side's pieces
      -> compare (h, aligned, h - aligned, h * aligned) -> max/mean pool, both sides, symmetric
      -> with 5 pair features (cosine, unmatched pieces, kept bigrams, same bag) -> a logit;
    the mean logit of 5 such scorers trained from different seeds -> P(same answer)

It reuses the embedder's tokenizer and embedding table (nothing of MiniLM is shipped twice); its own
weights (5 x ~83k parameters) are `verifier.safetensors`, produced by `python -m evals.train_verifier`
(seeded; the training data and its provenance are listed in evals/data/README.md). It costs ~2.6 ms
a pair on one CPU thread right after an embedding, 0.22x one MiniLM query embedding (evals.bench_verifier).
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .guards import GuardReason, Verdict

WEIGHTS_FILE = Path(__file__).with_name("verifier.safetensors")  # trained on every PAWS training pair; fixed bars
# Trained without the pairs set apart for calibration (semantic/calibration.py): the false-hit bound's verifier
CALIBRATED_FILE = Path(__file__).with_name("verifier_calibrated.safetensors")
FORMAT_VERSION = 2  # 2: an ensemble of scorers ("members" in the metadata)
WIDTH = 64
MAX_PIECES = 64  # per side; a cached question is at most ~1,000 characters, mostly far shorter
NUM_PIECE_BITS = 3  # per piece: occurs on the other side, its left neighbour kept, its right neighbour kept
NUM_PAIR_FEATURES = 5
# The guards that judge word order and roles by rule, which the verifier reads better: at its higher
# bar it may overrule them. Every other guard (numbers, negation, dates, units...) names a fact, and stands.
OVERRULABLE: frozenset[GuardReason] = frozenset({"order", "direction", "substitution"})


@dataclass(frozen=True, slots=True)
class Settings:
    """Thresholds on P(same answer), chosen by train_verifier on held-out pairs and stored with the weights.
    `accept`: the verifier's bar when no guard objects. `overrule`: the higher bar at which it may
    overrule the word-order guards (OVERRULABLE: order, direction, substitution), which it judges better."""

    accept: float = 0.5
    overrule: float = 0.9

    def bar(self, objected: bool) -> float:
        """The probability a reviewed pair needs to be served (`objected`: a word-order guard objects)."""
        return self.overrule if objected else self.accept


def reviewable(verdict: Verdict) -> bool:
    """Whether the verifier is asked at all: above the threshold, and no guard that names a fact objects."""
    objections = set(verdict.reasons)
    return "below_threshold" not in objections and objections <= OVERRULABLE


class PairScorer(nn.Module):
    """Logit of P(same answer) for padded batches of embedded pieces (batch, pieces, 384 + 3)."""

    def __init__(self, dim_in: int, width: int = WIDTH):
        super().__init__()
        self.project = nn.Linear(dim_in + NUM_PIECE_BITS, width)
        self.context = nn.ModuleList(nn.Conv1d(width, width, 3, padding=1) for _ in range(2))
        self.compare = nn.Sequential(nn.Linear(4 * width, width), nn.GELU())
        self.decide = nn.Sequential(nn.Linear(4 * width + NUM_PAIR_FEATURES, width), nn.GELU(), nn.Linear(width, 1))

    def encode(self, pieces: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.project(pieces) * mask[..., None]
        for conv in self.context:
            hidden = (hidden + F.gelu(conv(hidden.transpose(1, 2)).transpose(1, 2))) * mask[..., None]
        return hidden

    def forward(self, pieces_a, mask_a, pieces_b, mask_b, pair_features) -> torch.Tensor:
        hidden_a, hidden_b = self.encode(pieces_a, mask_a), self.encode(pieces_b, mask_b)
        scores = hidden_a @ hidden_b.transpose(1, 2) / math.sqrt(hidden_a.shape[-1])
        scores = scores.masked_fill(~(mask_a[:, :, None] * mask_b[:, None, :]).bool(), -1e4)
        aligned_a = scores.softmax(dim=2) @ hidden_b
        aligned_b = scores.transpose(1, 2).softmax(dim=2) @ hidden_a
        pooled_a = self._pool(hidden_a, aligned_a, mask_a)
        pooled_b = self._pool(hidden_b, aligned_b, mask_b)
        joint = torch.cat([pooled_a + pooled_b, (pooled_a - pooled_b).abs(), pair_features], dim=-1)
        return self.decide(joint).squeeze(-1)

    def _pool(self, hidden, aligned, mask) -> torch.Tensor:
        compared = self.compare(torch.cat([hidden, aligned, hidden - aligned, hidden * aligned], dim=-1))
        maximum = compared.masked_fill(~mask.bool()[..., None], -1e4).max(dim=1).values
        mean = (compared * mask[..., None]).sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.cat([maximum, mean], dim=-1)


class Ensemble(nn.Module):
    """The mean logit of several PairScorers trained from different seeds: one scorer's held-out
    loss varied by seed as much as by epoch; the mean is steadier and ranks pairs better."""

    def __init__(self, dim_in: int, num_members: int):
        super().__init__()
        self.members = nn.ModuleList(PairScorer(dim_in) for _ in range(num_members))

    def forward(self, *inputs) -> torch.Tensor:
        return torch.stack([member(*inputs) for member in self.members]).mean(dim=0)


# -- features: word pieces and their alignment ---------------------------------------------------


def piece_bits(pieces: list[int], other: list[int]) -> np.ndarray:
    """(len(pieces), 3): occurs in `other`; with the same left neighbour there; with the same right one."""
    others = set(other)
    bigrams = set(pairwise(other))
    bits = np.zeros((len(pieces), NUM_PIECE_BITS), dtype=np.float32)
    for i, piece in enumerate(pieces):
        bits[i, 0] = piece in others
        bits[i, 1] = i > 0 and (pieces[i - 1], piece) in bigrams
        bits[i, 2] = i + 1 < len(pieces) and (piece, pieces[i + 1]) in bigrams
    return bits


def pair_features(pieces_a: list[int], pieces_b: list[int], cosine: float) -> np.ndarray:
    """Symmetric in a and b, as the whole scorer is: cosine, the smaller and the larger share of
    pieces without a counterpart, the share of bigrams kept, whether the bags of pieces are equal."""
    bag_a, bag_b = Counter(pieces_a), Counter(pieces_b)
    bigrams_a, bigrams_b = Counter(pairwise(pieces_a)), Counter(pairwise(pieces_b))
    kept_bigrams = sum((bigrams_a & bigrams_b).values()) / max(1, min(len(pieces_a), len(pieces_b)) - 1)
    unmatched = sorted(
        [sum((bag_a - bag_b).values()) / max(1, len(pieces_a)), sum((bag_b - bag_a).values()) / max(1, len(pieces_b))]
    )
    return np.array([cosine, *unmatched, kept_bigrams, float(bag_a == bag_b)], dtype=np.float32)


@dataclass(frozen=True, slots=True)
class PairInputs:
    """One padded batch, ready for PairScorer."""

    pieces_a: torch.Tensor
    mask_a: torch.Tensor
    pieces_b: torch.Tensor
    mask_b: torch.Tensor
    pair_features: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """PairScorer's arguments, in order."""
        return self.pieces_a, self.mask_a, self.pieces_b, self.mask_b, self.pair_features


class Featurizer:
    """Texts -> PairInputs, with MiniLM's tokenizer and its frozen input-embedding table."""

    def __init__(self, tokenizer, table: torch.Tensor, lock: threading.Lock):
        self.tokenizer = tokenizer
        self.table = table
        # the tokenizer is shared with the embedder, which calls it with other truncation settings;
        # a fast tokenizer changes those settings in place ("Already borrowed" when two threads
        # overlap), so both hold the embedder's lock
        self.lock = lock

    @classmethod
    def from_minilm(cls, embedder) -> Featurizer:
        transformer = embedder.model[0].auto_model
        return cls(embedder.model.tokenizer, transformer.embeddings.word_embeddings.weight.detach(), embedder.lock)

    def pieces(self, texts: list[str]) -> list[list[int]]:
        with self.lock:
            encoded = self.tokenizer(texts, add_special_tokens=False, truncation=True, max_length=MAX_PIECES)
        return [ids or [self.tokenizer.unk_token_id] for ids in encoded["input_ids"]]

    def batch(self, lefts: list[str], rights: list[str], cosines: list[float]) -> PairInputs:
        pieces_a, pieces_b = self.pieces(lefts), self.pieces(rights)
        side_a = self._side(pieces_a, pieces_b)
        side_b = self._side(pieces_b, pieces_a)
        features = np.stack([pair_features(a, b, c) for a, b, c in zip(pieces_a, pieces_b, cosines)])
        return PairInputs(*side_a, *side_b, torch.from_numpy(features))

    def _side(self, pieces: list[list[int]], others: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(len(p) for p in pieces)
        dim = self.table.shape[1] + NUM_PIECE_BITS
        embedded = torch.zeros(len(pieces), length, dim)
        mask = torch.zeros(len(pieces), length)
        for row, (ids, other) in enumerate(zip(pieces, others)):
            embedded[row, : len(ids), :-NUM_PIECE_BITS] = self.table[ids]
            embedded[row, : len(ids), -NUM_PIECE_BITS:] = torch.from_numpy(piece_bits(ids, other))
            mask[row, : len(ids)] = 1.0
        return embedded, mask


# -- serving -------------------------------------------------------------------------------------


WARM_UP_PAIRS = [
    ("How do I reset my password?", "What is the way to reset my password?"),
    ("Is tea healthier than coffee for people who sleep badly at night?", "Is coffee healthier than tea?"),
]


def compiled(scorer: Ensemble, featurizer: Featurizer) -> torch.jit.ScriptModule:
    """The ensemble traced and frozen by TorchScript: the same arithmetic, the per-operation Python
    overhead gone (3 members: a forward in 0.87 ms instead of 1.56 ms, one thread). The trace holds for any length:
    nothing in the forward branches on a shape. Warmed up here, so no request pays the first runs."""
    import warnings

    cached, query = WARM_UP_PAIRS[0]
    example = featurizer.batch([cached], [query], [0.9])
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python scalars (the fixed width)
        traced = torch.jit.freeze(torch.jit.trace(scorer, example.tensors()))
        for cached, query in WARM_UP_PAIRS * 2:
            traced(*featurizer.batch([cached], [query], [0.9]).tensors())
    return traced


class Verifier:
    """P(a cached answer serves the new question), from the trained weights."""

    def __init__(self, featurizer: Featurizer, scorer: Ensemble | torch.jit.ScriptModule, settings: Settings):
        self.featurizer = featurizer
        self.scorer = scorer
        self.settings = settings

    @classmethod
    def load(cls, embedder, path: Path = WEIGHTS_FILE) -> Verifier:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
        if int(meta.get("format_version", 0)) != FORMAT_VERSION:
            raise ValueError(f"{path}: verifier format {meta.get('format_version')}, expected {FORMAT_VERSION}")
        featurizer = Featurizer.from_minilm(embedder)
        scorer = Ensemble(featurizer.table.shape[1], int(meta["members"]))
        scorer.load_state_dict(load_file(str(path)))
        return cls(featurizer, compiled(scorer.eval(), featurizer), Settings(**json.loads(meta["settings"])))

    def review(self, query: str, cached: str, verdict: Verdict) -> Verdict:
        """The guards' verdict, seen again. Pairs below the cosine threshold or refused by a
        guard that names a fact are not scored. Others are served when P(same answer) reaches
        `accept` (no objection) or `overrule` (only word-order objections)."""
        if not reviewable(verdict):
            return verdict
        probability = self.probability(query, cached, verdict.score)
        if probability >= self.settings.bar(objected=bool(verdict.reasons)):
            return Verdict(True, verdict.score, (), probability, overruled=verdict.reasons)
        return Verdict(False, verdict.score, (*verdict.reasons, "verifier"), probability)

    def probability(self, query: str, cached: str, cosine: float) -> float:
        with torch.inference_mode():
            inputs = self.featurizer.batch([cached], [query], [cosine])
            logit = self.scorer(*inputs.tensors())
        return float(torch.sigmoid(logit)[0])
