"""Stored Responses-API conversations: `previous_response_id` continues one.

    ConversationStore(path, retention_s).save(id, tenant, session, user, messages, response, now, parent)
    ConversationStore.load(id, tenant, now) -> messages | None      another tenant's id is not found
    ConversationStore.response(id, tenant, now) -> dict | None      the stored `response` object
    ConversationStore.used_bytes(tenant) -> int                     what the tenant's rows and images hold
    ConversationStore.delete(id, tenant) -> bool
    ConversationStore.purge_expired(now) -> int
    ConversationStore.purge(selector) -> Purged                     a tenant, or its session / end user

Each turn is stored once. A response's row holds only what it added (the new input and its own
output, as chat messages: the shape the chat-completions pipeline takes) and the id of the response
it continued; load() walks that chain back to its start, so a follow-up renders the same prompt and
reuses the earlier turns from the prefix cache. Images (data: URLs) are kept apart, once per tenant
and content (by a keyed digest of the URL), however many turns and branches send them: in the messages they
become `strata-blob:<hash>` and are put back on load. An 8-turn chain with a 1 MB image per turn
plus 8 branches from its end stores about what was sent, not the history again with every turn.

At rest a turn's messages and response, and every image, are sealed under the tenant's key, bound
to the row (or image) they belong to; an image's reference is a keyed digest under the same key. A
tenant whose key was shredded has nothing that loads: its rows read as not found.

Invariants: a row is visible (load, response) while `expires_at > now` and it is not deleted; it
stays stored while a later turn needs it: `keep_until` is the latest expiry of the rows that
continue it, and a deleted row with no stored continuation is removed at once. A blob is stored
while a stored row refers to it (`blob_refs`). Purges remove the selected rows whatever continues
them: a continuation of a purged turn can no longer be loaded (404), never with a hole in it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvcache.sealing import NO_SEALING, Sealer, Unreadable
from semantic import Purged, Selector

BLOB_PREFIX = "strata-blob:"
MIN_BLOB_CHARS = 1024  # data: URLs at least this long are kept apart (a tiny icon stays inline)
MAX_CHAIN = 10_000  # turns load() follows back: a cycle cannot hold it
BY_ID = "id = ? AND tenant = ?"  # a row is its tenant's alone: every lookup by id names the tenant too

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session TEXT,
    end_user TEXT,
    parent TEXT,             -- the response this one continued (previous_response_id), or NULL
    messages BLOB NOT NULL,  -- sealed JSON: the chat messages this turn added, its output last; images as blob refs
    response BLOB NOT NULL,  -- sealed JSON: the response object as the client got it
    num_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,  -- visible until then
    keep_until REAL NOT NULL,  -- stored until then: the latest expiry of the turns that continue it
    deleted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS responses_keep ON responses (keep_until);
CREATE INDEX IF NOT EXISTS responses_parent ON responses (parent);
CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant);
CREATE TABLE IF NOT EXISTS blobs (
    tenant TEXT NOT NULL,
    hash TEXT NOT NULL,
    data BLOB NOT NULL,  -- sealed: the data: URL
    num_bytes INTEGER NOT NULL,
    PRIMARY KEY (tenant, hash)
);
CREATE TABLE IF NOT EXISTS blob_refs (
    response_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    hash TEXT NOT NULL,
    PRIMARY KEY (response_id, hash)
);
CREATE INDEX IF NOT EXISTS blob_refs_blob ON blob_refs (tenant, hash);
"""


