"""Who holds an entry: its tenant, and the sessions and end users whose requests stored it.

Content stays shared within a tenant: one entry (the same question, the same answer) is owned by
every (session, end user) pair that stored it, "" standing for none. Purging a session or an end
user removes its ownership and deletes an entry only once no owner is left; purging a tenant
deletes all of the tenant's entries.

    Owner(session, end_user)                       recorded with each store
    Selector(tenant, session=None, end_user=None)  what a purge names; None matches any
    OwnerTable(db, name, key_type)                 the owners of one SQLite table's entries
    owner_label(tenant, owner) -> str              the same owner as one opaque string, for the layers
                                                   that keep labels (vision features, KV blocks);
    Selector.selects(label) -> bool                and what a purge picks among them
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class Owner:
    session: str = ""
    end_user: str = ""


@dataclass(frozen=True, slots=True)
class Selector:
    tenant: str
    session: str | None = None
    end_user: str | None = None

    @property
    def whole_tenant(self) -> bool:
        return self.session is None and self.end_user is None

    def where(self, prefix: str = "") -> tuple[str, list[str]]:
        """SQL conditions on the named session and end user ("" when neither is named), and their values."""
        named = [
            (column, value)
            for column, value in (("session", self.session), ("end_user", self.end_user))
            if value is not None
        ]
        return " AND ".join(f"{prefix}{column} = ?" for column, _ in named), [value for _, value in named]

    def matches(self, owner: Owner) -> bool:
        return (self.session is None or owner.session == self.session) and (
            self.end_user is None or owner.end_user == self.end_user
        )

    def selects(self, label: str) -> bool:
        """Whether an owner_label() names an owner this selector purges."""
        tenant, owner = _parse_label(label)
        return tenant == self.tenant and self.matches(owner)


def owner_label(tenant: str, owner: Owner) -> str:
    return json.dumps([tenant, owner.session, owner.end_user])


def tenant_of(label: str) -> str:
    """The tenant an owner_label() names."""
    return _parse_label(label)[0]


@lru_cache(maxsize=4096)
def _parse_label(label: str) -> tuple[str, Owner]:
    tenant, session, end_user = json.loads(label)
    return tenant, Owner(session, end_user)


class OwnerTable:
    """`<name>(key, session, end_user)`: one row per owner of an entry. The caller holds the lock
    that guards `db`. Names are the module's own constants, never client text."""

    def __init__(self, db: sqlite3.Connection, name: str, key_type: str):
        self.db = db
        self.name = name
        db.execute(
            f"CREATE TABLE IF NOT EXISTS {name} (key {key_type} NOT NULL, session TEXT NOT NULL, "
            f"end_user TEXT NOT NULL, PRIMARY KEY (key, session, end_user))"
        )

    def add(self, key, owner: Owner) -> None:
        self.db.execute(f"INSERT OR IGNORE INTO {self.name} VALUES (?, ?, ?)", (key, owner.session, owner.end_user))

    def release(self, selector: Selector, entries: str, key_column: str) -> list:
        """Remove the selector's ownership of the tenant's entries (`entries`, keyed by `key_column`,
        with a `tenant` column); return the keys left with no owner, which the caller deletes."""
        if selector.whole_tenant:
            keys = [
                row[0]
                for row in self.db.execute(f"SELECT {key_column} FROM {entries} WHERE tenant = ?", (selector.tenant,))
            ]
            self.forget(keys)
            return keys
        joined, values = selector.where("o.")
        keys = [
            row[0]
            for row in self.db.execute(
                f"SELECT DISTINCT o.key FROM {self.name} o JOIN {entries} e ON e.{key_column} = o.key "
                f"WHERE e.tenant = ? AND {joined}",
                (selector.tenant, *values),
            )
        ]
        owned = selector.where()[0]
        for key in keys:
            self.db.execute(f"DELETE FROM {self.name} WHERE key = ? AND {owned}", (key, *values))
        return [key for key in keys if not self.owned(key)]

    def owned(self, key) -> bool:
        return self.db.execute(f"SELECT 1 FROM {self.name} WHERE key = ? LIMIT 1", (key,)).fetchone() is not None

    def forget(self, keys: list) -> None:
        self.db.executemany(f"DELETE FROM {self.name} WHERE key = ?", [(key,) for key in keys])

    def owners(self, key) -> list[Owner]:
        return [
            Owner(*row) for row in self.db.execute(f"SELECT session, end_user FROM {self.name} WHERE key = ?", (key,))
        ]

    def sweep(self, entries: str, key_column: str) -> None:
        """Drop the owners of entries that are gone (expired, deleted)."""
        self.db.execute(f"DELETE FROM {self.name} WHERE key NOT IN (SELECT {key_column} FROM {entries})")
