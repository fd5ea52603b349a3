"""The threads engine workers run on: reused, never ended."""

from __future__ import annotations

import queue
import threading
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
