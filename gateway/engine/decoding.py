"""The sequences decoding together: their batch, drafts, draws, verification and text.

    rows.join(sequence, prefill)      the prompt has run: the sequence becomes the batch's last row
                                      (what it reads of cached blocks in place is share()d)
    rows.leave(index, pressed) -> prefill   its KV back in its own cache (to store, or to preempt)
    rows.propose()                    every row's drafts for the next step (one width for all)
    rows.part() -> Part | None        the rows' pending tokens and drafts, as one part of a step
    rows.take_logits(logits)          what the step computed for them
    rows.sample()                     draw, verify drafts, send text; rows that ended are retired

Invariant: `rows[i]` is the sequence of the batch's row i; only join() and leave() change either,
together. The step executor (gateway/engine/steps.py) owns the scheduler and joins rows; a row that
ended or failed goes back to it through `retire(index)` and `fail(job, exc)`.
Only the engine's worker thread calls in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import mlx.core as mx

from .batch import DecodeBatch
from .jobs import Delta, Finished, Job
from .mapped_kv import first_own_token
from .mtp import ModelHeads
from .runner import ModelRunner, Part, PrefillResult
from .sampling import Draw, Sampler, draw_all
from .scheduler import Sequence
from .speculative import Acceptance, Drafter, Proposer, SpeculativeReport, batch_width, default_proposers
from .text import TextStream

log = logging.getLogger("strata.engine")


class DecodeRows:
    def __init__(
        self,
        runner: ModelRunner,
        stats,
        max_verify_tokens: int,
        retire: Callable[[int], None],
        fail: Callable[[Job, Exception], None],
        share: Callable[[Sequence, int], None],
        unshare: Callable[[Sequence], bool],
    ):
        self.runner = runner
        self.stats = stats  # the worker's EngineStats: steps, drafts
        self.batch = DecodeBatch(runner)
        self.rows: list[Sequence] = []  # rows[i] is row i of self.batch
        self.retire = retire
        self.fail = fail
        self.share = share  # a row's tokens now read in place from cached blocks: its memory says so
        self.unshare = unshare  # ... and back in its own cache: its memory holds them again, if they fit
        # Speculative decoding: a sequence -> the proposers of its drafts, verified in the step that
        # feeds them (gateway/engine/speculative.py). None: one token per row and step.
        self.proposers: Callable[[Sequence], list[Proposer]] | None = self._proposers if max_verify_tokens else None
        # Tokens a decode step feeds at most over its rows, drafts included (the rows' pending tokens
        # always go): a wide batch verifies narrower drafts.
        self.max_verify_tokens = max_verify_tokens
        self.acceptance = Acceptance()  # each proposer's rate over every row: where a new row's starts
        # The last step's logits, one row each (no drafts), until sample() reads them: its rows
        # that draw greedily take one argmax over all of them. None otherwise.
        self.step_logits: mx.array | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, sequence: Sequence, prefill: PrefillResult) -> None:
        """The sequence's prompt has run: it becomes the last row; its first token is drawn from the
        prompt's last logits at the next sample()."""
        if not self.rows and first_own_token(prefill.cache) and self.unshare(sequence):
            self.batch.own_copy(prefill)  # alone: on a copy of its own, by the rule for a row left alone
        self.batch.join(prefill)
        sequence.logits = prefill.logits[None]  # one position: the prompt's last
        self.rows.append(sequence)
        for index, row in enumerate(self.rows):  # the new row, and the first when the rows went to segments
            if (shared := self.batch.shared_tokens(index) - row.num_shared_tokens) > 0:
                self.share(row, shared)
        self._own_cache_when_alone()  # it joined in segments alone (no room for its copy): room now?

    def leave(self, index: int, pressed: bool = False) -> PrefillResult:
        """Take row `index` out; its prefill, with its KV in its own cache again. `pressed`: it is
        preempted for memory, which a copy for the row left alone would take back."""
        prefill = self.batch.leave(index)
        del self.rows[index]
        if not pressed:  # memory is short: a row left alone keeps reading its cached blocks in place
            self._own_cache_when_alone()
        return prefill

    def _own_cache_when_alone(self) -> None:
        """A lone row that reads cached blocks in segments goes on a copy of its own (faster over long
        contexts: batch.collapse()) when its memory can hold that copy."""
        if len(self.rows) == 1 and self.batch.shared_tokens(0) and self.unshare(self.rows[0]):
            self.batch.collapse()

    def start(self, sequence: Sequence) -> None:
        """A sequence's first admission joins: its sampler, text stream and drafter."""
        sampling = sequence.job.sampling
        sequence.sampler = Sampler(sampling, self.runner.grammars if sampling.grammar else None)
        sequence.text = TextStream(self.runner.tokenizer, sampling.stop)
        sequence.started_at = time.perf_counter()
        sequence.drafter = self.drafter(sequence)

    def part(self) -> Part | None:
        """The rows' pending tokens (and drafts) as one part of the next step; None with no row."""
        if not self.rows:
            return None
        if self.runner.recurrent and self.rows[0].drafts:
            self.batch.start_drafts(1 + len(self.rows[0].drafts))  # what a rejection goes back to
        return self.batch.part([[s.generated[-1], *s.drafts] for s in self.rows])

    def propose(self) -> None:
        """Every row's drafts for the next step, padded to one width (the batched cache feeds each
        row the same number of tokens). The width keeps every row within its max_tokens (the KV it
        may hold) and the step within max_verify_tokens."""
        if not self.rows:
            return
        self.acceptance.fade()
        room = min(s.job.sampling.max_tokens - len(s.generated) for s in self.rows)
        room = min(room, self.max_verify_tokens // len(self.rows) - 1)
        rooms = self._recurrent_rooms(room) if self.runner.recurrent else [room] * len(self.rows)
        room = max(rooms)
        rates = [s.drafter.rate if s.drafter else 0.0 for s in self.rows]
        replay = bool(self.runner.recurrent) and not self.runner.draft_states
        if not batch_width([[0] * own for own in rooms], rates, room, replay):
            room = 0  # not even drafts of every row at full length would pay: the proposers are not asked
        drafts = [self._draft(s, own) if s.drafter and room > 0 and own > 0 else [] for s, own in zip(self.rows, rooms)]
        width = batch_width(drafts, rates, room, replay)
        for sequence, own in zip(self.rows, drafts):
            own = own[:width]
            sequence.drafts = own + [sequence.generated[-1]] * (width - len(own))
            sequence.num_real_drafts = len(own)

    def _recurrent_rooms(self, room: int) -> list[int]:
        """Each hybrid row's room for drafts: never past its next block boundary, where its state is
        snapshotted (took_step() keeps the state a row's cache ends on); rows with less room are
        padded to the step's width and keep no padding. In a batch only where every row keeps its
        own state after its last kept token (runner.batch_drafts); otherwise a lone row's only (a
        rejection runs the row's kept tokens again, which a batch cannot do for one row)."""
        if len(self.rows) > 1 and not self.runner.batch_drafts:
            return [0] * len(self.rows)
        block = self.runner.caches.config.block_size
        return [min(room, -(length + 1) % block) for length in self.batch.lengths]

    def _draft(self, sequence: Sequence, room: int) -> list[int]:
        try:
            return sequence.drafter.draft(sequence.generated, room)
        except Exception:  # a draft is only ever a guess: a proposer that fails leaves the row without one
            log.exception("a proposer failed; the row decodes on without drafts")
            sequence.drafter = None
            return []

    def _proposers(self, sequence: Sequence) -> list[Proposer]:
        """References, prompt lookup, then the model's MTP layers if it has them (they always guess)."""
        found = default_proposers(sequence.job.prompt.token_ids, sequence.job.references)
        if self.runner.heads is not None:
            found.append(ModelHeads(self.runner.heads))
        return found

    def drafter(self, sequence: Sequence) -> Drafter | None:
        """The row's drafter: none without proposers or under an output grammar (its matcher moves one
        token at a time)."""
        if self.proposers is None or sequence.job.sampling.grammar:
            return None
        return Drafter(self.proposers(sequence), shared=self.acceptance)

    def take_logits(self, logits: mx.array) -> None:
        """Each row's logits at every position it was fed (its pending token, then its drafts), for
        sample() to draw and verify."""
        width, hidden = len(self.rows[0].drafts), self.runner.decode_hidden
        self.step_logits = logits if width == 0 else None
        for index, sequence in enumerate(self.rows):
            fed = slice(index * (width + 1), (index + 1) * (width + 1))
            sequence.logits = logits[fed]
            sequence.hidden = (sequence.num_computed_tokens, hidden[fed]) if hidden is not None else None
            sequence.num_computed_tokens += 1 + width

    def sample(self) -> None:
        """Draw the next tokens of every row with logits (one evaluation for them all), send their
        text and retire the rows that ended. A row that was fed drafts draws at each of their
        positions as plain decoding would, keeps the drafts while they equal its draws and takes the
        draw where they first differ (gateway/engine/speculative.py); the KV of the drafts it did not
        keep is trimmed."""
        ready = [sequence.logits is not None for sequence in self.rows]
        if not any(ready):
            return
        try:
            draws = self._draw_rows(ready)
            taken = [self._verified(sequence, row) if row else [] for sequence, row in zip(self.rows, draws)]
            for sequence, tokens in zip(self.rows, taken):
                self._follow(sequence, tokens)
            rejected = [len(sequence.drafts) - max(len(tokens) - 1, 0) for sequence, tokens in zip(self.rows, taken)]
            if any(rejected) or self.batch.speculation is not None:
                self._drop_rejected(rejected, taken)
            self.batch.took_step()
        except Exception as exc:  # noqa: BLE001 - the evaluation failed: its rows fail, not the worker
            self.fail_all(exc)
            return
        for index in reversed(range(len(self.rows))):
            sequence = self.rows[index]
            sequence.num_computed_tokens -= rejected[index]
            sequence.logits, sequence.drafts = None, []
            if ready[index] and not self._take(sequence, taken[index]):
                self.retire(index)

    def _greedy_tokens(self, ready: list[bool]) -> dict[int, int]:
        """Row index -> its next token, for the rows of the step just taken that draw greedily with
        nothing to adjust, from one argmax over the step's logits (16 rows drawn one by one took
        0.65 ms a step, together 0.25 ms: evals.bench_step). Empty when the step fed drafts or
        under two such rows."""
        logits, self.step_logits = self.step_logits, None
        if logits is None or logits.shape[0] != len(self.rows):
            return {}
        plain = [i for i, s in enumerate(self.rows) if ready[i] and s.sampler.plain_greedy(s.generated)]
        if len(plain) < 2:
            return {}
        tokens = cast(list[int], mx.argmax(logits, axis=-1).tolist())  # a 1-D array's tolist(): ints
        return {index: tokens[index] for index in plain}

    def _follow(self, sequence: Sequence, tokens: list[tuple[int, tuple]]) -> None:
        """The row's MTP layers follow the positions it just verified. A lone row's only: a row in a
        batch, or whose drafting pauses, has them start over once it drafts again (a batch of one
        row's calls would cost more than its drafts save)."""
        if self.runner.heads is None:
            return
        heads = (
            next((p for p in sequence.drafter.proposers if isinstance(p, ModelHeads)), None)
            if sequence.drafter
            else None
        )
        if heads is None or not tokens or sequence.hidden is None:
            return
        if len(self.rows) > 1 or sequence.drafter.num_paused_steps:
            heads.reset()
            return
        position, hidden = sequence.hidden
        try:
            heads.follow(hidden[: len(tokens)], [t for t, _ in tokens], position, len(sequence.generated) + len(tokens))
        except Exception:  # a draft is only ever a guess: heads that fail leave the row without them
            log.exception("the MTP layers failed; the row decodes on without drafts")
            sequence.drafter = None

    def _drop_rejected(self, rejected: list[int], taken: list[list[tuple[int, tuple]]]) -> None:
        """Trim the KV of the drafts each row rejected (a hybrid model's recurrent layers keep each
        row's state after its last kept token). Where the library keeps no state per token, a hybrid
        model's lone row instead goes back to its state before the step and runs the tokens it
        keeps again (the next token it took is already drawn; the replay's logits are never evaluated)."""
        if not self.runner.recurrent or self.batch.speculation is not None:
            self.batch.trim(rejected)
            return
        assert len(self.rows) == 1, "without states per token, a hybrid model drafts for a lone row only"
        sequence = self.rows[0]
        kept = [sequence.generated[-1], *(token for token, _ in taken[0][:-1])]
        self.batch.roll_back()
        self.runner.run_step([self.batch.part([kept])])

    def _draw_rows(self, ready: list[bool]) -> list[list[tuple[int, tuple]]]:
        """Each row's draws (token, logprobs) at its pending position and after each of its drafts,
        as if the drafts before were taken: rows drawing plainly greedily from the step's one
        argmax, the rest in one draw_all (none for a row not ready)."""
        greedy = self._greedy_tokens(ready)
        wanted = [
            [
                Draw(sequence.sampler, sequence.logits[position], sequence.generated + sequence.drafts[:position])
                for position in range(sequence.num_real_drafts + 1)
            ]
            if now and index not in greedy
            else []
            for index, (sequence, now) in enumerate(zip(self.rows, ready))
        ]
        drawn = iter(draw_all([draw for row in wanted for draw in row]))
        return [
            [(greedy[index], ())] if index in greedy else [next(drawn) for _ in row] for index, row in enumerate(wanted)
        ]

    def _verified(self, sequence: Sequence, draws: list) -> list[tuple[int, tuple]]:
        """The tokens the row takes: its drafts while they equal its draws, then the draw where they
        first differ (or the draw after the last draft), each with its logprobs."""
        tokens = list(draws)
        accepted = 0
        while accepted < sequence.num_real_drafts and tokens[accepted][0] == sequence.drafts[accepted]:
            accepted += 1
        if sequence.drafter is not None:
            sequence.drafter.verified(sequence.num_real_drafts, accepted)
        self.stats.num_drafted_tokens += sequence.num_real_drafts
        self.stats.num_accepted_drafts += accepted
        return tokens[: accepted + 1]

    def _take(self, sequence: Sequence, tokens: list[tuple[int, tuple]]) -> bool:
        """Advance the row by its tokens; False once it ended (or failed)."""
        for token, logprobs in tokens:
            sequence.sampler.last_logprobs = logprobs or None
            try:
                if not self._advance(sequence, token):
                    return False
            except Exception as exc:  # noqa: BLE001 - one row's grammar or logprobs failed: that row fails, not the batch
                self.fail(sequence.job, exc)
                return False
        return True

    def _advance(self, sequence: Sequence, token: int) -> bool:
        """Take the row's sampled token and send it as text; False when the row ended (it then sent
        its last event)."""
        job, sampling = sequence.job, sequence.job.sampling
        if job.cancelled.is_set():
            self.stats.num_cancelled += 1
            return False
        generated = sequence.generated
        if len(generated) < sampling.max_tokens and token not in self.runner.eos_ids:
            generated.append(token)
            sequence.sampler.accept(token)
            if sampling.top_logprobs is not None:
                sequence.logprobs.append(sequence.sampler.logprobs(token))
            if chunk := sequence.text.push(token):
                job.send(_delta(sequence, chunk))
            if not sequence.text.stopped and len(generated) < sampling.max_tokens:
                return True
        tail = sequence.text.finish()
        if tail or sequence.logprobs:
            job.send(_delta(sequence, tail))
        cut = sequence.text.num_tokens >= sampling.max_tokens or sequence.sampler.closed_early
        reason = "stop" if sequence.text.stopped or not cut else "length"
        decode_ms = (time.perf_counter() - sequence.started_at) * 1000
        speculative = SpeculativeReport.of(sequence.drafter)
        ended = Finished(
            reason, sequence.text.num_tokens, decode_ms, sequence.text.matched_stop, speculative, tuple(generated)
        )
        job.send(ended)
        return False

    def fail_all(self, exc: Exception) -> None:
        """A broken batched step fails the rows in it, not the worker."""
        for index in reversed(range(len(self.rows))):
            self.fail(self.rows[index].job, exc)
            self.retire(index)


def _delta(sequence: Sequence, text: str) -> Delta:
    logprobs, sequence.logprobs = tuple(sequence.logprobs), []
    return Delta(text, logprobs)
