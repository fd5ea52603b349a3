"""SqliteStore (and the semantic entries' SqliteEntries) under another writer on its file (a busy
disk, a second process): a lookup never waits for a write, writes that queue up while the file is
locked commit together in one transaction, a lock free for a few milliseconds between another
writer's transactions is taken, and a group that fails fails for all of its writers while the
store keeps working."""

from __future__ import annotations

import sqlite3
import statistics
import threading
import time

import numpy as np
import pytest

from semantic import Answer, Scope, SqliteStore, StoredResponse
from semantic.entries import SqliteEntries
from semantic.store import GroupCommit


def _response(text: str = "hello") -> StoredResponse:
    return StoredResponse(text, "stop", 10, 2, 100.0, None)


class HeldLock:
    """Another connection's transaction holding the file's write lock until release()."""

    def __init__(self, path):
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.db.execute("COMMIT")
        self.db.close()


def _put_in_threads(store: SqliteStore, keys: list[str]) -> list[threading.Thread]:
    threads = [threading.Thread(target=store.put, args=(key, "t", _response(key))) for key in keys]
    for thread in threads:
        thread.start()
    return threads


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_lookup_does_not_wait_for_a_write_waiting_on_the_file(tmp_path):
    store = SqliteStore(tmp_path / "r.db")
    store.put("old", "t", _response("old"))
    held = HeldLock(tmp_path / "r.db")
    (writer,) = _put_in_threads(store, ["new"])
    _wait_for(store.file.lock.locked)  # the write holds the store's writing connection, waiting on the file
    start = time.perf_counter()
    assert store.get("old", 101.0) == _response("old") and store.get("new", 101.0) is None
    assert store.count() == 1
    waited = time.perf_counter() - start
    held.release()
    writer.join(10)
    assert store.get("new", 101.0) == _response("new")
    assert waited < 1.0, f"a lookup waited {waited:.2f} s behind a write"  # the write waits up to 5 s


def test_a_semantic_lookup_does_not_wait_for_an_insert_waiting_on_the_file(tmp_path):
    entries, scope, vector = SqliteEntries(tmp_path / "s.db"), Scope("t", "m"), np.ones(4, dtype=np.float32)
    (old_id, _) = entries.put("p", scope, "old question", Answer("old answer"), 1.0, None, vector)
    held = HeldLock(tmp_path / "s.db")
    writer = threading.Thread(target=entries.put, args=("p", scope, "new question", Answer("new"), 2.0, None, vector))
    writer.start()
    _wait_for(entries.file.lock.locked)
    start = time.perf_counter()
    assert [entry.answer for entry, _ in entries.fetch([old_id])] == ["old answer"]
    assert entries.find("p", "t", "new question") is None and entries.stats()[0]["unreviewed"] == 1
    waited = time.perf_counter() - start
    held.release()
    writer.join(10)
    assert entries.find("p", "t", "new question") is not None
    assert waited < 1.0, f"a lookup waited {waited:.2f} s behind an insert"


def test_writes_queued_behind_a_locked_file_commit_in_one_group(tmp_path):
    store = SqliteStore(tmp_path / "r.db")
    groups = []
    commit = store.file.writes._commit
    store.file.writes._commit = lambda group: (groups.append(len(group)), commit(group))[1]
    held = HeldLock(tmp_path / "r.db")
    (first,) = _put_in_threads(store, ["k0"])
    _wait_for(lambda: groups == [1])  # k0 alone, waiting for the file
    others = _put_in_threads(store, ["k1", "k2", "k3"])
    _wait_for(lambda: len(store.file.writes.queued) == 3)
    held.release()
    for thread in [first, *others]:
        thread.join(10)
    assert groups == [1, 3]  # k1..k3 waited for the file once, together
    assert [store.get(f"k{i}", 101.0).text for i in range(4)] == ["k0", "k1", "k2", "k3"]


@pytest.mark.serial  # the gaps between the other writer's transactions are 5 ms: timing, run alone
def test_a_lock_free_for_a_few_milliseconds_between_another_writers_transactions_is_taken(tmp_path):
    """Before: SQLite's own busy handler, backing off to 100 ms between tries, took 1.8-2.1 s (6-7
    holds) for a write against a writer holding the lock 300 ms at a time, 5 ms apart."""
    hold_s = 0.3
    store = SqliteStore(tmp_path / "r.db")
    other = sqlite3.connect(str(tmp_path / "r.db"), isolation_level=None, check_same_thread=False)
    stopped, holding = threading.Event(), threading.Event()

    def hold_in_turns() -> None:
        while not stopped.is_set():
            other.execute("BEGIN IMMEDIATE")
            holding.set()
            time.sleep(hold_s)
            holding.clear()
            other.execute("COMMIT")
            time.sleep(0.005)

    locker = threading.Thread(target=hold_in_turns)
    locker.start()
    waits = []
    for index in range(5):
        assert holding.wait(10)  # each write arrives while the other writer holds the lock
        start = time.perf_counter()
        store.put(f"k{index}", "t", _response())
        waits.append(time.perf_counter() - start)
    stopped.set()
    locker.join(5)
    assert store.count() == 5
    assert statistics.median(waits) < 2 * hold_s, waits


def test_a_group_that_fails_fails_for_each_of_its_writers_and_the_next_one_commits(tmp_path):
    db = sqlite3.connect(str(tmp_path / "g.db"), isolation_level=None, check_same_thread=False)
    db.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")
    writes = GroupCommit(db, threading.Lock())
    results: dict[int, object] = {}

    def insert(value: int):
        return lambda: db.execute("INSERT INTO t VALUES (?)", (value,)).rowcount

    with writes.lock:  # hold the connection so that three writers queue into one group
        threads = [
            threading.Thread(target=lambda i=i, v=v: results.__setitem__(i, _outcome(writes, insert(v))))
            for i, v in enumerate((1, 2, 1))  # the second 1 breaks the primary key
        ]
        for thread in threads:
            thread.start()
        _wait_for(lambda: len(writes.queued) == 3)
    for thread in threads:
        thread.join(10)
    assert len(results) == 3 and all(isinstance(outcome, sqlite3.IntegrityError) for outcome in results.values())
    assert db.execute("SELECT COUNT(*) FROM t").fetchone() == (0,)  # the group rolled back as one
    assert writes.run(insert(2)) == 1
    assert db.execute("SELECT x FROM t").fetchall() == [(2,)]


def _outcome(writes: GroupCommit, work):
    try:
        return writes.run(work)
    except Exception as exc:  # noqa: BLE001 - the test reads which error each writer got
        return exc
