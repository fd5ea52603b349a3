"""Chained block hashes: tenant salt in the root, image keys only where the image's tokens are."""

from kvcache import ExtraSpan, TenantSalt, chain_root, hash_blocks, tenant_salt

BS = 4
ROOT = chain_root(TenantSalt(b"a" * 32), "model|block=4")


def test_only_full_blocks_are_hashed_and_prefixes_share_hashes():
    short = hash_blocks(list(range(10)), BS, ROOT)
    longer = hash_blocks(list(range(10)) + [99, 98, 97], BS, ROOT)
    assert len(short) == 2 and len(longer) == 3
    assert longer[:2] == short


def test_a_changed_token_changes_its_block_and_every_later_one():
    base = hash_blocks(list(range(16)), BS, ROOT)
    changed = hash_blocks(list(range(5)) + [77] + list(range(6, 16)), BS, ROOT)
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(changed[1:], base[1:]))


def test_tenant_salt_changes_the_whole_chain():
    other = chain_root(tenant_salt(b"secret", "tenant-b"), "model|block=4")
    mine = chain_root(tenant_salt(b"secret", "tenant-a"), "model|block=4")
    tokens = list(range(12))
    assert not set(hash_blocks(tokens, BS, mine)) & set(hash_blocks(tokens, BS, other))


def test_image_key_enters_only_blocks_that_hold_image_tokens():
    tokens = [1] * 6 + [5] * 6 + [2] * 8  # text 0-5, image 6-11, text 12-19
    cat = hash_blocks(tokens, BS, ROOT, [ExtraSpan(6, 12, b"cat")])
    dog = hash_blocks(tokens, BS, ROOT, [ExtraSpan(6, 12, b"dog")])
    assert cat[0] == dog[0]  # block 0-3: text before the image stays shareable
    assert all(a != b for a, b in zip(cat[1:], dog[1:]))  # blocks 4-7 holds image tokens; all after differ
    no_image = hash_blocks(tokens, BS, ROOT)
    assert no_image[0] == cat[0] and no_image[1] != cat[1]


def test_model_namespace_separates_chains():
    salt = TenantSalt(b"a" * 32)
    assert chain_root(salt, "model-1|block=4") != chain_root(salt, "model-2|block=4")
    assert chain_root(salt, "model-1|block=4") != chain_root(salt, "model-1|block=8")
