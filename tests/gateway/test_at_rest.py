"""Data at rest, from outside: a real `strata serve` process, the official openai client, real files
and a real Redis. What a server keeps holds no question or answer in the clear; a tenant purge
shreds the tenant's key first (every copy unreadable at once) and reclaims the files afterwards;
the wrapping key rotates; a wrong or missing key file stops start-up; public prefixes are shared
across tenants and nothing after them is."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
import redis

from gateway.engine import model_fingerprint
from gateway.requests.schemas import parse_chat_request
from gateway.serving.responses import ResponseCaches
from gateway.settings import settings_from_env
from gateway.tenancy.auth import Caller
from gateway.tenancy.keyring import at_rest, keyring_for
from kvcache import tenant_salt
from kvcache.blocktrace import read_trace
from kvcache.sealing import FileKeys, Keyring
from kvcache.segment import describe
from kvcache.ssd import AdmissionPolicy, SpillRequest, SsdConfig, SsdTier
from semantic import Owner, owner_label
from semantic.owners import tenant_of
from tests.conftest import TINY
from tests.gateway.test_live_server import LiveServer

KEYS = {"acme": "key-acme", "globex": "key-globex", "initech": "key-initech"}  # initech: the rotation test's
ENV = {
    "STRATA_API_KEYS": "key-acme:acme,key-globex:globex",
    "STRATA_ADMIN_KEY": "admin-key",
    "STRATA_MODEL_NAME": TINY,
    "STRATA_SSD_WRITER": "w1",  # every block written through to SSD as it is stored
}
ADMIN = {"Authorization": "Bearer admin-key"}
SYSTEM = "You keep the records of the Quillfeather lighthouse and answer questions about them. " * 16
QUESTION = "Which keeper logged the zanzibar-quokka-7731 storm in the lighthouse ledger?"
SEEDED_BLOCKS = 3000  # acme's blocks on SSD before the server starts: 3000 x 64 KiB = 188 MiB
BLOCK_SIZE = 32  # the server's kv_block_size


def _client(server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0)


def _ask(server, tenant: str, question: str, system: str = SYSTEM):
    return _client(server, tenant).chat.completions.with_raw_response.create(
        model=TINY,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=12,
        temperature=0,
    )


def _cached(raw) -> int:
    return raw.parse().usage.prompt_tokens_details.cached_tokens


def _keyring(data_dir: Path):
    return keyring_for(settings_from_env(TINY, data_dir, "127.0.0.1", 0, env={}))


def _namespace(model_path: Path) -> str:
    return f"{model_fingerprint(model_path)}|block={BLOCK_SIZE}|quant=none"


def _seed_ssd(data_dir: Path, model_path: Path) -> None:
    """acme's blocks on SSD, sealed under its key, owned by it, as the server would have left them."""
    tier = SsdTier(
        SsdConfig(data_dir / "kv", admission=AdmissionPolicy(min_hits=0), sealer=_keyring(data_dir)),
        _namespace(model_path),
    )
    rng = np.random.default_rng(0)
    for start in range(0, SEEDED_BLOCKS, 200):
        for i in range(start, start + 200):
            tensors = {"0.keys": rng.standard_normal((1, 4, 32, 128), dtype=np.float32)}
            owner = owner_label("acme", Owner("seeded"))
            request = SpillRequest((10**9 + i).to_bytes(32, "big"), b"", BLOCK_SIZE, "s", tensors, (owner,), "acme")
            assert tier.offer(request)
        assert tier.drain(60)
    tier.close()


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    yield from _server(tiny_model_path, tmp_path_factory.mktemp("at-rest") / "data")


@pytest.fixture(scope="module")
def seeded_server(tiny_model_path, tmp_path_factory):
    """A server that finds SEEDED_BLOCKS of acme's blocks on SSD when it starts (the purge test's)."""
    data_dir = tmp_path_factory.mktemp("at-rest-seeded") / "data"
    _seed_ssd(data_dir, tiny_model_path)
    yield from _server(tiny_model_path, data_dir)


