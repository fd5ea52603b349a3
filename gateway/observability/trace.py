"""The request-scoped trace: what each cache layer did, who answered, and how long each step took.

Layers record typed outcomes; only `headers()` knows how they look on the wire:
    X-Cache-Layer: engine
    X-Cache-Prefix: hit; cached=3072; prompt=3100; tier=ram
    Cache-Status: strata-prefix; fwd=partial; detail="cached=3072; prompt=3100; tier=ram", ...  (RFC 9211)
    Server-Timing: exact;dur=0.1, semantic;dur=6.2, prefill;dur=80.5
    X-Strata-Speculative: proposer=cache,prompt; drafted=40; accepted=36   (an engine answer, when whole)
    X-Strata-Ignored: include, tools[8] (web_search: not offered)        (fields no layer acted on)
    X-Strata-Max-Tokens: asked=32000; allowed=15873; by=context         (max_tokens lowered)
    X-Strata-System-Messages: in_place=1                                 (later system messages)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final, Literal

from ..engine import SpeculativeReport, SystemPlacement

LAYERS = ("exact", "semantic", "vision", "prefix")
Status = Literal["hit", "miss", "bypass"]
HIT: Final = "hit"
MISS: Final = "miss"
BYPASS: Final = "bypass"


@dataclass(frozen=True, slots=True)
class LayerOutcome:
    status: Status
    details: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, status: Status, **details: object) -> LayerOutcome:
        return cls(status, tuple((k, str(v)) for k, v in details.items()))

    def header_value(self) -> str:
        return "; ".join([self.status, *(f"{k}={v}" for k, v in self.details)])


DISABLED = LayerOutcome.of(BYPASS, reason="disabled")


@dataclass(frozen=True, slots=True)
class PrefixFacts:
    """The prefix lookup in numbers, for the miss diagnosis (the header says the same in words)."""

    num_prompt_tokens: int
    num_cached_tokens: int
    num_ssd_tokens: int = 0  # of the cached tokens, promoted from the SSD tier
    why: str = ""  # cold | diverged | evicted | expired | purged ("" when nothing reusable was missed)
    tier: str = ""  # evicted / expired / purged: from ram or ssd
    lived_s: float = 0.0  # ... after this long there
    where: str = ""  # diverged: system | earlier_turn | latest | image ("" when unknown)
    # diverged: the first 40 characters of the prompt line where it did (for the admin's diagnosis only:
    # never in a header)
    line: str = ""


@dataclass(slots=True)
class Trace:
    outcomes: dict[str, LayerOutcome] = field(default_factory=lambda: {name: DISABLED for name in LAYERS})
    served_by: str = "engine"  # exact | semantic | engine
    timings_ms: dict[str, float] = field(default_factory=dict)
    prefix: PrefixFacts | None = None  # set when the prefix cache was looked up
    chain: tuple[bytes, ...] = ()  # the prompt's block hashes when the engine looked them up
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None  # from start to the first piece of the answer (time to first token)
    token_gaps_s: list[float] = field(default_factory=list)  # between the engine's pieces (inter-token latency)
    last_token_at: float = 0.0
    normalized: bool = False  # a normalisation rule changed the prompt (X-Cache-Prefix says normalized=1)
    speculative: SpeculativeReport | None = None  # an engine answer's drafts, once it finished
    ignored: list[str] = field(default_factory=list)  # the client's fields no layer acted on (X-Strata-Ignored)
    max_tokens: MaxTokens | None = None  # set when the answer may run to fewer tokens than the client asked
    system: SystemPlacement = SystemPlacement()  # how the prompt's later system messages were rendered

    def token(self, from_engine: bool) -> None:
        """A piece of the answer left (a stored answer's pieces count for the first token only)."""
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now - self.started
        elif from_engine:
            self.token_gaps_s.append(now - self.last_token_at)
        self.last_token_at = now

    def record(self, layer: str, outcome: LayerOutcome) -> None:
        assert layer in LAYERS, f"unknown layer {layer!r}"
        self.outcomes[layer] = outcome

    def time(self, step: str, duration_ms: float) -> None:
        self.timings_ms[step] = self.timings_ms.get(step, 0.0) + duration_ms

    @contextmanager
    def timed(self, step: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.time(step, (time.perf_counter() - start) * 1000)

    def server_timing(self) -> str:
        return ", ".join(f"{step};dur={ms:.2f}" for step, ms in self.timings_ms.items())

    def cache_status(self) -> str:
        """RFC 9211: one member per layer, the one closest to the origin (the model) first. A hit that
        answered is `hit`; the prefix cache's hit still runs the model on the rest (`fwd=partial`); a
        miss is `fwd=miss`, a bypass `fwd=bypass`; `detail` repeats the X-Cache-* details."""
        members = []
        for layer in reversed(LAYERS):
            outcome = self.outcomes[layer]
            if outcome.status == HIT and layer != "prefix":
                member = "hit"
            else:
                member = "fwd=" + {HIT: "partial", MISS: "miss", BYPASS: "bypass"}[outcome.status]
            detail = "; ".join(f"{k}={v}" for k, v in outcome.details)
            if detail:
                member += '; detail="' + detail.replace("\\", "\\\\").replace('"', '\\"') + '"'
            members.append(f"strata-{layer}; {member}")
        return ", ".join(members)

    def headers(self) -> dict[str, str]:
        headers = {"X-Cache-Layer": self.served_by, "Cache-Status": self.cache_status()}
        headers.update({f"X-Cache-{name.capitalize()}": self.outcomes[name].header_value() for name in LAYERS})
        if self.normalized:
            headers["X-Cache-Prefix"] += "; normalized=1"
        if self.timings_ms:
            headers["Server-Timing"] = self.server_timing()
        if self.speculative is not None:
            headers["X-Strata-Speculative"] = speculative_value(self.speculative)
        return headers | self.adjustments()

    def adjustments(self) -> dict[str, str]:
        """What the server did with the request other than asked, as headers: fields it ignored,
        max_tokens it lowered, system messages it placed. Known before the answer starts."""
        headers = {}
        if self.ignored:
            headers["X-Strata-Ignored"] = ignored_value(self.ignored)
        if self.max_tokens is not None:
            headers["X-Strata-Max-Tokens"] = self.max_tokens.header_value
        if self.system.header_value:
            headers["X-Strata-System-Messages"] = self.system.header_value
        return headers

    def summary(self) -> dict:
        """The trace as JSON, for the `usage.strata` field (streams put their late facts there)."""
        summary = {
            "layer": self.served_by,
            "cache": {name: self.outcomes[name].header_value() for name in LAYERS},
            "server_timing": self.server_timing(),
        }
        if self.speculative is not None:
            summary["speculative"] = speculative_value(self.speculative)
        if self.ignored:
            summary["ignored"] = list(self.ignored)
        if self.max_tokens is not None:
            summary["max_tokens"] = self.max_tokens.header_value
        if self.system.header_value:
            summary["system_messages"] = self.system.header_value
        return summary


@dataclass(frozen=True, slots=True)
class MaxTokens:
    """An answer's max_tokens lowered from what the client asked: to the server's output limit
    (STRATA_MAX_OUTPUT_TOKENS) or to what the model's context has left after the prompt."""

    asked: int
    allowed: int
    by: Literal["output_limit", "context"]

    @property
    def header_value(self) -> str:
        return f"asked={self.asked}; allowed={self.allowed}; by={self.by}"


MAX_IGNORED_SHOWN = 24  # names X-Strata-Ignored lists; past them, how many more


def ignored_value(ignored: list[str]) -> str:
    shown = ", ".join(ignored[:MAX_IGNORED_SHOWN])
    return shown + (f", and {len(ignored) - MAX_IGNORED_SHOWN} more" if len(ignored) > MAX_IGNORED_SHOWN else "")


def speculative_value(report: SpeculativeReport) -> str:
    """`proposer=cache,prompt; drafted=N; accepted=M` (proposer=none when no row drafted)."""
    names = ",".join(name for name, _, _ in report.counts) or "none"
    return f"proposer={names}; drafted={report.num_drafted}; accepted={report.num_accepted}"
