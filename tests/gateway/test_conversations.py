"""The Responses API's conversation store: per tenant, expiring, and bounded by its own sweep."""

from gateway.conversations import ConversationStore

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_conversation_is_its_tenants_until_it_expires(tmp_path):
    store = ConversationStore(tmp_path / "c.db", retention_s=10)
    store.save("resp_1", "tenant-a", "session-1", "user-1", MESSAGES, {"id": "resp_1"}, now=0)
    assert store.load("resp_1", "tenant-a", now=5) == MESSAGES
    assert store.response("resp_1", "tenant-a", now=5) == {"id": "resp_1"}
    assert store.load("resp_1", "tenant-b", now=5) is None and store.response("resp_1", "tenant-b", now=5) is None
    assert not store.delete("resp_1", "tenant-b")
    assert store.load("resp_1", "tenant-a", now=10) is None  # expired


def test_writes_sweep_what_expired(tmp_path):
    store = ConversationStore(tmp_path / "c.db", retention_s=10)
    for index in range(50):
        store.save(f"resp_{index}", "t", None, None, MESSAGES, {}, now=index)
    (rows,) = store.db.execute("SELECT COUNT(*) FROM conversations").fetchone()
    assert rows == 10  # only the last retention's worth is kept
    assert store.delete("resp_49", "t") and store.load("resp_49", "t", now=49) is None