def _server(tiny_model_path, data_dir):
    declared = data_dir.parent / "public.json"
    declared.write_text('[{"system": "You are a careful assistant for the harbour office."}]')
    trace = data_dir.parent / "trace.jsonl"
    live = LiveServer(
        tiny_model_path,
        data_dir,
        ENV | {"STRATA_PUBLIC_PREFIXES_FILE": str(declared), "STRATA_TRACE_FILE": str(trace)},
    )
    live.data_dir, live.trace = data_dir, trace
    yield live
    assert live.stop()


def _files_holding(folder: Path, *needles: bytes) -> list[str]:
    """Files under the folder that hold a needle. A live server renames and reclaims files while the
    folder is read: a scan that meets a vanished file starts again, so no file's bytes are missed."""
    for _ in range(20):
        try:
            return [
                f"{path.name}: {needle!r}"
                for path in folder.rglob("*")
                if path.is_file()
                for data in [path.read_bytes()]
                for needle in needles
                if needle in data
            ]
        except FileNotFoundError:
            time.sleep(0.05)
    raise AssertionError(f"{folder} never held still for a full scan")


END_USER = "ada-marmalade-4412@example.com"  # an end user's and a session's ids: never kept plain
SESSION = "sess-gooseberry-9931"


def _traffic(server) -> list[bytes]:
    """A chat answer, a semantic entry and a stored Responses conversation, each for an end user in a
    session; their distinctive strings and the ids."""
    client = _client(server, "acme").with_options(default_headers={"X-Strata-Session": SESSION})
    answer = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        user=END_USER,
    )
    client.responses.create(
        model=TINY,
        input="Describe the tessellated-okapi-5520 lamp room.",
        max_output_tokens=8,
        store=True,
        user=END_USER,
    )
    text = answer.choices[0].message.content or ""
    needles = [b"zanzibar-quokka-7731", b"tessellated-okapi-5520", b"Quillfeather", END_USER.encode(), SESSION.encode()]
    return needles + ([text.encode()] if len(text) >= 12 else [])


def test_nothing_a_tenant_sent_or_got_is_stored_in_the_clear(server):
    needles = _traffic(server)
    time.sleep(0.5)  # the SSD writer and the stores have written
    assert _files_holding(server.data_dir, *needles) == []
    assert _files_holding(server.data_dir, b"acme")  # the grep does read the stores: tenant ids are plain
    records = list(read_trace(server.trace))  # the block trace: hashes and times, nothing of the text
    assert records and any(len(r.blocks) >= 8 for r in records) and needles[0] not in server.trace.read_bytes()
    assert not any(b"acme" in r.tenant.encode() or needle in r.line().encode() for r in records for needle in needles)


def test_with_encryption_off_the_same_traffic_is_found(tiny_model_path, tmp_path):
    plain = LiveServer(tiny_model_path, tmp_path / "data", ENV | {"STRATA_ENCRYPT_AT_REST": "0"})
    try:
        _traffic(plain)
        time.sleep(0.5)
        assert _files_holding(tmp_path / "data", b"zanzibar-quokka-7731", b"tessellated-okapi-5520")
    finally:
        assert plain.stop()


def test_a_redis_holds_no_question_or_answer_in_the_clear(tiny_model_path, tmp_path, redis_server):
    redis_server.flush()
    live = LiveServer(tiny_model_path, tmp_path / "data", ENV | {"STRATA_REDIS_URL": redis_server.url})
    try:
        needles = _traffic(live)
        assert _ask(live, "acme", QUESTION).headers["x-cache-layer"] == "exact"  # the sealed answer opens
    finally:
        assert live.stop()
    values = _redis_values(redis.Redis.from_url(redis_server.url))
    assert any(b"acme" in value for value in values)  # the dump is read: tenant ids are plain
    owner = re.compile(rb'\["[0-9a-f]{64}", "[0-9a-f]{64}"\]')  # an owner set's member: [session, end user] digests
    assert any(owner.fullmatch(value) for value in values)
    assert [needle for needle in needles if any(needle in value for value in values)] == []


