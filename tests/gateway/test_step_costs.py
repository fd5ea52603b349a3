"""The prompt tokens a step with decode rows carries, from its latency budget and the steps' measured
costs (gateway/engine/step_costs.py): the fit recovers a machine's costs from timed passes, follows
a change of machine load, holds the configured length until it can fit, and stays in whole blocks
between one block and the most a step may carry."""

from __future__ import annotations

import random

from gateway.engine.step_costs import MIN_PASSES, WINDOW, StepCosts

BLOCK = 16


def _costs(budget_ms: float = 100.0, start: int = 128, most: int = 512) -> StepCosts:
    return StepCosts(budget_ms, start, BLOCK, most)


def _passes(costs: StepCosts, fixed: float, per_row: float, per_token: float, count: int, seed: int = 0) -> None:
    """`count` passes of varied shapes, half with prompt tokens, timed by the given costs with 3% noise."""
    rng = random.Random(seed)
    for index in range(count):
        rows = rng.randint(1, 16)
        tokens = rng.choice((16, 64, 128, 256)) if index % 2 else 0
        ms = (fixed + per_row * rows + per_token * tokens) * rng.uniform(0.97, 1.03)
        costs.record(rows, tokens, ms)


def test_the_fit_gives_the_tokens_the_budget_leaves_after_the_rows():
    costs = _costs()
    _passes(costs, fixed=5.0, per_row=1.0, per_token=0.25, count=WINDOW)
    # 16 rows: 100 - 5 - 16 = 79 ms left, at 0.25 ms a token: 316 tokens -> 304 in whole blocks (within the noise)
    assert 288 <= costs.prompt_tokens(16) <= 320
    assert costs.prompt_tokens(16) % BLOCK == 0
    assert costs.prompt_tokens(2) > costs.prompt_tokens(16)  # fewer rows leave more of the budget


def test_the_configured_length_holds_until_passes_with_and_without_prompts_were_timed():
    costs = _costs(start=128)
    for _ in range(3 * MIN_PASSES):
        costs.record(16, 128, 40.0)  # only mixed passes: nothing says what the rows cost alone
    assert costs.prompt_tokens(16) == 128
    for _ in range(MIN_PASSES - 1):
        costs.record(16, 0, 15.0)
    assert costs.prompt_tokens(16) == 128
    costs.record(16, 0, 15.0)
    assert costs.prompt_tokens(16) != 128


def test_the_fit_follows_the_machine_when_its_steps_get_slower():
    costs = _costs()
    _passes(costs, fixed=5.0, per_row=1.0, per_token=0.25, count=WINDOW)
    before = costs.prompt_tokens(16)
    _passes(costs, fixed=5.0, per_row=1.0, per_token=0.5, count=WINDOW, seed=1)  # another load on the cores
    assert costs.prompt_tokens(16) < before * 0.6


def test_a_budget_the_rows_alone_exceed_leaves_one_block_and_a_fast_machine_the_most():
    slow = _costs(budget_ms=10.0)
    _passes(slow, fixed=5.0, per_row=1.0, per_token=0.25, count=WINDOW)
    assert slow.prompt_tokens(16) == BLOCK
    fast = _costs(budget_ms=100.0, most=512)
    _passes(fast, fixed=1.0, per_row=0.1, per_token=0.01, count=WINDOW)
    assert fast.prompt_tokens(16) == 512


def test_no_budget_keeps_the_configured_length_and_records_nothing():
    costs = _costs(budget_ms=0.0, start=96)
    _passes(costs, fixed=5.0, per_row=1.0, per_token=0.25, count=WINDOW)
    assert costs.prompt_tokens(16) == 96 and not costs.passes


def test_times_that_show_no_cost_per_prompt_token_keep_the_configured_length():
    costs = _costs(start=128)
    for index in range(WINDOW):
        costs.record(16, 64 if index % 2 else 0, 20.0 if index % 2 else 30.0)  # prompts "make steps faster"
    assert costs.fit is None and costs.prompt_tokens(16) == 128
