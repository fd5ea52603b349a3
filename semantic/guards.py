"""Guards: reasons two similar-looking questions may need different answers.

Each guard compares the query with a cached prompt and names what differs: numbers, negation,
antonyms, dates and relative days, units, billing periods and plan tiers, entities, direction and
order, comparatives, quantifiers. They are rules over the texts' structure (normalised word forms,
small closed-class lexicons), not lists of any dataset's sentences. A cosine score alone cannot do
this: MiniLM puts negations at 0.94-0.98 and swapped directions at 0.99 (measured on look-alike pairs).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from difflib import SequenceMatcher
from functools import lru_cache
from pathlib import Path
from typing import Literal

WordSimilarity = Callable[[str, str], float]
# The closed-class lexicons the guards read (stop words, negations, antonym pairs, units, tiers,
# quantifiers, ...), kept as data beside this module and loaded once, at import.
WORDS: dict = json.loads(Path(__file__).with_name("guard_words.json").read_text(encoding="utf-8"))
WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*|\d+(?:[.,:/-]\d+)*%?|[$€£¥%]")

STOPWORDS = frozenset(WORDS["stopwords"])

NEGATIONS = frozenset(WORDS["negations"])
NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non")

ANTONYM_PAIRS = WORDS["antonym_pairs"]

MONTHS = WORDS["months"]
MONTH_ABBREVIATIONS = {m[:3]: m for m in MONTHS} | {"sept": "september"}
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
RELATIVE_DAYS = WORDS["relative_days"]
RELATIVE_MARKERS = WORDS["relative_markers"]
PERIOD_NOUNS = WORDS["period_nouns"]

UNIT_GROUPS = WORDS["unit_groups"]
UNITS = {alias: unit for unit, aliases in UNIT_GROUPS.items() for alias in aliases.split()}
AMBIGUOUS_UNITS = frozenset({"m", "l", "g", "w", "in.", "min", "cal", "mi"})  # count only right after a number

PERIODS = WORDS["periods"]
TIERS = frozenset(WORDS["tiers"])

COMPARATIVES = WORDS["comparatives"]
NOT_COMPARATIVE = frozenset(WORDS["not_comparative"])

QUANTIFIERS = WORDS["quantifiers"]

DIRECTION_MARKERS = frozenset(WORDS["direction_markers"])
RELATION_WORDS = DIRECTION_MARKERS | frozenset(["of", "for", "with", "by", "on", "in", "at"])

NUMBER_WORDS: dict[str, float] = {
    w: i
    for i, w in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}
NUMBER_WORDS |= {
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "sixty": 60,
    "seventy": 70,
    "eighty": 80,
    "ninety": 90,
    "hundred": 100,
    "thousand": 1000,
    "million": 10**6,
    "billion": 10**9,
    "dozen": 12,
    "twice": 2,
    "double": 2,
    "triple": 3,
    "single": 1,
    "half": 0.5,
    "quarter": 0.25,
    "couple": 2,
}
ORDINALS = {
    w: i + 1
    for i, w in enumerate(
        [
            "first",
            "second",
            "third",
            "fourth",
            "fifth",
            "sixth",
            "seventh",
            "eighth",
            "ninth",
            "tenth",
            "eleventh",
            "twelfth",
        ]
    )
}
ORDINAL_SUFFIX = re.compile(r"^(\d+)(st|nd|rd|th)$")


GuardReason = Literal[
    "below_threshold",
    "numbers",
    "arithmetic",
    "negation",
    "antonym",
    "date",
    "unit",
    "billing_period",
    "plan_tier",
    "entity",
    "direction",
    "order",
    "comparative",
    "quantifier",
    "substitution",
    "verifier",
    "bound",  # under the scope's false-hit bound, its calibrated P(right) is below the cut (calibration.py)
    "uncalibrated",  # the scope has too little evidence for its bound: nothing is served
]


@dataclass(frozen=True, slots=True)
class Verdict:
    accept: bool
    score: float
    reasons: tuple[GuardReason, ...] = ()  # the objections that stand (empty when accepted)
    probability: float | None = None  # the verifier's P(same answer), when it was asked
    overruled: tuple[GuardReason, ...] = ()  # word-order objections the verifier overruled (accepted only)


@dataclass(frozen=True, slots=True)
class Text:
    """One side of a comparison, analysed once."""

    raw: str
    words: tuple[str, ...]  # lower-cased tokens, in order
    lemmas: tuple[str, ...]

    @property
    def lemma_set(self) -> frozenset[str]:
        return frozenset(self.lemmas)


@lru_cache(maxsize=4096)
def analyse(text: str) -> Text:
    tokens = WORD.findall(text.replace("’", "'"))
    words = tuple(t.lower().removesuffix("'s") for t in tokens)
    return Text(text, words, tuple(lemma(w) for w in words))


def lemma(word: str) -> str:
    """A light, rule-based normaliser: plural/-ed/-ing forms to a shared stem."""
    word = word.strip("'-")
    for suffix, keep in (("ies", "y"), ("ied", "y"), ("sses", "ss"), ("ing", ""), ("ed", ""), ("es", ""), ("s", "")):
        if (
            word.endswith(suffix)
            and len(word) - len(suffix) >= 3
            and not word.endswith("ss" if suffix == "s" else "\0")
        ):
            stem = word[: -len(suffix)] + keep
            return stem[:-1] if len(stem) > 3 and stem[-1] == stem[-2] and stem[-1] not in "lsz" else stem
    return word


# -- the guards: each returns a reason or None ---------------------------------------------------


def numbers(a: Text, b: Text) -> GuardReason | None:
    return "numbers" if _numbers(a) != _numbers(b) else None


def _numbers(text: Text) -> Counter:
    """Values with their kind: '10% of 50' holds 10% and 50, so it differs from '50% of 10'."""
    values: Counter = Counter()
    for i, word in enumerate(text.words):
        if word[0].isdigit():
            match = ORDINAL_SUFFIX.match(word)
            value = _number_value(match.group(1) if match else word.rstrip("%"))
            percent = word.endswith("%") or (i + 1 < len(text.words) and text.words[i + 1] in ("percent", "%"))
            values[(value, "%") if percent else value] += 1
        elif word in NUMBER_WORDS and word not in ("quarter", "one", "single"):  # "which one", "a single"
            values[float(NUMBER_WORDS[word])] += 1
        elif word in ORDINALS:
            values[float(ORDINALS[word])] += 1
    return values


def _number_value(token: str) -> float | str:
    cleaned = token.replace(",", "")
    try:
        return float(cleaned)
    except ValueError:
        return token  # dates, times, versions: compared as text


def negation(a: Text, b: Text) -> GuardReason | None:
    count_a, count_b = _negations(a), _negations(b)
    if count_a % 2 != count_b % 2 or (count_a == 0) != (count_b == 0):
        return "negation"
    return "negation" if _prefix_negated(a, b) or _prefix_negated(b, a) else None


def _negations(text: Text) -> int:
    return sum(1 for w in text.words if w in NEGATIONS or w.endswith("n't"))


def _prefix_negated(a: Text, b: Text) -> bool:
    """'available' vs 'unavailable', 'like' vs 'dislike'."""
    lemmas_b = b.lemma_set
    for word in a.lemma_set - lemmas_b:
        for prefix in NEGATING_PREFIXES:
            if word.startswith(prefix) and len(word) - len(prefix) >= 4 and word[len(prefix) :] in lemmas_b:
                return True
    return False


def _antonym_index() -> dict[str, set[str]]:
    index: dict[str, set[str]] = {}
    for pair in ANTONYM_PAIRS:
        left, right = (lemma(w) for w in pair.split("/"))
        index.setdefault(left, set()).add(right)
        index.setdefault(right, set()).add(left)
    return index


ANTONYMS = _antonym_index()


PARTICLES = frozenset(["up", "down", "in", "out", "on", "off", "over", "back", "away"])


def antonym(a: Text, b: Text) -> GuardReason | None:
    """Opposite words ('increase' vs 'decrease'), or one verb with another particle ('sign up' vs
    'sign in', 'turn on' vs 'turn off')."""
    only_a, only_b = a.lemma_set - b.lemma_set, b.lemma_set - a.lemma_set
    if any(ANTONYMS.get(w, set()) & only_b for w in only_a):
        return "antonym"
    particles_a, particles_b = _phrasal(a), _phrasal(b)
    shared_verbs = particles_a.keys() & particles_b.keys()
    return "antonym" if any(particles_a[v] != particles_b[v] for v in shared_verbs) else None


def _phrasal(text: Text) -> dict[str, str]:
    """verb -> particle, where the particle ends the clause or precedes a function word ('sign up',
    'turn off the light'); 'a file in Linux' is a preposition before its object, not a particle."""
    words = text.words
    found = {}
    for i in range(len(words) - 1):
        after = words[i + 2] if i + 2 < len(words) else None
        if words[i + 1] in PARTICLES and words[i] not in STOPWORDS and (after is None or after in STOPWORDS):
            found[text.lemmas[i]] = words[i + 1]
    return found


def dates(a: Text, b: Text) -> GuardReason | None:
    return "date" if _dates(a) != _dates(b) else None


def _dates(text: Text) -> frozenset[str]:
    found = set()
    words = text.words
    for i, word in enumerate(words):
        relative = RELATIVE_MARKERS.get(words[i - 1], "") if i > 0 else ""
        if word in MONTHS or (word in MONTH_ABBREVIATIONS and word != "may"):
            found.add(MONTH_ABBREVIATIONS.get(word, word) + relative)
        elif word in WEEKDAYS or word.rstrip("s") in WEEKDAYS:
            found.add(word.rstrip("s") + relative)
        elif word in RELATIVE_DAYS:
            found.add(RELATIVE_DAYS[word])
        elif word in PERIOD_NOUNS and i > 0 and words[i - 1] in RELATIVE_MARKERS:
            found.add(f"{PERIOD_NOUNS[word]}{RELATIVE_MARKERS[words[i - 1]]}")
        elif re.fullmatch(r"(1[5-9]|20)\d\d", word) or re.fullmatch(r"\d{1,4}[-/.]\d{1,2}([-/.]\d{1,4})?", word):
            found.add(word)
    if "may" in words:  # the month, not the verb: "in May", "May 5"
        index = words.index("may")
        if (index > 0 and words[index - 1] in ("in", "of", "since", "until", "by")) or (
            index + 1 < len(words) and words[index + 1][0].isdigit()
        ):
            found.add("may")
    return frozenset(found)


def units(a: Text, b: Text) -> GuardReason | None:
    units_a, units_b = _units(a), _units(b)
    return "unit" if units_a and units_b and units_a != units_b else None


def _units(text: Text) -> frozenset[str]:
    found = set()
    for i, word in enumerate(text.words):
        unit = UNITS.get(word)
        if unit is None or (word in AMBIGUOUS_UNITS and not (i > 0 and text.words[i - 1][0].isdigit())):
            continue
        found.add(unit)
    return frozenset(found)


def billing(a: Text, b: Text) -> GuardReason | None:
    periods_a, periods_b = _periods(a), _periods(b)
    if periods_a and periods_b and periods_a != periods_b:
        return "billing_period"
    tiers_a, tiers_b = a.lemma_set & TIERS, b.lemma_set & TIERS
    return "plan_tier" if (tiers_a or tiers_b) and tiers_a != tiers_b else None


def _periods(text: Text) -> frozenset[str]:
    found = set()
    for i, word in enumerate(text.words):
        if word in (
            "monthly",
            "annual",
            "annually",
            "yearly",
            "weekly",
            "daily",
            "quarterly",
            "lifetime",
            "hourly",
            "biannual",
            "semiannual",
            "one-time",
        ) or (word in PERIODS and i > 0 and text.words[i - 1] in ("per", "a", "each", "every", "/")):
            found.add(PERIODS[word])
    return frozenset(found)


def entities(a: Text, b: Text) -> GuardReason | None:
    ents_a, ents_b = _entities(a.raw), _entities(b.raw)
    if ents_a == ents_b:
        return None
    only_a, only_b = ents_a - ents_b, ents_b - ents_a
    lemmas_a, lemmas_b = a.lemma_set, b.lemma_set
    # an entity that the other text mentions in lower case is the same entity
    unmatched_a = {e for e in only_a if not set(e.split()) <= lemmas_b}
    unmatched_b = {e for e in only_b if not set(e.split()) <= lemmas_a}
    return "entity" if unmatched_a or unmatched_b else None


ENTITY = re.compile(r"\b([A-Z][\w&.-]*(?:\s+(?:of\s+|de\s+|the\s+)?[A-Z][\w&.-]*)*)")


def _entities(raw: str) -> frozenset[str]:
    found = set()
    for sentence in re.split(r"(?<=[.!?])\s+|\n+", raw.strip()):
        for match in ENTITY.finditer(sentence):
            opens_sentence = match.start() == 0 or sentence[: match.start()].strip() in ("", '"', "'", "(", "-")
            if name := _entity_name(match.group(1), opens_sentence):
                found.add(name)
    found.update(w.lower() for w in WORD_CHARS.findall(raw) if _mixed_token(w))  # 4K, 5G, iOS
    return frozenset(e for e in found if e and e not in STOPWORDS)


WORD_CHARS = re.compile(r"\w+")
MIXED_CASE = re.compile(r"[a-z]+[A-Z]")  # anchored with match(): linear


def _mixed_token(word: str) -> bool:
    """A digit followed later by a letter ('4K', '5G', '3rdParty') or lower case then upper ('iOS').
    Written as scans, not one regex: `\\w*\\d\\w*[A-Za-z]\\w*` backtracks quadratically on long digit runs."""
    first_digit = next((i for i, c in enumerate(word) if c.isdigit()), None)
    if first_digit is not None and any(c.isascii() and c.isalpha() for c in word[first_digit + 1 :]):
        return True
    return MIXED_CASE.match(word) is not None


QUESTION_STARTS = frozenset(WORDS["question_starts"])
OPENERS = STOPWORDS | QUESTION_STARTS


def _entity_name(capitalised: str, opens_sentence: bool) -> str:
    """The lemma of a run of capitalised words; at a sentence's start its opening words ("How", "Is",
    "Did", "Can") name nothing and are dropped. Empty if nothing is left."""
    words = capitalised.split()
    if opens_sentence:
        while words and words[0].lower() in OPENERS:
            words = words[1:]
    return lemma(" ".join(w.lower().rstrip(".") for w in words)) if words else ""


def direction(a: Text, b: Text) -> GuardReason | None:
    """Two shared terms in the other order with the same relation word between them in both texts:
    'from Paris to Rome' vs 'from Rome to Paris', 'user to a group' vs 'group to a user', 'A bigger
    than B' vs 'B bigger than A'. A clause merely moved ('X according to Y' vs 'Y, what is ... X')
    keeps different words between the terms and passes."""
    terms_a, terms_b = _content_positions(a), _content_positions(b)
    shared = [t for t in terms_a if t in terms_b]
    for i, first in enumerate(shared):
        for second in shared[i + 1 :]:
            if (terms_a[first] < terms_a[second]) == (terms_b[first] < terms_b[second]):
                continue
            between_a = _between(a, terms_a[first], terms_a[second])
            between_b = _between(b, terms_b[first], terms_b[second])
            if between_a & between_b & RELATION_WORDS:
                return "direction"
    return None


def _between(text: Text, i: int, j: int) -> set[str]:
    low, high = sorted((i, j))
    return set(text.words[low + 1 : high]) if high - low <= 4 else set()


def _content_positions(text: Text) -> dict[str, int]:
    positions: dict[str, int] = {}
    for i, (word, lem) in enumerate(zip(text.words, text.lemmas)):
        if word not in STOPWORDS and word not in RELATION_WORDS and lem not in positions:
            positions[lem] = i
    return positions


def entity_order(a: Text, b: Text) -> GuardReason | None:
    """Named entities that both texts mention, in another order: 'A beat B' vs 'B beat A', and the
    word-order swaps of PAWS ('represented X ... representing Y' vs '... Y ... X')."""
    order_a, order_b = _entity_sequence(a.raw), _entity_sequence(b.raw)
    shared = [e for e in order_a if e in order_b]
    for i, first in enumerate(shared):
        for second in shared[i + 1 :]:
            if order_b.index(first) > order_b.index(second):
                return "order"
    return None


def _entity_sequence(raw: str) -> list[str]:
    sequence: list[str] = []
    for match in ENTITY.finditer(raw):
        name = _entity_name(match.group(1), opens_sentence=match.start() == 0)  # "Did Brazil": Brazil
        if name and name not in STOPWORDS and name not in sequence:
            sequence.append(name)
    return sequence


NOUN_SLOT = frozenset(WORDS["noun_slot"])
PRONOUNS = frozenset(["i", "you", "we", "they", "he", "she", "it"])


SYNONYM_SIMILARITY = 0.78  # MiniLM word cosine: synonyms measured 0.79-0.92, co-hyponyms 0.21-0.75


def substitution(a: Text, b: Text, similar: WordSimilarity | None = None) -> GuardReason | None:
    """One content word swapped for another in the same slot of otherwise aligned questions: 'a soft
    yolk' vs 'a hard yolk', 'my hand luggage' vs 'my checked luggage', 'for children' vs 'for adults',
    'do cats see' vs 'do dogs see'. Left to the paraphrase: a swapped verb after a pronoun or 'to'
    ('I see' vs 'I find'), spelling variants ('color'/'colour', 'doc'/'document'), and, when a word
    similarity is given, synonyms ('picture'/'photo': MiniLM word cosine >= SYNONYM_SIMILARITY)."""
    matcher = SequenceMatcher(a=a.lemmas, b=b.lemmas, autojunk=False)
    for op, a_start, a_end, b_start, b_end in matcher.get_opcodes():
        if op != "replace" or a_end - a_start != 1 or b_end - b_start != 1:
            continue
        left, right = a.lemmas[a_start], b.lemmas[b_start]
        if left in STOPWORDS or right in STOPWORDS or left[0].isdigit() or right[0].isdigit():
            continue
        if _spelling_variant(left, right):
            continue
        before = a.words[a_start - 1] if a_start else ""
        if before in PRONOUNS or before == "to" or (before not in NOUN_SLOT and before in STOPWORDS):
            continue  # a verb slot, or a slot we cannot read
        if similar is not None and similar(a.words[a_start], b.words[b_start]) >= SYNONYM_SIMILARITY:
            continue
        return "substitution"
    return None


def _spelling_variant(left: str, right: str) -> bool:
    if left.startswith(right) or right.startswith(left) or left.endswith(right) or right.endswith(left):
        return True
    return len(left) >= 4 and len(right) >= 4 and SequenceMatcher(a=left, b=right).ratio() >= 0.8


def comparatives(a: Text, b: Text) -> GuardReason | None:
    """Both texts compare, but not the same way: 'best' vs 'worst', 'more' vs 'less'. ('Improve
    my sleep' vs 'sleep better' is a paraphrase: only one side compares.)"""
    found_a, found_b = _comparatives(a), _comparatives(b)
    return "comparative" if found_a and found_b and found_a != found_b else None


COMPARISON_SYNONYMS = WORDS["comparison_synonyms"]


def _canonical_comparison(word: str) -> str:
    for suffix in ("est", "er"):
        if word.endswith(suffix):
            base = word[: -len(suffix)]
            base = base[:-1] if len(base) > 2 and base[-1] == base[-2] and base[-1] in "bdgmnprt" else base  # big
            base = base[:-1] + "y" if base.endswith("i") else base  # easiest -> easy
            return COMPARISON_SYNONYMS.get(base, base) + suffix
    return word


def _comparatives(text: Text) -> frozenset[str]:
    found = {COMPARATIVES[w] for w in text.words if w in COMPARATIVES}
    for i, word in enumerate(text.words):
        if word in NOT_COMPARATIVE or len(word) < 5 or word in COMPARATIVES:
            continue
        followed_by_than = i + 1 < len(text.words) and text.words[i + 1] == "than"
        after_copula = i > 0 and text.words[i - 1] in ("is", "are", "was", "were", "be", "get", "gets")
        if (word.endswith("er") and (followed_by_than or after_copula)) or (
            word.endswith("est") and i > 0 and text.words[i - 1] == "the"
        ):
            found.add(_canonical_comparison(word))
    return frozenset(found)


def quantifiers(a: Text, b: Text) -> GuardReason | None:
    return "quantifier" if _quantifiers(a) != _quantifiers(b) else None


def _quantifiers(text: Text) -> frozenset[str]:
    found = {QUANTIFIERS[w] for w in text.words if QUANTIFIERS.get(w)}
    found.discard("none")  # "no"/"none" are negations; that guard owns them
    if "most" in found and any(w in COMPARATIVES for w in text.words if w != "most"):
        found.discard("most")
    return frozenset(found)


# Arithmetic: the operation, not only its numbers. An operator or function word counts when a number
# stands within ARITHMETIC_REACH tokens of it ('add a user' is not arithmetic; 'add 5 to 7' is).
ARITHMETIC_TOKEN = re.compile(r"\d+(?:\.\d+)?|[+*×÷^=]|(?<=\s)[-/](?=\s)|[A-Za-z]+")
OPERATOR_WORDS = WORDS["operator_words"]
MATH_FUNCTIONS = WORDS["math_functions"]
ARITHMETIC_REACH = 3


COMMUTATIVE = frozenset({"+", "*", "mean", "median"})  # the operands' order changes nothing


def arithmetic(a: Text, b: Text) -> GuardReason | None:
    """'2+2' vs '2*2', 'square root of 16' vs 'square of 16', '7 times 8' vs '7 plus 8'; and, where
    an operation is not commutative, the operands' order: '10 divided by 2' vs '2 divided by 10'."""
    (found_a, order_a), (found_b, order_b) = _arithmetic(a.raw), _arithmetic(b.raw)
    if not (found_a or found_b):
        return None
    if found_a != found_b or (set(found_a) - COMMUTATIVE and order_a != order_b):
        return "arithmetic"
    return None


def _arithmetic(raw: str) -> tuple[Counter, list[float]]:
    """The operations next to numbers, and the numbers in the order they appear."""
    tokens = [t.lower() for t in ARITHMETIC_TOKEN.findall(raw)]
    numeric = [t[0].isdigit() or t in NUMBER_WORDS for t in tokens]
    found: Counter = Counter()
    for i, token in enumerate(tokens):
        kind = OPERATOR_WORDS.get(token) or MATH_FUNCTIONS.get(token)
        if kind and any(numeric[max(0, i - ARITHMETIC_REACH) : i + ARITHMETIC_REACH + 1]):
            found[kind] += 1
    order = [float(t) if t[0].isdigit() else float(NUMBER_WORDS[t]) for t, n in zip(tokens, numeric) if n]
    return found, order


GUARDS = (
    numbers,
    arithmetic,
    negation,
    antonym,
    dates,
    units,
    billing,
    entities,
    direction,
    entity_order,
    comparatives,
    quantifiers,
)


def check(query: str, cached: str, score: float, threshold: float, similar: WordSimilarity | None = None) -> Verdict:
    """Accept only above the threshold and when no guard objects; name every objection.
    `similar(word, word) -> cosine` lets the substitution guard tell synonyms from swapped nouns."""
    if score < threshold:
        return Verdict(False, score, ("below_threshold",))
    a, b = analyse(query), analyse(cached)
    reasons: list[GuardReason] = [r for guard in GUARDS if (r := guard(a, b))]
    if not reasons and (r := substitution(a, b, similar)):  # the only guard that may embed: run it last
        reasons.append(r)
    return Verdict(not reasons, score, tuple(reasons))