def test_cache_keys_and_ids_at_rest_are_digests_under_the_tenants_key(tmp_path):
    """An exact or draft key recomputed from a guessed prompt (the scope is readable) once found the
    entry in responses.db; ids were kept plain. Now both are keyed by the tenant's data key, which the
    data folder does not hold: another key gives other digests for the same request."""
    settings = settings_from_env(TINY, tmp_path / "data", "127.0.0.1", 0, env={})
    caches = ResponseCaches(settings)
    body = {"model": TINY, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "user": END_USER}
    request = parse_chat_request(body, settings.limits)
    caller = Caller("acme", tenant_salt(b"s" * 32, "acme"))
    headers = {"x-strata-session": SESSION}
    first, again = (caches.context(request, caller, headers, [], "model-fp") for _ in range(2))
    assert (first.exact_key, first.draft_key, first.owner) == (again.exact_key, again.draft_key, again.owner)
    assert END_USER not in repr(first.owner) and SESSION not in repr(first.owner) and first.owner.end_user
    elsewhere = Keyring(FileKeys(tmp_path / "other-keys.json"), b"\x07" * 32)
    caches.sealer = elsewhere  # the same request, another tenant key: nothing matches
    other = caches.context(request, caller, headers, [], "model-fp")
    assert other.exact_key != first.exact_key and other.draft_key != first.draft_key
    assert other.owner.session != first.owner.session and other.owner.end_user != first.owner.end_user
    assert at_rest(elsewhere, "acme", "session", SESSION) == other.owner.session  # what a purge selects by


def _redis_values(client) -> list[bytes]:
    """Every key and value, whatever its type (a dump file would hide strings in LZF compression)."""
    values = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        values.append(key)
        if kind == "string":
            values.append(client.get(key))
        elif kind == "hash":
            values += [b"%s=%s" % pair for pair in client.hgetall(key).items()]
        elif kind == "set":
            values += list(client.smembers(key))
        elif kind == "zset":
            values += list(client.zrange(key, 0, -1))
        elif kind == "list":
            values += list(client.lrange(key, 0, -1))
        elif kind == "stream":
            values += [repr(record).encode() for record in client.xrange(key)]
    return values


def _owned_blocks(folder: Path, namespace: str, tenant: str, served: bool = False) -> list[str]:
    """The blocks in a KV folder sealed under the tenant's own key (served: only those its requests
    stored, not the seeded). A declared public prefix's blocks the tenant also owns are sealed under
    the public key: they stay readable after its purge, for the other tenants sharing them."""
    blocks = []
    for path in folder.rglob("seg-*.safetensors"):
        described = describe(path, namespace)
        sealed_for = _sealing_tenants(path) if described is not None else {}
        for block, owners in described[1].items() if described is not None else ():
            mine = [o for o in owners if tenant_of(o) == tenant and not (served and "seeded" in o)]
            blocks += [block] if mine and sealed_for.get(block) == tenant else []
    return blocks


