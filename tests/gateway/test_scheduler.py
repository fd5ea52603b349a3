"""The scheduler's step plans on fake sequences: token budget, batched admissions, memory that grows
and preempts, fairness across tenants, no starvation. No model: the scheduler imports no MLX."""

from __future__ import annotations

import pytest

from gateway.engine.fair_queue import FairQueue
from gateway.engine.scheduler import ALONE_STEP_TOKENS, Limits, Scheduler, Sequence, Status

BLOCK = 16


class Memory:
    """A byte budget; bytes_per_token 1, so bytes are tokens."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0

    def reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.capacity:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, "released more than was reserved"


class Executor:
    """Admits with an optional cached prefix; records preemptions and refusals."""

    def __init__(self, cached: int = 0, in_use: int = 0, mapped: int = 0):
        self.cached, self.preempted, self.refused = cached, [], []
        self.in_use, self.mapped = in_use, mapped  # of the cached prefix: looked up, then read in place

    def num_tokens_in_use(self, sequence: Sequence) -> int:
        return self.in_use

    def admit(self, sequence: Sequence) -> bool:
        sequence.admission = object()
        sequence.num_computed_tokens = self.cached if not sequence.generated else sequence.num_tokens // BLOCK * BLOCK
        sequence.num_shared_tokens = self.mapped
        return True

    def preempt(self, sequence: Sequence) -> None:
        assert sequence.status is Status.RUNNING
        self.preempted.append(sequence)
        sequence.admission = None
        sequence.sampler = None

    def refuse(self, sequence: Sequence, reason: str) -> None:
        self.refused.append(sequence)


def _scheduler(capacity=10**9, max_num_seqs=8, step_tokens=64, cached=0):
    queue = FairQueue(64, tenant_share=32)
    executor = Executor(cached)
    scheduler = Scheduler(Limits(max_num_seqs, step_tokens, BLOCK, 1), Memory(capacity), executor, queue)
    return scheduler, executor


def _submit(scheduler, prompt_tokens, max_tokens=32, tenant=b"a"):
    sequence = Sequence(tenant, prompt_tokens, max_tokens)
    scheduler.waiting.put(tenant, sequence)
    return sequence


def _execute(scheduler, plan, token=7):
    """What the worker does with a plan: feed the tokens, sample one per row that has its logits."""
    for sequence in plan.decode:
        sequence.num_computed_tokens += 1
    for sequence, num_tokens in plan.chunks:
        sequence.num_computed_tokens += num_tokens
        if sequence.num_computed_tokens == sequence.num_tokens:
            sequence.admission, sequence.sampler = None, object()
    for sequence in list(scheduler.running):
        if sequence.decoding and sequence.num_pending_tokens == 0:
            if len(sequence.generated) == sequence.max_tokens:
                scheduler.finish(sequence)
            else:
                sequence.generated.append(token)


def _run_until_idle(scheduler, max_steps=10_000):
    plans = []
    for _ in range(max_steps):
        plan = scheduler.schedule()
        if not plan:
            return plans
        _execute(scheduler, plan)
        plans.append(plan)
    raise AssertionError("never idle")


def _long_prompts_under_way(prompt_tokens: int, decoding_tenant: bytes, prompts_tenant: bytes):
    """A 128-token step budget, one decoding row, and two long prompts three steps into coming in."""
    scheduler, _ = _scheduler(step_tokens=128)
    decoding = _submit(scheduler, 10, max_tokens=500, tenant=decoding_tenant)
    _execute(scheduler, scheduler.schedule())
    longs = [_submit(scheduler, prompt_tokens, tenant=prompts_tenant) for _ in range(2)]
    for _ in range(3):
        _execute(scheduler, scheduler.schedule())
    return scheduler, decoding, longs


def test_prompt_chunks_share_the_step_token_budget_in_whole_blocks():
    scheduler, _ = _scheduler(step_tokens=64)
    decoding = _submit(scheduler, 10, max_tokens=100)
    _execute(scheduler, scheduler.schedule())
    a, b = _submit(scheduler, 100), _submit(scheduler, 40)
    plan = scheduler.schedule()
    assert plan.decode == [decoding] and plan.chunks == [(a, 64)]  # a's first 64 tokens use the budget
    _execute(scheduler, plan)
    plan = scheduler.schedule()
    assert plan.chunks == [(a, 36), (b, 16)]  # a's rest, then b's first whole block within what is left
    assert plan.admitted == [b]


def test_with_no_stream_to_stall_a_prompt_runs_in_long_chunks():
    scheduler, _ = _scheduler(step_tokens=64)
    sequence = _submit(scheduler, 1000)
    assert scheduler.schedule().chunks == [(sequence, ALONE_STEP_TOKENS)]


def test_several_short_prompts_come_in_in_one_step():
    scheduler, _ = _scheduler(step_tokens=256)
    sequences = [_submit(scheduler, 50) for _ in range(4)]
    plan = scheduler.schedule()
    assert plan.chunks == [(s, 50) for s in sequences] and plan.admitted == sequences


def test_decode_rows_run_every_step_beside_a_long_prompt():
    scheduler, _ = _scheduler(step_tokens=32)
    short = _submit(scheduler, 10, max_tokens=100)
    _execute(scheduler, scheduler.schedule())
    long = _submit(scheduler, 500)
    for _ in range(10):
        plan = scheduler.schedule()
        assert plan.decode == [short] and plan.chunks == [(long, 32)]
        _execute(scheduler, plan)


def test_a_short_prompt_starts_at_the_next_step_beside_long_prompts_under_way():
    """Long prompts under way leave a quarter of the budget to requests waiting to start (before,
    two 11,000-token agent prompts kept another tenant's short chat waiting until both were in)."""
    scheduler, decoding, longs = _long_prompts_under_way(11_000, b"a", b"agent")
    short = _submit(scheduler, 20, tenant=b"b")
    plan = scheduler.schedule()
    assert plan.admitted == [short] and (short, 20) in plan.chunks and plan.decode == [decoding]
    assert all(sequence in [s for s, _ in plan.chunks] for sequence in longs)  # they move on too
    assert sum(n for _, n in plan.chunks) <= 128  # within the step's budget
    _execute(scheduler, plan)
    plan = scheduler.schedule()  # nobody waits: the long prompts share the whole budget again
    assert plan.chunks == [(longs[0], 64), (longs[1], 64)]


def test_a_prompt_of_a_tenant_running_fewer_sequences_takes_the_budget_first():
    """Beside a flooding tenant's long prompts under way, another tenant's prompt moves at the pace
    of a prompt alone (bench_load --fairness: its TTFT p50 0.40 -> 0.25 s), and the flood's prompts
    share the budget again once it is in; the flood's decoding row moves at every step."""
    scheduler, decoding, longs = _long_prompts_under_way(2000, b"flood", b"flood")
    other = _submit(scheduler, 300, tenant=b"b")
    plan = scheduler.schedule()
    assert plan.admitted == [other]
    _execute(scheduler, plan)
    while not other.decoding:
        pending = other.num_pending_tokens
        plan = scheduler.schedule()
        assert plan.decode == [decoding] and plan.chunks[-1] == (other, min(128, pending))
        assert sum(n for _, n in plan.chunks) <= 128  # the flood's prompts take only what it leaves
        _execute(scheduler, plan)
    plan = scheduler.schedule()
    assert plan.chunks == [(longs[0], 64), (longs[1], 64)] and other in plan.decode


def test_many_prompts_under_way_share_the_budget_and_never_exceed_it():
    """Ten prompts coming in at once beside a decoding row, under a 128-token budget: those under
    way share it in whole blocks, oldest first, and the rest wait their turn; no step carries more
    (before, each prompt under way took a block past the budget), and every prompt gets in."""
    scheduler, _ = _scheduler(step_tokens=128)
    decoding = _submit(scheduler, 10, max_tokens=500)
    _execute(scheduler, scheduler.schedule())
    prompts = [_submit(scheduler, 300, tenant=bytes([65 + i])) for i in range(10)]
    most_under_way = 0
    for _ in range(200):
        plan = scheduler.schedule()
        most_under_way = max(most_under_way, sum(1 for s in scheduler.running if not s.decoding))
        assert decoding in plan.decode
        assert sum(n for _, n in plan.chunks) <= 128, [n for _, n in plan.chunks]
        _execute(scheduler, plan)
        if all(sequence.decoding or sequence.status is Status.FINISHED for sequence in prompts):
            break
    assert most_under_way >= 4
    assert all(sequence.decoding or sequence.status is Status.FINISHED for sequence in prompts)


def test_a_prompt_with_a_cached_prefix_runs_only_the_rest():
    scheduler, _ = _scheduler(step_tokens=512, cached=96)
    sequence = _submit(scheduler, 100)
    assert scheduler.schedule().chunks == [(sequence, 4)]


def test_kv_is_held_for_the_prompt_then_grows_a_block_at_a_time():
    scheduler, _ = _scheduler(step_tokens=512)
    memory = scheduler.memory
    sequence = _submit(scheduler, 40, max_tokens=1000)
    _execute(scheduler, scheduler.schedule())
    assert sequence.num_reserved_tokens == 40 + BLOCK == memory.used  # not 40 + 1000
    for _ in range(30):
        _execute(scheduler, scheduler.schedule())
    assert sequence.num_computed_tokens == 40 + 30 - 1 + 1
    needed = sequence.num_computed_tokens + sequence.num_pending_tokens
    assert 0 <= sequence.num_reserved_tokens - needed < BLOCK == memory.used - sequence.num_reserved_tokens + BLOCK
    scheduler.finish(sequence)
    assert memory.used == 0


def test_growth_never_holds_more_than_prompt_and_max_tokens():
    scheduler, _ = _scheduler(step_tokens=512)
    sequence = _submit(scheduler, 40, max_tokens=5)
    _run_until_idle(scheduler)
    assert sequence.status is Status.FINISHED and scheduler.memory.used == 0
    sequence = _submit(scheduler, 40, max_tokens=5)
    _execute(scheduler, scheduler.schedule())
    assert sequence.num_reserved_tokens == 45


def test_many_sequences_with_large_max_tokens_run_together_under_a_small_budget():
    """Worst-case reservations (100 + 4096 tokens each) would let none of these run in 2,000
    tokens; holding what they use lets all eight run at once."""
    scheduler, executor = _scheduler(capacity=2000, step_tokens=1024)
    sequences = [_submit(scheduler, 100, max_tokens=4096) for _ in range(8)]
    for _ in range(10):
        _execute(scheduler, scheduler.schedule())
    assert all(s.status is Status.RUNNING for s in sequences) and not executor.preempted
    assert scheduler.stats.peak_running == 8


def test_when_memory_runs_out_the_newest_sequence_is_preempted_and_resumes_first():
    scheduler, executor = _scheduler(capacity=240, step_tokens=512)  # one whole sequence (232) fits
    sequences = [_submit(scheduler, 32, max_tokens=200, tenant=bytes([i])) for i in range(4)]
    while not executor.preempted:
        _execute(scheduler, scheduler.schedule())
        assert scheduler.memory.used <= scheduler.memory.capacity
    assert executor.preempted == [sequences[-1]]  # the newest goes first
    late = _submit(scheduler, 8, max_tokens=4, tenant=b"z")
    while late.status is Status.WAITING:
        plan = scheduler.schedule()
        if late in plan.admitted:  # only once every preempted sequence is back, and after them
            assert not scheduler.preempted and plan.admitted[-1] is late
        _execute(scheduler, plan)
    assert sequences[-1].status is not Status.PREEMPTED
    _run_until_idle(scheduler)
    assert all(s.status is Status.FINISHED and len(s.generated) == 200 for s in sequences)
    assert late.status is Status.FINISHED and scheduler.memory.used == 0
    assert scheduler.stats.num_preemptions == len(executor.preempted)


def test_a_preempted_sequence_resumes_with_its_tokens_so_far():
    scheduler, executor = _scheduler(capacity=150, step_tokens=512)  # one whole (132), not two
    first, second = _submit(scheduler, 32, max_tokens=100), _submit(scheduler, 32, max_tokens=100)
    while not executor.preempted:
        _execute(scheduler, scheduler.schedule())
    victim = executor.preempted[0]
    assert victim is second and victim.status is Status.PREEMPTED and victim.num_reserved_tokens == 0
    generated = list(victim.generated)
    while victim not in (plan := scheduler.schedule()).admitted:
        _execute(scheduler, plan)
    assert victim.generated == generated  # nothing was lost
    assert victim.num_computed_tokens == victim.num_tokens // BLOCK * BLOCK  # its cached blocks came back
    assert (victim, victim.num_tokens % BLOCK) in plan.chunks  # the rest runs as a prompt
    assert first.status in (Status.RUNNING, Status.FINISHED)


def test_a_request_that_does_not_fit_waits_at_the_head_of_the_line():
    scheduler, executor = _scheduler(capacity=200, step_tokens=512)
    big = _submit(scheduler, 150, max_tokens=10)
    blocker = scheduler.schedule().chunks[0][0]
    assert blocker is big
    waiting = _submit(scheduler, 100, max_tokens=10)
    small = _submit(scheduler, 10, max_tokens=10)
    _execute(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert scheduler.memory_wait is waiting and small not in plan.admitted  # nobody overtakes it
    assert scheduler.stats.num_memory_waits == 1
    _run_until_idle(scheduler)
    assert waiting.status is Status.FINISHED and small.status is Status.FINISHED and not executor.refused


def test_a_request_that_cannot_fit_with_nothing_running_is_refused():
    scheduler, executor = _scheduler(capacity=50, step_tokens=512)
    sequence = _submit(scheduler, 60)
    assert not scheduler.schedule()
    assert executor.refused == [sequence] and scheduler.memory.used == 0


def test_a_tenant_holds_at_most_half_of_the_places_while_others_wait():
    scheduler, _ = _scheduler(max_num_seqs=4, step_tokens=4096)
    flood = [_submit(scheduler, 20, max_tokens=1000, tenant=b"a") for _ in range(6)]
    other = [_submit(scheduler, 20, max_tokens=1000, tenant=b"b") for _ in range(2)]
    plan = scheduler.schedule()
    assert plan.admitted == [flood[0], other[0], flood[1]]  # turns; a stops at its half (2 of 4 places)
    # the last place is kept for a tenant with nothing running: b has a sequence, so nobody takes it
    assert len(scheduler.running) == 3


@pytest.mark.parametrize("max_num_seqs", [2, 3])
def test_the_last_place_is_kept_for_a_tenant_with_nothing_running(max_num_seqs):
    scheduler, _ = _scheduler(max_num_seqs=max_num_seqs, step_tokens=4096)
    _submit(scheduler, 10, max_tokens=1, tenant=b"b")
    _run_until_idle(scheduler)  # b has been served
    for _ in range(6):
        _submit(scheduler, 10, max_tokens=1000, tenant=b"a")
    for _ in range(5):
        _execute(scheduler, scheduler.schedule())
    assert len(scheduler.running) == max_num_seqs - 1
    late = _submit(scheduler, 10, max_tokens=1000, tenant=b"b")
    assert late in scheduler.schedule().admitted


def test_no_request_starves_under_a_steady_flood():
    """Requests keep arriving; every one of them ends, each within a bounded number of steps."""
    scheduler, _ = _scheduler(capacity=600, max_num_seqs=4, step_tokens=64)
    submitted: dict[int, Sequence] = {}
    finished_at: dict[int, int] = {}
    for step in range(1000):
        if step % 8 == 0 and step < 600:
            submitted[step] = _submit(scheduler, 40 + step % 50, max_tokens=20, tenant=bytes([step % 3]))
        _execute(scheduler, scheduler.schedule())
        for start, sequence in submitted.items():
            if sequence.status is Status.FINISHED:
                finished_at.setdefault(start, step)
    assert set(finished_at) == set(submitted) and scheduler.memory.used == 0
    assert all(len(sequence.generated) == 20 for sequence in submitted.values())
    assert max(end - start for start, end in finished_at.items()) < 200


def test_a_prompt_shorter_than_a_block_past_the_budget_takes_what_is_left():
    scheduler, _ = _scheduler(step_tokens=32)
    first, second = _submit(scheduler, 30), _submit(scheduler, 10)
    plan = scheduler.schedule()
    assert plan.chunks == [(first, 30), (second, 10)]  # the budget left (2) rounds up to a block, cut to 10


def test_a_request_waiting_for_memory_keeps_its_place_while_a_preempted_one_resumes():
    scheduler, executor = _scheduler(capacity=240, step_tokens=512)
    sequences = [_submit(scheduler, 32, max_tokens=200, tenant=bytes([i])) for i in range(4)]
    late = _submit(scheduler, 150, max_tokens=4, tenant=b"z")
    while not executor.preempted:
        _execute(scheduler, scheduler.schedule())
    assert scheduler.memory_wait is late
    _run_until_idle(scheduler)
    assert late.status is Status.FINISHED and all(s.status is Status.FINISHED for s in sequences)


def test_a_resumed_sequence_growing_never_preempts_one_already_in_the_plan():
    """Every sequence a plan feeds is still running when the plan is returned (a resumed sequence
    keeps its old place in line, so the newest is still the last one planned), and preempted
    sequences come back oldest first."""
    scheduler, executor = _scheduler(capacity=300, step_tokens=512)  # two preempted at once, resumed in turn
    for i in range(6):
        _submit(scheduler, 32, max_tokens=200, tenant=bytes([i]))
    for _ in range(3000):
        in_line = sorted(sequence.order for sequence in scheduler.preempted)
        plan = scheduler.schedule()
        if not plan:
            break
        resumed = [sequence.order for sequence in plan.admitted if sequence.num_preemptions]
        assert resumed == in_line[: len(resumed)]  # the oldest preempted come back first
        fed = plan.decode + [sequence for sequence, _ in plan.chunks]
        assert all(sequence.status is Status.RUNNING for sequence in fed)
        assert not set(fed) & set(plan.preempted)
        _execute(scheduler, plan)
    assert len(executor.preempted) >= 3


def test_each_running_sequence_holds_its_recurrent_state_until_it_ends():
    """A hybrid model's sequences hold a fixed state besides their KV: admission reserves it (so fewer
    fit), and finishing or preemption gives it back exactly once."""
    queue = FairQueue(64, tenant_share=32)
    memory, executor = Memory(2 * (36 + 100) + 100), Executor()  # KV for 36 tokens (32 + 4) each
    scheduler = Scheduler(Limits(8, 64, BLOCK, 1, state_bytes=100), memory, executor, queue)
    sequences = [_submit(scheduler, 32, max_tokens=4) for _ in range(3)]
    plan = scheduler.schedule()
    assert plan.admitted == sequences[:2]  # a third state does not fit beside two (its KV alone would)
    assert memory.used == 2 * (36 + 100)
    _run_until_idle(scheduler)
    assert all(s.status is Status.FINISHED for s in sequences) and memory.used == 0


def test_with_decode_rows_a_step_carries_what_their_latency_budget_leaves():
    """The budget comes from the step costs (gateway/engine/step_costs.py): measured passes where a
    prompt token costs 0.25 ms and a row 1 ms leave 16 rows 316 tokens of a 100 ms budget (304 in
    blocks); with no row decoding, a prompt still runs in ALONE_STEP_TOKENS chunks."""
    from gateway.engine.step_costs import WINDOW, StepCosts

    costs = StepCosts(100.0, 64, BLOCK, ALONE_STEP_TOKENS)
    for index in range(WINDOW):
        tokens = (index % 4) * 64 if index % 2 else 0
        costs.record(16, tokens, 5.0 + 16 * 1.0 + 0.25 * tokens)
        costs.record(4, tokens, 5.0 + 4 * 1.0 + 0.25 * tokens)
    queue = FairQueue(64, tenant_share=32)
    scheduler = Scheduler(Limits(32, 64, BLOCK, 1), Memory(10**9), Executor(), queue, costs)
    alone = _submit(scheduler, 1000)
    assert scheduler.schedule().chunks == [(alone, ALONE_STEP_TOKENS)]
    scheduler.finish(alone)
    rows = [_submit(scheduler, 10, max_tokens=100) for _ in range(16)]
    _execute(scheduler, scheduler.schedule())
    long = _submit(scheduler, 2000)
    plan = scheduler.schedule()
    assert plan.decode == rows and plan.chunks == [(long, 304)]


def test_a_row_reading_cached_blocks_in_place_holds_only_its_own_kv_and_grows_past_them():
    """share(): a decoding sequence's first 64 tokens move from its reservation to the pool; it
    then grows a block when its own KV passes what it holds, and release() gives back only its own."""
    scheduler, _ = _scheduler(capacity=1000)
    sequence = _submit(scheduler, 70, max_tokens=100)
    while not sequence.decoding:
        _execute(scheduler, scheduler.schedule())
    reserved = sequence.num_reserved_tokens
    scheduler.share(sequence, 64)
    assert (sequence.num_reserved_tokens, sequence.num_shared_tokens) == (reserved - 64, 64)
    assert scheduler.memory.used == reserved - 64
    while sequence.num_computed_tokens < reserved:  # the tokens it held before sharing, now partly the pool's
        _execute(scheduler, scheduler.schedule())
    held = sequence.num_reserved_tokens + 64
    assert held == sequence.num_computed_tokens == reserved  # it has not needed more yet
    _execute(scheduler, scheduler.schedule())
    assert sequence.num_reserved_tokens + 64 == held + BLOCK  # its next token took a block more
    assert scheduler.memory.used == sequence.num_reserved_tokens
    scheduler.release(sequence)
    assert scheduler.memory.used == 0 and sequence.num_shared_tokens == 0


def test_a_row_taking_its_shared_tokens_back_reserves_them_or_changes_nothing():
    scheduler, _ = _scheduler(capacity=200)
    sequence = _submit(scheduler, 70, max_tokens=100)
    while not sequence.decoding:
        _execute(scheduler, scheduler.schedule())
    scheduler.share(sequence, 64)
    held = sequence.num_reserved_tokens
    scheduler.memory.capacity = scheduler.memory.used + 63  # one token short of the copy
    assert not scheduler.unshare(sequence)
    assert (sequence.num_reserved_tokens, sequence.num_shared_tokens) == (held, 64)
    scheduler.memory.capacity += 1
    assert scheduler.unshare(sequence)
    assert (sequence.num_reserved_tokens, sequence.num_shared_tokens) == (held + 64, 0)
    assert scheduler.memory.used == held + 64


@pytest.mark.parametrize(
    ("in_use", "mapped", "own"),
    [(64, 64, 200 + BLOCK - 64), (0, 64, 200 + BLOCK - 64), (64, 32, 200 - 32)],
)
def test_a_prompt_reading_its_prefix_in_place_reserves_only_its_own_tokens(in_use, mapped, own):
    """The blocks a prompt will read in place (looked up before it is admitted) stay out of its first
    reservation; what it then reads settles it: shared past the lookup leaves the reservation, shared
    short of it is reserved (a block at a time) before its first chunk runs."""
    scheduler, executor = _scheduler(cached=64)
    executor.in_use, executor.mapped = in_use, mapped
    sequence = _submit(scheduler, 200, max_tokens=100)
    plan = scheduler.schedule()
    assert plan.chunks == [(sequence, 200 - 64)] and sequence.num_shared_tokens == mapped
    assert sequence.num_reserved_tokens == own == scheduler.memory.used
    assert sequence.num_shared_tokens + sequence.num_reserved_tokens >= 200  # the chunk's KV is held
    scheduler.release(sequence)
    assert scheduler.memory.used == 0


def test_a_prompt_that_shared_less_than_looked_up_steps_back_when_memory_is_short():
    """Its chunk would compute KV its memory does not hold: it is preempted before it runs (no older
    sequence is, their step is planned already) and waits first in line."""
    scheduler, executor = _scheduler(capacity=616 + 152 + BLOCK, cached=64)
    running = _submit(scheduler, 600, max_tokens=100)
    _execute(scheduler, scheduler.schedule())
    executor.in_use, executor.mapped = 64, 0
    newcomer = _submit(scheduler, 200, max_tokens=100)
    # its first reservation, 216 - 64 looked up, fits beside the 616 held (and a block of room); its
    # chunk then needs the 48 tokens past them it did not share
    plan = scheduler.schedule()
    assert newcomer not in [s for s, _ in plan.chunks] and newcomer in plan.preempted
    assert running.status is Status.RUNNING and running not in plan.preempted
    assert scheduler.memory.used == running.num_reserved_tokens and list(scheduler.preempted) == [newcomer]
