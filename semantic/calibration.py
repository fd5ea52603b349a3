"""A false-hit bound the operator chooses: which semantic candidates may be served so that, with 95%
confidence, at most `bound` of the lookups whose candidate has another answer (look-alikes) are
served it.

    Evidence(group, probability, right)                 one judged lookup and its candidate
    Calibration.fit(evidence, bound) -> Calibration     isotonic calibration + a risk-controlling cut
    Calibration.decide(group, probability) -> bool      serve?  (never, when uncalibrated)
    Calibration.calibrated(group, probability)          P(right), calibrated on the evidence
    Calibrator(base, bound, tenant_bounds, journal)     per tenant: base evidence + its own review verdicts
        .decide(tenant, entry_id, group, p) -> "" | "bound" | "uncalibrated"
        .served(tenant, entry_id, group, p)             a hit, kept until its entry is reviewed
        .reviewed(tenant, entry_id, right)              approve / reject: its hits become evidence
    SqliteJournal(path), redis_calibration.RedisJournal(url)   where the verdicts live: a replica's, or all

What is bounded: the false-hit rate is false hits per lookup (as `python -m evals false-hits` counts
it); the share of look-alikes served bounds it under any mix of traffic, since false hits per lookup
= (look-alikes per lookup) x (look-alikes served) <= look-alikes served. A bound on the wrong share
of *hits* instead would move with that mix, and costs most of the paraphrase hits at 10% (PAWS: 48%
vs 60%+). Both are reported (`/admin/stats`, `python -m evals false-hits --bound`).

A judged lookup has a group: `refused` (a fact guard refused its candidate: never served), `pass` (no
guard objects), `structural` (only the word-order guards object, which the verifier judges better);
past the fact guards, the verifier's P(same answer). Per served group, P(right) is calibrated on the
evidence by isotonic regression (pool adjacent violators: monotone in the verifier's probability, no
shape assumed). Candidates rank by calibrated value, then (within a flat isotonic step, where
calibration alone cannot tell them apart) by the verifier's own probability. The cut on that rank is
chosen by fixed-sequence testing as in "Learn then Test" (Angelopoulos et al.): the cuts (one per
distinct rank in the evidence) are tried from the strictest to the loosest, each a test of "it
serves more than `bound` of the look-alikes", rejected when the Clopper-Pearson 95% upper bound of
the share of the evidence's look-alikes it serves is at most `bound`; the first cut not rejected ends the search and the last rejected one is kept. Under
exchangeability of the evidence's look-alikes and the traffic's this bounds the share served with 95%
confidence, whatever the verifier's own miscalibration; no cut passing (too few look-alikes in the
evidence for the bound asked: even serving none of them, the upper bound of 0 of n is above it)
leaves the scope *uncalibrated*: it serves nothing and says so (`miss; reason=uncalibrated`).

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
from typing import Protocol

GROUPS = ("pass", "structural")  # the groups a cut may serve; "refused" lookups only count
CONFIDENCE = 0.95
BASE_EVIDENCE_FILE = Path(__file__).with_name("calibration.json")  # written by `python -m evals calibrate`


@dataclass(frozen=True, slots=True)
class Evidence:
    group: str  # "pass", "structural" or "refused"
    probability: float  # the verifier's P(same answer) (0 when refused)
    right: bool  # the cached answer serves the new question (False: a look-alike)


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
    """The fewest look-alikes the evidence must hold for any cut to certify `bound` (one serving none)."""
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
    curves: dict[str, list[tuple[float, float]]]  # served group -> isotonic steps
    cut: tuple[float, float] | None  # serve at (calibrated P(right), P(same answer)) >= cut; None: serve nothing
    num_evidence: int
    lookalikes: int  # evidence whose candidate had another answer
    lookalikes_served: float  # their share the cut serves (0 when uncalibrated): the estimated false-hit rate
    lookalikes_served_upper: float  # its 95% upper bound (<= bound when calibrated)
    hits_wrong: float  # the wrong share of what the cut serves, on the evidence

    @classmethod
    def fit(cls, evidence: Iterable[Evidence], bound: float) -> Calibration:
        items = list(evidence)
        curves = {group: isotonic([(e.probability, e.right) for e in items if e.group == group]) for group in GROUPS}
        lookalikes = sum(not e.right for e in items)
        scored = sorted(
            (((_value(curves, e.group, e.probability), e.probability), e.right) for e in items if e.group in GROUPS),
            reverse=True,
        )
        fitted = cls(bound, curves, None, len(items), lookalikes, 0.0, 0.0, 0.0)
        served = wrong = 0
        for index, (rank, right) in enumerate(scored):  # strictest first
            served, wrong = served + 1, wrong + (not right)
            if index + 1 < len(scored) and scored[index + 1][0] == rank:
                continue  # a cut serves every candidate of a rank, or none
            if (upper := upper_bound(wrong, lookalikes)) > bound:
                break  # fixed-sequence testing: the first failing cut ends the search
            fitted = cls(bound, curves, rank, len(items), lookalikes, wrong / lookalikes, upper, wrong / served)
        return fitted

    def calibrated(self, group: str, probability: float) -> float:
        return _value(self.curves, group, probability)

    def decide(self, group: str, probability: float) -> bool:
        return self.cut is not None and (self.calibrated(group, probability), probability) >= self.cut


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


class Journal(Protocol):
    """Where review evidence lives: SqliteJournal (one replica's file) or semantic.redis_calibration's
    RedisJournal (shared by every replica of a Redis-backed cache). A hit is kept per entry until its
    review; a verdict turns the entry's hits into the tenant's evidence in one step."""

    def served(self, tenant: str, entry_id: int, group: str, probability: float) -> None: ...
    def reviewed(self, tenant: str, entry_id: int, right: bool) -> int: ...
    def evidence(self, tenant: str) -> list[Evidence]: ...
    def floor(self, tenant: str, entry_id: int, group: str) -> float: ...
    def tenants(self) -> set[str]: ...
    def version(self, tenant: str) -> object: ...
    def forget(self, entry_ids: Iterable[int], tenant: str | None = None) -> None: ...
    def forget_all(self) -> None: ...
    def close(self) -> None: ...


MAX_SERVED_PER_ENTRY = 64  # hits kept per entry until its review (the lowest-probability ones say most)
SCHEMA = """
CREATE TABLE IF NOT EXISTS served (entry_id INTEGER, tenant TEXT, grp TEXT, probability REAL);
CREATE INDEX IF NOT EXISTS served_entry ON served (entry_id);
CREATE TABLE IF NOT EXISTS evidence (tenant TEXT, entry_id INTEGER, grp TEXT, probability REAL, right INTEGER);
CREATE INDEX IF NOT EXISTS evidence_tenant ON evidence (tenant);
"""


class SqliteJournal:
    """One replica's review evidence in SQLite at `path` (":memory:" in tests and evals). Only this
    process writes it, so a tenant's version is a counter kept here."""

    def __init__(self, path: str | Path):
        self.db = sqlite3.connect(str(path), check_same_thread=False)
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()  # guards db and versions
        self.versions: dict[str | None, int] = {}  # tenant (None: every tenant) -> verdicts and purges seen

    def served(self, tenant: str, entry_id: int, group: str, probability: float) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT INTO served VALUES (?, ?, ?, ?)", (entry_id, tenant, group, probability))
            self.db.execute(
                "DELETE FROM served WHERE entry_id = ? AND rowid NOT IN (SELECT rowid FROM served WHERE entry_id = ?"
                " ORDER BY probability LIMIT ?)",
                (entry_id, entry_id, MAX_SERVED_PER_ENTRY),
            )

    def reviewed(self, tenant: str, entry_id: int, right: bool) -> int:
        with self.lock, self.db:
            hits = self.db.execute(
                "SELECT grp, probability FROM served WHERE entry_id = ? AND tenant = ?", (entry_id, tenant)
            ).fetchall()
            self.db.executemany(
                "INSERT INTO evidence VALUES (?, ?, ?, ?, ?)",
                [(tenant, entry_id, group, probability, int(right)) for group, probability in hits],
            )
            self.db.execute("DELETE FROM served WHERE entry_id = ?", (entry_id,))
            self.versions[tenant] = self.versions.get(tenant, 0) + 1
        return len(hits)

    def evidence(self, tenant: str) -> list[Evidence]:
        with self.lock:
            rows = self.db.execute(
                "SELECT grp, probability, right FROM evidence WHERE tenant = ?", (tenant,)
            ).fetchall()
        return [Evidence(group, probability, bool(right)) for group, probability, right in rows]

    def floor(self, tenant: str, entry_id: int, group: str) -> float:
        with self.lock:
            row = self.db.execute(
                "SELECT MIN(probability) FROM evidence WHERE tenant = ? AND entry_id = ? AND grp = ? AND right = 1",
                (tenant, entry_id, group),
            ).fetchone()
        return row[0] if row[0] is not None else math.inf

    def tenants(self) -> set[str]:
        with self.lock:
            return {row[0] for row in self.db.execute("SELECT DISTINCT tenant FROM evidence")}

    def version(self, tenant: str) -> object:
        with self.lock:
            return self.versions.get(None, 0), self.versions.get(tenant, 0)

    def forget(self, entry_ids: Iterable[int], tenant: str | None = None) -> None:
        with self.lock, self.db:
            self.db.executemany("DELETE FROM served WHERE entry_id = ?", [(i,) for i in entry_ids])
            if tenant is not None:
                self.db.execute("DELETE FROM evidence WHERE tenant = ?", (tenant,))
                self.versions[tenant] = self.versions.get(tenant, 0) + 1

    def forget_all(self) -> None:
        with self.lock, self.db:
            self.db.execute("DELETE FROM served")
            self.db.execute("DELETE FROM evidence")
            self.versions[None] = self.versions.get(None, 0) + 1

    def close(self) -> None:
        with self.lock:
            self.db.close()


class Calibrator:
    """The false-hit bound of every tenant. A tenant's calibration is fitted on the base evidence (the
    evals' held-out pairs) plus its own review verdicts from the journal, and refitted when the
    journal's version for it moves (a verdict or a purge, on any replica sharing it); a tenant without
    its own bound runs at `bound`. Verdicts label only hits (the look-alikes that were not served are
    never reviewed), so a rejected hit raises the tenant's estimated share of look-alikes served more
    than it would with every look-alike counted: they err towards refusing. An approved entry also
    keeps its own floor: a candidate at least as likely, by the verifier, as one of its approved hits
    is served whatever the cut (the entry's history); a rejected entry is never served (the cache's
    status check). A journal out of reach raises StoreUnavailable (the layer is bypassed)."""

    def __init__(self, base: list[Evidence], bound: float, tenant_bounds: dict[str, float], journal: Journal):
        self.base = base
        self.bound = bound
        self.tenant_bounds = tenant_bounds
        self.journal = journal
        self.lock = threading.Lock()  # guards fitted
        self.fitted: dict[str, tuple[object, Calibration]] = {}  # tenant -> (journal version, calibration)

    def bound_of(self, tenant: str) -> float:
        return self.tenant_bounds.get(tenant, self.bound)

    def calibration(self, tenant: str) -> Calibration:
        version = self.journal.version(tenant)
        with self.lock:
            kept = self.fitted.get(tenant)
        if kept is not None and kept[0] == version:
            return kept[1]
        fitted = Calibration.fit([*self.base, *self.journal.evidence(tenant)], self.bound_of(tenant))
        with self.lock:
            self.fitted[tenant] = (version, fitted)
        return fitted

    def decide(self, tenant: str, entry_id: int, group: str, probability: float) -> str:
        """ "" to serve, else the refusal's reason: "bound" (below the cut) or "uncalibrated"."""
        if self.journal.floor(tenant, entry_id, group) <= probability:
            return ""
        calibration = self.calibration(tenant)
        if calibration.cut is None:
            return "uncalibrated"
        return "" if calibration.decide(group, probability) else "bound"

    def served(self, tenant: str, entry_id: int, group: str, probability: float) -> None:
        self.journal.served(tenant, entry_id, group, probability)

    def reviewed(self, tenant: str, entry_id: int, right: bool) -> int:
        """An admin's verdict on an entry: the hits it served become the tenant's evidence (how many)."""
        return self.journal.reviewed(tenant, entry_id, right)

    def forget(self, entry_ids: Iterable[int], tenant: str | None = None) -> None:
        """Purged data (numbers and entry ids, but a purge leaves nothing behind): the hits awaiting a
        review of these entries, and with a tenant named (a whole-tenant purge) its evidence too."""
        self.journal.forget(entry_ids, tenant)

    def forget_all(self) -> None:
        self.journal.forget_all()

    def stats(self, tenants: Iterable[str] = ()) -> dict[str, dict]:
        """Per tenant (the default's under "*"): its bound, cut, evidence and estimated false-hit rate."""
        out = {}
        for tenant in ["*", *sorted({*self.tenant_bounds, *self.journal.tenants(), *tenants})]:
            fitted = self.calibration(tenant)
            out[tenant] = {
                "configured": tenant == "*" or tenant in self.tenant_bounds,  # an operator's scope (a metrics label)
                "bound": fitted.bound,
                "calibrated": fitted.cut is not None,
                "cut": fitted.cut,  # [calibrated P(right), the verifier's P] of the last candidate served
                "evidence": fitted.num_evidence,
                "estimated_false_hit_rate": fitted.lookalikes_served,
                "estimated_false_hit_upper": fitted.lookalikes_served_upper,
                "estimated_wrong_share_of_hits": fitted.hits_wrong,
            }
        return out

    def close(self) -> None:
        self.journal.close()
