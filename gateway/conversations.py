"""Stored Responses-API conversations: `previous_response_id` continues one.

    ConversationStore(path, retention_s).save(id, tenant, session, user, messages, response, now)
    ConversationStore.load(id, tenant, now) -> messages | None      another tenant's id is not found
    ConversationStore.response(id, tenant, now) -> dict | None      the stored `response` object
    ConversationStore.delete(id, tenant) -> bool
    ConversationStore.purge_expired(now) -> int
    ConversationStore.purge(selector) -> Purged                  a tenant, or its session / end user

A response is stored with the whole conversation up to and including its own output, as chat
messages (the shape the chat-completions pipeline takes), so a follow-up renders the same prompt and
reuses the earlier turns from the prefix cache. Rows carry their tenant, session and end user (for
purges) and expire after `retention_s`; expired rows are deleted as new ones are written, and by
the server's sweep (gateway/sweeper.py).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from semantic import Purged, Selector

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session TEXT,
    end_user TEXT,
    messages TEXT NOT NULL,  -- JSON: chat messages, the response's output last
    response TEXT NOT NULL,  -- JSON: the response object as the client got it
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS conversations_expiry ON conversations (expires_at);
"""


class ConversationStore:
    def __init__(self, path: Path | str, retention_s: float):
        self.retention_s = retention_s
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    def save(
        self,
        response_id: str,
        tenant: str,
        session: str | None,
        user: str | None,
        messages: list[dict],
        response: dict,
        now: float,
    ) -> None:
        with self.lock:
            self.db.execute("DELETE FROM conversations WHERE expires_at <= ?", (now,))
            self.db.execute(
                "INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    response_id,
                    tenant,
                    session,
                    user,
                    json.dumps(messages, ensure_ascii=False),
                    json.dumps(response, ensure_ascii=False),
                    now,
                    now + self.retention_s,
                ),
            )

    def load(self, response_id: str, tenant: str, now: float) -> list[dict] | None:
        row = self._row("messages", response_id, tenant, now)
        return json.loads(row) if row else None

    def response(self, response_id: str, tenant: str, now: float) -> dict | None:
        row = self._row("response", response_id, tenant, now)
        return json.loads(row) if row else None

    def purge_expired(self, now: float) -> int:
        with self.lock:
            return self.db.execute("DELETE FROM conversations WHERE expires_at <= ?", (now,)).rowcount

    def purge(self, selector: Selector) -> Purged:
        owned, named = selector.where()
        where = " AND ".join(["tenant = ?"] + ([owned] if owned else []))
        values = (selector.tenant, *named)
        with self.lock:
            (size,) = self.db.execute(
                f"SELECT COALESCE(SUM(LENGTH(messages) + LENGTH(response)), 0) FROM conversations WHERE {where}", values
            ).fetchone()
            return Purged(self.db.execute(f"DELETE FROM conversations WHERE {where}", values).rowcount, size)

    def delete(self, response_id: str, tenant: str) -> bool:
        with self.lock:
            return (
                self.db.execute("DELETE FROM conversations WHERE id = ? AND tenant = ?", (response_id, tenant)).rowcount
                > 0
            )

    def _row(self, column: str, response_id: str, tenant: str, now: float) -> str | None:
        with self.lock:
            row = self.db.execute(
                f"SELECT {column} FROM conversations WHERE id = ? AND tenant = ? AND expires_at > ?",
                (response_id, tenant, now),
            ).fetchone()
        return row[0] if row else None

    def close(self) -> None:
        with self.lock:
            self.db.close()