def _sealing_tenants(path: Path) -> dict[str, str]:
    """hash -> the tenant whose key seals the block, from a segment's header. A segment the server
    reclaims between the folder's listing and this read holds no blocks any more: empty."""
    try:
        with open(path, "rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    except FileNotFoundError:
        return {}
    return {block["hash"]: block["tenant"] for block in json.loads(header["__metadata__"]["blocks"])}


@pytest.mark.serial
def test_a_tenant_purge_shreds_its_key_at_once_and_reclaims_the_files_later(seeded_server, tiny_model_path, tmp_path):
    server = seeded_server
    namespace = _namespace(tiny_model_path)
    _ask(server, "acme", "Who painted the lamp room?")
    _ask(server, "globex", "Who painted the lamp room?")
    time.sleep(0.5)  # written through to SSD
    backup = tmp_path / "backup"
    shutil.copytree(server.data_dir / "kv", backup, ignore=shutil.ignore_patterns("*.sqlite*", "journal-*"))
    copy = SsdTier(SsdConfig(backup, sealer=_keyring(server.data_dir)), namespace)
    acme_blocks, globex_blocks = _owned_blocks(backup, namespace, "acme"), _owned_blocks(backup, namespace, "globex")
    served = _owned_blocks(backup, namespace, "acme", served=True)  # sealed by the server itself
    assert len(acme_blocks) > SEEDED_BLOCKS and served and globex_blocks
    assert len(copy.read_chain(acme_blocks[:1])) == 1 and len(copy.read_chain(served[:1])) == 1  # the key lives

    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as admin:  # made first: its TLS setup untimed
        admin.get("/health")
        started = time.perf_counter()
        purged = admin.post("/admin/purge", json={"tenant": "acme"})
        took_s = time.perf_counter() - started
    assert purged.status_code == 200 and purged.json()["shredded"] is True
    assert took_s < 0.1, f"the purge took {took_s * 1000:.0f} ms with {SEEDED_BLOCKS} blocks on SSD"
    assert all(copy.read_chain([block]) == [] for block in [*served, *acme_blocks[:50]])
    assert len(copy.read_chain(globex_blocks[:1])) == 1
    copy.close()

    again = _ask(server, "globex", "Who painted the lamp room?")
    assert again.headers["x-cache-layer"] == "exact"  # other tenants keep hitting
    assert _cached(_ask(server, "globex", "And who restored it?")) >= 256
    fresh = _ask(server, "acme", "Who painted the lamp room?")
    assert fresh.headers["x-cache-layer"] == "engine" and _cached(fresh) == 0
    deadline = time.monotonic() + 120  # what acme held before the purge leaves the disk (its one new request may stay)
    while len(_owned_blocks(server.data_dir / "kv", namespace, "acme")) >= 100:
        assert time.monotonic() < deadline, "the purged blocks' files were not reclaimed"
        time.sleep(0.5)


def test_the_wrapping_key_rotates_and_a_wrong_or_missing_key_file_stops_start_up(tiny_model_path, tmp_path):
    data_dir = tmp_path / "data"
    live = LiveServer(tiny_model_path, data_dir, ENV)
    try:
        assert _ask(live, "acme", QUESTION).headers["x-cache-layer"] == "engine"
    finally:
        assert live.stop()
    new_key = tmp_path / "new.key"
    new_key.write_text(os.urandom(32).hex())
    rotated = _cli("keys", "rotate", "--new-key-file", str(new_key), "--data-dir", str(data_dir))
    assert rotated.returncode == 0 and "tenant keys wrapped" in rotated.stdout, rotated.stderr
    live = LiveServer(tiny_model_path, data_dir, ENV | {"STRATA_KEY_FILE": str(new_key)})
    try:
        assert _ask(live, "acme", QUESTION).headers["x-cache-layer"] == "exact"  # the answer opens under the new key
    finally:
        assert live.stop()
    wrong = _cli("serve", "--model", str(tiny_model_path), "--data-dir", str(data_dir))  # the old, derived key
    assert wrong.returncode == 2 and "does not open the key store" in wrong.stderr, wrong.stderr
    missing = _cli("serve", "--model", str(tiny_model_path), "--data-dir", str(data_dir), key_file="/nonexistent/k")
    assert missing.returncode == 2 and "/nonexistent/k cannot be read" in missing.stderr, missing.stderr


ROTATION_ENV = ENV | {"STRATA_API_KEYS": "key-acme:acme,key-globex:globex,key-initech:initech"}


def test_keys_rotate_while_the_server_runs_under_load_and_no_tenant_is_left_half_wrapped(tiny_model_path, tmp_path):
    data_dir, key_file, new_key = tmp_path / "data", tmp_path / "current.key", tmp_path / "new.key"
    key_file.write_text(os.urandom(32).hex())
    new_key.write_text(os.urandom(32).hex())
    env = ROTATION_ENV | {"STRATA_KEY_FILE": str(key_file)}
    live = LiveServer(tiny_model_path, data_dir, env)
    try:
        globex_id = _store_response(live, "globex", "Describe the lamp room.")  # a key this server held
    finally:
        assert live.stop()
    live = LiveServer(tiny_model_path, data_dir, env)  # a fresh process: globex's key not in memory
    try:
        acme_id = _store_response(live, "acme", "Describe the fog bell.")
        with _Load(live) as load:  # acme's chats and stored responses all along
            rotated = _cli(
                "keys", "rotate", "--new-key-file", str(new_key), "--data-dir", str(data_dir), key_file=str(key_file)
            )
            assert rotated.returncode == 0, rotated.stderr
            assert _get_response(live, "acme", acme_id).status_code == 200  # the keys it holds did not change
            waiting = _get_response(live, "globex", globex_id)
            assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "key_store_rotated"
            first_seen = _ask(live, "initech", QUESTION)  # a tenant first seen now is answered, its caches bypassed
            assert first_seen.status_code == 200
            os.replace(new_key, key_file)  # the operator puts the new key in place: no restart
            assert _get_response(live, "globex", globex_id).status_code == 200
            initech_id = _store_response(live, "initech", "Describe the keeper's cottage.")
            assert _ask(live, "initech", QUESTION).headers["x-cache-layer"] == "engine"  # written this time
        assert load.statuses and set(load.statuses) == {200}, load.statuses
    finally:
        assert live.stop()
    live = LiveServer(tiny_model_path, data_dir, env)  # restarted with the new key: every tenant opens
    try:
        for tenant, response_id in (("acme", acme_id), ("globex", globex_id), ("initech", initech_id)):
            assert _get_response(live, tenant, response_id).status_code == 200, tenant
        assert _ask(live, "initech", QUESTION).headers["x-cache-layer"] == "exact"
    finally:
        assert live.stop()


def _store_response(server, tenant: str, text: str) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0)
    return client.responses.create(model=TINY, input=text, max_output_tokens=6, store=True).id


