"""Which blocks the SSD tier holds, in which segment files, used when: memory, mirrored in SQLite.

Lock discipline: `lock` guards everything below it (the maps, `num_bytes`, `touched` and the
SQLite connection); every method takes it for its whole body and none calls out while holding it.

Invariants: every block entry names a segment in `segments`, and every segment's blocks are in
`blocks` (unless a later segment took the block over); `owners` has an entry for every block (empty
for blocks written before owners were recorded); num_bytes == sum of the segments' sizes; the maps
mirror index.sqlite, except that recent reads reach its `last_used` column in batches. A segment in
the `doomed` table holds purged blocks and is no longer indexed: its file is deleted, at the latest
by the next start-up's reconcile, and never indexed again.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .segment import PRIVATE_FILE_MODE


@dataclass(slots=True)
class Segment:
    nbytes: int  # on disk
    last_used: float
    blocks: list[str]  # hex hashes, in file order
    written_at: float = 0.0  # time.time() it was written (at start-up: its last use, close enough)


@dataclass(slots=True)
class BlockEntry:
    segment: str
    kv_nbytes: int  # the tensors alone: what the block will take in RAM


class SegmentIndex:
    def __init__(self, path: Path):
        self.lock = threading.Lock()
        self.blocks: dict[str, BlockEntry] = {}
        self.segments: dict[str, Segment] = {}
        self.num_bytes = 0
        self.touched: set[str] = set()  # segments read since the file last heard of it
        self.owners: dict[str, set[str]] = {}  # hex hash -> owner labels
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_FILE_MODE))  # SQLite's -wal/-shm copy its mode
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS segments (name TEXT PRIMARY KEY, nbytes INTEGER, last_used REAL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS blocks (hash TEXT PRIMARY KEY, segment TEXT, kv_nbytes INTEGER)")
        self.db.execute("CREATE TABLE IF NOT EXISTS owners (hash TEXT, owner TEXT, PRIMARY KEY (hash, owner))")
        self.db.execute("CREATE TABLE IF NOT EXISTS doomed (name TEXT PRIMARY KEY)")

    # -- queries ------------------------------------------------------------------------------

    def contains(self, hex_hash: str) -> bool:
        with self.lock:
            return hex_hash in self.blocks

    def has_segment(self, name: str) -> bool:
        with self.lock:
            return name in self.segments

    def kv_nbytes(self, hex_hash: str) -> int | None:
        with self.lock:
            entry = self.blocks.get(hex_hash)
        return entry.kv_nbytes if entry else None

    def segments_of(self, hex_hashes: list[str]) -> list[str | None]:
        with self.lock:
            return [self.blocks[h].segment if h in self.blocks else None for h in hex_hashes]

    def least_recently_used(self) -> list[tuple[str, Segment]]:
        with self.lock:
            return sorted(self.segments.items(), key=lambda item: item[1].last_used)

    def owners_of(self, hex_hash: str) -> frozenset[str]:
        with self.lock:
            return frozenset(self.owners.get(hex_hash, ()))

    def live_blocks(self, name: str) -> list[str]:
        """The blocks the index reads from segment `name` (others were taken over by later segments)."""
        with self.lock:
            segment = self.segments.get(name)
            return [h for h in segment.blocks if self.blocks[h].segment == name] if segment else []

    def doomed(self) -> list[str]:
        with self.lock:
            return [name for (name,) in self.db.execute("SELECT name FROM doomed")]

    def counts(self) -> tuple[int, int, int]:
        """(files, blocks, bytes) at one instant."""
        with self.lock:
            return len(self.segments), len(self.blocks), self.num_bytes

    # -- changes ------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        nbytes: int,
        last_used: float,
        sizes: dict[str, int],
        owners: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.add_all([(name, nbytes, last_used, sizes, owners or {})])

    def add_all(self, segments: list[tuple[str, int, float, dict[str, int], Mapping[str, Iterable[str]]]]) -> None:
        """Several segments (name, nbytes, last_used, sizes, owners) in one transaction: one commit
        (a disk flush) for all of them."""
        with self.lock:
            self.db.execute("BEGIN")
            for name, nbytes, last_used, sizes, owners in segments:
                self._add(name, nbytes, last_used, sizes, owners)
            self.db.execute("COMMIT")

    def own(self, hex_hash: str, owners: Iterable[str]) -> None:
        """More owners for a block on SSD (it was spilled again by other sessions' requests)."""
        with self.lock:
            known = self.owners.get(hex_hash)
            if known is None:  # not on SSD (any more)
                return
            new = set(owners) - known
            if new:
                known |= new
                self.db.executemany("INSERT OR IGNORE INTO owners VALUES (?, ?)", [(hex_hash, o) for o in new])

    def release(self, selects: Callable[[str], bool]) -> dict[str, list[str]]:
        """Take the selected owners off every block; returns, by segment, the blocks left with no owner
        (still indexed: the caller rewrites or deletes their segments with `replace`)."""
        orphans: dict[str, list[str]] = {}
        with self.lock:
            for hex_hash, owners in self.owners.items():
                selected = {owner for owner in owners if selects(owner)}
                if not selected:
                    continue
                owners -= selected
                self.db.executemany(
                    "DELETE FROM owners WHERE hash = ? AND owner = ?", [(hex_hash, owner) for owner in selected]
                )
                if not owners:
                    orphans.setdefault(self.blocks[hex_hash].segment, []).append(hex_hash)
        return orphans

    def doom(self, name: str) -> Segment | None:
        """In one transaction: segment `name` leaves the index and is marked doomed (its file must go,
        and must never be indexed again)."""
        with self.lock:
            self.db.execute("BEGIN")
            segment = self._forget(name)
            self.db.execute("INSERT OR IGNORE INTO doomed VALUES (?)", (name,))
            self.db.execute("COMMIT")
            return segment

    def undoom(self, name: str) -> None:
        """The doomed segment's file is gone."""
        with self.lock:
            self.db.execute("DELETE FROM doomed WHERE name = ?", (name,))

    def forget(self, name: str) -> Segment | None:
        """Drop a segment and its block rows (from memory and the file); None if it was not indexed."""
        with self.lock:
            return self._forget(name)

    def _add(
        self, name: str, nbytes: int, last_used: float, sizes: dict[str, int], owners: Mapping[str, Iterable[str]]
    ) -> None:  # caller holds the lock, in a transaction
        self.segments[name] = Segment(nbytes, last_used, list(sizes), last_used)
        self.num_bytes += nbytes
        self.blocks.update({h: BlockEntry(name, size) for h, size in sizes.items()})
        for hex_hash in sizes:
            self.owners.setdefault(hex_hash, set()).update(owners.get(hex_hash, ()))
        self.db.execute("INSERT OR REPLACE INTO segments VALUES (?, ?, ?)", (name, nbytes, last_used))
        self.db.executemany(
            "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)", [(h, name, size) for h, size in sizes.items()]
        )
        self.db.executemany(
            "INSERT OR IGNORE INTO owners VALUES (?, ?)", [(h, o) for h in sizes for o in owners.get(h, ())]
        )

    def _forget(self, name: str) -> Segment | None:  # caller holds the lock
        segment = self.segments.pop(name, None)
        if segment is not None:
            self.num_bytes -= segment.nbytes
            for hex_hash in segment.blocks:
                if self.blocks.get(hex_hash, BlockEntry("", 0)).segment == name:
                    del self.blocks[hex_hash]
                    self.owners.pop(hex_hash, None)
                    self.db.execute("DELETE FROM owners WHERE hash = ?", (hex_hash,))
        self._delete_rows(name)
        return segment

    def touch(self, name: str, now: float) -> None:
        """LRU order lives in memory; the file learns it in batches (a read must not wait for a
        journal write). After a crash the LRU order is a little stale, never wrong about files."""
        with self.lock:
            if name in self.segments:
                self.segments[name].last_used = now
                self.touched.add(name)

    def flush_touches(self) -> None:
        with self.lock:
            rows = [(self.segments[n].last_used, n) for n in self.touched if n in self.segments]
            self.touched.clear()
            self.db.executemany("UPDATE segments SET last_used = ? WHERE name = ?", rows)

    # -- start-up -----------------------------------------------------------------------------

    def load(self, on_disk: dict[str, int]) -> list[str]:
        """Take in the rows whose file exists with the recorded size (`on_disk`: name -> size);
        drop rows without a file. Returns the files the index does not describe."""
        with self.lock:
            indexed = {
                n: (size, used) for n, size, used in self.db.execute("SELECT name, nbytes, last_used FROM segments")
            }
            rows: dict[str, dict[str, int]] = {}
            for hex_hash, name, size in self.db.execute("SELECT hash, segment, kv_nbytes FROM blocks"):
                rows.setdefault(name, {})[hex_hash] = size
            owners: dict[str, set[str]] = {}
            for hex_hash, owner in self.db.execute("SELECT hash, owner FROM owners"):
                owners.setdefault(hex_hash, set()).add(owner)
            for name in set(indexed) - set(on_disk):
                self._delete_rows(name)
            unknown = []
            for name, size in on_disk.items():
                if name in indexed and indexed[name][0] == size and name in rows:
                    self.segments[name] = Segment(size, indexed[name][1], list(rows[name]), indexed[name][1])
                    self.blocks.update({h: BlockEntry(name, s) for h, s in rows[name].items()})
                    self.owners.update({h: owners.get(h, set()) for h in rows[name]})
                else:
                    unknown.append(name)
            self.num_bytes = sum(s.nbytes for s in self.segments.values())
            self.db.execute("DELETE FROM owners WHERE hash NOT IN (SELECT hash FROM blocks)")
            return unknown

    def num_rows_without_files(self, on_disk: dict[str, int]) -> int:
        with self.lock:
            return sum(1 for (name,) in self.db.execute("SELECT name FROM segments") if name not in on_disk)

    def close(self) -> None:
        self.flush_touches()
        with self.lock:
            self.db.close()

    def _delete_rows(self, name: str) -> None:  # caller holds the lock
        self.db.execute("DELETE FROM segments WHERE name = ?", (name,))
        self.db.execute("DELETE FROM blocks WHERE segment = ?", (name,))
