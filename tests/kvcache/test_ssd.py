"""SsdTier on real files: spill, verify, reconcile, quarantine, capacity, admission, failing disks."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvcache.ssd import PINNED_SHARE, AdmissionPolicy, SpillRequest, SsdConfig, SsdTier

NAMESPACE = "model-1|block=4|quant=none"


def _request(i: int) -> SpillRequest:
    tensors = {"0.k": np.full((1, 2, 4, 8), i, np.float32), "0.v": np.full((1, 2, 4, 8), -i, np.float32)}
    return SpillRequest(i.to_bytes(32, "big"), (i - 1).to_bytes(32, "big"), 4, "scope", tensors)


def _tier(tmp_path, **config) -> SsdTier:
    return SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0), **config), NAMESPACE)


def _spill(tier: SsdTier, *indices: int) -> None:
    """One segment file per block here: each spill is written before the next is offered."""
    for i in indices:
        assert tier.offer(_request(i))
        assert tier.drain(10)


def _file(tier: SsdTier, i: int):
    segment = tier.index.blocks[i.to_bytes(32, "big").hex()].segment
    return next(tier.folder.glob(f"*/{segment}.safetensors"))


def _read(tier: SsdTier, i: int):
    found = tier.read_chain([i.to_bytes(32, "big").hex()])
    return found[0] if found else None


def test_blocks_spilled_together_share_one_segment_file(tmp_path, monkeypatch):
    tier = _tier(tmp_path)
    gate = __import__("threading").Event()
    original = tier._write_segment
    monkeypatch.setattr(tier, "_write_segment", lambda requests: (gate.wait(5), original(requests)))
    for i in range(1, 6):
        assert tier.offer(_request(i))
    gate.set()
    assert tier.drain(10)
    files = {_file(tier, i) for i in range(1, 6)}
    assert len(files) <= 2 and tier.counters.num_spilled == 5  # the first, then the four queued behind it
    assert len(tier.read_chain([i.to_bytes(32, "big").hex() for i in range(1, 6)])) == 5
    tier.close()


def test_spilled_block_reads_back_verified(tmp_path):
    tier = _tier(tmp_path)
    _spill(tier, 1)
    tensors = _read(tier, 1)
    np.testing.assert_array_equal(tensors["0.v"], np.full((1, 2, 4, 8), -1, np.float32))
    assert tier.counters.num_spilled == 1 and tier.index.num_bytes == _file(tier, 1).stat().st_size
    assert not list(tier.folder.glob("*/.tmp-*"))
    tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_quarantined_on_read(tmp_path, damage):
    tier = _tier(tmp_path)
    _spill(tier, 2)
    path = _file(tier, 2)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2]
    path.write_bytes(bytes(raw))
    assert _read(tier, 2) is None
    assert tier.counters.num_quarantined == 1 and not path.exists()
    assert len(list((tmp_path / "kv" / "quarantine").iterdir())) == 1
    assert not tier.contains((2).to_bytes(32, "big").hex())
    tier.close()


def test_reconcile_repairs_index_and_files(tmp_path):
    tier = _tier(tmp_path)
    _spill(tier, 1, 2, 3)
    first, second = _file(tier, 1), _file(tier, 2)
    tier.close()
    first.unlink()  # index row without a file
    (second.parent / ".tmp-crashed").write_bytes(b"half a block")  # a torn write
    foreign = SsdTier(
        SsdConfig(tmp_path / "other", admission=AdmissionPolicy(min_hits=0)), "model-2|block=4|quant=none"
    )
    _spill(foreign, 9)
    foreign_file = _file(foreign, 9)
    foreign.close()
    stray = tier.folder / foreign_file.relative_to(foreign.folder)
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(foreign_file.read_bytes())  # another model's file in our folder
    (tier.folder / "index.sqlite").unlink()  # and no index at all
    again = _tier(tmp_path)
    stats = again.counters
    assert stats.num_temp_removed == 1 and stats.num_quarantined == 1
    assert stats.num_reindexed == 2  # blocks 2 and 3, verified from the files alone
    assert sorted(again.index.blocks) == sorted(i.to_bytes(32, "big").hex() for i in (2, 3))
    assert _read(again, 3) is not None
    again.close()


@pytest.mark.serial
def test_full_queue_drops_and_counts_without_blocking(tmp_path, monkeypatch):
    tier = _tier(tmp_path, queue_blocks=1)
    monkeypatch.setattr(tier, "_write_segment", lambda requests: time.sleep(0.2))
    start = time.perf_counter()
    accepted = [tier.offer(_request(i)) for i in range(1, 20)]
    assert time.perf_counter() - start < 0.1
    assert accepted.count(False) == tier.counters.num_dropped_queue_full >= 15
    tier.close(timeout_s=2)


def test_failing_disk_is_counted_and_leaves_no_partial_file(tmp_path, monkeypatch):
    tier = _tier(tmp_path)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    assert tier.offer(_request(5))
    tier.drain(10)
    assert tier.counters.num_write_errors == 1 and tier.counters.num_spilled == 0
    assert not list(tier.folder.glob("*/*"))
    assert not tier.contains((5).to_bytes(32, "big").hex()) and tier.index.num_bytes == 0
    tier.close()


def test_capacity_evicts_least_recently_used_files_and_retention_expires_them(tmp_path):
    probe = _tier(tmp_path / "probe")
    _spill(probe, 1)
    size = probe.index.num_bytes
    probe.close()
    tier = _tier(tmp_path, capacity_bytes=2 * size)
    _spill(tier, 1, 2)
    _read(tier, 1)  # block 1 is used again: block 2 is now the LRU file
    _spill(tier, 3)
    assert tier.contains((1).to_bytes(32, "big").hex()) and not tier.contains((2).to_bytes(32, "big").hex())
    assert tier.counters.num_evicted_files == 1 and tier.index.num_bytes <= 2 * size
    tier._enforce_capacity(now=time.time() + 8 * 24 * 3600)
    assert tier.counters.num_expired_files == 2 and not tier.index.blocks
    tier.close()


def test_admission_policy_and_daily_budget(tmp_path):
    policy = AdmissionPolicy(min_hits=1, min_prefix_tokens=64, daily_write_bytes=1)
    tier = SsdTier(SsdConfig(tmp_path / "kv", admission=policy), NAMESPACE)
    assert not tier.admits(num_hits=0, end_token=128)
    assert not tier.admits(num_hits=3, end_token=32)
    assert tier.admits(num_hits=1, end_token=64)
    assert tier.offer(_request(1))
    tier.drain(10)
    assert not tier.offer(_request(2))  # the day's budget is spent
    assert tier.counters.num_not_admitted == 1
    tier.close()


def test_segment_names_appear_only_once_the_file_is_complete(tmp_path, monkeypatch):
    """Mid-write (at fsync) only a temp name may exist: a crash there must leave nothing that looks whole."""
    tier = _tier(tmp_path)
    seen: list[list[str]] = []
    real_fsync = os.fsync

    def observing_fsync(fd):
        seen.append(sorted(path.name for path in tier.folder.glob("*/*")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", observing_fsync)
    _spill(tier, 1, 2)
    complete = [[name for name in names if not name.startswith(".tmp-")] for names in seen]
    temps = [[name for name in names if name.startswith(".tmp-")] for names in seen]
    assert [len(names) for names in complete] == [0, 1], seen  # only the segments written before
    assert [len(names) for names in temps] == [1, 1], seen
    assert _file(tier, 1).exists() and _file(tier, 2).exists()
    tier.close()


def test_reconcile_verifies_checksums_of_files_the_index_lacks(tmp_path):
    tier = _tier(tmp_path)
    _spill(tier, 1, 2)
    damaged = _file(tier, 2)
    tier.close()
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF  # a flipped byte in the tensor data, the header intact
    damaged.write_bytes(bytes(raw))
    (tier.folder / "index.sqlite").unlink()
    again = _tier(tmp_path)
    assert again.counters.num_quarantined == 1 and again.counters.num_reindexed == 1
    assert sorted(again.index.blocks) == [(1).to_bytes(32, "big").hex()]
    assert not damaged.exists()
    again.close()


def _owned(i: int, *owners: str) -> SpillRequest:
    import dataclasses

    return dataclasses.replace(_request(i), owners=owners)


def _hex(i: int) -> str:
    return i.to_bytes(32, "big").hex()


def _spill_together(tier: SsdTier, *requests: SpillRequest) -> None:
    tier._write_segment(list(requests))  # one segment file holding every block, as a burst of evictions does


def test_purge_cuts_blocks_out_of_their_file_and_a_restart_does_not_bring_them_back(tmp_path):
    tier = _tier(tmp_path)
    _spill_together(tier, _owned(1, "A"), _owned(2, "A", "B"), _owned(3, "B"))
    old_file = _file(tier, 1)
    removed = tier.purge_owned(lambda owner: owner == "A")
    assert (removed.num_entries, removed.num_files) == (1, 1) and removed.num_bytes == 2 * (
        2 * 4 * 8 * 4
    )  # keys and values, (1, 2, 4, 8) float32
    assert not old_file.exists() and not tier.contains(_hex(1))
    assert _read(tier, 2) is not None and _read(tier, 3) is not None  # rewritten into a new file
    assert tier.owners_of(_hex(2)) == {"B"} and tier.ghost(_hex(1)).how == "purged"
    assert not any(f"{_hex(1)}/".encode() in path.read_bytes() for path in tier.folder.glob("*/*.safetensors"))
    tier.close()
    again = _tier(tmp_path)
    assert not again.contains(_hex(1)) and again.contains(_hex(2)) and again.owners_of(_hex(3)) == {"B"}
    (again.folder / "index.sqlite").unlink()
    again.close()
    rebuilt = _tier(tmp_path)  # no index: rebuilt from the files, owners from their metadata
    assert not rebuilt.contains(_hex(1)) and rebuilt.owners_of(_hex(2)) == {"B"}
    assert rebuilt.purge_owned(lambda owner: owner == "B").num_entries == 2
    assert not list(rebuilt.folder.glob("*/*.safetensors"))
    rebuilt.close()


def test_a_crash_between_doom_and_unlink_still_deletes_the_purged_file(tmp_path, monkeypatch):
    tier = _tier(tmp_path)
    _spill_together(tier, _owned(1, "A"), _owned(2, "B"))
    old_file = _file(tier, 1)
    monkeypatch.setattr(tier, "_rewrite_without", lambda name, dropped: tier.index.doom(name))  # dies after dooming
    tier.purge_owned(lambda owner: owner == "A")
    assert old_file.exists()
    tier.close()
    again = _tier(tmp_path)
    assert not old_file.exists() and not again.contains(_hex(1))  # reconcile deleted it, never reindexed it
    assert again.index.doomed() == []
    again.close()


def test_spilling_a_block_already_on_ssd_adds_its_new_owners(tmp_path):
    tier = _tier(tmp_path)
    _spill_together(tier, _owned(1, "A"))
    assert tier.offer(_owned(1, "B"))
    assert tier.owners_of(_hex(1)) == {"A", "B"}
    assert tier.purge_owned(lambda owner: owner == "A").num_entries == 0 and tier.contains(_hex(1))
    tier.close()


def test_capacity_evictions_are_remembered_for_miss_reasons(tmp_path):
    tier = _tier(tmp_path)
    _spill(tier, 1)
    tier._enforce_capacity(now=time.time() + 8 * 24 * 3600)
    ghost = tier.ghost(_hex(1))
    assert ghost.how == "expired" and ghost.lived_s >= 0
    tier.close()


# -- one folder, several writers (replicas sharing a KV tier) --------------------------------------


def test_two_writers_share_a_folder_each_with_its_own_index(tmp_path):
    a, b = _tier(tmp_path, writer="a"), _tier(tmp_path, writer="b")
    _spill(a, 1, 2)
    assert not b.contains(_hex(1))  # not yet taken in
    assert b.refresh() == 2 and b.refresh() == 0  # the journal is read once
    assert np.array_equal(_read(b, 1)["0.k"], _request(1).tensors["0.k"])
    _spill(b, 3)
    assert a.refresh() == 1 and _read(a, 3) is not None
    assert {p.name for p in a.folder.glob("index*")} >= {"index-a.sqlite", "index-b.sqlite"}
    assert not (a.folder / "index.sqlite").exists()  # no index is written by two processes
    a.close()
    b.close()


def test_a_segment_deleted_by_one_writer_is_forgotten_by_the_other(tmp_path):
    a, b = _tier(tmp_path, writer="a"), _tier(tmp_path, writer="b")
    _spill_together(a, _owned(1, "A"), _owned(2, "B"))
    b.refresh()
    assert b.owners_of(_hex(1)) == {"A"}  # owners come from the file's header
    b.purge_owned(lambda owner: owner == "A")  # b rewrites a's file: a new segment without block 1
    assert a.contains(_hex(1))  # until a hears of it...
    a.refresh()
    assert not a.contains(_hex(1)) and _read(a, 2) is not None and a.owners_of(_hex(2)) == {"B"}
    _spill(a, 5)
    b.refresh()
    (next(a.folder.glob(f"*/{a.index.blocks[_hex(5)].segment}.safetensors"))).unlink()  # gone without a word
    assert _read(b, 5) is None and not b.contains(_hex(5))
    assert b.stats().counters.num_vanished == 1 and b.stats().counters.num_quarantined == 0
    a.close()
    b.close()


def test_a_restarted_writer_keeps_others_temp_files_and_journals_afresh(tmp_path):
    a, b = _tier(tmp_path, writer="a"), _tier(tmp_path, writer="b")
    _spill(a, 1)
    in_flight = a.folder / "ab" / ".tmp-another-writer-mid-write"
    in_flight.parent.mkdir(exist_ok=True)
    in_flight.write_bytes(b"partial")
    stale = a.folder / "ab" / ".tmp-left-by-a-crash"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    b.close()
    b = _tier(tmp_path, writer="b")  # reconcile: indexes a's file from the folder, keeps the young temp file
    assert in_flight.exists() and not stale.exists() and b.contains(_hex(1))
    a.close()
    a = _tier(tmp_path, writer="a")  # a's journal starts empty (a new file): b reads it from the start
    assert (a.folder / "journal-a.log").read_bytes() == b""
    _spill(a, 2)
    assert b.refresh() == 1 and b.contains(_hex(2))
    a.close()
    b.close()


def test_a_pinned_block_outlives_capacity_and_retention_until_its_pin_ends(tmp_path):
    probe = _tier(tmp_path / "probe")
    _spill(probe, 1)
    size = probe.index.num_bytes
    probe.close()
    tier = _tier(tmp_path, capacity_bytes=2 * size, pin_budget_bytes=10 * size)
    _spill(tier, 1)
    day = 24 * 3600
    assert tier.pin("scope", [(_hex(1), size)], time.time() + day) == 1
    _spill(tier, 2, 3, 4)  # a storm past capacity: the LRU file is the pinned one
    assert tier.contains(_hex(1)) and not tier.contains(_hex(2))
    tier._enforce_capacity(now=time.time() + 8 * day)  # past the retention as well as the pin
    assert not tier.contains(_hex(1)) and not tier.pins
    tier.close()


def test_ssd_pins_stay_within_each_scopes_budget(tmp_path):
    tier = _tier(tmp_path, pin_budget_bytes=300)
    until = time.time() + 3600
    assert tier.pin("tenant-a", [(_hex(1), 100), (_hex(2), 100), (_hex(3), 100), (_hex(4), 100)], until) == 3
    assert tier.pin("tenant-b", [(_hex(5), 300)], until) == 1  # a's pins spend none of b's budget
    assert tier.pin("tenant-a", [(_hex(1), 100)], until + 60) == 1 and tier.pins[_hex(1)][2] == until + 60
    tier.close()


def test_every_tenants_ssd_pins_together_stay_inside_the_capacity(tmp_path):
    """Five tenants at a budget of 25% each would pin 125% of the tier: together they stop at PINNED_SHARE."""
    tier = _tier(tmp_path, capacity_bytes=1000, pin_budget_bytes=250)
    until = time.time() + 3600
    pinned = [tier.pin(f"tenant-{t}", [(_hex(10 * t + i), 50) for i in range(5)], until) for t in range(5)]
    assert sum(pinned) * 50 == 1000 * PINNED_SHARE and pinned[0] == 5
    assert tier.pin("tenant-0", [(_hex(1000), 50)], until) == 0  # past the tenant's own budget too
    tier.close()


def test_a_purge_ends_the_pins_of_the_blocks_it_removes(tmp_path):
    tier = _tier(tmp_path, pin_budget_bytes=10_000)
    _spill_together(tier, _owned(1, "tenant-a/s1"), _owned(2, "tenant-b/s1"))
    until = time.time() + 3600
    tier.pin("scope-a", [(_hex(1), 100)], until)
    tier.pin("scope-b", [(_hex(2), 100)], until)
    tier.purge_owned(lambda owner: owner.startswith("tenant-a"))
    assert _hex(1) not in tier.pins and _hex(2) in tier.pins  # the other tenant's pin stays
    tier.purge()
    assert not tier.pins
    tier.close()


def test_the_reuse_meter_admits_what_later_requests_ask_for_again_and_not_a_scan():
    from kvcache.ssd import REUSE_EVIDENCE, ReuseMeter

    meter = ReuseMeter()
    for i in range(REUSE_EVIDENCE):
        meter.evicted_block(b"turn-%d" % i, num_hits=0)  # a conversation's blocks, evicted before its next turn
        assert meter.worth(0) is None or i >= REUSE_EVIDENCE - 1  # too little evidence until the last
        if i % 3 == 0:
            meter.asked_again(b"turn-%d" % i)
    meter.asked_again(b"turn-0")  # asked again twice counts once
    assert meter.worth(0) is True and meter.worth(1) is None
    policy = AdmissionPolicy(min_hits=1)
    assert policy.admits(0, 0, meter.worth(0)) and not policy.admits(0, 0, None)
    for i in range(5 * REUSE_EVIDENCE):
        meter.evicted_block(b"scan-%d" % i, num_hits=0)  # a flood nobody asks for again
    assert meter.worth(0) is False and not policy.admits(0, 0, meter.worth(0))


def test_an_operator_can_keep_admission_to_min_hits_alone():
    policy = AdmissionPolicy(min_hits=1, measured=False)
    assert not policy.admits(0, 0, worth=True) and policy.admits(1, 0, worth=False)
