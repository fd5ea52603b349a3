"""One dedicated thread runs the model; requests wait in a bounded queue; events flow back to asyncio.

    HTTP handler --submit()--> FairQueue(max_queue) --> worker thread (ModelRunner, DecodeBatch)
         ^                                                       |
         +---- asyncio.Queue <-- loop.call_soon_threadsafe(event) +

The worker decodes up to `max_num_seqs` sequences together, one batched forward per step. One queued
job at a time is admitted: it is prefilled on its own (every cache applies), one chunk per step, each
chunk followed by a decode step of the batch, so running streams keep flowing while a long prompt
comes in; then it joins the batch. Tenants take turns (gateway/engine/fair_queue.py): none holds more
than half of the waiting places, or, while others wait, of the batch, and once several tenants have
been served the batch's last place is kept for a tenant with nothing running. A full queue raises
QueueFull at once (the gateway answers 429). A job whose client went away is cancelled: skipped if
still queued, removed from the batch at the next step if running.

One memory budget: a job is admitted only once its own KV (prompt + max_tokens tokens) is reserved
under the prefix cache's byte budget, which free cached blocks give way to (spilled to SSD when the
tier is on); until then it waits at the head of the line while the batch decodes, and no other job
overtakes it. A job that could not fit even in an empty budget is refused at submit (OverBudget).
The left padding of the shared batch cache (rows shorter than the longest) is not counted.

The caches belong to this thread: other threads reach them through call() (a purge runs between
two steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import mlx.core as mx

from kvcache import TenantSalt

from .batch import DecodeBatch
from .caching import PrefixReport, VisionReport
from .constraint import GrammarError
from .fair_queue import FairQueue, QueueFull
from .prompt import PreparedPrompt
from .runner import Cancelled, ModelRunner, PrefillResult, Sampler, TokenLogprob
from .text import TextStream
from .types import Pin, Sampling

log = logging.getLogger("strata.engine")
EXPIRY_INTERVAL_S = 10.0  # how often the worker drops idle entries from the RAM tiers


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
    # When the request asked for logprobs: the tokens whose text this delta completes (a character's
    # bytes may span tokens, and text that could begin a stop sequence is held back a while).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    num_completion_tokens: int
    decode_ms: float
    stop_sequence: str | None = None  # the client's stop sequence that ended the answer, if one did


@dataclass(frozen=True, slots=True)
class Failed:
    message: str
    code: str = "engine_error"  # what the client's error says: invalid_schema for an output grammar that broke
    status: int = 500


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: list  # one np.ndarray per text, in order


Event = Started | Delta | Finished | Failed | Embedded
ENDINGS = (Finished, Failed, Embedded)  # a job's last event: nothing follows it


class OverBudget(Exception):
    """The job's KV alone (prompt + max_tokens) is more than the whole memory budget."""

    def __init__(self, need_bytes: int, budget_bytes: int):
        super().__init__(f"needs {need_bytes} bytes of KV, the budget is {budget_bytes}")
        self.need_bytes = need_bytes
        self.budget_bytes = budget_bytes


@dataclass(slots=True)
class Job:
    prompt: PreparedPrompt
    sampling: Sampling
    salt: TenantSalt
    loop: asyncio.AbstractEventLoop
    owner: str | None = None  # the label of who asks (tenant, session, end user): cache purges select by it
    pins: tuple[Pin, ...] = ()  # prompt prefixes to keep cached for a while once the job ends
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    ended: bool = False  # Finished or Failed was sent: nothing more is

    def send(self, event: Event) -> None:
        _deliver(self, event)


@dataclass(slots=True)
class EmbedJob:
    """Texts to embed with the engine's own model (its family pools): one text per worker step."""

    texts: tuple[tuple[int, ...], ...]  # token ids
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    vectors: list = field(default_factory=list)
    ended: bool = False

    def send(self, event: Event) -> None:
        _deliver(self, event)


