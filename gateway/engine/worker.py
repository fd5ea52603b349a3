"""One dedicated thread runs the model; requests wait in a bounded queue; events flow back to asyncio.

    HTTP handler --submit()--> queue.Queue(max_queue) --> worker thread (ModelRunner)
         ^                                                       |
         +---- asyncio.Queue <-- loop.call_soon_threadsafe(event) +

A full queue raises QueueFull at once (the gateway answers 429). A job whose client went away is
cancelled: skipped if still queued, stopped between two model steps if running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from kvcache import TenantSalt

from .types import Sampling
from .caching import PrefixReport, VisionReport
from .prompt import PreparedPrompt
from .runner import Cancelled, ModelRunner
from .text import TextStream

log = logging.getLogger("strata.engine")


class QueueFull(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Started:
    num_prompt_tokens: int
    num_cached_tokens: int
    prefix: PrefixReport
    vision: VisionReport
    queue_ms: float
    vision_ms: float
    prefill_ms: float


@dataclass(frozen=True, slots=True)
class Delta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    num_completion_tokens: int
    decode_ms: float


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


Event = Started | Delta | Finished | Failed


@dataclass(slots=True)
class Job:
    prompt: PreparedPrompt
    sampling: Sampling
    salt: TenantSalt
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)

    def send(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass(slots=True)
class EngineStats:
    num_requests: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_rejected_full: int = 0


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    counters: EngineStats
    queue_depth: int
    busy: bool  # a job is on the model right now


class EngineWorker:
    def __init__(self, runner: ModelRunner, max_queue: int, prefill_chunk_tokens: int):
        self.runner = runner
        self.chunk_tokens = prefill_chunk_tokens
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.stats = EngineStats()
        self.busy = False  # a job is on the model right now
        self.current: Job | None = None  # that job, so that stop() can cancel it
        self.thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self.warmed_up = threading.Event()  # set once warm-up ended, well or not (warm_up_error says)
        self.warm_up_error: BaseException | None = None

    def start(self, warm_up_timeout_s: float = 600.0) -> None:
        """Start the thread and wait for its warm-up: a model that cannot run fails here, at start-up,
        with the reason, never on the first request."""
        self.thread.start()
        if not self.warmed_up.wait(warm_up_timeout_s):
            raise RuntimeError(f"engine warm-up did not finish within {warm_up_timeout_s:.0f} s")
        if self.warm_up_error is not None:
            raise RuntimeError(f"engine warm-up failed: {self.warm_up_error!r}") from self.warm_up_error

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Cancel the running job, fail the waiting ones, end the thread. True when it ended."""
        if self.current is not None:
            self.current.cancelled.set()
            self.current.send(Failed("server is shutting down"))
        while True:  # drop what waits, then wake the thread with the sentinel
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.send(Failed("server is shutting down"))
        self.jobs.put(None)
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def submit(self, prompt: PreparedPrompt, sampling: Sampling, salt: TenantSalt) -> Job:
        job = Job(prompt, sampling, salt, asyncio.get_running_loop())
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.stats.num_rejected_full += 1
            raise QueueFull() from None
        return job

    def snapshot(self) -> WorkerSnapshot:
        return WorkerSnapshot(replace(self.stats), self.jobs.qsize(), self.busy)

    async def events(self, job: Job) -> AsyncIterator[Event]:
        """The job's events until Finished or Failed. Leaving early (client gone) cancels the job."""
        try:
            while True:
                event = await job.events.get()
                yield event
                if isinstance(event, (Finished, Failed)):
                    return
        finally:
            job.cancelled.set()

    def _loop(self) -> None:
        try:
            self.runner.warm_up()
        except BaseException as exc:  # reported by start(); the thread ends, serving nothing
            self.warm_up_error = exc
            return
        finally:
            self.warmed_up.set()
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self.stats.num_cancelled += 1
                continue
            self.busy, self.current = True, job
            try:
                self._run(job)
            except Cancelled:
                self.stats.num_cancelled += 1
            except Exception as exc:  # the worker must survive any one request
                log.exception("generation failed")
                self.stats.num_failed += 1
                job.send(Failed(f"generation failed: {type(exc).__name__}"))
            finally:
                self.busy, self.current = False, None

    def _run(self, job: Job) -> None:
        self.stats.num_requests += 1
        queue_ms = (time.perf_counter() - job.enqueued_at) * 1000
        prefill = self.runner.prefill(job.prompt, job.salt, self.chunk_tokens, job.cancelled.is_set)
        generated: list[int] = []
        try:
            job.send(Started(job.prompt.num_tokens, prefill.prefix.num_cached_tokens, prefill.prefix, prefill.vision,
                             queue_ms, prefill.vision_ms, prefill.prefill_ms))
            self._decode(job, prefill, generated)
        finally:
            self.runner.finish(prefill, generated)

    def _decode(self, job: Job, prefill, generated: list[int]) -> None:
        start = time.perf_counter()
        text = TextStream(self.runner.tokenizer, job.sampling.stop)
        for token in self.runner.decode(prefill, job.sampling, job.cancelled.is_set):
            generated.append(token)
            if chunk := text.push(token):
                job.send(Delta(chunk))
            if text.stopped:
                break
        if tail := text.finish():
            job.send(Delta(tail))
        reason = "stop" if text.stopped or text.num_tokens < job.sampling.max_tokens else "length"
        job.send(Finished(reason, text.num_tokens, (time.perf_counter() - start) * 1000))
