"""Encryption at rest: the keyring (per-tenant AES-256-GCM data keys, wrapped), its file store shared
by processes, rotation of the wrapping key, SSD segments sealed per tenant, and the public chain."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

from kvcache.chain import ExtraSpan, Roots, hash_blocks, public_blocks
from kvcache.keys import PUBLIC_SALT, chain_root, rejoin, tenant_salt
from kvcache.sealing import (
    CHECK,
    FileKeys,
    Keyring,
    KeysRotated,
    KeyStoreDamaged,
    Plain,
    Unreadable,
    WrongKey,
    read_key_file,
)
from kvcache.ssd import AdmissionPolicy, SpillRequest, SsdConfig, SsdTier

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
NAMESPACE = "model-1|block=4|quant=none"


def _keyring(tmp_path, key: bytes = KEY) -> Keyring:
    return Keyring(FileKeys(tmp_path / "keys.json"), key)


def test_a_sealed_blob_opens_only_for_its_tenant_place_and_bytes(tmp_path):
    keyring = _keyring(tmp_path)
    sealed = keyring.seal("acme", b"entry-1", b"the harbour ledger")
    assert b"harbour" not in sealed and keyring.open("acme", b"entry-1", sealed) == b"the harbour ledger"
    keyring.seal("globex", b"entry-1", b"x")  # globex has a key of its own now
    for tenant, place, blob in (
        ("globex", b"entry-1", sealed),  # another tenant's key
        ("acme", b"entry-2", sealed),  # moved to another entry
        ("acme", b"entry-1", sealed[:-1] + bytes([sealed[-1] ^ 1])),  # altered
        ("acme", b"entry-1", Plain().seal("acme", b"entry-1", b"the harbour ledger")),  # written with sealing off
    ):
        with pytest.raises(Unreadable):
            keyring.open(tenant, place, blob)
    with pytest.raises(Unreadable):
        Plain().open("acme", b"entry-1", sealed)


def test_shredding_a_tenant_makes_its_blobs_unreadable_at_once_everywhere(tmp_path):
    writer, other_process = _keyring(tmp_path), _keyring(tmp_path)  # two processes sharing the key file
    acme, globex = writer.seal("acme", b"p", b"acme data"), writer.seal("globex", b"p", b"globex data")
    assert other_process.open("acme", b"p", acme) == b"acme data"  # its key is cached there now
    assert writer.shred("acme")
    with pytest.raises(Unreadable):
        writer.open("acme", b"p", acme)
    with pytest.raises(Unreadable):
        other_process.open("acme", b"p", acme)  # the file changed: its cache is dropped
    assert other_process.open("globex", b"p", globex) == b"globex data"
    fresh = writer.seal("acme", b"p", b"new data")  # a new key for the tenant's new data
    assert other_process.open("acme", b"p", fresh) == b"new data"
    with pytest.raises(Unreadable):
        other_process.open("acme", b"p", acme)


def test_processes_creating_a_tenant_key_at_once_agree_on_one(tmp_path):
    keyrings = [_keyring(tmp_path) for _ in range(4)]
    sealed: dict[int, bytes] = {}
    threads = [
        threading.Thread(target=lambda i=i: sealed.__setitem__(i, keyrings[i].seal("acme", b"p", b"%d" % i)))
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(keyrings[0].open("acme", b"p", sealed[i]) == b"%d" % i for i in range(4))


def test_rotating_the_wrapping_key_keeps_the_data_and_retires_the_old_key(tmp_path):
    keyring = _keyring(tmp_path)
    sealed = keyring.seal("acme", b"p", b"kept")
    assert keyring.rewrap(OTHER_KEY) == 1
    assert _keyring(tmp_path, OTHER_KEY).open("acme", b"p", sealed) == b"kept"
    assert bytes(KEY).hex() not in (tmp_path / "keys.json").read_text()
    with pytest.raises(WrongKey):
        _keyring(tmp_path, KEY)


def test_a_running_process_follows_a_rotation_once_its_key_file_holds_the_new_key(tmp_path):
    key_file = [KEY]  # what the running process's key file holds
    running = Keyring(FileKeys(tmp_path / "keys.json"), KEY, reload=lambda: key_file[0])
    acme = running.seal("acme", b"p", b"acme data")
    globex = _keyring(tmp_path).seal("globex", b"p", b"globex data")  # a key the running process never unwrapped
    assert _keyring(tmp_path).rewrap(OTHER_KEY) == 2  # `strata keys rotate` in another process

    assert running.open("acme", b"p", acme) == b"acme data"  # the data keys it holds did not change
    assert running.open("acme", b"p", running.seal("acme", b"p", b"more")) == b"more"
    with pytest.raises(KeysRotated):
        running.open("globex", b"p", globex)  # its record opens only under the new key
    with pytest.raises(KeysRotated):
        running.seal("initech", b"p", b"x")  # never a new key wrapped under the old one
    assert set(FileKeys(tmp_path / "keys.json").records()) == {CHECK, "acme", "globex"}

    key_file[0] = OTHER_KEY  # the operator puts the new key in place
    assert running.open("globex", b"p", globex) == b"globex data"
    initech = running.seal("initech", b"p", b"initech data")
    assert _keyring(tmp_path, OTHER_KEY).open("initech", b"p", initech) == b"initech data"


def test_a_key_added_while_the_store_is_rewrapped_is_never_left_under_the_old_key(tmp_path):
    class RotatedJustBeforeTheAdd(FileKeys):  # the rotation lands between the wrap and the add
        def add(self, tenant, record, check):
            if tenant == "initech" and not rotated:
                rotated.append(_keyring(tmp_path).rewrap(OTHER_KEY))
            return super().add(tenant, record, check)

    rotated: list[int] = []
    running = Keyring(RotatedJustBeforeTheAdd(tmp_path / "keys.json"), KEY, reload=lambda: OTHER_KEY)
    running.seal("acme", b"p", b"x")
    sealed = running.seal("initech", b"p", b"initech data")
    assert rotated == [1]
    assert _keyring(tmp_path, OTHER_KEY).open("initech", b"p", sealed) == b"initech data"


def test_keys_created_during_rotations_all_open_under_the_final_key(tmp_path):
    keys = [bytes([n]) * 32 for n in range(1, 5)]
    running = Keyring(FileKeys(tmp_path / "keys.json"), keys[0], reload=lambda: current[0])
    current = [keys[0]]
    sealed = {"t-first": running.seal("t-first", b"p", b"-first")}  # a running server has opened its store

    def rotate_three_times() -> None:
        for old, new in itertools.pairwise(keys):
            Keyring(FileKeys(tmp_path / "keys.json"), old).rewrap(new)
            current[0] = new

    def add_tenants() -> None:
        deadline = time.monotonic() + 30
        for n in range(60):
            while f"t{n}" not in sealed and time.monotonic() < deadline:
                # a seal that read the key file just before it changed is refused: its client retries
                with contextlib.suppress(KeysRotated):
                    sealed[f"t{n}"] = running.seal(f"t{n}", b"p", b"%d" % n)

    threads = [threading.Thread(target=rotate_three_times), threading.Thread(target=add_tenants)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = _keyring(tmp_path, keys[-1])
    assert len(sealed) == 61
    assert all(final.open(tenant, b"p", blob) == tenant[1:].encode() for tenant, blob in sealed.items())
    stored = FileKeys(tmp_path / "keys.json").records()
    assert all(final._unwrap(tenant, record) for tenant, record in stored.items() if tenant != CHECK)


def test_a_wrong_wrapping_key_is_refused_before_anything_is_read(tmp_path):
    _keyring(tmp_path).seal("acme", b"p", b"x")
    with pytest.raises(WrongKey):
        _keyring(tmp_path, OTHER_KEY)


def test_key_files_are_32_bytes_raw_or_hex(tmp_path):
    (tmp_path / "raw").write_bytes(KEY)
    (tmp_path / "hex").write_text(KEY.hex() + "\n")
    (tmp_path / "short").write_bytes(b"too short")
    assert read_key_file(tmp_path / "raw") == KEY == read_key_file(tmp_path / "hex")
    for name in ("short", "missing"):
        with pytest.raises(ValueError, match=name):
            read_key_file(tmp_path / name)


# -- the SSD tier ------------------------------------------------------------------------------


def _request(i: int, tenant: str) -> SpillRequest:
    tensors = {"0.k": np.full((1, 2, 4, 8), i, np.float32), "0.v": np.arange(64, dtype=np.float16).reshape(1, 2, 4, 8)}
    return SpillRequest(i.to_bytes(32, "big"), b"", 4, "scope", tensors, (f"owner-{tenant}",), tenant)


def _sealed_tier(root, keyring) -> SsdTier:
    return SsdTier(SsdConfig(root, admission=AdmissionPolicy(min_hits=0), sealer=keyring), NAMESPACE)


def _hex(i: int) -> str:
    return i.to_bytes(32, "big").hex()


def test_ssd_blocks_are_sealed_per_tenant_and_read_back(tmp_path):
    keyring = _keyring(tmp_path)
    tier = _sealed_tier(tmp_path / "kv", keyring)
    for i, tenant in ((1, "acme"), (2, "globex")):
        assert tier.offer(_request(i, tenant)) and tier.drain(10)
    raw = b"".join(path.read_bytes() for path in tier.folder.glob("*/*.safetensors"))
    assert np.full((1, 2, 4, 8), 1, np.float32).tobytes() not in raw  # no plain tensor on disk
    back = tier.read_chain([_hex(1)])[0]
    assert np.array_equal(back["0.k"], np.full((1, 2, 4, 8), 1, np.float32)) and back["0.v"].dtype == np.float16
    assert tier.ram_size_of(_hex(1)) == 256 + 128  # the plain tensors' bytes, not the sealed blob's
    tier.close()


def test_a_segment_relabelled_for_another_tenant_does_not_open_and_is_not_quarantined(tmp_path):
    keyring = _keyring(tmp_path)
    tier = _sealed_tier(tmp_path / "kv", keyring)
    assert tier.offer(_request(1, "acme")) and tier.drain(10)
    tier.close()
    (path,) = (tmp_path / "kv").glob("*/*/*.safetensors")
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + header_len].replace(b'\\"tenant\\": \\"acme\\"', b'\\"tenant\\": \\"zeta\\"')
    assert header != raw[8 : 8 + header_len]
    keyring.seal("zeta", b"p", b"zeta has a key of its own")
    path.write_bytes(raw[:8] + header + raw[8 + header_len :])  # same length: the checksum still holds
    again = _sealed_tier(tmp_path / "kv", keyring)
    assert again.read_chain([_hex(1)]) == [] and again.counters.num_unreadable == 1
    assert again.counters.num_quarantined == 0 and path.exists()
    again.close()


def test_after_a_shred_the_tier_and_a_copy_made_before_it_read_nothing_of_the_tenant(tmp_path):
    keyring = _keyring(tmp_path)
    tier = _sealed_tier(tmp_path / "kv", keyring)
    for i, tenant in ((1, "acme"), (2, "globex")):
        assert tier.offer(_request(i, tenant)) and tier.drain(10)
    shutil.copytree(tmp_path / "kv", tmp_path / "backup")
    copy = _sealed_tier(tmp_path / "backup", keyring)
    assert len(copy.read_chain([_hex(1)])) == 1  # the copy opens while the key lives
    keyring.shred("acme")
    assert tier.read_chain([_hex(1)]) == [] and copy.read_chain([_hex(1)]) == []
    assert len(tier.read_chain([_hex(2)])) == 1 and len(copy.read_chain([_hex(2)])) == 1
    tier.close()
    copy.close()


def test_a_plain_tier_still_reads_segments_written_before_sealing(tmp_path):
    plain = SsdTier(SsdConfig(tmp_path / "kv", admission=AdmissionPolicy(min_hits=0)), NAMESPACE)
    assert plain.offer(_request(1, "acme")) and plain.drain(10)
    plain.close()
    sealed = _sealed_tier(tmp_path / "kv", _keyring(tmp_path))
    assert len(sealed.read_chain([_hex(1)])) == 1
    sealed.close()


def test_the_key_file_is_private(tmp_path):
    _keyring(tmp_path).seal("acme", b"p", b"x")
    assert os.stat(tmp_path / "keys.json").st_mode & 0o077 == 0
    assert set(json.loads((tmp_path / "keys.json").read_text())) == {"__check__", "acme"}


# -- public prefixes ---------------------------------------------------------------------------


def _roots(tenant: str, num_public: int):
    salt = tenant_salt(b"s" * 32, tenant)
    return Roots(chain_root(salt, "m"), chain_root(PUBLIC_SALT, "m"), num_public)


def test_public_blocks_are_shared_and_what_follows_them_stays_the_tenants():
    tokens = list(range(40))
    acme, globex = _roots("acme", 2).hash_blocks(tokens, 8, ()), _roots("globex", 2).hash_blocks(tokens, 8, ())
    assert acme[:2] == globex[:2] and all(a != g for a, g in zip(acme[2:], globex[2:]))
    private = _roots("acme", 0).hash_blocks(tokens, 8, ())
    assert private == hash_blocks(tokens, 8, _roots("acme", 0).tenant) and not set(private) & set(acme)
    roots = _roots("acme", 2)
    assert acme[2] == hash_blocks(tokens, 8, rejoin(roots.tenant, acme[1]), (), 2)[0]
    assert [roots.parent(i, acme) for i in range(1, 5)] == [acme[0], rejoin(roots.tenant, acme[1]), acme[2], acme[3]]


def test_public_blocks_lie_wholly_inside_the_text_and_before_any_image():
    assert public_blocks(47, (), 16) == 2 and public_blocks(48, (), 16) == 3 and public_blocks(15, (), 16) == 0
    assert public_blocks(100, (ExtraSpan(40, 60, b"img"),), 16) == 2


def test_a_damaged_key_store_is_refused_with_its_path(tmp_path):
    _keyring(tmp_path).seal("acme", b"p", b"x")
    (tmp_path / "keys.json").write_text('{"acme": "not hex"')
    with pytest.raises(KeyStoreDamaged, match=r"keys\.json is damaged"):
        _keyring(tmp_path)


def test_a_store_emptied_under_a_running_keyring_is_new_again_but_for_the_keys_it_holds(tmp_path):
    """A Redis key store restarted without its data loses the check record with the keys: a key
    made after it must not be refused as if the store had been rewrapped, and a key a running
    server holds goes back into the store (what it sealed stays readable, its digests stay the
    same: a cache key computed before the restart still finds what was written after it)."""
    running = Keyring(FileKeys(tmp_path / "keys.json"), KEY, reload=lambda: KEY)
    before = running.seal("acme", b"p", b"acme data")
    digest = running.digest("acme", b"question")
    (tmp_path / "keys.json").unlink()
    sealed = running.seal("initech", b"p", b"initech data")
    assert _keyring(tmp_path).open("initech", b"p", sealed) == b"initech data"
    assert running.digest("acme", b"question") == digest
    assert _keyring(tmp_path).open("acme", b"p", before) == b"acme data"


def test_a_shredded_key_is_not_written_back_while_the_store_keeps_its_check_record(tmp_path):
    running = Keyring(FileKeys(tmp_path / "keys.json"), KEY, reload=lambda: KEY)
    before = running.seal("acme", b"p", b"acme data")
    assert _keyring(tmp_path).shred("acme")  # another process purges the tenant
    with pytest.raises(Unreadable, match="purged"):
        running.open("acme", b"p", before)
    with pytest.raises(Unreadable):
        _keyring(tmp_path).open("acme", b"p", before)
