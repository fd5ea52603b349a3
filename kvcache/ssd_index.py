"""Which blocks the SSD tier holds, in which segment files, used when: memory, mirrored in SQLite.

Lock discipline: `lock` guards everything below it (the two maps, `num_bytes`, `touched` and the
SQLite connection); every method takes it for its whole body and none calls out while holding it.

Invariants: every block entry names a segment in `segments`, and every segment's blocks are in
`blocks` (unless a later segment took the block over); num_bytes == sum of the segments' sizes;
both maps mirror index.sqlite, except that recent reads reach its `last_used` column in batches.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from .segment import PRIVATE_FILE_MODE


@dataclass(slots=True)
class Segment:
    nbytes: int  # on disk
    last_used: float
    blocks: list[str]  # hex hashes, in file order


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
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_FILE_MODE))  # SQLite's -wal/-shm copy its mode
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS segments (name TEXT PRIMARY KEY, nbytes INTEGER, last_used REAL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS blocks (hash TEXT PRIMARY KEY, segment TEXT, kv_nbytes INTEGER)")

    # -- queries ------------------------------------------------------------------------------

    def contains(self, hex_hash: str) -> bool:
        with self.lock:
            return hex_hash in self.blocks

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

    def counts(self) -> tuple[int, int, int]:
        """(files, blocks, bytes) at one instant."""
        with self.lock:
            return len(self.segments), len(self.blocks), self.num_bytes

    # -- changes ------------------------------------------------------------------------------

    def add(self, name: str, nbytes: int, last_used: float, sizes: dict[str, int]) -> None:
        with self.lock:
            self.segments[name] = Segment(nbytes, last_used, list(sizes))
            self.num_bytes += nbytes
            self.blocks.update({h: BlockEntry(name, size) for h, size in sizes.items()})
            self.db.execute("BEGIN")
            self.db.execute("INSERT OR REPLACE INTO segments VALUES (?, ?, ?)", (name, nbytes, last_used))
            self.db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)",
                                [(h, name, size) for h, size in sizes.items()])
            self.db.execute("COMMIT")

    def forget(self, name: str) -> Segment | None:
        """Drop a segment and its block rows (from memory and the file); None if it was not indexed."""
        with self.lock:
            segment = self.segments.pop(name, None)
            if segment is not None:
                self.num_bytes -= segment.nbytes
                for hex_hash in segment.blocks:
                    if self.blocks.get(hex_hash, BlockEntry("", 0)).segment == name:
                        del self.blocks[hex_hash]
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
            indexed = {n: (size, used) for n, size, used in
                       self.db.execute("SELECT name, nbytes, last_used FROM segments")}
            rows: dict[str, dict[str, int]] = {}
            for hex_hash, name, size in self.db.execute("SELECT hash, segment, kv_nbytes FROM blocks"):
                rows.setdefault(name, {})[hex_hash] = size
            for name in set(indexed) - set(on_disk):
                self._delete_rows(name)
            unknown = []
            for name, size in on_disk.items():
                if name in indexed and indexed[name][0] == size and name in rows:
                    self.segments[name] = Segment(size, indexed[name][1], list(rows[name]))
                    self.blocks.update({h: BlockEntry(name, s) for h, s in rows[name].items()})
                else:
                    unknown.append(name)
            self.num_bytes = sum(s.nbytes for s in self.segments.values())
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