def _deliver(job: Job | EmbedJob, event: Event) -> None:
    """Hand an event to the job's event loop (any thread); nothing after its Finished or Failed."""
    if job.ended:
        return
    job.ended = isinstance(event, ENDINGS)
    with contextlib.suppress(RuntimeError):  # the client's event loop is closed: nobody is left to tell
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)


@dataclass(slots=True)
class EngineStats:
    num_requests: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_rejected_full: int = 0
    num_decode_steps: int = 0  # batched forwards
    num_decoded_tokens: int = 0  # rows fed over all steps: / num_decode_steps = the mean batch size
    num_prefill_chunks: int = 0
    num_prefilled_tokens: int = 0  # prompt tokens run (reused prefixes excluded): / chunks = tokens per chunk
    num_memory_waits: int = 0  # jobs that waited at the head of the line for KV memory


@dataclass(frozen=True, slots=True)
class StepShape:
    """One worker step: a prefill chunk (0 tokens when none ran) and a decode step over `rows`."""

    rows: int = 0
    prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Health:
    """Whether the worker serves: `alive` (its loop runs and steps while work is pending) and `ready`
    (warm-up ended well, and alive); `reason` says what is wrong when either is false."""

    alive: bool
    ready: bool
    reason: str = ""


class EngineStopped(Exception):
    """The worker's loop has ended (stopped, warm-up failed, or broken): nothing queued will run."""


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    counters: EngineStats
    queue_depth: int
    busy: bool  # a job is on the model right now
    num_running: int = 0  # sequences in the decode batch
    last_step: StepShape = StepShape()
    waiting_for_memory: bool = False  # the next job waits for running sequences to free KV


@dataclass(slots=True)
class Prefilling:
    """The job being admitted: its prefill, advanced one chunk per worker step."""

    job: Job
    steps: Generator[int, None, PrefillResult]
    queue_ms: float
    reserved: int  # bytes of the memory budget held for the job's KV, until it retires
    num_chunk_tokens: int = 0  # tokens the yielded chunks ran


@dataclass(slots=True)
class Running:
    """One job in the decode batch: what it has produced and the logits of its next token."""

    job: Job
    sampler: Sampler
    text: TextStream
    logits: mx.array  # (vocab,): the next token's logits
    reserved: int  # bytes of the memory budget held for the job's KV
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet sent with a Delta
    started_at: float = field(default_factory=time.perf_counter)

    def delta(self, text: str) -> Delta:
        logprobs, self.logprobs = tuple(self.logprobs), []
        return Delta(text, logprobs)


