"""The scheduler's executor: it opens, preempts and refuses sequences, runs each step plan as one
model call, joins the prompts that ran to the decode rows and retires the rows that end.

    steps.admit(sequence) -> bool     open its prompt (the cached prefix read in place where it can be)
    steps.run(plan)                   one model call: the decode rows' tokens and the prompt chunks
    steps.drop_cancelled()            prompts whose client went away stop coming in
    steps.store_what_runs()           the loop stopped: what runs is stored as cached blocks
    steps.check()                     each byte of KV counted once under the budget (tests, after steps)

The worker (gateway/engine/worker.py) owns the thread, the queue and the loop; the decoding rows
(gateway/engine/decoding.py) own the batch, drafts and draws; the scheduler
(gateway/engine/scheduler.py) owns the plan and the memory counts. Invariant: a sequence is
`admission`-open (its prompt coming in) or a decode row, never both; the scheduler's running list
holds both kinds until `end()`. Only the engine's worker thread calls in.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from .constraint import GrammarError
from .decoding import DecodeRows
from .jobs import EmbedJob, Failed, Job, Started
from .prompt import PreparedPrompt
from .runner import ModelRunner, PrefillResult
from .scheduler import Scheduler, Sequence, StepPlan

log = logging.getLogger("strata.engine")


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
    num_preemptions: int = 0  # sequences stopped to free KV, resumed later from their cached blocks
    peak_running: int = 0  # most sequences on the model at once (decoding or coming in)
    num_steps: int = 0  # model calls (decode rows and prompt chunks together)
    num_resumed_tokens: int = 0  # tokens preempted sequences got back from the prefix cache
    num_drafted_tokens: int = 0  # proposed tokens verified (gateway/engine/speculative.py)
    num_accepted_drafts: int = 0  # of them, those a verification confirmed


class StepExecutor:
    def __init__(self, runner: ModelRunner, stats: EngineStats, max_verify_tokens: int):
        self.runner = runner
        self.stats = stats
        self.scheduler: Scheduler | None = None  # the worker's, built once warm-up measured the KV bytes per token
        # the decoding sequences (drafts, draws, text); rows that end come back through retire and fail
        self.decoding = DecodeRows(runner, stats, max_verify_tokens, self.retire, self.fail, self._share, self._unshare)

    @property
    def running(self) -> list[Sequence]:
        """The sequences on the model: decoding, or their prompt coming in."""
        return list(self.scheduler.running) if self.scheduler else []

    @property
    def prefilling(self) -> list[Sequence]:
        return [sequence for sequence in self.running if sequence.admission is not None]

    def num_tokens_in_use(self, sequence: Sequence) -> int:
        if sequence.lookup is None or sequence.lookup[0] != sequence.num_tokens:  # hashing 100k tokens: 25 ms
            job = sequence.job
            chain = self.runner.prefix_chain(self._prompt_of(sequence), job.cache_salt or job.salt)
            sequence.lookup = (sequence.num_tokens, chain)
        chain = sequence.lookup[1]
        return chain.num_tokens_in_use(sequence.num_tokens - 1) if chain is not None else 0

    def admit(self, sequence: Sequence) -> bool:
        """Open the sequence's prompt (its prefix from the cache, read in place where it can be:
        those tokens are shared, not reserved); a resumed one's prompt carries the tokens it generated."""
        job = sequence.job
        if job.cancelled.is_set():
            self.stats.num_cancelled += 1
            return False
        prompt = self._prompt_of(sequence)
        if not sequence.num_preemptions:  # its first admission
            self.stats.num_requests += 1
            job.queue_ms = (time.perf_counter() - job.enqueued_at) * 1000
        try:
            sequence.admission = self.runner.open_prefill(
                prompt, job.cache_salt or job.salt, job.owner, job.pins, job.tenant, in_place=True
            )
        except Exception as exc:  # noqa: BLE001 - the worker must survive any one request
            self.fail(job, exc)
            return False
        sequence.num_resumed_tokens = len(sequence.generated)
        sequence.num_computed_tokens = sequence.admission.first
        sequence.num_shared_tokens = sequence.admission.num_mapped_tokens  # the pool counts them, not its reservation
        return True

    @staticmethod
    def _prompt_of(sequence: Sequence) -> PreparedPrompt:
        """The sequence's prompt; a resumed one's carries the tokens it generated."""
        prompt = sequence.job.prompt
        if sequence.generated:
            prompt = dataclasses.replace(prompt, token_ids=prompt.token_ids + tuple(sequence.generated))
        return prompt

    def preempt(self, sequence: Sequence) -> None:
        """Store the sequence's KV as cached blocks (its resumption finds them) and drop its cache."""
        if sequence.admission is not None:
            sequence.admission.close(self.runner.caches, sequence.num_computed_tokens)
            sequence.admission = None
            return
        prefill = self.decoding.leave(self.decoding.rows.index(sequence), pressed=True)
        self.store(prefill, sequence, to_ssd=True)
        sequence.logits = None

    def refuse(self, sequence: Sequence, reason: str) -> None:
        self.fail(sequence.job, MemoryError(reason))

    def run(self, plan: StepPlan) -> None:
        """One model call for the plan: the decode rows' pending tokens (and drafts) and the prompt chunks."""
        rows = self.decoding.rows
        assert {id(s) for s in plan.decode} == {id(s) for s in rows}, "every row decodes in each step"
        decode_part = self.decoding.part()
        parts = [decode_part] if decode_part is not None else []
        chunks = [(s, s.num_computed_tokens + n) for s, n in plan.chunks]
        for sequence, end in chunks:
            parts += self.runner.chunk_parts(sequence.admission, sequence.num_computed_tokens, end)
        self.stats.num_steps += 1
        try:
            logits = self.runner.run_step(parts)
        except Exception as exc:  # noqa: BLE001 - a failed model call fails its sequences, not the worker
            self._fail_step(plan, exc)
            return
        if rows:
            self.stats.num_decode_steps += 1
            self.stats.num_decoded_tokens += len(rows)
            self.decoding.take_logits(logits[0])
            self.decoding.sample()  # before rows join: a hybrid row's roll-back runs on its own cache
        for sequence, end in chunks:
            self._count_chunk(end - sequence.num_computed_tokens)
            sequence.num_computed_tokens = end
            if sequence.admission.done:
                self._join(sequence)

    def _count_chunk(self, num_tokens: int) -> None:
        self.stats.num_prefill_chunks += 1
        self.stats.num_prefilled_tokens += num_tokens

    def _fail_step(self, plan: StepPlan, exc: Exception) -> None:
        for sequence, _ in plan.chunks:
            sequence.admission.close()
            sequence.admission = None
            self.fail(sequence.job, exc)
            self.end(sequence)
        self.decoding.fail_all(exc)

    def _join(self, sequence: Sequence) -> None:
        """The prompt has run: the sequence joins the decode batch (its first token is sampled at
        the next pass). Started is sent once, not again when a preempted sequence comes back."""
        admission, job = sequence.admission, sequence.job
        sequence.admission = None
        prefill = admission.result()
        try:
            if sequence.sampler is None:
                job.send(
                    Started(
                        job.prompt.num_tokens,
                        prefill.prefix.num_cached_tokens,
                        prefill.prefix,
                        prefill.vision,
                        job.queue_ms,
                        prefill.vision_ms,
                        prefill.prefill_ms,
                    )
                )
                self.decoding.start(sequence)
            else:
                self.stats.num_resumed_tokens += prefill.prefix.num_cached_tokens
            self.decoding.join(sequence, prefill)
        except Exception as exc:  # noqa: BLE001 - a sampler or grammar that cannot start fails its job alone
            self.runner.finish(prefill, [])
            self.fail(job, exc)
            self.end(sequence)

    def drop_cancelled(self) -> None:
        """Prompts whose client went away stop coming in (their stored blocks stay cached)."""
        for sequence in self.prefilling:
            if sequence.job.cancelled.is_set():
                sequence.admission.close(self.runner.caches, sequence.num_computed_tokens)
                sequence.admission = None
                self.stats.num_cancelled += 1
                self.end(sequence)

    def retire(self, index: int) -> None:
        """Take row `index` out of the batch and store its blocks (prompt and reply) for the next
        turn. Its memory is given back first, so those blocks may use the room its KV held. The
        sequence stays running (the worker is busy) until its blocks are stored."""
        sequence = self.decoding.rows[index]
        prefill = self.decoding.leave(index)
        if self.scheduler is not None:
            self.scheduler.release(sequence)
        try:
            self.store(prefill, sequence)
        finally:
            self.end(sequence)

    def store(self, prefill: PrefillResult, sequence: Sequence, to_ssd: bool = False) -> None:
        """Cache the sequence's prompt and reply blocks (best effort: the answer was sent already)."""
        try:
            self.runner.finish(prefill, sequence.generated[sequence.num_resumed_tokens :], to_ssd)
        except Exception:  # storing blocks is best effort: the answer was sent already
            log.exception("storing the sequence's blocks failed")

    def end(self, sequence: Sequence) -> None:
        if self.scheduler is not None:
            self.scheduler.finish(sequence)

    def store_what_runs(self) -> None:
        """Stopped: the sequences still running store what they computed and release their blocks."""
        for sequence in list(self.running):
            if sequence.admission is not None:
                sequence.admission.close(self.runner.caches, sequence.num_computed_tokens)
                self.end(sequence)
        for index in reversed(range(len(self.decoding))):
            self.retire(index)

    def _share(self, sequence: Sequence, num_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.share(sequence, num_tokens)

    def _unshare(self, sequence: Sequence) -> bool:
        return self.scheduler.unshare(sequence) if self.scheduler is not None else True

    def fail(self, job: Job | EmbedJob, exc: Exception) -> None:
        log.error("generation failed", exc_info=exc)
        self.stats.num_failed += 1
        if isinstance(exc, GrammarError):  # the client's schema, past what the probe before admission saw
            job.send(Failed(f"the output grammar could not be followed: {exc}", "invalid_schema", 400))
        else:
            job.send(Failed(f"generation failed: {type(exc).__name__}"))

    def check(self) -> None:
        """Assert that each byte of KV is counted once under the budget (tests call it after steps):
        the pool's reservation is exactly the running sequences' own KV, each prompt coming in
        shares exactly the blocks its layers read in place, and each decoding row's
        first tokens are read in place from the blocks its own session maps (its chain: its tenant's),
        held in the pool, their arrays the row's first segments."""
        prefix = self.runner.caches.prefix
        if prefix is None or self.scheduler is None:
            return
        prefix.pool.check()
        limits = self.scheduler.limits
        owned = [s for s in self.scheduler.held() if s.num_reserved_tokens]
        own_bytes = sum(s.num_reserved_tokens * limits.kv_bytes_per_token + limits.state_bytes for s in owned)
        assert prefix.pool.reserved_bytes == own_bytes, (prefix.pool.reserved_bytes, own_bytes)
        for sequence in self.prefilling:  # a prompt's mapped prefix: shared, and the layers read those blocks
            admission = sequence.admission
            mapped = admission.plan.session.mapped if admission.plan is not None else []
            assert sequence.num_shared_tokens == admission.num_mapped_tokens == len(mapped) * limits.block_tokens
            for index, layer in enumerate(admission.cache if mapped else []):
                assert all(a is b.kv[index] for a, b in zip(layer.blocks, mapped, strict=True)), "another block read"
        batch = self.decoding.batch
        for index, (sequence, row) in enumerate(zip(self.decoding.rows, batch.rows)):
            session = row.plan.session if row.plan is not None else None
            mapped = session.mapped if session is not None else []
            shared = batch.shared_tokens(index)
            assert sequence.num_shared_tokens == shared == len(mapped) * limits.block_tokens, (index, shared)
            assert session is None or [b.block_hash for b in mapped] == session.hashes[: len(mapped)], (
                "another chain's block"
            )
            assert all(b.ref_count > 0 and (b.purged or prefix.pool.get(b.block_hash) is b) for b in mapped)
            if mapped:
                segments = batch.segments.rows[index].segments  # type: ignore[union-attr]
                for block, segment in zip(mapped, segments):
                    arrays = [array for pair in block.kv for array in pair]
                    assert all(a is b for a, b in zip(segment.holds, arrays, strict=True)), (
                        "a table reads another block"
                    )
