"""The threads engine workers run on (reused, never ended), and the helpers that take parts of a
step's attention and of its sampled draws to the other cores."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .worker import EngineWorker


class EngineThreads:
    """The threads engine workers run on, reused and never ended. MLX keeps compiled functions in a
    C++ thread-local cache whose destructor calls into Python when its thread exits; once the
    interpreter is shutting down that aborts the process ("terminate called without an active
    exception", seen about one exit in four). So a thread whose worker's loop ended waits for the
    next worker instead of exiting (a daemon: the process ends around it), holding no reference to
    the last one, so a stopped engine's model and caches are freed. Invariant: `num_idle` counts the
    threads waiting on `ready`; a worker is handed to one of them, or to a new thread when none waits,
    so the number of threads is the most engines ever running at once, not the number of loads."""

    def __init__(self) -> None:
        self.ready: queue.SimpleQueue[EngineWorker] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.num_idle = 0
        self.num_threads = 0

    def run(self, worker: EngineWorker) -> None:
        with self.lock:
            reuse = self.num_idle > 0
            if reuse:
                self.num_idle -= 1
            else:
                self.num_threads += 1
        if reuse:
            self.ready.put(worker)
        else:
            holder = [worker]
            threading.Thread(target=self._serve, args=(holder,), name="strata-engine", daemon=True).start()

    def _serve(self, holder: list[EngineWorker]) -> None:
        worker = holder.pop()
        while True:
            worker._run()
            del worker
            with self.lock:
                self.num_idle += 1
            worker = self.ready.get()


ENGINE_THREADS = EngineThreads()


# Work a step hands to the other cores: MLX's own CPU operations and the numpy and C code of attention
# run on the engine's thread alone, while OpenBLAS's threads wait between products. Below this many
# attention scores (rows x heads x queries x keys) a call is not split: attention alone on 2 cores,
# split against whole, read 0.97x at 76,800 scores and 1.35x at 153,600 (1.57x for 16 decode rows
# x 800 keys, 1.94x for 512 queries x 2,000 keys).
SPLIT_FROM_SCORES = 1 << 16
MAX_PARTS = 4

_switch = {"enabled": True}  # process-wide; only benchmarks turn it off


def use_split_rows(enabled: bool) -> None:
    _switch["enabled"] = enabled


def split_rows(work: Callable[[int, int], None], num_rows: int, num_scores: int) -> None:
    """Run `work(first, last)` over [0, num_rows) in contiguous parts, one per core this process may
    use (at most MAX_PARTS), the engine's thread taking the last; returns when all have run, and
    raises what any raised. Each part must write only its own rows' results."""
    split = _switch["enabled"] and num_scores >= SPLIT_FROM_SCORES
    parts = min(num_rows, _num_cores(), MAX_PARTS) if split else 1
    bounds = [num_rows * part // parts for part in range(parts + 1)]
    others = [_helpers().submit(work, bounds[part], bounds[part + 1]) for part in range(parts - 1)]
    try:
        work(bounds[-2], bounds[-1])
    finally:
        for other in others:
            other.result()


@cache
def _num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@cache
def _helpers() -> ThreadPoolExecutor:
    """Threads that take parts of a split call (engines in several threads share them: a part waits
    for a free one). They run numpy and C code only, never MLX (see EngineThreads on MLX's
    thread-local state); idle, they hold nothing."""
    return ThreadPoolExecutor(MAX_PARTS - 1, thread_name_prefix="strata-split")
