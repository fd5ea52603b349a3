"""SemanticCache on the real MiniLM and faiss: partitions, guards, TTL, review status, restart."""

import pytest

from semantic import Answer, RiskPolicy, Scope, SemanticCache, SemanticSettings, SqliteEntries, load_risk_patterns

SCOPE = Scope("tenant-a", "model-1")
CONTEXT = "ctx"


@pytest.fixture
def cache(tmp_path, embedder):
    live = SemanticCache(embedder, SqliteEntries(tmp_path / "semantic.db"), SemanticSettings())
    yield live
    live.close()


def test_paraphrase_hits_and_reports_score(cache):
    entry_id = cache.insert("How do I reset my password?", Answer("Use the reset link."), SCOPE, CONTEXT, now=0)
    result = cache.lookup("What is the way to reset my password?", SCOPE, CONTEXT, now=1)
    assert result.status == "hit" and result.entry.id == entry_id and result.score > 0.8
    assert result.entry.answer == "Use the reset link."
    assert cache.get(entry_id).hit_count == 1


def test_lookalike_misses_with_the_guard_reason(cache):
    cache.insert("How do I enable dark mode?", Answer("Settings > Appearance."), SCOPE, CONTEXT, now=0)
    result = cache.lookup("Why can't I enable dark mode?", SCOPE, CONTEXT, now=1)
    assert result.status == "miss" and result.reason == "negation" and result.score > 0.8
    assert result.entry is None and result.candidate.answer == "Settings > Appearance."  # a draft, never served


def test_a_distant_miss_names_no_candidate(cache):
    cache.insert("How do I enable dark mode?", Answer("Settings > Appearance."), SCOPE, CONTEXT, now=0)
    result = cache.lookup("What does the lighthouse keeper log each night?", SCOPE, CONTEXT, now=1)
    assert result.status == "miss" and result.score < 0.8 and result.candidate is None


def test_other_scope_or_context_never_sees_the_entry(cache):
    cache.insert("What is the refund policy?", Answer("30 days."), SCOPE, CONTEXT, now=0)
    for scope, context in [
        (Scope("tenant-b", "model-1"), CONTEXT),
        (Scope("tenant-a", "model-2"), CONTEXT),
        (Scope("tenant-a", "model-1", locale="de-DE"), CONTEXT),
        (SCOPE, "other-system-prompt"),
    ]:
        result = cache.lookup("What is the refund policy?", scope, context, now=1)
        assert result.status == "miss" and result.reason == "no_candidate"


def test_expired_entries_are_removed_from_index_and_store(cache):
    entry_id = cache.insert("What are the opening hours?", Answer("9 to 5."), SCOPE, CONTEXT, now=0, ttl_s=10)
    assert cache.lookup("What are the opening hours?", SCOPE, CONTEXT, now=5).status == "hit"
    assert cache.lookup("What are the opening hours?", SCOPE, CONTEXT, now=11).status == "miss"
    assert cache.get(entry_id) is None and len(cache.index) == 0


def test_rejected_entries_are_never_served_and_approval_can_be_required(cache, tmp_path, embedder):
    entry_id = cache.insert("Is there a mobile app?", Answer("Yes."), SCOPE, CONTEXT, now=0)
    cache.set_status(entry_id, "rejected")
    assert cache.lookup("Is there a mobile app?", SCOPE, CONTEXT, now=1).status == "miss"
    strict = SemanticCache(embedder, SqliteEntries(tmp_path / "strict.db"), SemanticSettings(require_approved=True))
    other = strict.insert("Is there a mobile app?", Answer("Yes."), SCOPE, CONTEXT, now=0)
    assert strict.lookup("Is there a mobile app?", SCOPE, CONTEXT, now=1).status == "miss"
    strict.set_status(other, "approved")
    assert strict.lookup("Is there a mobile app?", SCOPE, CONTEXT, now=1).status == "hit"
    strict.close()


def test_entries_and_index_survive_a_restart(tmp_path, embedder):
    first = SemanticCache(embedder, SqliteEntries(tmp_path / "s.db"), SemanticSettings())
    entry_id = first.insert("How do I export my data?", Answer("Use Export."), SCOPE, CONTEXT, now=0)
    first.close()
    second = SemanticCache(embedder, SqliteEntries(tmp_path / "s.db"), SemanticSettings())
    result = second.lookup("How can I export my data?", SCOPE, CONTEXT, now=1)
    assert result.status == "hit" and result.entry.id == entry_id
    assert (
        second.delete(entry_id) and second.lookup("How can I export my data?", SCOPE, CONTEXT, now=1).status == "miss"
    )
    second.close()


def test_risky_topics_are_named_for_bypass(cache):
    risk = RiskPolicy(load_risk_patterns())

    def screen(text, has_tools=False, has_end_user=False):
        return cache.screen(text, has_tools, risk.category(text), has_end_user)

    assert screen("What is the status of my order?").bypass_reason == "risk:personal_data"
    assert screen("What dosage of ibuprofen is safe?").bypass_reason == "risk:medical"
    assert screen("Anything", has_tools=True).bypass_reason == "tools"
    assert screen("How do I export my data?").bypass_reason is None
    assert screen("Where is my package?").bypass_reason == "risk:personal_data"
    assert screen("Why was my card declined?").bypass_reason == "risk:personal_data"
    assert screen("x" * 1001).bypass_reason == "query_too_long"  # beyond what MiniLM reads


def test_personal_questions_need_a_named_end_user(cache):
    risk = RiskPolicy(load_risk_patterns())
    question = "What is my account number?"
    assert (
        cache.screen(question, False, risk.category(question), has_end_user=False).bypass_reason == "risk:personal_data"
    )
    scoped = cache.screen(question, False, risk.category(question), has_end_user=True)
    assert scoped.bypass_reason is None and scoped.personal


def test_owned_entries_are_purged_by_session_keeping_shared_ones(tmp_path, embedder):
    from semantic import Answer, Owner, Scope, Selector, SemanticCache, SemanticSettings, SqliteEntries

    cache = SemanticCache(embedder, SqliteEntries(tmp_path / "s.db"), SemanticSettings())
    scope = Scope("tenant-a", "model")
    shared = cache.insert("What are your opening hours?", Answer("9 to 5"), scope, "ctx", 0.0, owner=Owner("s1"))
    assert (
        cache.insert("What are your opening hours?", Answer("9 to 5"), scope, "ctx", 1.0, owner=Owner("s2")) == shared
    )
    private = cache.insert("How do I reset my password?", Answer("Use the link"), scope, "ctx", 0.0, owner=Owner("s1"))
    purged = cache.purge_owned(Selector("tenant-a", session="s1"))
    assert purged.num_entries == 1 and purged.num_bytes > 0
    assert cache.get(private) is None and cache.get(shared) is not None
    assert cache.lookup("How do I reset my password?", scope, "ctx", 2.0).status == "miss"  # gone from the index too
    assert cache.purge_owned(Selector("tenant-a")).num_entries == 1 and cache.stats().num_entries == 0
    cache.close()
