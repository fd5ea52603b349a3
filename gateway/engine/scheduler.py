"""Which sequences run in the next model call, and how many tokens each: the engine's step plan.

No MLX here: the scheduler sees sequences as token counts, a memory budget and a fair queue, and is
tested with fake sequences (tests/gateway/test_scheduler.py). The step executor
(gateway/engine/steps.py) executes its plans on the worker's thread; the runner makes the model calls.

There is no prefill or decode phase (as in vLLM v1): a sequence has `num_tokens` (prompt and
generated) of which `num_computed_tokens` have KV; a step feeds it the difference, or a chunk of it.
A decoding sequence needs one token a step (its last sampled one); a prompt coming in needs the rest
of its prompt, taken in chunks under a per-step token budget shared by every admission, so running
streams keep their pace while prompts arrive, and several prompts can come in in the same call
(each an even share in whole blocks, oldest first, the prompts of the tenants running fewest
sequences before the others; no step carries more prompt tokens than the budget, except the one
block the first prompt always moves).

Memory: one budget (the prefix cache's, where cached blocks give way to running sequences). A
sequence holds `num_reserved_tokens` of KV in it: its prompt and one block at admission, then a
block more whenever it fills what it holds, never its worst case up front. When a sequence cannot
grow, the newest sequence is preempted: the executor stores its KV as cached prefix blocks and
forgets it; it resumes ahead of every waiting request, as a prompt of its tokens so far, which the
prefix cache mostly serves (greedy or seeded, it continues with the tokens it would have drawn).
Cached blocks are evicted before any running sequence is preempted (the budget's reserve() does so).
A sequence that reads cached blocks in place (a prompt its cached prefix as it comes in, a decoding
row its prompt's blocks: share()) holds them in the pool, and its reservation only the rest: each
byte is counted once. A prompt's first reservation leaves out the blocks it will read in place
that other sequences hold already (num_tokens_in_use, looked up before it is admitted); blocks it
will map that are free count in it, as mapping them keeps them from eviction (released from its
reservation once mapped: share() at admission).
A request that does not fit waits at the head of the line while others run; with nothing running it
is refused.

Fairness (tenants): the fair queue takes turns; no tenant holds more than half of the running places
while others wait, and once several tenants have been served the last place is kept for a tenant
with nothing running; and its prompt takes the step's prompt budget before a busier tenant's.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from .fair_queue import FairQueue
from .step_costs import StepCosts

# With no decode row to stall, prompts run in chunks up to this size: the engine's chunk length
# before steps were mixed (a longer chunk's attention costs more than the calls it saves).
ALONE_STEP_TOKENS = 512


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request's generation. The scheduler reads and writes the counts; the step executor and
    the decoding rows (steps.py, decoding.py) keep the rest (its job, KV, sampler, text stream),
    which the scheduler never touches."""

    tenant: bytes
    num_prompt_tokens: int
    max_tokens: int
    job: Any = None  # the worker's Job: events, cancellation
    status: Status = Status.WAITING
    generated: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # of prompt + generated, the tokens whose KV is in the sequence's cache
    num_reserved_tokens: int = 0  # KV tokens the memory budget holds for it
    # Of num_computed_tokens, the first it reads in place from cached blocks: the pool counts those
    # (in use while it runs), so its reservation does not (share()); its own KV is the rest.
    num_shared_tokens: int = 0
    order: int = 0  # first admission's order: the newest is preempted first, a resumed one keeps its place
    num_preemptions: int = 0
    drafts: list[int] = field(default_factory=list)  # tokens proposed to verify in the next step
    num_real_drafts: int = 0  # of drafts, the proposer's (the rest pad the batch to one width)
    # the executor's own state: the admission under way, the sampler, the drafter (speculative
    # decoding), the text stream, the logits (and hidden states) of the positions fed last, logprobs not yet sent, when decoding started, the tokens generated before
    # the last resume (already in the prompt the runner saw)
    admission: Any = None
    sampler: Any = None
    drafter: Any = None
    text: Any = None
    logits: Any = None
    hidden: Any = None  # (position, hidden states) of the positions fed last, for the MTP layers
    logprobs: list = field(default_factory=list)
    started_at: float = 0.0
    num_resumed_tokens: int = 0
    # the executor's: (its tokens then, its prompt's prefix chain), hashed once for num_tokens_in_use
    # (a request waiting at the head of the line is looked up at every step)
    lookup: Any = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.generated)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to feed before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def decoding(self) -> bool:
        """Its prompt has run: it needs one token a step."""
        return self.status is Status.RUNNING and self.sampler is not None and self.admission is None


