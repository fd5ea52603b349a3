"""The SSD tier: KV blocks evicted from RAM, kept in safetensors files that survive restarts.

    offer(block) -> bool          enqueue a spill (never blocks; a full queue drops and counts it)
    contains / ram_size_of(hash)  what is on SSD, and what it will cost in RAM
    read_chain([hash, ...])       the request path: consecutive blocks, each checksum-verified;
                                  stops at the first missing or bad one (bad files: quarantined)
    reconcile()                   at start-up: temp leftovers and doomed files removed, index fixed from the files
    refresh()                     a shared folder: take in the segments other writers wrote or deleted
    purge_owned(selects)          take owners off blocks; blocks left with none are cut out of their files
    pin(scope, blocks, until)     keep blocks' segments past LRU and retention until then (a budget per scope)
    ghost(hash)                   why a block recently left the tier ("evicted" / "expired" / "purged")
    drain(timeout_s) / close()    at shutdown: the writer finishes within a bounded time

Layout: ROOT/<namespace digest>/<xx>/seg-<id>.safetensors — a segment file holds up to
SEGMENT_BLOCKS blocks that were spilled together (a chain persisted at shutdown, or a burst of
evictions), and index.sqlite maps block hash -> segment, which reconcile() rebuilds from the files
alone. One file per block was measured first: 128 KiB files read at 3.2x below the disk's
sequential speed however many reads were in flight (evals/bench_ssd); segments of 16 blocks
(2 MiB on the demo model) bring the whole read path within 2x. The namespace digest covers model
fingerprint, block size and quantisation: another model's files are never even looked at, and each
file's metadata repeats the namespace, checked on every read.

Ownership: each block records opaque owner labels (in the index, and in the file for reindexing).
A purge takes the selected owners off; a segment holding blocks left with no owner is rewritten
without them (the survivors go to a new segment first) and its file deleted. The old segment is
marked doomed in the same index transaction that drops it, so a crash before the unlink cannot bring
the purged blocks back: reconcile deletes doomed files before it indexes anything.

Crash safety: a segment is written to a temp file in its folder, fsynced, then os.replace()d into
its name, so a reader sees a whole file or none; a torn file can only be a temp file, and reconcile
deletes those. Every block read verifies its XXH3-128 checksum; a mismatch quarantines the file.

Several writers (a folder shared by replicas: `SsdConfig.writer` names this one). Segment files are
written to a temp name and renamed, under names no other writer can pick (a random 128-bit id), so
writers never touch one file at once. Each writer keeps its own index (`index-<writer>.sqlite`: no
index is ever written by two processes) and appends one line per segment it writes ("+seg-...") or
deletes ("-seg-...") to its own journal (`journal-<writer>.log`, O_APPEND, one write per line); the
others read each journal from where they stopped (`refresh`: when a lookup's chain stops short on
SSD, and before a purge) and index the new segments from their headers alone (blocks are verified
when read, as always). A segment another writer deleted reads as missing, which forgets it (never a
quarantine). reconcile() leaves temp files younger than TEMP_STALE_S alone (another writer may be
mid-write), and starts this writer's journal afresh: the others' folder scans cover what it said
before. Capacity and retention bound the folder as a whole; every writer enforces them on the
segments it knows, deleting others' files as well as its own (and saying so in its journal).

Parts: `segment.py` is the file format (pure functions), `ssd_index.py` the index (its own lock);
this module is the tier: the writer thread, admission and the daily budget, capacity and retention,
quarantine and reconcile. Lock discipline here: `lock` guards `stats`, `written_today`, `ghosts`
and `pins`; the index guards itself; the two are never held together. `journal_lock` guards
`journals` (the others' journals read so far) for refresh(). `files_lock` serialises the
writer's segment writes and capacity deletions with a purge's rewrites (never taken under `lock`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .pool import Block, Ghost, Ghosts, Purged
from .sealing import Sealer
from .segment import (
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    SEGMENT_BLOCKS,
    TEMP_PREFIX,
    SpillRequest,
    decode,
    describe,
    described_owners,
    encode,
    plain_nbytes,
    seal,
    unseal,
    verified_blocks,
    write_atomically,
)
from .ssd_index import Segment, SegmentIndex

log = logging.getLogger("strata.kvcache.ssd")
READER_THREADS = 4  # segment reads in flight at once while a chain is promoted
PURGE_DRAIN_S = 10.0  # a purge first lets queued spills land, so none reappears after it
TEMP_STALE_S = 600.0  # in a shared folder, a younger temp file may be another writer's, mid-write
JOURNAL_PREFIX = "journal-"

__all__ = [
    "AdmissionPolicy",
    "Purged",
    "ReuseMeter",
    "SpillRequest",
    "SsdConfig",
    "SsdSnapshot",
    "SsdStats",
    "SsdTier",
    "segments_to_remove",
    "spill_admits",
]


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """Which evicted blocks may be written (SSD wear is a budget, not free)."""

    min_hits: int = 1  # a block never reused in RAM is not worth a write
    min_prefix_tokens: int = 0  # only blocks whose end lies at least this deep in a prefix
    daily_write_bytes: int = 10 << 30  # stop spilling for the day past this
    measured: bool = True  # once there is evidence, measured reuse (ReuseMeter) decides instead of min_hits

    def admits(self, num_hits: int, end_token: int, worth: bool | None = None) -> bool:
        """Whether an evicted block is worth a write (the daily budget aside). `worth`: what the
        measured reuse of blocks evicted with as many hits says (ReuseMeter); None: min_hits decides."""
        enough = num_hits >= self.min_hits if worth is None or not self.measured else worth
        return enough and end_token >= self.min_prefix_tokens


REUSE_WORTH = 0.2  # evicted blocks of a class asked for again this often (or more) are worth writing
REUSE_EVIDENCE = 200  # evictions of a class before its measured rate decides
REUSE_WINDOW = 20_000  # evictions of a class after which its counts are halved (traffic changes)
PENDING_BLOCKS = 65_536  # evicted blocks watched for a second ask (oldest forgotten first)


class ReuseMeter:
    """How often blocks evicted from RAM are asked for again, by their hits at eviction (0, 1, 2 or
    more): the SSD admission rule from measurement rather than a fixed min_hits. A conversation's
    blocks, evicted before its next turn with no hit yet, are asked for again; a scan's never are.
    Invariant: reused[c] <= evicted[c]; `pending` holds at most PENDING_BLOCKS evicted blocks."""

    def __init__(self) -> None:
        self.evicted, self.reused = [0, 0, 0], [0, 0, 0]
        self.pending: OrderedDict[bytes, int] = OrderedDict()

    def evicted_block(self, block_hash: bytes, num_hits: int) -> None:
        kind = min(num_hits, 2)
        self.evicted[kind] += 1
        if self.evicted[kind] > REUSE_WINDOW:
            self.evicted[kind], self.reused[kind] = self.evicted[kind] // 2, self.reused[kind] // 2
        self.pending[block_hash] = kind
        if len(self.pending) > PENDING_BLOCKS:
            self.pending.popitem(last=False)

    def asked_again(self, block_hash: bytes) -> None:
        kind = self.pending.pop(block_hash, None)
        if kind is not None:
            self.reused[kind] += 1

    def worth(self, num_hits: int) -> bool | None:
        """Whether blocks evicted with this many hits are asked for again often enough (None: too
        little evidence yet)."""
        kind = min(num_hits, 2)
        if self.evicted[kind] < REUSE_EVIDENCE:
            return None
        return self.reused[kind] >= REUSE_WORTH * self.evicted[kind]


def spill_admits(policy: AdmissionPolicy, reuse: ReuseMeter | None, block: Block) -> bool:
    """The rule for a block RAM evicts: the meter (when there is one) records the eviction, then the
    policy judges the block with the measured worth of its class. PrefixCache spills by it, and the
    cache simulator (evals.cache_sim) replays it."""
    worth = None
    if reuse is not None:
        reuse.evicted_block(block.block_hash, block.num_hits)
        worth = reuse.worth(block.num_hits)
    return policy.admits(block.num_hits, block.end_token, worth)


def segments_to_remove(
    index: SegmentIndex, capacity_bytes: int, retention_s: float, pinned: set[str], now: float
) -> list[tuple[str, str]]:
    """The tier's capacity rule: segments least recently read first, each "expired" (unread past
    retention_s) or "evicted" (while the segments exceed capacity_bytes), never a pinned one. The
    cache simulator (evals.cache_sim) runs the same rule over the same index."""
    excess = index.counts()[2] - capacity_bytes
    removed = []
    for name, segment in index.least_recently_used():
        if name in pinned:
            continue
        expired = now - segment.last_used > retention_s
        if not expired and excess <= 0:
            break
        removed.append((name, "expired" if expired else "evicted"))
        excess -= segment.nbytes
    return removed


# What every tenant's pins may hold together, of the tier's capacity. Pins are counted by their blocks'
# bytes, and a segment is kept whole while one of its blocks is pinned: half leaves room for the segments'
# other blocks, and for the unpinned traffic.
PINNED_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class SsdConfig:
    root: Path
    capacity_bytes: int = 20 << 30
    retention_s: float = 7 * 24 * 3600.0
    queue_blocks: int = 256
    admission: AdmissionPolicy = AdmissionPolicy()
    writer: str = ""  # this process's name among the writers of a shared root ("": the only writer)
    pin_budget_bytes: int = 0  # what one tenant may pin on this tier (0: no pins); all together at most PINNED_SHARE
    sealer: Sealer | None = None  # seals each block under its tenant's key on the writer thread (None: plain)


@dataclass(slots=True)
class SsdStats:
    num_spilled: int = 0  # blocks written
    num_segments_written: int = 0
    num_dropped_queue_full: int = 0
    num_not_admitted: int = 0
    num_write_errors: int = 0
    num_reads: int = 0  # blocks read and verified
    num_read_bytes: int = 0
    num_quarantined: int = 0  # files
    num_evicted_files: int = 0
    num_expired_files: int = 0
    num_temp_removed: int = 0
    num_reindexed: int = 0  # files the index lacked, verified and indexed from their contents
    num_index_rows_dropped: int = 0
    num_purged_blocks: int = 0  # blocks whose last owner a purge removed (cut out of their files)
    num_rewritten_files: int = 0  # segments rewritten without purged blocks
    num_foreign_indexed: int = 0  # segments other writers of a shared folder wrote, taken in by refresh()
    num_vanished: int = 0  # segments gone when read (another writer deleted them): forgotten
    num_unreadable: int = 0  # sealed blocks that did not open (their tenant's key was shredded): misses


@dataclass(frozen=True, slots=True)
class SsdSnapshot:
    """The tier at one instant, for operators: counters plus what it holds."""

    counters: SsdStats
    num_files: int
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    written_today_bytes: int
    queue_depth: int


class SsdTier:
    """Cache protocol: `name`, `stats()`, `purge()`, `close()` (any thread)."""

    name = "ssd"

    def __init__(self, config: SsdConfig, namespace: str):
        self.config = config
        self.namespace = namespace
        self.folder = Path(config.root) / hashlib.sha256(namespace.encode()).hexdigest()[:16]
        self.quarantine = Path(config.root) / "quarantine"
        self.folder.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        self.lock = threading.Lock()  # guards stats and written_today
        self.counters = SsdStats()
        self.written_today = (time.strftime("%Y-%m-%d"), 0)
        self.ghosts: Ghosts[str] = Ghosts()  # blocks that left the tier, by hex hash
        self.files_lock = threading.Lock()
        self.index = SegmentIndex(self.folder / (f"index-{config.writer}.sqlite" if config.writer else "index.sqlite"))
        self.journal_lock = threading.Lock()
        self.journals: dict[str, tuple[int, int]] = {}  # another writer's journal -> (inode, bytes taken in)
        # Pins (OpenAI prompt_cache_retention "24h"), under `lock`: block -> (tenant, bytes, until: time.time());
        # a segment holding a pinned block is neither evicted nor expired. Kept in memory: a restart ends them.
        # Invariant: a tenant's live pins hold at most pin_budget_bytes, all of them at most PINNED_SHARE of
        # the capacity (a pinned segment may hold other blocks too: the rest of the capacity has room for them).
        self.pins: dict[str, tuple[str, int, float]] = {}
        self.pending: queue.Queue[SpillRequest | None] = queue.Queue(maxsize=config.queue_blocks)
        self.readers = ThreadPoolExecutor(max_workers=READER_THREADS, thread_name_prefix="strata-ssd-reader")
        self.writer = threading.Thread(target=self._write_loop, name="strata-ssd-writer", daemon=True)
        self.reconcile()
        self.writer.start()

    def stats(self) -> SsdSnapshot:
        num_files, num_blocks, num_bytes = self.index.counts()
        with self.lock:
            counters = replace(self.counters)
            written = self.written_today[1]
        return SsdSnapshot(
            counters, num_files, num_blocks, num_bytes, self.config.capacity_bytes, written, self.pending.qsize()
        )

    def purge(self) -> Purged:
        """Every segment file and its index rows, after the spills already queued are written."""
        self.drain(PURGE_DRAIN_S)
        self.refresh()
        num_files, num_blocks, num_bytes = 0, 0, 0
        with self.files_lock:
            with self.lock:
                self.pins = {}
            for name, _ in self.index.least_recently_used():
                if (segment := self._delete_segment(name, "purged")) is not None:
                    num_files, num_blocks, num_bytes = (
                        num_files + 1,
                        num_blocks + len(segment.blocks),
                        num_bytes + segment.nbytes,
                    )
        return Purged(num_blocks, num_bytes, num_files)

    def purge_owned(self, selects: Callable[[str], bool]) -> Purged:
        """Take the selected owners off every block (after queued spills land); blocks left with no
        owner are cut out of their segments. Counts blocks, their bytes, and the files replaced."""
        self.drain(PURGE_DRAIN_S)
        self.refresh()
        num_blocks, num_bytes, num_files = 0, 0, 0
        with self.files_lock:
            for name, dropped in self.index.release(selects).items():
                num_bytes += sum(self.index.kv_nbytes(h) or 0 for h in dropped)
                self._rewrite_without(name, set(dropped))
                num_blocks, num_files = num_blocks + len(dropped), num_files + 1
                self._unpin(dropped)
        self._count("num_purged_blocks", num_blocks)
        return Purged(num_blocks, num_bytes, num_files)

    def _rewrite_without(self, name: str, dropped: set[str]) -> None:
        """Segment `name` without the `dropped` blocks. The old segment is doomed before anything is
        written: a crash at any point loses survivors (a cache may), never brings a dropped block back."""
        keep = [h for h in self.index.live_blocks(name) if h not in dropped]
        survivors = [
            replace(r, owners=tuple(sorted(self.index.owners_of(r.block_hash.hex()))))
            for r in (self._read_blocks(name, keep) if keep else [])
        ]
        old = self.index.doom(name)
        if survivors:
            try:
                self._new_segment(survivors, old.written_at if old else time.time())
            except OSError as exc:  # a full or failing disk: the survivors are lost, the purge still holds
                self._count("num_write_errors")
                log.warning("SSD purge could not rewrite %s: %s", name, exc)
            else:
                self._count("num_rewritten_files")
        self._segment_path(name).unlink(missing_ok=True)
        self._journal(f"-{name}")
        self.index.undoom(name)
        self._remember(old, "purged", dropped)

    def _read_blocks(self, name: str, hex_hashes: list[str]) -> list[SpillRequest]:
        try:
            blocks, _ = decode(self._segment_path(name).read_bytes(), self.namespace, hex_hashes)
        except OSError:
            return []  # unreadable: the survivors go with it
        return blocks

    def owners_of(self, hex_hash: str) -> frozenset[str]:
        return self.index.owners_of(hex_hash)

    def ghost(self, hex_hash: str) -> Ghost | None:
        with self.lock:
            return self.ghosts.get(hex_hash)

    def _remember(self, segment: Segment | None, how: str, hex_hashes) -> None:
        now = time.time()
        ghost = Ghost(how, now - segment.written_at if segment is not None else 0.0, now)
        with self.lock:
            for hex_hash in hex_hashes:
                self.ghosts.remember(hex_hash, ghost)

    def _count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            setattr(self.counters, name, getattr(self.counters, name) + amount)

    # -- spill (any thread; never blocks) ----------------------------------------------------

    def admits(self, num_hits: int, end_token: int, worth: bool | None = None) -> bool:
        """Whether a block is worth a write (a pure test: `refused` counts a refusal)."""
        return self.config.admission.admits(num_hits, end_token, worth)

    def refused(self) -> None:
        """An evicted block was not admitted (counted under the tier's lock)."""
        self._count("num_not_admitted")

    def offer(self, request: SpillRequest) -> bool:
        if self.contains(request.block_hash.hex()):
            self.index.own(request.block_hash.hex(), request.owners)
            return True
        if not self._within_daily_budget():
            self._count("num_not_admitted")
            return False
        try:
            self.pending.put_nowait(request)
        except queue.Full:
            self._count("num_dropped_queue_full")
            return False
        return True

    def pin(self, tenant: str, blocks: list[tuple[str, int]], until: float) -> int:
        """Pin (hex hash, bytes) blocks until `until` (time.time()) within the tenant's pin budget and
        every tenant's pins within PINNED_SHARE of the capacity, in order, stopping at the first that
        does not fit; how many were pinned."""
        with self.lock:
            now = time.time()
            live = [(owner, nbytes) for owner, nbytes, end in self.pins.values() if end > now]
            used = sum(nbytes for owner, nbytes in live if owner == tenant)
            total = sum(nbytes for _, nbytes in live)
            room = min(self.config.pin_budget_bytes - used, int(self.config.capacity_bytes * PINNED_SHARE) - total)
            pinned = 0
            for hex_hash, nbytes in blocks:
                if hex_hash in self.pins:
                    owner, held, end = self.pins[hex_hash]
                    self.pins[hex_hash] = (owner, held, max(end, until))
                elif nbytes > room:
                    break
                else:
                    self.pins[hex_hash] = (tenant, nbytes, until)
                    room -= nbytes
                pinned += 1
            return pinned

    def _unpin(self, hex_hashes: list[str]) -> None:
        """Purged blocks' pins end with them (they no longer spend their scope's budget)."""
        with self.lock:
            for hex_hash in hex_hashes:
                self.pins.pop(hex_hash, None)

    def _pinned_segments(self, now: float) -> set[str]:
        """Segments holding a block pinned past `now`; pins that ended are dropped."""
        with self.lock:
            self.pins = {h: pin for h, pin in self.pins.items() if pin[2] > now}
            pinned = list(self.pins)
        return {name for name in self.index.segments_of(pinned) if name is not None}

    def _within_daily_budget(self) -> bool:
        today = time.strftime("%Y-%m-%d")
        with self.lock:
            if self.written_today[0] != today:
                self.written_today = (today, 0)
            return self.written_today[1] < self.config.admission.daily_write_bytes

    # -- read (engine thread) ----------------------------------------------------------------

    def contains(self, hex_hash: str) -> bool:
        return self.index.contains(hex_hash)

    def ram_size_of(self, hex_hash: str) -> int | None:
        """Bytes the block will take in RAM once read (None: not on SSD)."""
        return self.index.kv_nbytes(hex_hash)

    def read_chain(self, hex_hashes: list[str]) -> list[dict[str, np.ndarray]]:
        """Verified tensors of consecutive blocks, each segment read and verified once, several in
        flight; stops at the first block that is missing, unreadable or fails its checksum."""
        wanted: dict[str, list[str]] = {}
        for hex_hash, name in zip(hex_hashes, self.index.segments_of(hex_hashes)):
            if name is None:
                break
            wanted.setdefault(name, []).append(hex_hash)
        verified: dict[str, dict[str, np.ndarray]] = {}
        for blocks in self.readers.map(self._load_segment, wanted, wanted.values()):
            verified.update(blocks)
        good = []
        for hex_hash in hex_hashes:
            if hex_hash not in verified:
                break
            good.append(verified[hex_hash])
        return good

    def _load_segment(self, name: str, hex_hashes: list[str]) -> dict[str, dict[str, np.ndarray]]:
        """The wanted blocks of one segment file, verified; the good ones before a bad one."""
        try:
            raw = self._segment_path(name).read_bytes()
        except FileNotFoundError:  # another writer of a shared folder deleted it
            self.index.forget(name)
            self._count("num_vanished")
            return {}
        except OSError as exc:
            self._quarantine(name, f"unreadable: {type(exc).__name__}")
            return {}
        good, problem = verified_blocks(raw, self.namespace, hex_hashes)
        if problem:
            self._quarantine(name, problem)
        if self.config.sealer is not None:
            good, refused = unseal(self.config.sealer, self.namespace, raw, good)
            if refused:  # a key gone is not a damaged file: the block reads as a miss
                self._count("num_unreadable")
                log.debug("sealed block of %s not opened: %s", name, refused)
        self._count("num_reads", len(good))
        self._count("num_read_bytes", sum(t.nbytes for block in good.values() for t in block.values()))
        self.index.touch(name, time.time())
        return good

    # -- writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        running = True
        while running:
            batch = [self.pending.get()]
            while len(batch) < SEGMENT_BLOCKS and batch[-1] is not None:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            running = batch[-1] is not None
            unique = {r.block_hash: r for r in batch if r is not None and not self.contains(r.block_hash.hex())}
            try:
                if unique:
                    self._write_segment(list(unique.values()))
            except Exception as exc:  # noqa: BLE001 - a full or failing disk, or a bad block: count it, keep serving
                self._count("num_write_errors")
                log.warning("SSD spill failed: %s: %s", type(exc).__name__, exc)
            finally:
                for _ in batch:
                    self.pending.task_done()

    def _write_segment(self, requests: list[SpillRequest]) -> None:
        if self.config.sealer is not None:
            requests = [r if r.layout else seal(self.config.sealer, self.namespace, r) for r in requests]
        with self.files_lock:
            nbytes = self._new_segment(requests, time.time())
            self._enforce_capacity()
        with self.lock:
            day, written = self.written_today
            self.written_today = (day, written + nbytes)
            self.counters.num_spilled += len(requests)
            self.counters.num_segments_written += 1
        if self.pending.empty():
            self.index.flush_touches()

    def _new_segment(self, requests: list[SpillRequest], written_at: float) -> int:
        """Write the blocks to a new segment file and index it, with their owners: its bytes on disk
        (the caller holds files_lock; OSError when the disk refuses, leaving no file behind)."""
        name = f"seg-{uuid.uuid4().hex}"
        payload = encode(self.namespace, requests)
        write_atomically(self._segment_path(name), payload)
        sizes = {r.block_hash.hex(): plain_nbytes(r) for r in requests}
        self.index.add(name, len(payload), written_at, sizes, {r.block_hash.hex(): r.owners for r in requests})
        self._journal(f"+{name}")
        return len(payload)

    def _enforce_capacity(self, now: float | None = None) -> None:
        """Remove the segments capacity and retention rule out (the caller holds files_lock)."""
        now = time.time() if now is None else now
        capacity, retention = self.config.capacity_bytes, self.config.retention_s
        for name, how in segments_to_remove(self.index, capacity, retention, self._pinned_segments(now), now):
            self._delete_segment(name, how)
            self._count("num_expired_files" if how == "expired" else "num_evicted_files")

    def _delete_segment(self, name: str, how: str) -> Segment | None:
        """A segment out of the index and off the disk; what the index held of it (None: nothing)."""
        live = self.index.live_blocks(name)
        segment = self.index.forget(name)
        self._segment_path(name).unlink(missing_ok=True)
        self._journal(f"-{name}")
        self._remember(segment, how, live)
        return segment

    def _segment_path(self, name: str) -> Path:
        return self.folder / name[4:6] / f"{name}.safetensors"

    def _quarantine(self, name: str, why: str) -> None:
        self.index.forget(name)
        self._move_to_quarantine(self._segment_path(name), why)
        self._journal(f"-{name}")

    def _move_to_quarantine(self, path: Path, why: str) -> None:
        self._count("num_quarantined")
        log.warning("quarantined %s: %s", path.name, why)
        self.quarantine.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        if path.exists():
            shutil.move(str(path), str(self.quarantine / f"{path.name}.{uuid.uuid4().hex[:8]}"))

    # -- start-up and shutdown ---------------------------------------------------------------

    def reconcile(self) -> None:
        """Remove temp leftovers; drop index rows whose file is gone; index files the index lacks
        (verifying them first); quarantine what cannot be read or belongs elsewhere."""
        for name in self.index.doomed():  # purged blocks: their file must not be indexed again
            self._segment_path(name).unlink(missing_ok=True)
            self.index.undoom(name)
        self._start_journal()
        on_disk: dict[str, Path] = {}
        for path in self.folder.glob("*/*"):
            if path.name.startswith(TEMP_PREFIX):
                if self._stale_temp(path):
                    path.unlink(missing_ok=True)
                    self._count("num_temp_removed")
            elif path.suffix == ".safetensors":
                on_disk[path.stem] = path
        sizes = {name: path.stat().st_size for name, path in on_disk.items()}
        self._count("num_index_rows_dropped", self.index.num_rows_without_files(sizes))
        for name in self.index.load(sizes):
            self._reindex(name, on_disk[name])

    def _stale_temp(self, path: Path) -> bool:
        """A temp file no writer is still writing: any, for the only writer; in a shared folder, old ones."""
        if not self.config.writer:
            return True
        try:
            return time.time() - path.stat().st_mtime > TEMP_STALE_S
        except FileNotFoundError:
            return False

    # -- a folder shared by several writers --------------------------------------------------

    def refresh(self) -> int:
        """Take in the segments the other writers of a shared folder wrote or deleted since the last
        call, from their journals; returns how many were indexed. Cheap when nothing changed: a
        listing of the folder's top level and one stat per other writer."""
        if not self.config.writer:
            return 0
        found = []
        with self.journal_lock:
            for path in self.folder.glob(f"{JOURNAL_PREFIX}*.log"):
                if path.name == self._journal_path().name:
                    continue
                for line in self._news(path):
                    if line.startswith("-"):
                        self.index.forget(line[1:])
                    elif line.startswith("+") and not self.index.has_segment(line[1:]):
                        found.append(self._described(line[1:]))
        segments = [segment for segment in found if segment is not None]
        if segments:
            self.index.add_all(segments)
        self._count("num_foreign_indexed", len(segments))
        return len(segments)

    def _news(self, path: Path) -> list[str]:
        """The complete lines another writer's journal gained since the last read (the caller holds
        journal_lock). A journal with a new inode or fewer bytes was started afresh: read it whole."""
        try:
            status = path.stat()
        except FileNotFoundError:
            return []
        inode, offset = self.journals.get(path.name, (status.st_ino, 0))
        if inode != status.st_ino or status.st_size < offset:
            offset = 0
        if status.st_size == offset:
            self.journals[path.name] = (status.st_ino, offset)
            return []
        with open(path, "rb") as journal:
            journal.seek(offset)
            data = journal.read(status.st_size - offset)
        complete = data[: data.rfind(b"\n") + 1]  # a line being appended is read next time
        self.journals[path.name] = (status.st_ino, offset + len(complete))
        return complete.decode(errors="replace").split()

    def _described(self, name: str) -> tuple | None:
        """Another writer's segment as the index takes it in, from its header; None when it is gone
        or not of this namespace."""
        path = self._segment_path(name)
        described = describe(path, self.namespace)
        try:
            return (name, path.stat().st_size, time.time(), *described) if described is not None else None
        except FileNotFoundError:
            return None

    def _journal(self, line: str) -> None:
        """Tell the other writers of a shared folder: "+name" written, "-name" deleted. One write()
        of one short line with O_APPEND: lines from one writer never interleave."""
        if not self.config.writer:
            return
        try:
            fd = os.open(self._journal_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE_MODE)
            try:
                os.write(fd, f"{line}\n".encode())
            finally:
                os.close(fd)
        except OSError as exc:  # the others then learn of it at their next start-up's folder scan
            log.warning("SSD journal not written: %s", exc)

    def _start_journal(self) -> None:
        """At start-up: this writer's journal begins empty (the others re-read a new inode whole), and
        the others' are taken as read (the folder scan that follows covers what they said)."""
        if not self.config.writer:
            return
        write_atomically(self._journal_path(), b"")
        with self.journal_lock:
            for path in self.folder.glob(f"{JOURNAL_PREFIX}*.log"):
                try:
                    status = path.stat()
                except FileNotFoundError:
                    continue
                self.journals[path.name] = (status.st_ino, status.st_size)

    def _journal_path(self) -> Path:
        return self.folder / f"{JOURNAL_PREFIX}{self.config.writer}.log"

    def _reindex(self, name: str, path: Path) -> None:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            self._move_to_quarantine(path, f"unreadable: {type(exc).__name__}")
            return
        blocks, problem = verified_blocks(raw, self.namespace)
        if problem:
            self._move_to_quarantine(path, problem)
            return
        sizes = {h: sum(t.nbytes for t in tensors.values()) for h, tensors in blocks.items()}
        self.index.add(name, len(raw), path.stat().st_mtime, sizes, described_owners(raw))
        self._count("num_reindexed")

    def read_s_per_byte(self, probe_bytes: int = 8 << 20) -> float:
        """Seconds per byte of reading a file of this folder from the disk (written, dropped from the
        page cache, read back, removed): what a restore costs here, measured once at start-up."""
        probe = self.folder / f"{TEMP_PREFIX}read-probe-{uuid.uuid4().hex}"
        try:
            write_atomically(probe, os.urandom(probe_bytes))
            fd = os.open(probe, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                started = time.perf_counter()
                while os.read(fd, 1 << 20):
                    pass
                return (time.perf_counter() - started) / probe_bytes
            finally:
                os.close(fd)
        finally:
            probe.unlink(missing_ok=True)

    def drain(self, timeout_s: float) -> bool:
        """Wait until queued spills are written, at most timeout_s. True when all were."""
        deadline = time.monotonic() + timeout_s
        while self.pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.pending.unfinished_tasks == 0

    def close(self, timeout_s: float = 10.0) -> None:
        self.drain(timeout_s)
        with contextlib.suppress(queue.Full):
            self.pending.put(None, timeout=1.0)
        self.writer.join(timeout=1.0)
        self.readers.shutdown(wait=True)
        self.index.close()