class ConversationStore:
    def __init__(self, path: Path | str, retention_s: float, sealer: Sealer = NO_SEALING):
        self.retention_s = retention_s
        self.sealer = sealer
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()  # one connection; every method holds it around its statements
        self._migrate()

    # -- writing -----------------------------------------------------------------------------

    def save(
        self,
        response_id: str,
        tenant: str,
        session: str | None,
        user: str | None,
        messages: list[dict],
        response: dict,
        now: float,
        parent: str | None = None,
    ) -> None:
        """Store a turn: `messages` are the ones it added (its new input and its output)."""
        blobs: dict[str, str] = {}
        digest = partial(self.sealer.digest, tenant)
        stored = json.dumps(_externalised(messages, blobs, digest), ensure_ascii=False)
        body = json.dumps(response, ensure_ascii=False)
        num_bytes = len(stored) + len(body)
        sealed_stored = self._seal(tenant, f"turn|{response_id}|messages", stored)
        sealed_body = self._seal(tenant, f"turn|{response_id}|response", body)
        expires_at = now + self.retention_s
        with self.lock:
            self.db.execute("BEGIN")
            self._remove_expired(now)
            self.db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (
                    response_id,
                    tenant,
                    session,
                    user,
                    parent,
                    sealed_stored,
                    sealed_body,
                    num_bytes,
                    now,
                    expires_at,
                    expires_at,
                ),
            )
            self._keep_chain(parent, tenant, expires_at)
            for blob, data in blobs.items():
                sealed = self._seal(tenant, f"blob|{blob}", data)
                self.db.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?, ?)", (tenant, blob, sealed, len(data)))
                self.db.execute("INSERT OR IGNORE INTO blob_refs VALUES (?, ?, ?)", (response_id, tenant, blob))
            self.db.execute("COMMIT")

    def _keep_chain(self, parent: str | None, tenant: str, until: float) -> None:
        """The turns a new one continues stay stored as long as it does (caller holds the lock)."""
        for _ in range(MAX_CHAIN):
            if parent is None:
                return
            row = self.db.execute(
                f"SELECT parent, keep_until FROM responses WHERE {BY_ID}", (parent, tenant)
            ).fetchone()
            if row is None or row[1] >= until:
                return  # a broken chain, or the rest already lives as long
            self.db.execute("UPDATE responses SET keep_until = ? WHERE id = ?", (until, parent))
            parent = row[0]

    # -- reading -----------------------------------------------------------------------------

    def load(self, response_id: str, tenant: str, now: float, end_user: str | None = None) -> list[dict] | None:
        """The whole conversation up to and including `response_id`'s output; None when it is not
        this tenant's, has expired, was deleted, or a turn before it was purged; with `end_user`
        (a tenant that keeps its end users apart; "" for none), also when it was stored for another."""
        with self.lock:
            if self._visible(response_id, tenant, now) is None or not self._stored_for(response_id, tenant, end_user):
                return None
            turns = self._chain(response_id, tenant)
            if turns is None:
                return None
            blobs = self._blobs(tenant, [digest for turn in turns for digest in _blob_digests(turn)])
        messages = [message for turn in turns for message in json.loads(turn)]
        return _restored(messages, blobs)

    def response(self, response_id: str, tenant: str, now: float) -> dict | None:
        with self.lock:
            row = self._visible(response_id, tenant, now)
        opened = self._open(tenant, f"turn|{response_id}|response", row[0]) if row else None
        return json.loads(opened) if opened is not None else None

    def used_bytes(self, tenant: str) -> int:
        """What the tenant's stored turns and images hold (its storage quota counts this)."""
        with self.lock:
            (rows,) = self.db.execute(
                "SELECT COALESCE(SUM(num_bytes), 0) FROM responses WHERE tenant = ?", (tenant,)
            ).fetchone()
            (images,) = self.db.execute(
                "SELECT COALESCE(SUM(num_bytes), 0) FROM blobs WHERE tenant = ?", (tenant,)
            ).fetchone()
        return rows + images

    def _stored_for(self, response_id: str, tenant: str, end_user: str | None) -> bool:
        if end_user is None:
            return True
        (stored,) = self.db.execute(
            f"SELECT COALESCE(end_user, '') FROM responses WHERE {BY_ID}", (response_id, tenant)
        ).fetchone()
        return stored == end_user

    def _visible(self, response_id: str, tenant: str, now: float) -> tuple | None:
        return self.db.execute(
            f"SELECT response FROM responses WHERE {BY_ID} AND expires_at > ? AND deleted = 0",
            (response_id, tenant, now),
        ).fetchone()

    def _chain(self, response_id: str, tenant: str) -> list[str] | None:
        """Each turn's stored messages, first turn first; None when one is missing."""
        turns: list[str] = []
        current: str | None = response_id
        while current is not None and len(turns) < MAX_CHAIN:
            row = self.db.execute(f"SELECT parent, messages FROM responses WHERE {BY_ID}", (current, tenant)).fetchone()
            messages = self._open(tenant, f"turn|{current}|messages", row[1]) if row is not None else None
            if messages is None:
                return None
            current = row[0]
            turns.append(messages)
        return turns[::-1] if current is None else None

    def _blobs(self, tenant: str, digests: list[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for digest in dict.fromkeys(digests):
            row = self.db.execute("SELECT data FROM blobs WHERE tenant = ? AND hash = ?", (tenant, digest)).fetchone()
            data = self._open(tenant, f"blob|{digest}", row[0]) if row is not None else None
            if data is not None:
                found[digest] = data
        return found

    def _seal(self, tenant: str, place: str, text: str) -> bytes:
        return self.sealer.seal(tenant, place.encode(), text.encode())

    def _open(self, tenant: str, place: str, sealed: bytes) -> str | None:
        """The text sealed there; None when it does not open (the tenant's key was shredded)."""
        try:
            return self.sealer.open(tenant, place.encode(), sealed).decode()
        except Unreadable:
            return None

    # -- removing ----------------------------------------------------------------------------

    def delete(self, response_id: str, tenant: str) -> bool:
        """Hidden at once; removed once no stored turn continues it."""
        with self.lock:
            self.db.execute("BEGIN")
            hidden = self.db.execute(
                f"UPDATE responses SET deleted = 1 WHERE {BY_ID} AND deleted = 0", (response_id, tenant)
            ).rowcount
            self._remove_unneeded([response_id])
            self.db.execute("COMMIT")
        return hidden > 0

    def purge_expired(self, now: float) -> int:
        with self.lock:
            self.db.execute("BEGIN")
            removed = self._remove_expired(now)
            self.db.execute("COMMIT")
        return removed

    def purge(self, selector: Selector) -> Purged:
        owned, named = selector.where()
        where = " AND ".join(["tenant = ?"] + ([owned] if owned else []))
        values = (selector.tenant, *named)
        with self.lock:
            self.db.execute("BEGIN")
            rows = self.db.execute(f"SELECT id, num_bytes FROM responses WHERE {where}", values).fetchall()
            num_bytes = self._remove([row[0] for row in rows]) + sum(row[1] for row in rows)
            self.db.execute("COMMIT")
        return Purged(len(rows), num_bytes)

    def _remove_expired(self, now: float) -> int:
        ids = [row[0] for row in self.db.execute("SELECT id FROM responses WHERE keep_until <= ?", (now,))]
        self._remove(ids)
        return len(ids)

    def _remove_unneeded(self, ids: list[str]) -> None:
        """Remove the deleted rows among `ids` that nothing continues, then their parents likewise."""
        while ids:
            parents = [
                row[0]
                for response_id in ids
                for row in self.db.execute("SELECT parent FROM responses WHERE id = ?", (response_id,))
                if row[0] is not None
            ]
            unneeded = [
                response_id
                for response_id in ids
                if self.db.execute(
                    "SELECT 1 FROM responses WHERE id = ? AND deleted = 1 AND NOT EXISTS "
                    "(SELECT 1 FROM responses AS child WHERE child.parent = responses.id)",
                    (response_id,),
                ).fetchone()
            ]
            self._remove(unneeded)
            ids = parents if unneeded else []

    def _remove(self, ids: list[str]) -> int:
        """Delete rows and the images only they referred to; the images' bytes (caller holds the lock)."""
        tenants = set()
        for response_id in ids:
            for (tenant,) in self.db.execute("SELECT tenant FROM responses WHERE id = ?", (response_id,)):
                tenants.add(tenant)
            self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            self.db.execute("DELETE FROM blob_refs WHERE response_id = ?", (response_id,))
        orphans = "NOT EXISTS (SELECT 1 FROM blob_refs AS r WHERE r.tenant = blobs.tenant AND r.hash = blobs.hash)"
        num_bytes = 0
        for tenant in tenants:
            (size,) = self.db.execute(
                f"SELECT COALESCE(SUM(num_bytes), 0) FROM blobs WHERE tenant = ? AND {orphans}", (tenant,)
            ).fetchone()
            self.db.execute(f"DELETE FROM blobs WHERE tenant = ? AND {orphans}", (tenant,))
            num_bytes += size
        return num_bytes

    def _migrate(self) -> None:
        """Rows of the first format (`conversations`: every row the whole conversation) become
        first turns of the new one, their images kept apart."""
        with self.lock:
            old = self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'conversations'")
            if old.fetchone() is None:
                return
            rows = self.db.execute("SELECT * FROM conversations").fetchall()
        for response_id, tenant, session, user, messages, response, created_at, expires_at in rows:  # plain text
            self.save(response_id, tenant, session, user, json.loads(messages), json.loads(response), created_at)
            with self.lock:
                self.db.execute(
                    "UPDATE responses SET expires_at = ?, keep_until = ? WHERE id = ?",
                    (expires_at, expires_at, response_id),
                )
        with self.lock:
            self.db.execute("DROP TABLE conversations")

    def close(self) -> None:
        with self.lock:
            self.db.close()


def _externalised(messages: list[dict], blobs: dict[str, str], digest: Callable[[bytes], str]) -> list[dict]:
    """The messages with every large data: URL replaced by a blob reference (collected in `blobs`),
    named by `digest` (keyed: a reference does not tell which image it is)."""
    return [_with_parts(message, lambda part: _part_out(part, blobs, digest)) for message in messages]


def _restored(messages: list[dict], blobs: dict[str, str]) -> list[dict]:
    return [_with_parts(message, lambda part: _part_in(part, blobs)) for message in messages]


def _with_parts(message: dict, change) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": [change(part) for part in content]}


def _part_out(part: Any, blobs: dict[str, str], digest: Callable[[bytes], str]) -> Any:
    url = _image_url(part)
    if url is None or not url.startswith("data:") or len(url) < MIN_BLOB_CHARS:
        return part
    name = digest(url.encode())
    blobs[name] = url
    return {**part, "image_url": {**part["image_url"], "url": BLOB_PREFIX + name}}


def _part_in(part: Any, blobs: dict[str, str]) -> Any:
    url = _image_url(part)
    if url is None or not url.startswith(BLOB_PREFIX):
        return part
    return {**part, "image_url": {**part["image_url"], "url": blobs.get(url[len(BLOB_PREFIX) :], "")}}


def _image_url(part: Any) -> str | None:
    if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
        url = part["image_url"].get("url")
        return url if isinstance(url, str) else None
    return None


def _blob_digests(stored_messages: str) -> list[str]:
    """The blob references in one turn's stored JSON (a cheap scan: hashes are hex)."""
    digests, at = [], stored_messages.find(BLOB_PREFIX)
    while at >= 0:
        start = at + len(BLOB_PREFIX)
        digests.append(stored_messages[start : start + 64])
        at = stored_messages.find(BLOB_PREFIX, start)
    return digests