class Memory(Protocol):
    def reserve(self, nbytes: int) -> bool: ...

    def release(self, nbytes: int) -> None: ...


class Executor(Protocol):
    """What the scheduler asks of the step executor (gateway/engine/steps.py) while it plans."""

    def num_tokens_in_use(self, sequence: Sequence) -> int:
        """Of the sequence's tokens, those its admission would now read in place from cached blocks
        that other sequences hold already (the pool keeps them anyway: its reservation need not
        hold them); looked up, nothing held."""
        ...

    def admit(self, sequence: Sequence) -> bool:
        """Start the sequence (look up its prefix: num_computed_tokens is set, and num_shared_tokens
        to the tokens it reads in place from cached blocks); False if it failed."""
        ...

    def preempt(self, sequence: Sequence) -> None:
        """Store the sequence's KV as cached blocks and drop it; it resumes from its tokens."""
        ...

    def refuse(self, sequence: Sequence, reason: str) -> None:
        """Fail a sequence that can never run."""
        ...


@dataclass(frozen=True, slots=True)
class Limits:
    max_num_seqs: int
    step_tokens: int  # prompt tokens per model call, over every admission
    block_tokens: int  # chunks end on block boundaries (blocks are stored as chunks complete them)
    kv_bytes_per_token: int
    state_bytes: int = 0  # a hybrid model's recurrent state: held by each sequence from admission on


@dataclass(slots=True)
class StepPlan:
    """One model call: `decode` feeds each its one pending token; `chunks` feed (sequence, tokens)."""

    decode: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        """The rows' pending tokens and drafts."""
        return sum(s.num_pending_tokens + len(s.drafts) for s in self.decode)

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_memory_waits: int = 0  # requests that waited at the head of the line for KV memory
    peak_running: int = 0  # most sequences running at once