def _get_response(server, tenant: str, response_id: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {KEYS[tenant]}"}
    return httpx.get(f"{server.url}/v1/responses/{response_id}", headers=auth, timeout=30)


class _Load:
    """acme's traffic in a thread while the block runs: varied chats and stored responses."""

    def __init__(self, server):
        self.server, self.statuses, self.done = server, [], threading.Event()
        self.thread = threading.Thread(target=self._run)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.done.set()
        self.thread.join(60)

    def _run(self) -> None:
        auth = {"Authorization": f"Bearer {KEYS['acme']}"}
        with httpx.Client(base_url=self.server.url, headers=auth, timeout=60) as client:
            n = 0
            while not self.done.is_set():
                n += 1
                chat = {
                    "model": TINY,
                    "messages": [{"role": "user", "content": f"Log entry {n % 3}?"}],
                    "max_tokens": 4,
                }
                self.statuses.append(client.post("/v1/chat/completions", json=chat).status_code)
                stored = {"model": TINY, "input": f"Note {n}.", "max_output_tokens": 4, "store": True}
                self.statuses.append(client.post("/v1/responses", json=stored).status_code)


def _cli(*args: str, key_file: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_") and k != "LD_PRELOAD"}
    env |= {"STRATA_KEY_FILE": key_file} if key_file else {}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


PUBLIC = "You are the shared coding agent of the Quay toolkit; follow the repository's conventions. " * 12


def test_a_public_prefix_is_shared_across_tenants_and_nothing_after_it_is(server):
    listed = httpx.get(server.url + "/admin/public-prefixes", headers=ADMIN).json()["data"]
    assert [prefix["system"] for prefix in listed] == ["You are a careful assistant for the harbour office."]
    declared = httpx.post(server.url + "/admin/public-prefixes", json={"system": PUBLIC}, headers=ADMIN)
    assert declared.status_code == 201, declared.text
    shared = declared.json()["shared_tokens"]
    assert shared >= 256
    question = "Please list every file that the build step reads, and explain each of them in turn. " * 4
    first = _ask(server, "acme", question, PUBLIC)
    assert f"public={shared}" in first.headers["x-cache-prefix"]
    other = _ask(server, "globex", question, PUBLIC)  # the same whole prompt from another tenant
    assert f"public={shared}" in other.headers["x-cache-prefix"]
    assert _cached(other) == shared  # the public blocks, and not one token of acme's own after them
    changed = _ask(server, "globex", "Another question entirely.", PUBLIC.replace("Quay", "Quai", 1))
    assert _cached(changed) == 0 and "public=" not in changed.headers["x-cache-prefix"]  # one token off: not public
    removed = httpx.delete(server.url + f"/admin/public-prefixes/{declared.json()['id']}", headers=ADMIN)
    assert removed.status_code == 200 and httpx.delete(removed.request.url, headers=ADMIN).status_code == 404


def test_a_bad_public_prefix_is_a_clear_400(server):
    for body in ({"system": ""}, {"system": "x", "colour": 1}, ["x"], {"tools": "none"}):
        bad = httpx.post(server.url + "/admin/public-prefixes", json=body, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["message"], body
    assert httpx.post(server.url + "/admin/public-prefixes", json={"system": "x"}).status_code == 401


TOOL = {
    "name": "read_file",
    "description": "Read one file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
AGENT = "You are the Quay toolkit's shared coding agent. Use the tools; never guess a file's contents. " * 10


def test_a_public_system_prompt_and_tool_list_is_shared_between_openai_and_anthropic_clients(server):
    declared = httpx.post(
        server.url + "/admin/public-prefixes",
        json={"system": AGENT, "tools": [{"type": "function", "function": TOOL}]},
        headers=ADMIN,
    )
    assert declared.status_code == 201, declared.text
    shared = declared.json()["shared_tokens"]
    first = _client(server, "acme").chat.completions.with_raw_response.create(
        model=TINY,
        messages=[{"role": "system", "content": AGENT}, {"role": "user", "content": "Open the build file."}],
        tools=[{"type": "function", "function": TOOL}],
        max_tokens=4,
        temperature=0,
    )
    assert f"public={shared}" in first.headers["x-cache-prefix"]
    agent = anthropic.Anthropic(base_url=server.url, api_key=KEYS["globex"], max_retries=0)
    message = agent.messages.with_raw_response.create(
        model=TINY,
        system=AGENT,
        tools=[{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}],
        max_tokens=4,
        messages=[{"role": "user", "content": "Which files does the test step read?"}],
    )
    assert f"public={shared}" in message.headers["x-cache-prefix"]
    assert message.parse().usage.cache_read_input_tokens == shared  # acme's public blocks, nothing of its own


def test_data_files_are_private(tiny_model_path, tmp_path):
    data_dir = tmp_path / "data"
    live = LiveServer(tiny_model_path, data_dir, {"STRATA_MODEL_NAME": TINY, "STRATA_SSD_MIN_HITS": "0"})
    try:
        for turn in range(2):
            httpx.post(
                live.url + "/v1/chat/completions",
                timeout=60,
                json={
                    "model": TINY,
                    "max_tokens": 4,
                    "temperature": 0,
                    "messages": [
                        {"role": "user", "content": "Remember this sentence about private files. " * (4 + turn)}
                    ],
                },
            )
    finally:
        assert live.stop()
    found = {path.name for path in data_dir.rglob("*")}
    assert {"responses.db", "semantic.db", "index.sqlite"} <= found
    assert any(name.endswith(".safetensors") for name in found)
    for path in [data_dir, *data_dir.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
