"""A false-hit bound the operator chooses: which semantic candidates may be served so that, with 95%
confidence, at most `bound` of the answers served are wrong.

    Evidence(group, probability, right)                 one judged candidate
    Calibration.fit(evidence, bound) -> Calibration     isotonic calibration + a risk-controlling cut
    Calibration.decide(group, probability) -> bool      serve?  (never, when uncalibrated)
    Calibration.calibrated(group, probability)          P(right), calibrated on the evidence
    Calibrator(base, bound, tenant_bounds, path)        per tenant: base evidence + its own review verdicts
        .decide(tenant, entry_id, group, p) -> "" | "bound" | "uncalibrated"
        .served(tenant, entry_id, group, p)             a hit, kept until its entry is reviewed
        .reviewed(tenant, entry_id, right)              approve / reject: its hits become evidence

A candidate that no fact guard refused has a group (`pass`: no guard objects; `structural`: only the
word-order guards object, which the verifier judges better) and the verifier's P(same answer). Per
group, P(right) is calibrated on judged evidence by isotonic regression (pool adjacent violators:
monotone in the verifier's probability, no shape assumed). The cut on the calibrated value is chosen
by fixed-sequence testing as in "Learn then Test" (Angelopoulos et al.): the cuts (one per distinct
calibrated value) are tried from the strictest to the loosest, each a test of "its served wrong share
exceeds `bound`", rejected when the Clopper-Pearson 95% upper bound of the wrong share among the
evidence it serves is at most `bound`; the first cut not rejected ends the search and the last
rejected one is kept. The sequence starts at the first cut that serves enough evidence to be
certified at all (`least_certifiable`: with nothing wrong), which depends on the bound alone. Under exchangeability of the evidence and the traffic this bounds
the wrong share of served answers with 95% confidence, whatever the verifier's own miscalibration;
no cut passing (too little evidence for the bound asked) leaves the scope *uncalibrated*: it serves
nothing and says so (`miss; reason=uncalibrated`).

Chosen over vCache's per-entry sigmoid thresholds: those need each cached entry's own labelled hits
before they stop being conservative, which a cache of many rarely-repeated questions never gets; the
verifier already generalises across entries, so one calibration per scope (tenant) uses all the
evidence at once, and the entry's own review (approve / reject) still moves its next decision.
"""

from __future__ import annotations

import bisect
import json
import math
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

GROUPS = ("pass", "structural")
CONFIDENCE = 0.95
BASE_EVIDENCE_FILE = Path(__file__).with_name("calibration.json")  # written by `python -m evals calibrate`


@dataclass(frozen=True, slots=True)
class Evidence:
    group: str  # "pass" or "structural"
    probability: float  # the verifier's P(same answer)
    right: bool  # the cached answer served the new question


def upper_bound(wrong: int, total: int, confidence: float = CONFIDENCE) -> float:
    """Clopper-Pearson one-sided upper bound on a binomial rate (1.0 for no trials): the rate at which
    seeing `wrong` or fewer has probability 1 - confidence, i.e. the Beta(wrong + 1, total - wrong)
    quantile at `confidence`, found by bisection on the regularised incomplete beta function."""
    if total == 0 or wrong >= total:
        return 1.0
    low, high = wrong / total, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        if _incomplete_beta(wrong + 1, total - wrong, middle) < confidence:
            low = middle
        else:
            high = middle
    return high


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) by its continued fraction (modified Lentz), on the side where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return result


def least_certifiable(bound: float, confidence: float = CONFIDENCE) -> int:
    """The fewest served candidates whose upper bound can be at most `bound` (all of them right)."""
    return math.ceil(math.log(1 - confidence) / math.log1p(-bound)) if bound < 1 else 1


def isotonic(points: list[tuple[float, bool]]) -> list[tuple[float, float]]:
    """Pool adjacent violators: (upper end of a run of probabilities, P(right) of the run), increasing."""
    blocks: list[list[float]] = []  # [right, count, last probability]
    for probability, right in sorted(points):
        blocks.append([float(right), 1.0, probability])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            right_sum, count, last = blocks.pop()
            blocks[-1] = [blocks[-1][0] + right_sum, blocks[-1][1] + count, last]
    return [(last, right_sum / count) for right_sum, count, last in blocks]


