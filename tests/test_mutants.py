"""`make mutants` stays runnable: every mutant's text still occurs exactly once where it points."""

import pytest

from tests.mutants import MUTANTS, ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_still_applies(mutant):
    assert (ROOT / mutant.path).read_text().count(mutant.old) == 1
    for test in mutant.tests:
        assert (ROOT / test.split("::", 1)[0]).exists(), test


def test_the_mutants_cover_the_critical_breakages():
    names = " | ".join(m.name for m in MUTANTS)
    for needed in (
        "tenant out of the exact key",
        "tenant out of the semantic partition",
        "tenant out of the KV",
        "tenant out of the vision",
        "checksum skipped (read and reindex)",
        "kept on read",
        "indexed on reindex",
        "writes in place",
        "folder containment",
        "no-store",
        "sampled",
        "guard removed",
    ):
        assert needed in names, needed
