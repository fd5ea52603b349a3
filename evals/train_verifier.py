"""Train the semantic verifier (semantic/verifier.py) and write semantic/verifier.safetensors.

    python -m evals.train_verifier [--seed 2026] [--epochs N] [--out FILE]

Training data (provenance in evals/data/README.md), none of it used to report a number:
- `evals/data/paws_train.tsv`: the PAWS-Wiki dev pairs *not* in `paws_sample.jsonl` (the reported
  sample is never trained on);
- question pairs written here (`written_pairs`): role and direction swaps (a different answer),
  the same question reworded, and swaps that keep the meaning (symmetric relations, a moved
  "on Android" / "in 2019"); and statements in the style of encyclopedia text for the failure
  classes held-out PAWS runs showed: roles swapped across passive and active voice, a phrase attached
  to the other noun, a modifier moved between clauses (with or without a change of meaning). The dev
  set `evals/data/dev.jsonl` is not trained on: it reports.
With --calibrated (the verifier the false-hit bound runs on, `verifier_calibrated.safetensors`, trained
with `--calibrated --epochs 5`), a quarter of the PAWS pairs is first set apart in whole groups of
pairs sharing a sentence: 15% for `python -m evals calibrate` (the bound's evidence) and 10% only to
report how the bound holds on text nothing was tuned on (`python -m evals false-hits --bound`);
neither is trained on. Without it (the fixed-bar verifier, `verifier.safetensors`, 8 epochs) every
PAWS training pair is used. A seeded tenth of each source's rest is held out to pick the epoch and the two fixed bars, which
are stored in the weights' metadata. Deterministic for a seed on one machine (one CPU thread).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from semantic import MiniLMEmbedder, SemanticCache, SemanticSettings, SqliteEntries
from semantic.guards import check
from semantic.verifier import (
    CALIBRATED_FILE,
    FORMAT_VERSION,
    WEIGHTS_FILE,
    Ensemble,
    Featurizer,
    PairScorer,
    Settings,
    reviewable,
)

DATA = Path(__file__).resolve().parent / "data"
BATCH = 64
LEARNING_RATE = 2e-3
EMA_DECAY = 0.99
MEMBERS = 5  # scorers in the ensemble, seeds seed, seed + 1, ...
HELD_OUT = 0.1
WRITTEN_WEIGHT = (
    3  # each written pair is seen this many times an epoch: they are few beside PAWS, and the questions users ask
)


@dataclass(frozen=True, slots=True)
class Example:
    cached: str
    query: str
    label: int  # 1: the cached answer serves the query
    source: str  # "paws" or "written"


def paws_pairs() -> list[Example]:
    with open(DATA / "paws_train.tsv", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [Example(left, right, int(label), "paws") for _, left, right, label in rows]


# (cached, look-alike with another answer, rewording with the same answer); {x} and {y} take two
# different fillers of the named kind.
ASYMMETRIC = [
    (
        "cities",
        "Flights from {x} to {y} tomorrow",
        "Flights from {y} to {x} tomorrow",
        "Tomorrow's flights from {x} to {y}",
    ),
    ("cities", "Is {x} bigger than {y}?", "Is {y} bigger than {x}?", "Is {x} larger than {y}?"),
    (
        "cities",
        "How long is the train from {x} to {y}?",
        "How long is the train from {y} to {x}?",
        "How long does the train from {x} to {y} take?",
    ),
    ("formats", "How do I convert {x} to {y}?", "How do I convert {y} to {x}?", "What's the way to turn {x} into {y}?"),
    (
        "products",
        "How do I migrate from {x} to {y}?",
        "How do I migrate from {y} to {x}?",
        "What are the steps to move from {x} to {y}?",
    ),
    ("products", "Does {x} replace {y}?", "Does {y} replace {x}?", "Is {y} replaced by {x}?"),
    ("products", "Does {x} depend on {y}?", "Does {y} depend on {x}?", "Is {x} dependent on {y}?"),
    (
        "roles",
        "Can a {x} see the {y}'s records?",
        "Can a {y} see the {x}'s records?",
        "Is a {x} able to view the records of the {y}?",
    ),
    (
        "roles",
        "How much does a {x} earn compared to a {y}?",
        "How much does a {y} earn compared to a {x}?",
        "What does a {x} earn relative to a {y}?",
    ),
    (
        "roles",
        "Who pays when a {x} cancels on a {y}?",
        "Who pays when a {y} cancels on a {x}?",
        "If a {x} cancels on a {y}, who pays?",
    ),
    (
        "languages",
        "Is it harder for a {x} speaker to learn {y}?",
        "Is it harder for a {y} speaker to learn {x}?",
        "Do {x} speakers find {y} harder to learn?",
    ),
    (
        "teams",
        "Did {x} beat {y} in the final?",
        "Did {y} beat {x} in the final?",
        "Did {x} win against {y} in the final?",
    ),
    (
        "currencies",
        "How do I exchange {x} for {y}?",
        "How do I exchange {y} for {x}?",
        "How can I swap my {x} for {y}?",
    ),
    (
        "devices",
        "How do I send a file from my {x} to my {y}?",
        "How do I send a file from my {y} to my {x}?",
        "How can I move a file from my {x} over to my {y}?",
    ),
    (
        "accounts",
        "Can I move money from {x} into {y}?",
        "Can I move money from {y} into {x}?",
        "Is it possible to transfer money from {x} into {y}?",
    ),
]
# The failure classes of held-out runs on text from elsewhere (PAWS-style statements): role swaps
# across passive and active voice, a phrase moved to another noun (attachment), a modifier moved
# between clauses. (cached, the roles swapped: another meaning, the same said another way.)
ASYMMETRIC += [
    (
        "people",
        "{x} was succeeded by {y} as head coach.",
        "{y} was succeeded by {x} as head coach.",
        "{y} succeeded {x} as head coach.",
    ),
    (
        "people",
        "{x} defeated {y} in the second round.",
        "{y} defeated {x} in the second round.",
        "In the second round, {y} was defeated by {x}.",
    ),
    (
        "people",
        "{x} was replaced by {y} in the starting line-up.",
        "{y} was replaced by {x} in the starting line-up.",
        "{y} replaced {x} in the starting line-up.",
    ),
    (
        "people",
        "{x} was a student of {y} in Vienna.",
        "{y} was a student of {x} in Vienna.",
        "In Vienna, {x} was taught by {y}.",
    ),
    (
        "people",
        "The song was written by {x} and produced by {y}.",
        "The song was written by {y} and produced by {x}.",
        "{y} produced the song, which {x} wrote.",
    ),
    (
        "people",
        "{x} married {y}, the daughter of a local merchant.",
        "{y} married {x}, the daughter of a local merchant.",
        "{x} married a local merchant's daughter, {y}.",
    ),
    (
        "people",
        "{x} was elected mayor, with {y} as his deputy.",
        "{y} was elected mayor, with {x} as his deputy.",
        "With {y} as his deputy, {x} was elected mayor.",
    ),
    (
        "people",
        "The brother of {x} played alongside {y}.",
        "The brother of {y} played alongside {x}.",
        "{y} played alongside the brother of {x}.",
    ),
    (
        "people",
        "{x} signed for the club after {y} left.",
        "{y} signed for the club after {x} left.",
        "After {y} left, {x} signed for the club.",
    ),
    (
        "cities",
        "He was born in {x} and died in {y}.",
        "He was born in {y} and died in {x}.",
        "He died in {y}, having been born in {x}.",
    ),
    (
        "cities",
        "The river rises near {x} and flows into the sea at {y}.",
        "The river rises near {y} and flows into the sea at {x}.",
        "Rising near {x}, the river flows into the sea at {y}.",
    ),
    (
        "cities",
        "The line runs from {x} to {y}, with a branch to the airport.",
        "The line runs from {y} to {x}, with a branch to the airport.",
        "With a branch to the airport, the line runs from {x} to {y}.",
    ),
    (
        "cities",
        "The company moved its headquarters from {x} to {y} in the same year.",
        "The company moved its headquarters from {y} to {x} in the same year.",
        "In the same year the company moved its headquarters to {y} from {x}.",
    ),
    (
        "cities",
        "The village lies north of {x} and south of {y}.",
        "The village lies north of {y} and south of {x}.",
        "The village lies south of {y} and north of {x}.",
    ),
    (
        "years",
        "The school opened in {x} and closed in {y}.",
        "The school opened in {y} and closed in {x}.",
        "The school, which closed in {y}, had opened in {x}.",
    ),
    (
        "years",
        "She joined the band in {x} and left it in {y}.",
        "She joined the band in {y} and left it in {x}.",
        "She left the band in {y}, having joined it in {x}.",
    ),
    (
        "teams",
        "{x} sold the striker to {y} for a record fee.",
        "{y} sold the striker to {x} for a record fee.",
        "For a record fee, the striker was sold by {x} to {y}.",
    ),
    (
        "teams",
        "The coach left {x} to manage {y}.",
        "The coach left {y} to manage {x}.",
        "To manage {y}, the coach left {x}.",
    ),
]
# (cached, the same with x and y swapped: same answer, a look-alike naming another filler z)
SYMMETRIC = [
    (
        "products",
        "What is the difference between {x} and {y}?",
        "What is the difference between {y} and {x}?",
        "What is the difference between {x} and {z}?",
    ),
    ("products", "Are {x} and {y} compatible?", "Are {y} and {x} compatible?", "Are {x} and {z} compatible?"),
    (
        "cities",
        "How far is it between {x} and {y}?",
        "How far is it between {y} and {x}?",
        "How far is it between {x} and {z}?",
    ),
    ("formats", "Compare {x} with {y}", "Compare {y} with {x}", "Compare {z} with {y}"),
    (
        "teams",
        "When did {x} and {y} last play each other?",
        "When did {y} and {x} last play each other?",
        "When did {x} and {z} last play each other?",
    ),
]
# (cached, the same with a phrase moved: same answer, a look-alike with another filler)
MOVED = [
    (
        "devices",
        "On my {x}, how do I change the wallpaper?",
        "How do I change the wallpaper on my {x}?",
        "On my {y}, how do I change the wallpaper?",
    ),
    ("years", "In {x}, who won the world cup?", "Who won the world cup in {x}?", "In {y}, who won the world cup?"),
    (
        "roles",
        "For a {x}, what is the login page?",
        "What is the login page for a {x}?",
        "For a {y}, what is the login page?",
    ),
    (
        "cities",
        "Which museums in {x} are open on Mondays?",
        "Which museums are open on Mondays in {x}?",
        "Which museums in {y} are open on Mondays?",
    ),
]
MOVED += [  # a phrase moved within the sentence, the meaning kept (statements)
    (
        "years",
        "In {x}, the bridge was rebuilt in stone.",
        "The bridge was rebuilt in stone in {x}.",
        "In {y}, the bridge was rebuilt in stone.",
    ),
    (
        "cities",
        "The film was shot in {x} during the summer.",
        "During the summer, the film was shot in {x}.",
        "The film was shot in {y} during the summer.",
    ),
    (
        "people",
        "After the war, {x} returned to teaching.",
        "{x} returned to teaching after the war.",
        "After the war, {y} returned to teaching.",
    ),
    (
        "cities",
        "Born in {x}, he studied law before turning to music.",
        "He was born in {x} and studied law before turning to music.",
        "Born in {y}, he studied law before turning to music.",
    ),
    (
        "teams",
        "Later that season, he was loaned to {x}.",
        "He was loaned to {x} later that season.",
        "Later that season, he was loaned to {y}.",
    ),
]
FILLERS = {
    "cities": [
        "Paris",
        "Lyon",
        "Berlin",
        "Madrid",
        "Tokyo",
        "Osaka",
        "Chicago",
        "Denver",
        "Boston",
        "Seattle",
        "Rome",
        "Milan",
        "Dublin",
        "Oslo",
        "Lisbon",
        "Prague",
    ],
    "formats": ["PDF", "Word", "Excel", "CSV", "JSON", "XML", "PNG", "JPEG", "Markdown", "HTML", "YAML", "MP4"],
    "products": [
        "Slack",
        "Teams",
        "Zoom",
        "Jira",
        "Trello",
        "Asana",
        "Notion",
        "Confluence",
        "Dropbox",
        "SQLite",
        "MariaDB",
        "Redis",
        "Kafka",
        "Docker",
    ],
    "roles": [
        "doctor",
        "patient",
        "teacher",
        "student",
        "manager",
        "employee",
        "landlord",
        "tenant",
        "buyer",
        "seller",
        "admin",
        "guest",
    ],
    "languages": [
        "English",
        "French",
        "German",
        "Spanish",
        "Italian",
        "Japanese",
        "Chinese",
        "Portuguese",
        "Dutch",
        "Korean",
    ],
    "teams": [
        "Arsenal",
        "Chelsea",
        "Liverpool",
        "Barcelona",
        "Madrid",
        "Juventus",
        "Bayern",
        "Ajax",
        "Celtic",
        "Benfica",
    ],
    "currencies": ["dollars", "euros", "pounds", "yen", "francs", "pesos", "rupees"],
    "devices": ["phone", "laptop", "tablet", "desktop", "watch", "Mac", "iPad", "Kindle"],
    "accounts": ["brokerage", "crypto", "wallet", "pension", "PayPal", "Venmo", "escrow"],
    "years": ["1998", "2002", "2006", "2010", "2014", "2018", "2022"],
    "people": [
        "Anderson",
        "Okafor",
        "Müller",
        "Rossi",
        "Tanaka",
        "Novak",
        "Fischer",
        "Moreau",
        "Kowalski",
        "Haddad",
        "Lindqvist",
        "Petrov",
        "Costa",
        "O'Brien",
    ],
}
FILLINGS_PER_TEMPLATE = 12


def written_pairs(rng: random.Random) -> list[Example]:
    return _file_pairs(DATA / "written_pairs.txt") + _template_pairs(rng)


def _file_pairs(path: Path) -> list[Example]:
    """Same line: one question asked two ways (1). Same block, other line: a near question (0)."""
    examples = []
    for block in path.read_text().split("\n\n"):
        lines = [
            [q.strip() for q in line.split(" | ")] for line in block.splitlines() if line and not line.startswith("#")
        ]
        for i, line in enumerate(lines):
            examples += [Example(a, b, 1, "written") for a, b in itertools.permutations(line, 2)]
            for other in lines[i + 1 :]:
                examples += [Example(a, b, 0, "written") for a in line for b in other]
                examples += [Example(b, a, 0, "written") for a in line for b in other]
    return examples


def _template_pairs(rng: random.Random) -> list[Example]:
    examples = []
    for kind, cached, different, same in ASYMMETRIC:
        for x, y in _fillings(rng, kind):
            examples += [
                Example(cached.format(x=x, y=y), different.format(x=x, y=y), 0, "written"),
                Example(cached.format(x=x, y=y), same.format(x=x, y=y), 1, "written"),
            ]
    for kind, cached, same, different in SYMMETRIC + MOVED:
        for x, y in _fillings(rng, kind):
            z = rng.choice([f for f in FILLERS[kind] if f not in (x, y)])
            fill = {"x": x, "y": y, "z": z}
            examples += [
                Example(cached.format(**fill), same.format(**fill), 1, "written"),
                Example(cached.format(**fill), different.format(**fill), 0, "written"),
            ]
    return examples


def _fillings(rng: random.Random, kind: str) -> list[tuple[str, str]]:
    return [(first, second) for first, second in (rng.sample(FILLERS[kind], 2) for _ in range(FILLINGS_PER_TEMPLATE))]


# -- training ------------------------------------------------------------------------------------


CALIBRATION_SHARE = 0.15  # of the PAWS pairs, set apart for `python -m evals calibrate`
FRESH_SHARE = 0.10  # and for reporting only: the calibration's gap on text nothing was tuned on


def set_apart(examples: list[Example], rng: random.Random) -> tuple[list[Example], list[Example], list[Example]]:
    """(training, calibration, fresh): whole groups of pairs that share a sentence go to one part
    (PAWS builds several pairs from one sentence), so neither the calibration nor the fresh pairs hold
    a sentence the verifier was trained on. Seeded; the groups are dealt in shuffled order."""
    parent: dict[str, str] = {}

    def root(text: str) -> str:
        while parent.setdefault(text, text) != text:
            parent[text] = parent[parent[text]]
            text = parent[text]
        return text

    for example in examples:
        parent[root(example.cached)] = root(example.query)
    groups: dict[str, list[Example]] = {}
    for example in examples:
        groups.setdefault(root(example.cached), []).append(example)
    dealt = list(groups.values())
    rng.shuffle(dealt)
    calibration: list[Example] = []
    fresh: list[Example] = []
    training: list[Example] = []
    for group in dealt:
        if len(calibration) < CALIBRATION_SHARE * len(examples):
            calibration += group
        elif len(fresh) < FRESH_SHARE * len(examples):
            fresh += group
        else:
            training += group
    return training, calibration, fresh


def parts(seed: int, limit: int | None = None, apart: bool = True) -> dict[str, list[Example]]:
    """Every part of the data as a training run with `seed` deals it: train, held_out (picks the epoch
    and the fixed bars), calibration and fresh (never trained or tuned on; empty unless `apart`)."""
    rng = random.Random(seed)
    if apart:
        paws, calibration, fresh = set_apart(paws_pairs()[:limit], rng)
    else:
        paws, calibration, fresh = paws_pairs()[:limit], [], []
    train_paws, held_paws = split(paws, rng)
    train_written, held_written = split(written_pairs(rng)[:limit], rng)
    return {
        "train": train_paws + train_written,
        "train_paws": train_paws,
        "train_written": train_written,
        "held_out": held_paws + held_written,
        "held_paws": held_paws,
        "calibration": calibration,
        "fresh": fresh,
    }


def split(examples: list[Example], rng: random.Random) -> tuple[list[Example], list[Example]]:
    shuffled = examples[:]
    rng.shuffle(shuffled)
    cut = int(len(shuffled) * HELD_OUT)
    return shuffled[cut:], shuffled[:cut]


def train(
    featurizer: Featurizer, examples: list[Example], cosines: dict, held_out: list[Example], epochs: int, seed: int
) -> PairScorer:
    """AdamW on binary cross-entropy; the weights kept are an exponential moving average of the
    steps' (decay EMA_DECAY), at the epoch where it did best on the held-out pairs: single steps'
    weights swung the held-out loss by +-0.05 from epoch to epoch."""
    torch.manual_seed(seed)
    scorer = PairScorer(featurizer.table.shape[1])
    average = PairScorer(featurizer.table.shape[1])
    average.load_state_dict(scorer.state_dict())
    optimiser = torch.optim.AdamW(scorer.parameters(), lr=LEARNING_RATE, weight_decay=1e-3)
    rng = random.Random(seed)
    best, best_state = float("inf"), None
    for epoch in range(epochs):
        scorer.train()
        order = examples[:]
        rng.shuffle(order)
        for start in range(0, len(order), BATCH):
            batch = order[start : start + BATCH]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                _logits(scorer, featurizer, batch, cosines), torch.tensor([e.label for e in batch], dtype=torch.float32)
            )
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            with torch.no_grad():
                for kept, current in zip(average.parameters(), scorer.parameters()):
                    kept.lerp_(current, 1 - EMA_DECAY)
        held_loss = _loss(average, featurizer, held_out, cosines)
        print(f"epoch {epoch + 1:>2}  held-out loss {held_loss:.4f}", flush=True)
        if held_loss < best:
            best, best_state = held_loss, {k: v.clone() for k, v in average.state_dict().items()}
    assert best_state is not None, "the first epoch's loss is below inf"
    average.load_state_dict(best_state)
    return average.eval()


def _logits(scorer: PairScorer, featurizer: Featurizer, batch: list[Example], cosines: dict) -> torch.Tensor:
    inputs = featurizer.batch([e.cached for e in batch], [e.query for e in batch], [cosines[e] for e in batch])
    return scorer(*inputs.tensors())


def _all_logits(scorer, featurizer, examples, cosines) -> torch.Tensor:
    """Logits of every example, without gradients, 256 at a time."""
    with torch.inference_mode():
        return torch.cat(
            [_logits(scorer, featurizer, examples[i : i + 256], cosines) for i in range(0, len(examples), 256)]
        )


def _loss(scorer, featurizer, examples, cosines) -> float:
    labels = torch.tensor([e.label for e in examples], dtype=torch.float32)
    return float(
        torch.nn.functional.binary_cross_entropy_with_logits(_all_logits(scorer, featurizer, examples, cosines), labels)
    )


def probabilities(scorer, featurizer, examples, cosines) -> np.ndarray:
    return torch.sigmoid(_all_logits(scorer, featurizer, examples, cosines)).numpy()


# -- thresholds ----------------------------------------------------------------------------------


def guard_outcomes(examples: list[Example], cosines: dict, similar) -> list[str]:
    """Per example: "pass" (no guard objects), "structural" (only overrulable guards object), "refused"
    (the verifier is not asked), as Verifier.review sees the guards' verdict."""
    outcomes = []
    for example in examples:
        verdict = check(example.query, example.cached, cosines[example], SemanticSettings().threshold, similar)
        outcomes.append("refused" if not reviewable(verdict) else "structural" if verdict.reasons else "pass")
    return outcomes