class EngineWorker:
    def __init__(self, runner: ModelRunner, max_queue: int, prefill_chunk_tokens: int, max_num_seqs: int):
        self.runner = runner
        self.chunk_tokens = prefill_chunk_tokens
        # Recurrent layers have no batched cache here: such models decode one sequence at a time.
        self.max_num_seqs = max_num_seqs if runner.batchable else 1
        # a tenant holds at most half of the waiting places and, while others wait, half of the batch
        self.jobs = FairQueue(max_queue, tenant_share=max(1, max_queue // 2))
        self.batch_share = max(1, self.max_num_seqs // 2)
        self.stats = EngineStats()
        self.batch = DecodeBatch(runner)
        self.running: list[Running] = []  # running[i] is row i of self.batch
        self.prefilling: Prefilling | None = None  # the job being admitted, one chunk per step
        self.memory_wait: Job | None = None  # taken from the queue, waiting for its KV to fit the budget
        # Embedding requests, oldest first; at most max_queue wait. Any thread appends, the worker pops.
        self.embeddings: deque[EmbedJob] = deque()
        self.max_embeddings = max_queue
        # Work that must run on this thread between steps (cache purges: the caches are its own).
        # Any thread appends; the worker pops.
        self.calls: deque[tuple[Callable[[], object], Future]] = deque()
        self.last_step = StepShape()
        self.next_expiry = 0.0  # time.monotonic() of the next retention sweep of the RAM tiers
        self.thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self.ended = threading.Event()  # the loop has ended (the thread itself parks: see _run)
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
        """Start the thread without waiting: jobs queue until its warm-up ends (health says when)."""
        self.thread.start()

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
        pending = self.jobs.qsize() + len(self.running) + bool(self.prefilling) + len(self.embeddings) + len(self.calls)
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
    ) -> Job:
        """Queue a job; QueueFull when there is no place for it, OverBudget when it can never fit,
        EngineStopped when the worker's loop has ended."""
        if self.ended.is_set():
            raise EngineStopped(self.health(0).reason)
        budget = self.runner.caches.running_budget_bytes()
        need = self.kv_bytes(prompt, sampling)
        if budget is not None and need > budget:
            raise OverBudget(need, budget)
        job = Job(prompt, sampling, salt, asyncio.get_running_loop(), owner, pins)
        try:
            self.jobs.put(salt, job)
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
    def busy(self) -> bool:
        """A job is on the model: being prefilled, or decoding in the batch."""
        return bool(self.running or self.prefilling)

    def kv_bytes(self, prompt: PreparedPrompt, sampling: Sampling) -> int:
        """The most KV the job's own cache can grow to: every prompt token and max_tokens more."""
        return (prompt.num_tokens + sampling.max_tokens) * self.runner.kv_bytes_per_token

    def snapshot(self) -> WorkerSnapshot:
        return WorkerSnapshot(
            replace(self.stats),
            self.jobs.qsize() + (self.memory_wait is not None),
            self.busy,
            len(self.running),
            self.last_step,
            self.memory_wait is not None,
        )

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
        """The loop, then parking for good. MLX keeps compiled functions in a C++ thread-local cache
        whose destructor calls into Python when its thread exits; once the interpreter is shutting
        down that aborts the process ("terminate called without an active exception", seen about
        one exit in four). A parked daemon thread never exits: the process ends around it."""
        try:
            self._loop()
        except BaseException as exc:  # a broken loop: health reports it, waiting jobs fail
            self.loop_error = exc
            log.exception("the engine worker's loop broke")
        finally:
            self.ended.set()
            self._fail_what_waits()
            threading.Event().wait()

    def _fail_what_waits(self) -> None:
        """Once the loop has ended nothing will run: every job fails and submit() refuses new ones."""
        self._end_every_job("the engine has stopped")
        self._fail_calls()

    def _end_every_job(self, reason: str) -> None:
        """Cancel every job held (running, prefilling, waiting for memory) or queued and send it
        Failed(reason) (a job that ended already ignores it); close the queue, which wakes the thread
        and makes submit() refuse new jobs. Any thread."""
        admitting = self.prefilling.job if self.prefilling else None
        held = [row.job for row in list(self.running)] + [admitting, self.memory_wait]
        for job in [*held, *self.jobs.drain(), *self.embeddings]:
            if job is not None:
                job.cancelled.set()
                job.send(Failed(reason))
        self.jobs.close()

    def _loop(self) -> None:
        try:
            self.runner.warm_up()
        except BaseException as exc:  # noqa: BLE001 - reported by start(); the thread ends, serving nothing
            self.warm_up_error = exc
            return
        finally:
            self.last_progress = time.monotonic()
            self.warmed_up.set()
        while self._admit():
            self._expire_now_and_then()
            self._run_calls()
            if self.embeddings:
                self._embed_one()
            prefill_tokens = self._prefill_chunk() if self.prefilling else 0
            if self.running:
                self._step()
            self.last_step = StepShape(len(self.running), prefill_tokens)
            self.last_progress = time.monotonic()
        # stopped: the rows still running store what they computed and release their blocks
        if self.prefilling:
            self.prefilling.steps.close()
            self.prefilling = None
        for index in reversed(range(len(self.running))):
            self._retire(index)

    def _admit(self) -> bool:
        """Start admitting one queued job when the batch has room, no admission is under way and the
        job's KV fits the memory budget (waiting for a job when nothing runs). False once stop() sent
        its sentinel."""
        while self.prefilling is None and len(self.running) < self.max_num_seqs:
            waited, self.memory_wait = self.memory_wait, None
            job = waited or self.jobs.get(
                block=not (self.running or self.embeddings),
                passed_over=self._holds_its_batch_share,
                allowed=self._may_take_a_place,
                timeout_s=EXPIRY_INTERVAL_S,
            )
            if job is None:
                return not self.jobs.closed
            if job.cancelled.is_set():
                self.stats.num_cancelled += 1
                continue
            need = self.kv_bytes(job.prompt, job.sampling)
            if not self.runner.caches.reserve_running(need):
                if self.running:  # they free memory as they retire: wait for them at the head of the line
                    self.stats.num_memory_waits += waited is None
                    self.memory_wait = job
                    return True
                self._fail(job, MemoryError("its KV does not fit the memory budget, which blocks in use hold"))
                continue
            self.stats.num_requests += 1
            queue_ms = (time.perf_counter() - job.enqueued_at) * 1000
            steps = self.runner.prefill_steps(
                job.prompt, job.salt, self.chunk_tokens, job.cancelled.is_set, job.owner, job.pins
            )
            self.prefilling = Prefilling(job, steps, queue_ms, need)
        return True

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
            self._fail(job, exc)
        self.embeddings.popleft()

    def _num_rows(self, tenant: bytes) -> int:
        return sum(1 for row in self.running if row.job.salt == tenant)

    def _holds_its_batch_share(self, tenant: bytes) -> bool:
        return self._num_rows(tenant) >= self.batch_share

    def _may_take_a_place(self, tenant: bytes) -> bool:
        """Once more than one tenant has been served, the batch's last free place is kept for a
        tenant with nothing running: another tenant's request then starts after at most the prefill
        chunk under way, instead of waiting for a flooding tenant's row to end. A lone tenant (one
        salt, as in single-tenant mode) may fill the batch."""
        if len(self.running) < self.max_num_seqs - 1 or self.jobs.num_tenants_served() < 2:
            return True
        return self._num_rows(tenant) == 0

    def _prefill_chunk(self) -> int:
        """Run the admitted job's next prefill chunk; after its last, the job joins the batch.
        Returns the chunk's tokens."""
        admitting = self.prefilling
        assert admitting is not None, "called only while a job is prefilling"
        try:
            num_tokens = next(admitting.steps)
            admitting.num_chunk_tokens += num_tokens
            self._count_chunk(num_tokens)
            return num_tokens  # more chunks to come
        except StopIteration as done:
            prefill = done.value
        except Cancelled:
            self.stats.num_cancelled += 1
            prefill = None
        except Exception as exc:  # noqa: BLE001 - the worker must survive any one request
            self._fail(admitting.job, exc)
            prefill = None
        self.prefilling = None
        if prefill is None:
            self.runner.caches.release_running(admitting.reserved)
            return 0
        num_tokens = prefill.prompt.num_tokens - prefill.prefix.num_cached_tokens - admitting.num_chunk_tokens
        self._count_chunk(num_tokens)
        self._join(admitting, prefill)
        return num_tokens

    def _count_chunk(self, num_tokens: int) -> None:
        self.stats.num_prefill_chunks += 1
        self.stats.num_prefilled_tokens += num_tokens

    def _join(self, admitted: Prefilling, prefill: PrefillResult) -> None:
        job = admitted.job
        job.send(
            Started(
                job.prompt.num_tokens,
                prefill.prefix.num_cached_tokens,
                prefill.prefix,
                prefill.vision,
                admitted.queue_ms,
                prefill.vision_ms,
                prefill.prefill_ms,
            )
        )
        try:
            grammars = self.runner.grammars if job.sampling.grammar else None
            row = Running(
                job,
                Sampler(job.sampling, grammars),
                TextStream(self.runner.tokenizer, job.sampling.stop),
                prefill.logits,
                admitted.reserved,
            )
            self.batch.join(prefill)
        except Exception as exc:  # noqa: BLE001 - a sampler or grammar that cannot start fails its job alone
            self.runner.caches.release_running(admitted.reserved)
            self.runner.finish(prefill, [])
            self._fail(job, exc)
            return
        self.running.append(row)

    def _step(self) -> None:
        """Sample every row's next token (one evaluation for the whole batch), retire the rows that
        ended, feed the others one batched step."""
        try:
            draws = mx.stack([row.sampler.draw(row.logits, row.generated) for row in self.running])
            mx.eval(draws, *[array for row in self.running for array in row.sampler.lazy_logprobs()])
            tokens: list[int] = draws.tolist()  # type: ignore[assignment]  # mlx types tolist() as any nesting
        except Exception as exc:  # noqa: BLE001 - the last step's evaluation failed: its rows fail, not the worker
            self._fail_all(exc)
            return
        going: list[int] = []
        for index in reversed(range(len(self.running))):
            row = self.running[index]
            try:
                goes_on = self._advance(row, tokens[index])
            except Exception as exc:  # noqa: BLE001 - one row's grammar or logprobs failed: that row fails, not the batch
                self._fail(row.job, exc)
                goes_on = False
            if goes_on:
                going.append(tokens[index])
            else:
                self._retire(index)
        if not self.running:
            return
        self.stats.num_decode_steps += 1
        self.stats.num_decoded_tokens += len(going)
        try:
            logits = self.batch.step(going[::-1])
        except Exception as exc:  # noqa: BLE001 - a failed batched forward fails its rows, not the worker
            self._fail_all(exc)
            return
        for index, row in enumerate(self.running):
            row.logits = logits[index]

    def _advance(self, row: Running, token: int) -> bool:
        """Take the row's sampled token and send it as text; False when the row ended (it then sent
        its last event)."""
        sampling = row.job.sampling
        if row.job.cancelled.is_set():
            self.stats.num_cancelled += 1
            return False
        if len(row.generated) < sampling.max_tokens and token not in self.runner.eos_ids:
            row.generated.append(token)
            row.sampler.accept(token)
            if sampling.top_logprobs is not None:
                row.logprobs.append(row.sampler.logprobs(token))
            if chunk := row.text.push(token):
                row.job.send(row.delta(chunk))
            if not row.text.stopped and len(row.generated) < sampling.max_tokens:
                return True
        tail = row.text.finish()
        if tail or row.logprobs:
            row.job.send(row.delta(tail))
        cut = row.text.num_tokens >= sampling.max_tokens or row.sampler.closed_early
        reason = "stop" if row.text.stopped or not cut else "length"
        decode_ms = (time.perf_counter() - row.started_at) * 1000
        row.job.send(Finished(reason, row.text.num_tokens, decode_ms, row.text.matched_stop))
        return False

    def _fail_all(self, exc: Exception) -> None:
        """A broken batched step fails the rows in it, not the worker."""
        for index in reversed(range(len(self.running))):
            self._fail(self.running[index].job, exc)
            self._retire(index)

    def _retire(self, index: int) -> None:
        """Take row `index` out of the batch and store its blocks (prompt and reply) for the next turn.
        Its reservation is returned first, so those blocks may use the room its KV held. The row stays
        in `running` (the worker is busy) until its blocks are stored."""
        row = self.running[index]
        prefill = self.batch.leave(index)
        self.runner.caches.release_running(row.reserved)
        try:
            self.runner.finish(prefill, row.generated)
        except Exception:  # storing blocks is best effort; the answer was already sent
            log.exception("storing the finished sequence's blocks failed")
        finally:
            del self.running[index]

    def _fail(self, job: Job | EmbedJob, exc: Exception) -> None:
        log.error("generation failed", exc_info=exc)
        self.stats.num_failed += 1
        if isinstance(exc, GrammarError):  # the client's schema, past what the probe before admission saw
            job.send(Failed(f"the output grammar could not be followed: {exc}", "invalid_schema", 400))
        else:
            job.send(Failed(f"generation failed: {type(exc).__name__}"))
