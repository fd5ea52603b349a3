"""The Responses API's conversation store: per tenant, expiring, and bounded by its own sweep."""

from gateway.serving.conversations import ConversationStore
from kvcache.sealing import FileKeys, Keyring

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
    (rows,) = store.db.execute("SELECT COUNT(*) FROM responses").fetchone()
    assert rows == 10  # only the last retention's worth is kept
    assert store.delete("resp_49", "t") and store.load("resp_49", "t", now=49) is None


def _image(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + f"{seed:08d}" * 4096}}


def _turn(seed: int, answer: str) -> list[dict]:
    return [
        {"role": "user", "content": [_image(seed), {"type": "text", "text": f"turn {seed}"}]},
        {"role": "assistant", "content": answer},
    ]


def test_each_turn_and_each_image_is_stored_once(tmp_path):
    """A chain of turns, each continuing the last, and branches from its end: a row keeps only the
    turn's own messages and every image once; load() gives back the whole conversation."""
    store = ConversationStore(tmp_path / "c.db", retention_s=100)
    parent, expected = None, []
    for turn in range(8):
        added = _turn(turn, f"answer {turn}")
        store.save(f"resp_{turn}", "t", None, None, added, {"turn": turn}, now=turn, parent=parent)
        parent, expected = f"resp_{turn}", expected + added
    for branch in range(4):  # each branch sends the first image again, and one of its own
        added = [{"role": "user", "content": [_image(0), _image(100 + branch)]}, {"role": "assistant", "content": "b"}]
        store.save(f"branch_{branch}", "t", None, None, added, {}, now=10, parent="resp_7")
        assert store.load(f"branch_{branch}", "t", now=11) == expected + added
    assert store.load("resp_7", "t", now=11) == expected
    image_bytes = len(_image(0)["image_url"]["url"])
    assert store.used_bytes("t") < (8 + 4) * image_bytes * 1.05  # 12 distinct images, nothing twice
    (blobs,) = store.db.execute("SELECT COUNT(*) FROM blobs").fetchone()
    assert blobs == 12


def test_a_turn_stays_stored_while_a_later_turn_needs_it(tmp_path):
    store = ConversationStore(tmp_path / "c.db", retention_s=10)
    store.save("first", "t", None, None, MESSAGES, {}, now=0)
    store.save("second", "t", None, None, MESSAGES, {}, now=8, parent="first")
    assert store.load("first", "t", now=12) is None  # expired as itself ...
    assert store.load("second", "t", now=12) == MESSAGES + MESSAGES  # ... but kept for what continues it
    assert store.delete("second", "t") and store.load("second", "t", now=12) is None
    store.purge_expired(now=19)
    assert store.db.execute("SELECT COUNT(*) FROM responses").fetchone() == (0,)


def test_deleting_a_turn_hides_it_and_keeps_its_continuations_whole(tmp_path):
    store = ConversationStore(tmp_path / "c.db", retention_s=10)
    store.save("first", "t", None, None, _turn(1, "a"), {}, now=0)
    store.save("second", "t", None, None, _turn(2, "b"), {}, now=1, parent="first")
    assert store.delete("first", "t") and not store.delete("first", "t")
    assert store.load("first", "t", now=2) is None and store.response("first", "t", now=2) is None
    assert store.load("second", "t", now=2) == _turn(1, "a") + _turn(2, "b")
    assert store.delete("second", "t")  # now nothing needs either: both go, with their images
    assert store.db.execute("SELECT COUNT(*) FROM responses").fetchone() == (0,)
    assert store.used_bytes("t") == 0


def test_a_purged_turn_breaks_what_continues_it_rather_than_leaving_a_hole(tmp_path):
    from semantic import Selector

    store = ConversationStore(tmp_path / "c.db", retention_s=10)
    store.save("first", "t", "s1", None, _turn(1, "a"), {}, now=0)
    store.save("second", "t", "s2", None, _turn(2, "b"), {}, now=1, parent="first")
    removed = store.purge(Selector("t", "s1"))
    assert removed.num_entries == 1 and removed.num_bytes > len(_image(1)["image_url"]["url"])
    assert store.load("second", "t", now=2) is None


def test_rows_of_the_first_format_are_migrated(tmp_path):
    import json
    import sqlite3

    db = sqlite3.connect(tmp_path / "c.db")
    db.execute(
        "CREATE TABLE conversations (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session TEXT, end_user TEXT, "
        "messages TEXT NOT NULL, response TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL)"
    )
    db.execute(
        "INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        ("old", "t", None, None, json.dumps(_turn(1, "a")), "{}", 0, 50),
    )
    db.commit()
    db.close()
    store = ConversationStore(tmp_path / "c.db", retention_s=10)
    assert store.load("old", "t", now=40) == _turn(1, "a")  # its own expiry kept
    assert store.load("old", "t", now=50) is None


def test_a_sealed_conversation_keeps_no_text_and_is_gone_once_its_tenant_is_shredded(tmp_path):
    keyring = Keyring(FileKeys(tmp_path / "keys.json"), bytes(32))
    store = ConversationStore(tmp_path / "c.db", retention_s=100, sealer=keyring)
    first = [{"role": "user", "content": "the okapi-lamp question"}, {"role": "assistant", "content": "an answer"}]
    store.save("resp_1", "acme", None, None, first, {"id": "resp_1", "note": "okapi-lamp"}, now=0)
    store.save("resp_2", "acme", None, None, _turn(7, "seen"), {"id": "resp_2"}, now=1, parent="resp_1")
    store.save("resp_3", "globex", None, None, MESSAGES, {"id": "resp_3"}, now=1)
    store.db.execute("PRAGMA wal_checkpoint(FULL)")
    raw = b"".join(path.read_bytes() for path in tmp_path.glob("c.db*"))
    assert b"okapi-lamp" not in raw and b"00000007" * 4 not in raw  # neither text nor image
    assert store.load("resp_2", "acme", now=2) == first + _turn(7, "seen")
    keyring.shred("acme")
    assert store.load("resp_2", "acme", now=2) is None and store.response("resp_1", "acme", now=2) is None
    assert store.load("resp_3", "globex", now=2) == MESSAGES
