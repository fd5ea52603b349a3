"""Risk rules: questions whose answers must not be shared across end users, or at all.

    RiskPolicy.category(text) -> str | None      the first matching category, in file order

Patterns run on RE2 (google-re2): its matching time is linear in the text for every pattern, so no
rule, built in or supplied by an operator, can stall a request on hostile input. (Python's `re`
backtracks: the first version's `\\b(status|tracking)\\b[^?.!]*\\bmy\\b` took 13 s on 73 KB of
"status ", on the event loop, holding every request.)

The rules are data: `risk_patterns.json` beside this module is the default and documents the format;
`load_risk_patterns(path)` reads an operator's copy (setting STRATA_RISK_PATTERNS_FILE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import re2

PERSONAL_DATA: Final = "personal_data"  # scoped to the named end user, or the semantic layer is bypassed
DEFAULT_PATTERNS_FILE = Path(__file__).with_name("risk_patterns.json")


@dataclass(frozen=True, slots=True)
class RiskPatterns:
    """category -> RE2 patterns; a category matches when a pattern matches and no exemption does."""

    categories: dict[str, tuple[str, ...]]
    exemptions: dict[str, tuple[str, ...]] = field(default_factory=dict)


def load_risk_patterns(path: Path = DEFAULT_PATTERNS_FILE) -> RiskPatterns:
    """Read and compile-check a patterns file; ValueError names the bad pattern."""
    raw = json.loads(Path(path).read_text())
    categories = {name: tuple(group) for name, group in raw["categories"].items()}
    exemptions = {name: tuple(group) for name, group in raw.get("exemptions", {}).items()}
    patterns = RiskPatterns(categories, exemptions)
    RiskPolicy(patterns)  # fail at start-up, not on the first request
    return patterns


class RiskPolicy:
    """Each category's patterns are one RE2 alternation: one linear scan per category, not per pattern."""

    def __init__(self, patterns: RiskPatterns):
        self.categories = {name: _compile(group) for name, group in patterns.categories.items()}
        self.exemptions = {name: _compile(group) for name, group in patterns.exemptions.items() if group}

    def category(self, text: str) -> str | None:
        for name, pattern in self.categories.items():
            exemption = self.exemptions.get(name)
            if pattern.search(text) and not (exemption and exemption.search(text)):
                return name
        return None


def _compile(group: tuple[str, ...]):
    for pattern in group:  # one by one first, so the error names the bad pattern
        try:
            re2.compile(pattern)
        except re2.error as exc:
            raise ValueError(f"risk pattern {pattern!r} is not valid RE2: {exc}") from None
    return re2.compile("(?i)" + "|".join(f"(?:{pattern})" for pattern in group))
