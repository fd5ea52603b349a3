"""One dedicated thread runs the model; requests wait in a bounded queue; events flow back to asyncio.

    HTTP handler --submit()--> FairQueue(max_queue) --> worker thread: Scheduler -> step plan
         ^                                                    |        ModelRunner, DecodeBatch
         +---- asyncio.Queue <-- loop.call_soon_threadsafe(event) +

Each pass of the loop: give each decoding row its drafts (speculative decoding,
gateway/engine/speculative.py); ask the scheduler (gateway/engine/scheduler.py: fair queue, memory
budget, token budget) for the next step; the step executor (gateway/engine/steps.py, the
scheduler's executor) runs it as one model call: the decode rows' tokens (and drafts) and the chunks
of prompts coming in (several at once) packed together (gateway/engine/mixed.py); then every row's
next tokens are drawn (one evaluation for the batch), keeping the drafts the draws confirm, their
text sent and the sequences that ended retired (their prompt and reply blocks are stored for the next
turn). A prompt whose last chunk ran joins the decode batch; its first token is drawn at the start of
the next pass. This file keeps the thread: the queue, the loop, calls between steps, embeddings,
health and the counters. A full queue raises QueueFull at once (the gateway answers 429). A job
whose client went away is cancelled: skipped if still queued, dropped at the next step if running.

Memory: a sequence holds KV for its prompt and grows a block at a time; when the budget runs out the
scheduler preempts the newest sequence, whose KV the worker stores as cached prefix blocks, and
resumes it later from them. A job that could not fit even in an empty budget (prompt + max_tokens)
is refused at submit (OverBudget). The left padding of the shared batch cache is not counted.

The caches belong to this thread: other threads reach them through call() (a purge runs between
two steps).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from kvcache import TenantSalt

from .caching import EngineCaches
from .decoding import DecodeRows
from .fair_queue import FairQueue, QueueFull
from .jobs import (
    ENDINGS,
    Embedded,
    EmbedJob,
    EngineStopped,
    Event,
    Failed,
    Job,
    OverBudget,
)
from .prompt import PreparedPrompt
from .runner import Cancelled, ModelRunner
from .scheduler import ALONE_STEP_TOKENS, Limits, Scheduler, Sequence, StepPlan
from .speculative import Proposer
from .step_costs import StepCosts
from .steps import EngineStats, StepExecutor
from .threads import ENGINE_THREADS
from .types import Pin, Sampling

log = logging.getLogger("strata.engine")
EXPIRY_INTERVAL_S = 10.0  # how often the worker drops idle entries from the RAM tiers


@dataclass(frozen=True, slots=True)
class StepShape:
    """One worker step: `rows` decoding sequences and `prefill_tokens` prompt tokens in one call."""

    rows: int = 0
    prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Health:
    """Whether the worker serves: `alive` (its loop runs and steps while work is pending) and `ready`
    (warm-up ended well, and alive); `reason` says what is wrong when either is false."""

    alive: bool
    ready: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    counters: EngineStats
    queue_depth: int
    busy: bool  # a job is on the model right now
    num_running: int = 0  # sequences in the decode batch
    last_step: StepShape = StepShape()
    waiting_for_memory: bool = False  # the next job waits for running sequences to free KV
    kv_bytes_per_token: int = 0  # what each token of a running sequence holds of the memory budget


class EngineWorker:
    def __init__(
        self,
        runner: ModelRunner,
        max_queue: int,
        step_prompt_tokens: int,
        max_num_seqs: int,
        max_verify_tokens: int = 0,
        step_budget_ms: float = 0.0,
    ):
        self.runner = runner
        # A model with a layer cache the libraries cannot batch (runner.batchable: plain KV, sliding
        # windows and recurrent states can) decodes one sequence at a time.
        self.max_num_seqs = max_num_seqs if runner.batchable else 1
        block = runner.caches.config.block_size
        # prompt tokens per model call, over every admission, in whole blocks
        self.step_tokens = max(block, step_prompt_tokens // block * block)
        # a step beside decode rows: the prompt tokens its latency budget leaves (0: step_tokens)
        self.costs = StepCosts(step_budget_ms, self.step_tokens, block, max(self.step_tokens, ALONE_STEP_TOKENS))
        self.timed_step: tuple[float, int, int] | None = None  # (start, decode tokens, prompt tokens) of the last step
        # a tenant holds at most half of the waiting places
        self.jobs = FairQueue(max_queue, tenant_share=max(1, max_queue // 2))
        self.stats = EngineStats()
        # admissions, steps, joins and retirements (the scheduler's executor); it holds the scheduler
        self.steps = StepExecutor(runner, self.stats, max_verify_tokens)
        # Embedding requests, oldest first; at most max_queue wait. Any thread appends, the worker pops.
        self.embeddings: deque[EmbedJob] = deque()
        self.max_embeddings = max_queue
        # Work that must run on this thread between steps (cache purges: the caches are its own).
        # Any thread appends; the worker pops.
        self.calls: deque[tuple[Callable[[], object], Future]] = deque()
        self.last_step = StepShape()
        self.next_expiry = 0.0  # time.monotonic() of the next retention sweep of the RAM tiers
        self.launched = False
        self.ended = threading.Event()  # the loop has ended (its thread waits for the next worker: EngineThreads)
        self.warmed_up = threading.Event()  # set once warm-up ended, well or not (warm_up_error says)
        self.warm_up_error: BaseException | None = None
        self.loop_error: BaseException | None = None  # what ended the loop, when not stop()
        self.last_progress = time.monotonic()  # the end of the loop's last pass (health: stuck detection)

    def start(self, warm_up_timeout_s: float = 600.0) -> None:
        """Start the thread and wait for its warm-up: a model that cannot run fails here, at start-up,
        with the reason, never on the first request."""
        self.launch()
        self.wait_warm(warm_up_timeout_s)

    def launch(self) -> None:
        """Start the loop without waiting: jobs queue until its warm-up ends (health says when)."""
        assert not self.launched, "a worker runs once"
        self.launched = True
        ENGINE_THREADS.run(self)

    def wait_warm(self, warm_up_timeout_s: float = 600.0) -> None:
        if not self.warmed_up.wait(warm_up_timeout_s):
            raise RuntimeError(f"engine warm-up did not finish within {warm_up_timeout_s:.0f} s")
        if self.warm_up_error is not None:
            raise RuntimeError(f"engine warm-up failed: {self.warm_up_error!r}") from self.warm_up_error

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Cancel the running jobs, fail the waiting ones, end the thread. True when it ended."""
        self._end_every_job("server is shutting down")
        ended = self.ended.wait(timeout_s)
        self._fail_calls()
        return ended

    def call(self, work: Callable[[], object]) -> Future:
        """Run `work` on the worker thread between two steps; its result or exception comes back in
        the Future (failed at once when the loop has ended)."""
        future: Future = Future()
        self.calls.append((work, future))
        self.jobs.nudge()  # the worker may be waiting for a job
        if self.ended.is_set():
            self._fail_calls()
        return future

    def _run_calls(self) -> None:
        while self.calls:
            work, future = self.calls.popleft()
            try:
                future.set_result(work())
            except Exception as exc:  # noqa: BLE001 - the caller gets it; the loop keeps serving
                future.set_exception(exc)

    def _fail_calls(self) -> None:
        while self.calls:
            _, future = self.calls.popleft()
            future.set_exception(RuntimeError("the engine worker has stopped"))

    def health(self, stuck_after_s: float) -> Health:
        """Alive unless the loop has ended or, with work pending, no pass of it ended for stuck_after_s."""
        if self.ended.is_set():
            error = self.warm_up_error or self.loop_error
            why = (
                f"warm-up failed: {error!r}"
                if self.warm_up_error
                else (f"the engine worker has stopped: {error!r}" if error else "the engine worker has stopped")
            )
            return Health(False, False, why)
        pending = self.jobs.qsize() + len(self.held()) + len(self.embeddings) + len(self.calls)
        idle_s = time.monotonic() - self.last_progress
        if pending and idle_s > stuck_after_s and self.warmed_up.is_set():
            return Health(
                False, False, f"stuck: no engine step ended for {idle_s:.0f} s with {pending} requests pending"
            )
        if not self.warmed_up.is_set():
            return Health(True, False, "warming up")
        return Health(True, True)

    def submit(
        self,
        prompt: PreparedPrompt,
        sampling: Sampling,
        salt: TenantSalt,
        owner: str | None = None,
        pins: tuple[Pin, ...] = (),
        references: tuple[tuple[int, ...], ...] = (),
        cache_salt: TenantSalt | None = None,
        tenant: str = "",
    ) -> Job:
        """Queue a job; QueueFull when there is no place for it, OverBudget when it can never fit,
        EngineStopped when the worker's loop has ended. `references`: answers the caller's caches
        hold for this question, as token ids (drafts for speculative decoding). `cache_salt` salts
        the job's prefix and vision caches instead of `salt` (which still names its tenant in the
        fair queue)."""
        if self.ended.is_set():
            raise EngineStopped(self.health(0).reason)
        budget = self.runner.caches.running_budget_bytes()
        need = self.kv_bytes(prompt, sampling)
        if budget is not None and need > budget:
            raise OverBudget(need, budget)
        job = Job(prompt, sampling, salt, asyncio.get_running_loop(), owner, pins, references, cache_salt, tenant)
        try:
            self.jobs.put(salt, Sequence(salt, prompt.num_tokens, sampling.max_tokens, job))
        except QueueFull:
            self.stats.num_rejected_full += 1
            raise
        return job

    def submit_embedding(self, texts: tuple[tuple[int, ...], ...]) -> EmbedJob:
        """Queue texts to embed; QueueFull when max_queue embedding requests wait already."""
        if self.ended.is_set():
            raise EngineStopped(self.health(0).reason)
        if len(self.embeddings) >= self.max_embeddings:
            self.stats.num_rejected_full += 1
            raise QueueFull("queue_full")
        job = EmbedJob(texts, asyncio.get_running_loop())
        self.embeddings.append(job)
        self.jobs.nudge()  # the worker may be waiting for a generation job
        return job

    @property
    def scheduler(self) -> Scheduler | None:
        """None until warm-up measured the KV bytes per token."""
        return self.steps.scheduler

    @property
    def decoding(self) -> DecodeRows:
        return self.steps.decoding

    @property
    def running(self) -> list[Sequence]:
        """The sequences on the model: decoding, or their prompt coming in."""
        return self.steps.running

    @property
    def rows(self) -> list[Sequence]:
        """The decoding sequences, in batch-row order."""
        return self.decoding.rows

    @property
    def proposers(self) -> Callable[[Sequence], list[Proposer]] | None:
        """Where each row's drafts come from (None: speculative decoding off); tests swap it."""
        return self.decoding.proposers

    @proposers.setter
    def proposers(self, proposers: Callable[[Sequence], list[Proposer]] | None) -> None:
        self.decoding.proposers = proposers

    @property
    def prefilling(self) -> list[Sequence]:
        return self.steps.prefilling

    def held(self) -> list[Sequence]:
        return self.scheduler.held() if self.scheduler else []

    @property
    def busy(self) -> bool:
        """A job is on the model: coming in, or decoding in the batch."""
        return bool(self.running)

    def kv_bytes(self, prompt: PreparedPrompt, sampling: Sampling) -> int:
        """The most KV the job's own cache can grow to: every prompt token and max_tokens more (and
        a hybrid model's recurrent state)."""
        return (prompt.num_tokens + sampling.max_tokens) * self.runner.kv_bytes_per_token + self.runner.state_bytes

    def snapshot(self) -> WorkerSnapshot:
        memory_wait = self.scheduler is not None and self.scheduler.memory_wait is not None
        return WorkerSnapshot(
            self._counters(),
            self.jobs.qsize() + memory_wait + len(self.scheduler.preempted if self.scheduler else ()),
            self.busy,
            len(self.decoding),
            self.last_step,
            memory_wait,
            self.runner.kv_bytes_per_token,
        )

    def _counters(self) -> EngineStats:
        counters = replace(self.stats)
        if self.scheduler is not None:
            counters.num_memory_waits = self.scheduler.stats.num_memory_waits
            counters.num_preemptions = self.scheduler.stats.num_preemptions
            counters.peak_running = self.scheduler.stats.peak_running
        return counters

    async def events(self, job: Job | EmbedJob) -> AsyncGenerator[Event, None]:
        """The job's events until Finished or Failed. Leaving early (client gone) cancels the job."""
        try:
            while True:
                event = await job.events.get()
                yield event
                if isinstance(event, ENDINGS):
                    return
        finally:
            job.cancelled.set()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a broken loop: health reports it, waiting jobs fail
            self.loop_error = exc
            log.exception("the engine worker's loop broke")
        finally:
            self.ended.set()
            self._fail_what_waits()

    def _fail_what_waits(self) -> None:
        """Once the loop has ended nothing will run: every job fails and submit() refuses new ones."""
        self._end_every_job("the engine has stopped")
        self._fail_calls()

    def _end_every_job(self, reason: str) -> None:
        """Cancel every job held (running, preempted, waiting for memory) or queued and send it
        Failed(reason) (a job that ended already ignores it); close the queue, which wakes the thread
        and makes submit() refuse new jobs. Any thread."""
        sequences = [*self.held(), *self.jobs.drain()]
        for job in [*(sequence.job for sequence in sequences), *self.embeddings]:
            job.cancelled.set()
            job.send(Failed(reason))
        self.jobs.close()

    def _loop(self) -> None:
        try:
            self.runner.warm_up()
            self.steps.scheduler = Scheduler(
                self._limits(), _Budget(self.runner.caches), self.steps, self.jobs, self.costs
            )
        except BaseException as exc:  # noqa: BLE001 - reported by start(); the thread ends, serving nothing
            self.warm_up_error = exc
            return
        finally:
            self.last_progress = time.monotonic()
            self.warmed_up.set()
        while True:
            self._expire_now_and_then()
            if self.calls or self.embeddings:
                self.timed_step = None  # this pass does other work: its time is not the step's
            self._run_calls()
            if self.embeddings:
                self._embed_one()
            self.decoding.sample()
            self._time_step()
            self.steps.drop_cancelled()
            self.decoding.propose()
            if not self.running:
                self.last_step = StepShape()  # idle: what shows while the loop waits for a job
            plan = self._admit()
            if plan is None:
                break
            if plan:
                self.timed_step = (time.perf_counter(), plan.num_decode_tokens, plan.num_prompt_tokens)
                self.steps.run(plan)
            self.last_step = StepShape(len(plan.decode), plan.num_prompt_tokens)
            self.last_progress = time.monotonic()
        self.steps.store_what_runs()

    def _time_step(self) -> None:
        """The last step's time, from its call to its logits drawn (a decode call's logits are lazy
        until the draws), into the step costs."""
        if self.timed_step is not None:
            start, decode_tokens, prompt_tokens = self.timed_step
            self.costs.record(decode_tokens, prompt_tokens, (time.perf_counter() - start) * 1000)
        self.timed_step = None

    def _limits(self) -> Limits:
        block = self.runner.caches.config.block_size
        return Limits(
            self.max_num_seqs, self.step_tokens, block, self.runner.kv_bytes_per_token, self.runner.state_bytes
        )

    def _admit(self) -> StepPlan | None:
        """The scheduler's next step plan (waiting for a job when nothing runs); None once stop()
        closed the queue."""
        assert self.scheduler is not None
        idle = not (self.scheduler.running or self.embeddings or self.scheduler.preempted)
        plan = self.scheduler.schedule(block=idle, timeout_s=EXPIRY_INTERVAL_S)
        if not plan and self.jobs.closed:
            return None
        return plan

    def _expire_now_and_then(self) -> None:
        """Every EXPIRY_INTERVAL_S (an idle worker wakes for it), drop what the RAM tiers' retention
        no longer allows."""
        now = time.monotonic()
        if now < self.next_expiry:
            return
        self.next_expiry = now + EXPIRY_INTERVAL_S
        for layer, removed in self.runner.caches.expire().items():
            if removed.num_entries:
                log.info("expired %d idle %s entries (%d bytes)", removed.num_entries, layer, removed.num_bytes)

    def _embed_one(self) -> None:
        """Embed the oldest request's next text (a short forward, like a prefill chunk, between
        decode steps); it gets its vectors once all its texts are done."""
        job = self.embeddings[0]
        try:
            if job.cancelled.is_set():
                raise Cancelled()
            job.vectors.append(self.runner.embed(job.texts[len(job.vectors)]))
            if len(job.vectors) < len(job.texts):
                return
            job.send(Embedded(job.vectors))
        except Cancelled:
            self.stats.num_cancelled += 1
        except Exception as exc:  # noqa: BLE001 - the worker must survive any one request
            self.steps.fail(job, exc)
        self.embeddings.popleft()


@dataclass(slots=True)
class _Budget:
    """The scheduler's memory: the prefix cache's budget, where cached blocks give way."""

    caches: EngineCaches

    def reserve(self, nbytes: int) -> bool:
        return self.caches.reserve_running(nbytes)

    def release(self, nbytes: int) -> None:
        self.caches.release_running(nbytes)