class Scheduler:
    def __init__(
        self, limits: Limits, memory: Memory, executor: Executor, queue: FairQueue, costs: StepCosts | None = None
    ):
        self.limits = limits
        self.costs = costs  # the prompt tokens a step with decode rows carries (None: limits.step_tokens)
        self.memory = memory
        self.executor = executor
        self.waiting = queue
        self.preempted: deque[Sequence] = deque()  # resumed before anything waiting, oldest (by order) first
        self.memory_wait: Sequence | None = None  # the head of the line, until its KV fits
        self.running: list[Sequence] = []  # admission order (oldest first)
        self.batch_share = max(1, limits.max_num_seqs // 2)
        self.stats = SchedulerStats()
        self.next_order = 0

    # -- the plan ------------------------------------------------------------------------------

    def schedule(self, block: bool = False, timeout_s: float | None = None) -> StepPlan:
        """The next step: every decoding sequence, the chunks of prompts under way (_prompt_shares),
        then new admissions while places, memory and the token budget last. `block`: wait for a
        request when nothing runs."""
        plan = StepPlan()
        budget = self._prompt_budget()
        reserve = self._admission_reserve(budget)
        shares = self._prompt_shares(budget - reserve)
        for sequence in sorted(self.running, key=lambda s: s.order):  # oldest first: victims come later
            if sequence.status is not Status.RUNNING:
                continue  # preempted while an older one grew
            if sequence.decoding:
                num_tokens = self._tokens_for(sequence, 0)
            elif not (num_tokens := shares.get(id(sequence), 0)):
                continue  # the step's budget is spent: this prompt moves at the next step
            if num_tokens and self._grow(sequence, num_tokens, plan):
                self._add(plan, sequence, num_tokens)
                budget -= num_tokens if not sequence.decoding else 0
        self._admit(plan, max(budget, reserve), block, timeout_s)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return plan

    def _prompt_budget(self) -> int:
        """Prompt tokens for this step: with decode rows, what their latency budget leaves (StepCosts)
        or the configured step_tokens; with none, up to ALONE_STEP_TOKENS."""
        decode_tokens = sum(self._tokens_for(s, 0) for s in self.running if s.decoding)
        if not decode_tokens:
            return max(self.limits.step_tokens, ALONE_STEP_TOKENS)
        return self.costs.prompt_tokens(decode_tokens) if self.costs is not None else self.limits.step_tokens

    def _admission_reserve(self, budget: int) -> int:
        """Prompt tokens of this step kept for requests not yet running, while any waits and a place
        is free: a quarter of the budget (whole blocks). Without it, long prompts under way (two
        96-tool agent requests: ~11,000 tokens each) took every step's budget and another tenant's
        two-line chat waited 16.7 s to start; with it, a short prompt starts at the next step and a
        long new one moves on beside those under way."""
        waiting = self.preempted or self.memory_wait is not None or self.waiting.qsize()
        if not waiting or len(self.running) >= self.limits.max_num_seqs:
            return 0
        block = self.limits.block_tokens
        return max(block, budget // 4 // block * block)

    def _prompt_shares(self, budget: int) -> dict[int, int]:
        """Prompt tokens of this step for each prompt under way (by id). Prompts whose tenants run
        fewest sequences share the budget first, evenly (the oldest take the odd blocks); those of
        busier tenants share what they leave. A lone tenant's prompts share it all, oldest first.
        So a tenant's prompt beside a flooding tenant's moves at the pace of a prompt alone, instead
        of an even share among every prompt the flood has under way."""
        prompts = [s for s in self.running if s.status is Status.RUNNING and not s.decoding]
        load = Counter(s.tenant for s in self.running)
        prompts.sort(key=lambda s: (load[s.tenant], s.order))
        left_at_load = Counter(load[s.tenant] for s in prompts)  # prompts not yet given, by their tenant's load
        shares = {}
        for index, sequence in enumerate(prompts):
            share = self._share(budget, left_at_load[load[sequence.tenant]], first=index == 0)
            left_at_load[load[sequence.tenant]] -= 1
            if share:
                shares[id(sequence)] = self._tokens_for(sequence, share)
                budget -= shares[id(sequence)]
        return shares

    def _share(self, budget: int, num_prompts: int, first: bool) -> int:
        """Prompt tokens for the next of `num_prompts` prompts sharing what is left of the budget (in
        _prompt_shares' order): an even share, in whole blocks (0: it waits for the next step). The
        first prompt of a step always moves a block at least; the others only while the budget
        lasts, so a step never carries more prompt tokens than its budget (six prompts under way
        once each took a block past it: 288 prompt tokens in a 128-token step, the decode rows'
        slowest steps)."""
        block = self.limits.block_tokens
        blocks_left = max(budget, 0) // block
        if not blocks_left:
            return block if first else 0
        return -(-blocks_left // num_prompts) * block  # the older prompts take the odd blocks

    def _tokens_for(self, sequence: Sequence, budget: int) -> int:
        """A decoding sequence: its pending token and its drafts. A prompt: what is left, or the largest whole
        number of blocks within the budget (at least one block)."""
        pending = sequence.num_pending_tokens
        if sequence.decoding:
            return pending + len(sequence.drafts)
        if pending <= budget:
            return pending
        block = self.limits.block_tokens
        return min(pending, max(block, budget // block * block))

    def _add(self, plan: StepPlan, sequence: Sequence, num_tokens: int) -> None:
        if sequence.decoding:
            plan.decode.append(sequence)
        else:
            plan.chunks.append((sequence, num_tokens))

    def _grow(self, sequence: Sequence, num_tokens: int, plan: StepPlan, others: bool = True) -> bool:
        """Hold KV for num_tokens more of the sequence, a block at a time, preempting the newest
        sequences while it does not fit (`others` False: the sequence itself, one just admitted,
        whose plan holds the others already); False if the sequence itself was preempted."""
        held = sequence.num_shared_tokens + sequence.num_reserved_tokens
        need = sequence.num_computed_tokens + num_tokens - held
        if need <= 0:
            return True
        block = self.limits.block_tokens
        extra = min(-(-need // block) * block, self._most(sequence) - held)
        while not self.memory.reserve(extra * self.limits.kv_bytes_per_token):
            victim = self._newest_running() if others else sequence
            self._preempt(victim, plan)
            if victim is sequence:
                return False
        sequence.num_reserved_tokens += extra
        return True

    def _newest_running(self) -> Sequence:
        return max((s for s in self.running if s.status is Status.RUNNING), key=lambda s: s.order)

    def _preempt(self, sequence: Sequence, plan: StepPlan) -> None:
        self.release(sequence)  # first: the room its KV held takes its blocks (its tail is evicted first)
        self.executor.preempt(sequence)
        sequence.status = Status.PREEMPTED
        sequence.num_computed_tokens = 0
        sequence.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.running.remove(sequence)
        self.preempted.append(sequence)
        plan.preempted.append(sequence)

    # -- admissions ----------------------------------------------------------------------------

    def _admit(self, plan: StepPlan, budget: int, block: bool, timeout_s: float | None) -> None:
        while len(self.running) < self.limits.max_num_seqs and budget >= self.limits.block_tokens:
            sequence = self._next_candidate(plan, block and not self.running and not plan, timeout_s)
            if sequence is None:
                return
            in_use = self.executor.num_tokens_in_use(sequence)
            first_tokens = min(sequence.num_tokens + self.limits.block_tokens, self._most(sequence))
            if not self._hold(sequence, first_tokens - in_use, plan):
                if self.running:  # they free memory as they end: wait at the head of the line
                    self._wait_for_memory(sequence)
                    return
                self.executor.refuse(sequence, "its KV does not fit the memory budget, which blocks in use hold")
                continue
            if sequence is self.memory_wait:
                self.memory_wait = None
            sequence.status = Status.RUNNING
            if not sequence.num_preemptions:  # its place in line is its first admission's
                sequence.order, self.next_order = self.next_order, self.next_order + 1
            self.running.append(sequence)
            if not self.executor.admit(sequence):
                self.finish(sequence)
                continue
            self._settle(sequence, in_use)
            num_tokens = self._tokens_for(sequence, budget)
            if not self._grow(sequence, num_tokens, plan, others=False):  # shared less than looked up, memory short
                continue
            plan.admitted.append(sequence)
            self._add(plan, sequence, num_tokens)
            budget -= num_tokens

    def _settle(self, sequence: Sequence, in_use: int) -> None:
        """The admission read num_shared_tokens in place where `in_use` were looked up (and left out
        of its reservation): tokens shared past those (blocks that were free) leave the reservation
        now; tokens looked up but not shared are reserved by _grow before each chunk needs them."""
        if (extra := sequence.num_shared_tokens - in_use) > 0:
            self.memory.release(extra * self.limits.kv_bytes_per_token)
            sequence.num_reserved_tokens -= extra

    def _wait_for_memory(self, sequence: Sequence) -> None:
        if sequence.status is Status.PREEMPTED:
            self.preempted.appendleft(sequence)  # still first in line
            return
        self.stats.num_memory_waits += sequence is not self.memory_wait
        self.memory_wait = sequence

    def _next_candidate(self, plan: StepPlan, block: bool, timeout_s: float | None) -> Sequence | None:
        """The oldest preempted sequence (it was running; not one preempted by this very plan), else the
        request waiting for memory at the head of the line, else the fair queue's next."""
        if self.preempted:
            oldest = min(self.preempted, key=lambda s: s.order)
            if oldest in plan.preempted:
                return None
            self.preempted.remove(oldest)
            return oldest
        if self.memory_wait is not None:
            return self.memory_wait
        return self.waiting.get(
            block=block, passed_over=self._holds_its_share, allowed=self._may_take_a_place, timeout_s=timeout_s
        )

    @staticmethod
    def _most(sequence: Sequence) -> int:
        """The most KV a sequence can ever hold: its prompt and max_tokens."""
        return sequence.num_prompt_tokens + sequence.max_tokens

    def _hold(self, sequence: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Reserve the sequence's first KV, leaving a block of room for each running sequence to
        grow into (admitting into the last free bytes only to preempt the newcomer a few steps
        later wastes its prefill); a sequence preempted this step is not let back in."""
        per_token = self.limits.kv_bytes_per_token
        room = len(self.running) * self.limits.block_tokens * per_token
        if not self.memory.reserve(num_tokens * per_token + self.limits.state_bytes + room):
            return False
        self.memory.release(room)
        sequence.num_reserved_tokens = num_tokens
        return True

    def _num_running(self, tenant: bytes) -> int:
        return sum(1 for sequence in self.running if sequence.tenant == tenant)

    def _holds_its_share(self, tenant: bytes) -> bool:
        return self._num_running(tenant) >= self.batch_share

    def _may_take_a_place(self, tenant: bytes) -> bool:
        """Once more than one tenant has been served, the last free place is kept for a tenant with
        nothing running (another tenant's request then starts at the next step instead of waiting
        for a flooding tenant's sequence to end). A lone tenant may take every place."""
        if len(self.running) < self.limits.max_num_seqs - 1 or self.waiting.num_tenants_served() < 2:
            return True
        return self._num_running(tenant) == 0

    # -- endings -------------------------------------------------------------------------------

    def finish(self, sequence: Sequence) -> None:
        """The sequence ended (answered, failed or cancelled): its memory is free."""
        self.release(sequence)
        sequence.status = Status.FINISHED
        if sequence in self.running:
            self.running.remove(sequence)

    def release(self, sequence: Sequence) -> None:
        """Give the sequence's memory back (it is ending; finish() follows). Its recurrent state was
        held with its first tokens (num_reserved_tokens > 0 from _hold on). The cached blocks it
        reads go back to the pool as its session closes."""
        if sequence.num_reserved_tokens:
            self.memory.release(sequence.num_reserved_tokens * self.limits.kv_bytes_per_token + self.limits.state_bytes)
        sequence.num_reserved_tokens = sequence.num_shared_tokens = 0

    def share(self, sequence: Sequence, num_tokens: int) -> None:
        """num_tokens more of the running sequence's KV are now read in place from cached blocks,
        which the pool counts while the sequence holds them: its reservation lets them go, so each
        byte is counted once."""
        assert 0 < num_tokens <= sequence.num_reserved_tokens, (num_tokens, sequence.num_reserved_tokens)
        self.memory.release(num_tokens * self.limits.kv_bytes_per_token)
        sequence.num_reserved_tokens -= num_tokens
        sequence.num_shared_tokens += num_tokens

    def unshare(self, sequence: Sequence) -> bool:
        """The running sequence is to hold its shared tokens in its own cache again: reserve them
        (cached blocks give way); False, changing nothing, when they do not fit."""
        if not self.memory.reserve(sequence.num_shared_tokens * self.limits.kv_bytes_per_token):
            return False
        sequence.num_reserved_tokens += sequence.num_shared_tokens
        sequence.num_shared_tokens = 0
        return True

    def held(self) -> list[Sequence]:
        """Every sequence taken from the queue and not finished: running, preempted, waiting for memory."""
        waiting_for_memory = [self.memory_wait] if self.memory_wait is not None else []
        return [*self.running, *self.preempted, *waiting_for_memory]