@dataclass(frozen=True, slots=True)
class Calibration:
    bound: float
    curves: dict[str, list[tuple[float, float]]]  # group -> isotonic steps
    cut: float | None  # serve when calibrated P(right) >= cut; None: uncalibrated, serve nothing
    num_evidence: int
    served_wrong_share: float  # on the evidence, at the cut (0 when uncalibrated)
    served_wrong_upper: float  # its 95% upper bound (<= bound when calibrated)

    @classmethod
    def fit(cls, evidence: Iterable[Evidence], bound: float) -> Calibration:
        items = list(evidence)
        curves = {group: isotonic([(e.probability, e.right) for e in items if e.group == group]) for group in GROUPS}
        scored = sorted(((_value(curves, e.group, e.probability), e.right) for e in items), reverse=True)
        cuts = []  # (calibrated value, served, wrong): a cut serves every candidate of a value, or none
        served = wrong = 0
        for index, (value, right) in enumerate(scored):
            served, wrong = served + 1, wrong + (not right)
            if index + 1 == len(scored) or scored[index + 1][0] != value:
                cuts.append((value, served, wrong))
        smallest = least_certifiable(bound)
        cut, share, upper = None, 0.0, 0.0
        for value, served, wrong in cuts:  # strictest first
            if served < smallest:
                continue  # too few to certify even with nothing wrong: not a test
            if (bound_here := upper_bound(wrong, served)) > bound:
                break  # fixed-sequence testing: the first failing cut ends the search
            cut, share, upper = value, wrong / served, bound_here
        return cls(bound, curves, cut, len(items), share, upper)

    def calibrated(self, group: str, probability: float) -> float:
        return _value(self.curves, group, probability)

    def decide(self, group: str, probability: float) -> bool:
        return self.cut is not None and self.calibrated(group, probability) >= self.cut


def _value(curves: dict[str, list[tuple[float, float]]], group: str, probability: float) -> float:
    """The calibrated P(right) of `probability` in its group: the value of the first step whose upper
    end reaches it (past the last step, the last value; 0 for a group with no evidence)."""
    steps = curves.get(group) or []
    if not steps:
        return 0.0
    index = bisect.bisect_left(steps, (probability, -1.0))
    return steps[min(index, len(steps) - 1)][1]


def load_evidence(path: Path = BASE_EVIDENCE_FILE) -> list[Evidence]:
    rows = json.loads(Path(path).read_text())["evidence"]
    return [Evidence(group, float(probability), bool(right)) for group, probability, right in rows]


SCHEMA = """
CREATE TABLE IF NOT EXISTS served (entry_id INTEGER, tenant TEXT, grp TEXT, probability REAL);
CREATE INDEX IF NOT EXISTS served_entry ON served (entry_id);
CREATE TABLE IF NOT EXISTS evidence (tenant TEXT, entry_id INTEGER, grp TEXT, probability REAL, right INTEGER);
CREATE INDEX IF NOT EXISTS evidence_tenant ON evidence (tenant);
"""
MAX_SERVED_PER_ENTRY = 64  # hits kept per entry until its review (the lowest-probability ones say most)


