"""How many prompt tokens a step with decode rows may carry: as many as its latency budget allows,
at what this machine's steps have been measured to cost.

Every decode row of a step waits for the step's end, so a stream's time between two tokens is the
time of the steps it is in. A fixed chunk length is wrong on every machine but one: too short, a
prompt takes many steps and most steps are slow mixed ones (the demo model on a 2-core Xeon, 16
clients: 128-token chunks gave ITL p50 48 ms, 256-token chunks 26-29 ms, more tok/s and half the
TTFT, at the same p99); too long, the slowest step grows without bound. So each pass of the worker
loop is timed with its shape, and a least-squares fit over the last WINDOW passes gives

    ms = fixed + per_row * decode_tokens + per_token * prompt_tokens

(decode_tokens: the rows' pending tokens and drafts) from which a step with that many decode tokens
gets the prompt tokens the budget leaves. Until the passes vary enough to fit (both with and
without prompt tokens), the configured length holds.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64  # passes kept: a few seconds of serving, so the fit follows the load
MIN_PASSES = 8  # of each kind (with and without prompt tokens) before the fit is used


class StepCosts:
    """Invariant: `passes` holds (decode_tokens, prompt_tokens, ms) of the last WINDOW timed passes
    that ran a model call; `prompt_tokens()` returns whole blocks, at least one and at most
    `most_tokens`."""

    def __init__(self, budget_ms: float, start_tokens: int, block_tokens: int, most_tokens: int):
        self.budget_ms = budget_ms  # 0: the chunk length stays start_tokens
        self.start_tokens = start_tokens
        self.block_tokens = block_tokens
        self.most_tokens = most_tokens
        self.passes: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self.fit: tuple[float, float, float] | None = None  # (fixed, per_row, per_token) ms

    def record(self, decode_tokens: int, prompt_tokens: int, ms: float) -> None:
        if not self.budget_ms or not (decode_tokens or prompt_tokens):
            return
        self.passes.append((decode_tokens, prompt_tokens, ms))
        self.fit = self._fitted()

    def prompt_tokens(self, decode_tokens: int) -> int:
        """Prompt tokens for a step that feeds `decode_tokens` to its decode rows."""
        if not self.budget_ms or self.fit is None:
            return self.start_tokens
        fixed, per_row, per_token = self.fit
        tokens = int((self.budget_ms - fixed - per_row * decode_tokens) / per_token)
        return min(self.most_tokens, max(self.block_tokens, tokens // self.block_tokens * self.block_tokens))

    def _fitted(self) -> tuple[float, float, float] | None:
        with_prompt = sum(1 for _, tokens, _ in self.passes if tokens)
        if min(with_prompt, len(self.passes) - with_prompt) < MIN_PASSES:
            return None
        shapes = np.array([(1.0, decode, tokens) for decode, tokens, _ in self.passes])
        times = np.array([ms for _, _, ms in self.passes])
        (fixed, per_row, per_token), *_ = np.linalg.lstsq(shapes, times, rcond=None)
        if per_token <= 0:  # noise over too narrow a spread of lengths: no cost to go by
            return None
        return max(fixed, 0.0), max(per_row, 0.0), float(per_token)
