"""SemanticCache on the real MiniLM and faiss: partitions, guards, TTL, review status, restart."""

import pytest

from semantic import Scope, SemanticCache, SemanticSettings

SCOPE = Scope("tenant-a", "model-1")
CONTEXT = "ctx"


@pytest.fixture
def cache(tmp_path, embedder):
    live = SemanticCache(embedder, tmp_path / "semantic.db", SemanticSettings())
    yield live
    live.close()


def test_paraphrase_hits_and_reports_score(cache):
    entry_id = cache.insert("How do I reset my password?", "Use the reset link.", SCOPE, CONTEXT, now=0)
    result = cache.lookup("What is the way to reset my password?", SCOPE, CONTEXT, now=1)
    assert result.status == "hit" and result.entry.id == entry_id and result.score > 0.8
    assert result.entry.answer == "Use the reset link."
    assert cache.get(entry_id).hit_count == 1


def test_lookalike_misses_with_the_guard_reason(cache):
    cache.insert("How do I enable dark mode?", "Settings > Appearance.", SCOPE, CONTEXT, now=0)
    result = cache.lookup("Why can't I enable dark mode?", SCOPE, CONTEXT, now=1)
    assert result.status == "miss" and result.reason == "negation" and result.score > 0.8


def test_other_scope_or_context_never_sees_the_entry(cache):
    cache.insert("What is the refund policy?", "30 days.", SCOPE, CONTEXT, now=0)
    for scope, context in [(Scope("tenant-b", "model-1"), CONTEXT), (Scope("tenant-a", "model-2"), CONTEXT),
                           (Scope("tenant-a", "model-1", locale="de-DE"), CONTEXT), (SCOPE, "other-system-prompt")]:
        result = cache.lookup("What is the refund policy?", scope, context, now=1)
        assert result.status == "miss" and result.reason == "no_candidate"


def test_expired_entries_are_removed_from_index_and_store(cache):
    entry_id = cache.insert("What are the opening hours?", "9 to 5.", SCOPE, CONTEXT, now=0, ttl_s=10)
    assert cache.lookup("What are the opening hours?", SCOPE, CONTEXT, now=5).status == "hit"
    assert cache.lookup("What are the opening hours?", SCOPE, CONTEXT, now=11).status == "miss"
    assert cache.get(entry_id) is None and len(cache.index) == 0


def test_rejected_entries_are_never_served_and_approval_can_be_required(cache, tmp_path, embedder):
    entry_id = cache.insert("Is there a mobile app?", "Yes.", SCOPE, CONTEXT, now=0)
    cache.set_status(entry_id, "rejected")
    assert cache.lookup("Is there a mobile app?", SCOPE, CONTEXT, now=1).status == "miss"
    strict = SemanticCache(embedder, tmp_path / "strict.db", SemanticSettings(require_approved=True))
    other = strict.insert("Is there a mobile app?", "Yes.", SCOPE, CONTEXT, now=0)
    assert strict.lookup("Is there a mobile app?", SCOPE, CONTEXT, now=1).status == "miss"
    strict.set_status(other, "approved")
    assert strict.lookup("Is there a mobile app?", SCOPE, CONTEXT, now=1).status == "hit"
    strict.close()


def test_entries_and_index_survive_a_restart(tmp_path, embedder):
    first = SemanticCache(embedder, tmp_path / "s.db", SemanticSettings())
    entry_id = first.insert("How do I export my data?", "Use Export.", SCOPE, CONTEXT, now=0)
    first.close()
    second = SemanticCache(embedder, tmp_path / "s.db", SemanticSettings())
    result = second.lookup("How can I export my data?", SCOPE, CONTEXT, now=1)
    assert result.status == "hit" and result.entry.id == entry_id
    assert second.delete(entry_id) and second.lookup("How can I export my data?", SCOPE, CONTEXT, now=1).status == "miss"
    second.close()


def test_risky_topics_are_named_for_bypass(cache):
    assert cache.bypass_reason("What is the status of my order?", has_tools=False) == "risk:personal_data"
    assert cache.bypass_reason("What dosage of ibuprofen is safe?", has_tools=False) == "risk:medical"
    assert cache.bypass_reason("Anything", has_tools=True) == "tools"
    assert cache.bypass_reason("How do I export my data?", has_tools=False) is None
    assert cache.bypass_reason("Where is my package?", has_tools=False) == "risk:personal_data"
    assert cache.bypass_reason("Why was my card declined?", has_tools=False) == "risk:personal_data"
