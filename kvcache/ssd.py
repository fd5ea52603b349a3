"""The SSD tier: KV blocks evicted from RAM, kept as safetensors files that survive restarts.

    offer(block) -> bool        enqueue a spill (never blocks; a full queue drops and counts it)
    contains(hash) / read(hash) the request path: read + checksum-verify one block (bad: quarantined)
    reconcile()                 at start-up: temp leftovers removed, index fixed from the files
    drain(timeout_s) / close()  at shutdown: the writer finishes within a bounded time

Layout: ROOT/<namespace digest>/<hh>/<block hash>.safetensors, one file per block, and index.sqlite
(block hash -> file, size, last use), which reconcile() can rebuild from the files alone. The
namespace digest covers model fingerprint, block size and quantisation: another model's files are
never even looked at, and each file's metadata repeats the namespace, checked on every read.

Crash safety: a block is written to a temp file in its folder, fsynced, then os.replace()d into its
name, so a reader sees a whole file or none; a torn file can only be a temp file, and reconcile
deletes those. Every read verifies the SHA-256 of the tensor bytes; a mismatch is quarantined.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import sqlite3
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash
from safetensors.numpy import save as save_tensors

log = logging.getLogger("strata.kvcache.ssd")
FORMAT_VERSION = "1"


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """Which evicted blocks may be written (SSD wear is a budget, not free)."""

    min_hits: int = 1  # a block never reused in RAM is not worth a write
    min_prefix_tokens: int = 0  # only blocks whose end lies at least this deep in a prefix
    daily_write_bytes: int = 10 << 30  # stop spilling for the day past this


@dataclass(frozen=True, slots=True)
class SsdConfig:
    root: Path
    capacity_bytes: int = 20 << 30
    retention_s: float = 7 * 24 * 3600.0
    queue_blocks: int = 256
    admission: AdmissionPolicy = AdmissionPolicy()


@dataclass(slots=True)
class SsdStats:
    num_spilled: int = 0
    num_dropped_queue_full: int = 0
    num_not_admitted: int = 0
    num_write_errors: int = 0
    num_reads: int = 0
    num_read_bytes: int = 0
    num_quarantined: int = 0
    num_evicted_files: int = 0
    num_expired_files: int = 0
    num_temp_removed: int = 0
    num_reindexed: int = 0
    num_index_rows_dropped: int = 0


@dataclass(frozen=True, slots=True)
class SpillRequest:
    block_hash: bytes
    parent_hash: bytes
    num_tokens: int
    tenant_scope: str
    tensors: dict[str, np.ndarray] = field(repr=False)


@dataclass(slots=True)
class FileEntry:
    nbytes: int  # on disk
    kv_nbytes: int  # the tensors alone: what the block will take in RAM
    last_used: float


class SsdTier:
    def __init__(self, config: SsdConfig, namespace: str):
        self.config = config
        self.namespace = namespace
        self.folder = Path(config.root) / hashlib.sha256(namespace.encode()).hexdigest()[:16]
        self.quarantine = Path(config.root) / "quarantine"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stats = SsdStats()
        self.lock = threading.Lock()
        self.entries: dict[str, FileEntry] = {}  # hex hash -> entry; mirrors index.sqlite
        self.touched: set[str] = set()  # read since the index last heard of it
        self.num_bytes = 0
        self.written_today = (time.strftime("%Y-%m-%d"), 0)
        self.db = sqlite3.connect(str(self.folder / "index.sqlite"), check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS blocks (hash TEXT PRIMARY KEY, nbytes INTEGER, kv_nbytes INTEGER, "
                        "last_used REAL)")
        self.pending: queue.Queue[SpillRequest | None] = queue.Queue(maxsize=config.queue_blocks)
        self.readers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="strata-ssd-reader")
        self.writer = threading.Thread(target=self._write_loop, name="strata-ssd-writer", daemon=True)
        self.reconcile()
        self.writer.start()

    # -- spill (any thread; never blocks) ----------------------------------------------------

    def admits(self, num_hits: int, end_token: int) -> bool:
        policy = self.config.admission
        return num_hits >= policy.min_hits and end_token >= policy.min_prefix_tokens

    def offer(self, request: SpillRequest) -> bool:
        hex_hash = request.block_hash.hex()
        if self.contains(hex_hash):
            return True
        if not self._within_daily_budget():
            self.stats.num_not_admitted += 1
            return False
        try:
            self.pending.put_nowait(request)
        except queue.Full:
            self.stats.num_dropped_queue_full += 1
            return False
        return True

    def _within_daily_budget(self) -> bool:
        day, written = self.written_today
        if day != time.strftime("%Y-%m-%d"):
            self.written_today = (time.strftime("%Y-%m-%d"), 0)
            return True
        return written < self.config.admission.daily_write_bytes

    # -- read (engine thread) ----------------------------------------------------------------

    def contains(self, hex_hash: str) -> bool:
        with self.lock:
            return hex_hash in self.entries

    def ram_size_of(self, hex_hash: str) -> int | None:
        """Bytes the block will take in RAM once read (None: not on SSD)."""
        with self.lock:
            entry = self.entries.get(hex_hash)
        return entry.kv_nbytes if entry else None

    def read_chain(self, hex_hashes: list[str]) -> list[dict[str, np.ndarray]]:
        """Read consecutive blocks of one chain with several reads in flight (one small file at a
        time leaves the disk idle between requests); stops at the first missing or bad block."""
        results = list(self.readers.map(self.read, hex_hashes))
        good = []
        for tensors in results:
            if tensors is None:
                break
            good.append(tensors)
        return good

    def read(self, hex_hash: str) -> dict[str, np.ndarray] | None:
        """The block's tensors, checksum-verified; None (and quarantined) if the file is bad."""
        path = self._path(hex_hash)
        try:
            raw = path.read_bytes()
            tensors, meta = parse(raw)
        except Exception as exc:  # noqa: BLE001 - safetensors, JSON and OS errors alike mean unreadable
            self._quarantine(hex_hash, f"unreadable: {type(exc).__name__}")
            return None
        problem = self._check(meta, tensors, hex_hash)
        if problem:
            self._quarantine(hex_hash, problem)
            return None
        with self.lock:
            self.stats.num_reads += 1
            self.stats.num_read_bytes += len(raw)
        self._touch(hex_hash)
        return tensors

    def _check(self, meta: dict, tensors: dict[str, np.ndarray], hex_hash: str) -> str | None:
        if meta.get("format_version") != FORMAT_VERSION or meta.get("namespace") != self.namespace:
            return "another format or namespace"
        if meta.get("block_hash") != hex_hash:
            return "block hash mismatch"
        if meta.get("checksum") != tensor_checksum(tensors):
            return "checksum mismatch"
        return None

    # -- writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (request := self.pending.get()) is not None:
            try:
                self._write(request)
            except Exception as exc:  # noqa: BLE001 - a full or failing disk, or a bad block: count it, keep serving
                self.stats.num_write_errors += 1
                log.warning("SSD spill failed: %s: %s", type(exc).__name__, exc)
            finally:
                self.pending.task_done()
        self.pending.task_done()

    def _write(self, request: SpillRequest) -> None:
        hex_hash = request.block_hash.hex()
        metadata = {"format_version": FORMAT_VERSION, "namespace": self.namespace, "block_hash": hex_hash,
                    "parent_hash": request.parent_hash.hex(), "num_tokens": str(request.num_tokens),
                    "tenant_scope": request.tenant_scope, "checksum": tensor_checksum(request.tensors)}
        payload = save_tensors(request.tensors, metadata=metadata)
        path = self._path(hex_hash)
        path.parent.mkdir(exist_ok=True)
        temp = path.with_name(f".tmp-{uuid.uuid4().hex}")
        try:
            with open(temp, "wb") as out:
                out.write(payload)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        except OSError:
            temp.unlink(missing_ok=True)
            raise
        self._index(hex_hash, len(payload), sum(t.nbytes for t in request.tensors.values()))
        if self.pending.empty():
            self._flush_touches()
        day, written = self.written_today
        self.written_today = (day, written + len(payload))
        self.stats.num_spilled += 1
        self._enforce_capacity()

    # -- index -------------------------------------------------------------------------------

    def _index(self, hex_hash: str, nbytes: int, kv_nbytes: int, last_used: float | None = None) -> None:
        last_used = time.time() if last_used is None else last_used
        with self.lock:
            previous = self.entries.get(hex_hash)
            self.num_bytes += nbytes - (previous.nbytes if previous else 0)
            self.entries[hex_hash] = FileEntry(nbytes, kv_nbytes, last_used)
            self.db.execute("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)", (hex_hash, nbytes, kv_nbytes, last_used))

    def _touch(self, hex_hash: str) -> None:
        """LRU order lives in memory; the index learns it in batches (a read must not wait for a
        journal write). After a crash the LRU order is a little stale, never wrong about files."""
        with self.lock:
            if hex_hash in self.entries:
                self.entries[hex_hash].last_used = time.time()
                self.touched.add(hex_hash)

    def _flush_touches(self) -> None:
        with self.lock:
            rows = [(self.entries[h].last_used, h) for h in self.touched if h in self.entries]
            self.touched.clear()
            self.db.execute("BEGIN")
            self.db.executemany("UPDATE blocks SET last_used = ? WHERE hash = ?", rows)
            self.db.execute("COMMIT")

    def _forget(self, hex_hash: str) -> None:
        with self.lock:
            entry = self.entries.pop(hex_hash, None)
            if entry:
                self.num_bytes -= entry.nbytes
            self.db.execute("DELETE FROM blocks WHERE hash = ?", (hex_hash,))

    def _enforce_capacity(self, now: float | None = None) -> None:
        """LRU-evict files past the byte cap; remove files unused for longer than the retention."""
        now = time.time() if now is None else now
        with self.lock:
            by_age = sorted(self.entries.items(), key=lambda item: item[1].last_used)
        excess = self.num_bytes - self.config.capacity_bytes
        for hex_hash, entry in by_age:
            expired = now - entry.last_used > self.config.retention_s
            if not expired and excess <= 0:
                break
            self._forget(hex_hash)
            self._path(hex_hash).unlink(missing_ok=True)
            excess -= entry.nbytes
            if expired:
                self.stats.num_expired_files += 1
            else:
                self.stats.num_evicted_files += 1

    def _path(self, hex_hash: str) -> Path:
        return self.folder / hex_hash[:2] / f"{hex_hash}.safetensors"

    def _quarantine(self, hex_hash: str, why: str) -> None:
        self._forget(hex_hash)
        self._move_to_quarantine(self._path(hex_hash), why)

    def _move_to_quarantine(self, path: Path, why: str) -> None:
        self.stats.num_quarantined += 1
        log.warning("quarantined %s: %s", path.name, why)
        self.quarantine.mkdir(parents=True, exist_ok=True)
        if path.exists():
            shutil.move(str(path), str(self.quarantine / f"{path.name}.{uuid.uuid4().hex[:8]}"))

    # -- start-up and shutdown ---------------------------------------------------------------

    def reconcile(self) -> None:
        """Remove temp leftovers; drop index rows whose file is gone; index files the index lacks
        (verifying them first); quarantine what cannot be read or belongs elsewhere."""
        rows = {h: (n, kv, t) for h, n, kv, t in self.db.execute("SELECT hash, nbytes, kv_nbytes, last_used FROM blocks")}
        on_disk: dict[str, Path] = {}
        for path in self.folder.glob("*/*"):
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
                self.stats.num_temp_removed += 1
            elif path.suffix == ".safetensors":
                on_disk[path.stem] = path
        for hex_hash in set(rows) - set(on_disk):
            self.db.execute("DELETE FROM blocks WHERE hash = ?", (hex_hash,))
            self.stats.num_index_rows_dropped += 1
        for hex_hash, path in on_disk.items():
            if hex_hash in rows and rows[hex_hash][0] == path.stat().st_size:
                self.entries[hex_hash] = FileEntry(*rows[hex_hash])
            else:
                self._reindex(hex_hash, path)
        self.num_bytes = sum(e.nbytes for e in self.entries.values())

    def _reindex(self, hex_hash: str, path: Path) -> None:
        try:
            raw = path.read_bytes()
            tensors, meta = parse(raw)
            problem = self._check(meta, tensors, hex_hash)
        except Exception as exc:  # noqa: BLE001 - any unreadable file
            problem, raw, tensors = f"unreadable: {type(exc).__name__}", b"", {}
        if problem:
            self._move_to_quarantine(path, problem)
            return
        self._index(hex_hash, len(raw), sum(t.nbytes for t in tensors.values()), path.stat().st_mtime)
        self.stats.num_reindexed += 1

    def drain(self, timeout_s: float) -> bool:
        """Wait until queued spills are written, at most timeout_s. True when all were."""
        deadline = time.monotonic() + timeout_s
        while self.pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.pending.unfinished_tasks == 0

    def close(self, timeout_s: float = 10.0) -> None:
        self.drain(timeout_s)
        try:
            self.pending.put(None, timeout=1.0)
        except queue.Full:
            pass
        self.writer.join(timeout=1.0)
        self.readers.shutdown(wait=True)
        self._flush_touches()
        with self.lock:
            self.db.close()


def tensor_checksum(tensors: dict[str, np.ndarray]) -> str:
    """XXH3-128 over names, dtypes, shapes and bytes: it detects torn and flipped files at ~10 GB/s
    (SHA-256 took 8x longer per block read). It guards against corruption, not against an attacker
    who can write the data dir, who could rewrite the checksum as well."""
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "U32": np.uint32, "I32": np.int32, "U8": np.uint8}


def parse(raw: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """A safetensors file's tensors (zero-copy views of `raw`) and metadata; raises ValueError."""
    header_len = int.from_bytes(raw[:8], "little")
    if header_len <= 0 or 8 + header_len > len(raw):
        raise ValueError("bad safetensors header length")
    header = json.loads(raw[8:8 + header_len])
    metadata = header.pop("__metadata__", {})
    base, tensors = 8 + header_len, {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        begin, end = info["data_offsets"]
        if dtype is None or base + end > len(raw):
            raise ValueError(f"tensor {name} is truncated or of an unknown dtype")
        tensors[name] = np.frombuffer(raw, dtype=dtype, count=(end - begin) // np.dtype(dtype).itemsize,
                                      offset=base + begin).reshape(info["shape"])
    return tensors, metadata