def served(probability: np.ndarray, outcomes: list[str], settings: Settings) -> np.ndarray:
    """Which examples Verifier.review would serve at these bars."""
    return np.array(
        [o != "refused" and p >= settings.bar(objected=o == "structural") for p, o in zip(probability, outcomes)]
    )


def choose_settings(probability: np.ndarray, outcomes: list[str], labels: np.ndarray) -> Settings:
    """The pair of bars that serves the most same-answer pairs while serving at most 5% of the
    different-answer ones (held-out pairs), preferring higher bars on ties."""
    best = (-1.0, Settings())
    grid = [round(x, 2) for x in np.arange(0.05, 1.0, 0.05)] + [0.97, 0.99, 1.01]
    for accept in grid:
        for overrule in [o for o in grid if o >= accept]:
            settings = Settings(accept, overrule)
            hits = served(probability, outcomes, settings)
            false_rate = hits[labels == 0].mean()
            hit_rate = hits[labels == 1].mean()
            if false_rate <= 0.05 and (hit_rate, accept + overrule) > (best[0], best[1].accept + best[1].overrule):
                best = (hit_rate, settings)
    return best[1]


def report(name: str, probability, outcomes, labels, settings: Settings) -> None:
    hits = served(probability, outcomes, settings)
    rule_hits = np.array([o == "pass" for o in outcomes])
    print(
        f"{name:<18} pairs {len(labels):>5}   rules only: same {rule_hits[labels == 1].mean():.1%} "
        f"different {rule_hits[labels == 0].mean():.1%}   with verifier: same {hits[labels == 1].mean():.1%} "
        f"different {hits[labels == 0].mean():.1%}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.train_verifier")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--epochs", type=int, default=8)  # the held-out loss was lowest at 4-6
    parser.add_argument(
        "--out", type=Path, help=f"default {WEIGHTS_FILE.name}, with --calibrated {CALIBRATED_FILE.name}"
    )
    parser.add_argument(
        "--calibrated",
        action="store_true",
        help="set the calibration and fresh PAWS pairs apart first (the verifier the false-hit bound runs on)",
    )
    parser.add_argument("--limit", type=int, help="a smoke run: this many pairs of each source")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    args.out = args.out or (CALIBRATED_FILE if args.calibrated else WEIGHTS_FILE)
    data = parts(args.seed, args.limit, apart=args.calibrated)
    train_paws, train_written, held_out = data["train_paws"], data["train_written"], data["held_out"]
    embedder = MiniLMEmbedder()
    featurizer = Featurizer.from_minilm(embedder)
    cosines = pair_cosines(embedder, data["train"] + held_out)
    scorer = Ensemble(featurizer.table.shape[1], MEMBERS)
    for number, member in enumerate(scorer.members):
        trained = train(
            featurizer, train_paws + train_written * WRITTEN_WEIGHT, cosines, held_out, args.epochs, args.seed + number
        )
        member.load_state_dict(trained.state_dict())
    print(f"ensemble of {MEMBERS}: held-out loss {_loss(scorer, featurizer, held_out, cosines):.4f}")
    similar = SemanticCache(embedder, SqliteEntries(":memory:"), SemanticSettings()).word_similarity
    probability = probabilities(scorer, featurizer, held_out, cosines)
    outcomes = guard_outcomes(held_out, cosines, similar)
    labels = np.array([e.label for e in held_out])
    settings = choose_settings(probability, outcomes, labels)
    for source in ("paws", "written"):
        rows = [i for i, e in enumerate(held_out) if e.source == source]
        report(f"held-out {source}", probability[rows], [outcomes[i] for i in rows], labels[rows], settings)
    save(scorer, settings, args, args.out)
    print(
        f"bars: accept {settings.accept}, overrule {settings.overrule}; wrote {args.out} "
        f"in {time.perf_counter() - started:.0f} s"
    )
    return 0


def pair_cosines(embedder, examples: list[Example]) -> dict:
    texts = sorted({t for e in examples for t in (e.cached, e.query)})
    vectors = dict(zip(texts, embedder.embed(texts)))
    return {e: float(vectors[e.cached] @ vectors[e.query]) for e in examples}


def save(scorer: Ensemble, settings: Settings, args, path: Path) -> None:
    from safetensors.torch import save_file

    meta = {
        "format_version": str(FORMAT_VERSION),
        "members": str(len(scorer.members)),
        "settings": json.dumps(asdict(settings)),
        "seed": str(args.seed),
        "epochs": str(args.epochs),
        "data": "evals/data/paws_train.tsv + evals.train_verifier.written_pairs",
    }
    save_file({k: v.contiguous() for k, v in scorer.state_dict().items()}, str(path), metadata=meta)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
