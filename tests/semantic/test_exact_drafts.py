"""The exact cache keeps each answer's token ids under a draft key (the same request under any decoding
parameters), in a store beside the answers: read back as drafts, never counted or served as answers,
purged and expired with them, apart per tenant."""

from __future__ import annotations

import pytest

from semantic import CacheControl, Draft, ExactCache, MemoryStore, Owner, Scope, Selector, SqliteStore, draft_key

MESSAGES = [{"role": "user", "content": [{"text": "Which harbour does the ferry leave from?"}]}]
KEY = draft_key(Scope("tenant-a", "model"), MESSAGES, {})


@pytest.fixture(params=["memory", "sqlite"])
def cache(request, tmp_path):
    if request.param == "memory":
        return ExactCache(MemoryStore(), 3600.0, drafts=MemoryStore())
    return ExactCache(SqliteStore(tmp_path / "answers.db"), 3600.0, drafts=SqliteStore(tmp_path / "drafts.db"))


def test_a_draft_is_read_back_as_token_ids_and_is_not_an_answer(cache):
    cache.store_draft(KEY, "tenant-a", Draft((5, 6, 7), "stop", 10.0, None), CacheControl(), Owner())
    assert cache.draft(KEY, 11.0) == (5, 6, 7)
    assert cache.stats().num_entries == 0 and cache.store.get(KEY, 11.0) is None
    assert cache.draft(draft_key(Scope("tenant-b", "model"), MESSAGES, {}), 11.0) is None  # another tenant's key
    cache.store_draft(KEY, "tenant-a", Draft((1, 2), "stop", 12.0, None), CacheControl(no_store=True), Owner())
    assert cache.draft(KEY, 13.0) == (5, 6, 7)  # no_store keeps drafts out too


def test_an_answer_cut_by_max_tokens_or_a_stop_keeps_the_longer_draft_it_begins(cache):
    cache.store_draft(KEY, "tenant-a", Draft((5, 6, 7, 8), "length", 10.0, None), CacheControl(), Owner())
    cache.store_draft(KEY, "tenant-a", Draft((5, 6), "length", 11.0, None), CacheControl(), Owner())
    cache.store_draft(KEY, "tenant-a", Draft((5, 6, 7), "stop", 11.0, None), CacheControl(), Owner())
    assert cache.draft(KEY, 12.0) == (5, 6, 7, 8)
    cache.store_draft(KEY, "tenant-a", Draft((5, 9), "length", 13.0, None), CacheControl(), Owner())
    assert cache.draft(KEY, 14.0) == (5, 9)  # it does not begin the kept one: the latest wins


def test_drafts_are_purged_by_owner_and_expire_with_the_answers(cache):
    mine, theirs = Owner(session="A"), Owner(session="B")
    other = draft_key(Scope("tenant-a", "model"), [{"role": "user", "content": [{"text": "other"}]}], {})
    cache.store_draft(KEY, "tenant-a", Draft((1,), "stop", 10.0, None), CacheControl(), mine)
    cache.store_draft(other, "tenant-a", Draft((2,), "stop", 10.0, 20.0), CacheControl(), theirs)
    cache.purge_owned(Selector("tenant-a", session="A"))
    assert cache.draft(KEY, 11.0) is None and cache.draft(other, 11.0) == (2,)
    cache.purge_expired(21.0)
    assert cache.draft(other, 15.0) is None


def test_without_a_drafts_store_nothing_is_kept():
    cache = ExactCache(MemoryStore(), 3600.0)
    cache.store_draft(KEY, "tenant-a", Draft((1,), "stop", 10.0, None), CacheControl(), Owner())
    assert cache.draft(KEY, 11.0) is None