class Calibrator:
    """The false-hit bound of every tenant. A tenant's calibration is fitted on the base evidence (the
    evals' held-out pairs) plus its own review verdicts, and refitted when a verdict arrives; a tenant
    without its own bound runs at `bound`. An approved entry also keeps its own floor: a candidate at
    least as likely, by the verifier, as one of its approved hits is served whatever the cut (the
    entry's history); a rejected entry is never served (the cache's status check). Verdicts and the
    hits awaiting one are kept in SQLite at `path` (":memory:" in tests and evals)."""

    def __init__(self, base: list[Evidence], bound: float, tenant_bounds: dict[str, float], path: str | Path):
        self.base = base
        self.bound = bound
        self.tenant_bounds = tenant_bounds
        self.db = sqlite3.connect(str(path), check_same_thread=False)
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()  # guards db and fitted
        self.fitted: dict[str, Calibration] = {}  # tenant -> its calibration (dropped on a verdict)

    def bound_of(self, tenant: str) -> float:
        return self.tenant_bounds.get(tenant, self.bound)

    def calibration(self, tenant: str) -> Calibration:
        with self.lock:
            if tenant not in self.fitted:
                self.fitted[tenant] = Calibration.fit([*self.base, *self._evidence(tenant)], self.bound_of(tenant))
            return self.fitted[tenant]

    def _evidence(self, tenant: str) -> list[Evidence]:
        rows = self.db.execute("SELECT grp, probability, right FROM evidence WHERE tenant = ?", (tenant,))
        return [Evidence(group, probability, bool(right)) for group, probability, right in rows]

    def decide(self, tenant: str, entry_id: int, group: str, probability: float) -> str:
        """ "" to serve, else the refusal's reason: "bound" (below the cut) or "uncalibrated"."""
        if self._floor(tenant, entry_id, group) <= probability:
            return ""
        calibration = self.calibration(tenant)
        if calibration.cut is None:
            return "uncalibrated"
        return "" if calibration.decide(group, probability) else "bound"

    def _floor(self, tenant: str, entry_id: int, group: str) -> float:
        """The lowest P(same answer) at which the entry was served and then approved (inf: none)."""
        with self.lock:
            row = self.db.execute(
                "SELECT MIN(probability) FROM evidence WHERE tenant = ? AND entry_id = ? AND grp = ? AND right = 1",
                (tenant, entry_id, group),
            ).fetchone()
        return row[0] if row[0] is not None else math.inf

    def served(self, tenant: str, entry_id: int, group: str, probability: float) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT INTO served VALUES (?, ?, ?, ?)", (entry_id, tenant, group, probability))
            self.db.execute(
                "DELETE FROM served WHERE entry_id = ? AND rowid NOT IN (SELECT rowid FROM served WHERE entry_id = ?"
                " ORDER BY probability LIMIT ?)",
                (entry_id, entry_id, MAX_SERVED_PER_ENTRY),
            )

    def reviewed(self, tenant: str, entry_id: int, right: bool) -> int:
        """An admin's verdict on an entry: the hits it served become the tenant's evidence (how many)."""
        with self.lock, self.db:
            hits = self.db.execute(
                "SELECT grp, probability FROM served WHERE entry_id = ? AND tenant = ?", (entry_id, tenant)
            ).fetchall()
            self.db.executemany(
                "INSERT INTO evidence VALUES (?, ?, ?, ?, ?)",
                [(tenant, entry_id, group, probability, int(right)) for group, probability in hits],
            )
            self.db.execute("DELETE FROM served WHERE entry_id = ?", (entry_id,))
            self.fitted.pop(tenant, None)
        return len(hits)

    def stats(self, tenants: Iterable[str] = ()) -> dict[str, dict]:
        """Per tenant (the default's under "*"): its bound, cut, evidence and estimated wrong share."""
        with self.lock:
            known = {row[0] for row in self.db.execute("SELECT DISTINCT tenant FROM evidence")}
        out = {}
        for tenant in ["*", *sorted({*self.tenant_bounds, *known, *tenants})]:
            fitted = self.calibration(tenant)
            out[tenant] = {
                "configured": tenant == "*" or tenant in self.tenant_bounds,  # an operator's scope (a metrics label)
                "bound": fitted.bound,
                "calibrated": fitted.cut is not None,
                "cut": fitted.cut,
                "evidence": fitted.num_evidence,
                "estimated_false_hit_rate": fitted.served_wrong_share,
                "estimated_false_hit_upper": fitted.served_wrong_upper,
            }
        return out

    def close(self) -> None:
        with self.lock:
            self.db.close()
