"""One request through the layers, cheapest first: exact -> semantic -> engine.

    Pipeline.start(request, caller, headers, body_size) -> Turn     (a cached answer or a started job)
    Turn.events()   (choice index, event) pairs, applied to turn.completions; at the end of a whole
                    answer the one request-end step runs: every response layer stores it, the
                    counters count it. n > 1 choices are n jobs; the later ones start once the first
                    has prefilled, so they reuse its prompt blocks from the prefix cache.
    Turn.finish()   the same, drained (non-streaming)

Each response layer has one interface (`lookup(ctx, trace) -> StoredResponse | None`, then
`store(ctx, answer)` after an engine answer); the first hit answers and the later layers record
`bypass; reason=<layer>_hit`. Request-end accounting happens in `Turn._end` only.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import anyio

from semantic import Answer, StoredResponse

from ..engine import Delta, Finished, Pin, Sampling
from ..formats.openai_format import Completion
from ..observability.metrics import RequestMetrics
from ..observability.stats import LayerCounters
from ..observability.trace import BYPASS, LayerOutcome, Trace
from ..requests.normalize import Normalizer
from ..requests.schemas import ChatRequest
from ..tenancy.auth import Caller
from ..tenancy.sessions import SessionClock
from .chat import Drafts, Run
from .models import ServedModel, ServedModels
from .responses import RequestContext, ResponseCaches

T = TypeVar("T")

OFF_LOOP_BYTES = 64 * 1024  # bodies above this are parsed and canonicalised in a worker thread


async def off_loop(body_size: int, work: Callable[[], T], may_wait: bool = False) -> T:
    """CPU work on a request body (parsing, canonical keys, risk rules): on the event loop while the
    body is small, in a worker thread above OFF_LOOP_BYTES, so one large body never stalls the rest;
    always in a worker thread when the work `may_wait` on a store (a tenant's key read from Redis)."""
    return work() if body_size <= OFF_LOOP_BYTES and not may_wait else await anyio.to_thread.run_sync(work)


@dataclass(slots=True)
class Turn:
    """One request from its first layer to its last event."""

    pipeline: Pipeline
    model: ServedModel  # the model named by the request (its jobs keep it loaded while they run)
    ctx: RequestContext
    trace: Trace
    runs: list[Run]  # one per choice
    cached: bool  # answered by a response layer: nothing to store, nothing to abandon
    pins: tuple[Pin, ...] = ()  # the prefixes the client asked to keep, in prompt tokens

    @property
    def completion(self) -> Completion:
        return self.runs[0].completion

    @property
    def completions(self) -> list[Completion]:
        return [run.completion for run in self.runs]

    async def events(self) -> AsyncGenerator[tuple[int, object], None]:
        """Choice after choice (the engine decodes them together; their events wait in their queues)."""
        try:
            for index, run in enumerate(self.runs):
                async for event in self.model.chat.events(run):
                    if isinstance(event, Delta) and index == 0 and event.text:
                        self.trace.token(from_engine=not self.cached)
                    if isinstance(event, Finished) and not self.cached and index == 0:
                        self.trace.time("decode", event.decode_ms)
                        self.trace.speculative = event.speculative
                    yield index, event
        finally:
            for run in self.runs:
                await run.events.aclose()  # a client gone early cancels the jobs
        if all(completion.whole for completion in self.completions):
            await self._end()

    async def finish(self) -> None:
        async for _ in self.events():
            pass

    async def _end(self) -> None:
        if not self.cached:
            answer = Answer(
                self.completion.text,
                self.completion.finish_reason,
                self.completion.completion_tokens,
                self.completion.prompt_tokens,
                self.completion.token_ids,
            )
            for layer in self.pipeline.responses.layers:
                await layer.store(self.ctx, answer)
        self.pipeline.counters.add(self.trace)
        if self.pipeline.metrics is not None:
            self.pipeline.metrics.observe(
                self.trace,
                self.ctx.tenant,
                self.completion.prompt_tokens,
                sum(c.completion_tokens for c in self.completions),
                time.perf_counter(),
            )


def _choice(sampling: Sampling, index: int) -> Sampling:
    """Choice `index` of a seeded request draws from its own seed: n copies of one draw are no use."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + index)


class Pipeline:
    def __init__(
        self,
        models: ServedModels,
        responses: ResponseCaches,
        counters: LayerCounters,
        sessions: SessionClock,
        metrics: RequestMetrics | None,
        normalizer: Normalizer,
    ):
        self.normalizer = normalizer  # before every key and token: volatile system lines removed
        self.models = models
        self.responses = responses
        self.counters = counters
        self.sessions = sessions
        self.metrics = metrics

    async def start(self, request: ChatRequest, caller: Caller, headers, body_size: int) -> Turn:
        """The request's model is held from here until its jobs are admitted (they then keep it loaded)."""
        deadline = anyio.current_time() + self.models.settings.request_timeout_s
        async with self.models.lease(request.model) as model:
            return await self._start(model, request, caller, headers, body_size, deadline)

    async def _start(
        self, model: ServedModel, request: ChatRequest, caller: Caller, headers, body_size: int, deadline: float
    ) -> Turn:
        chat = model.chat
        trace = Trace()
        request, trace.normalized = self.normalizer.apply(request, caller.tenant)
        trace.ignored = [
            *request.ignored,
            *(f"{ask} (no switch in this model's template)" for ask in model.engine.unused_switches(request.switches)),
        ]
        with trace.timed("prepare"):
            images = await chat.load_images(request)
            context = partial(self.responses.context, request, caller, headers, images, model.stamp.fingerprint)
            ctx = await off_loop(body_size, context, self.responses.digests_may_wait)
        self.sessions.touch(caller.tenant, ctx.owner.session, time.time())
        cached = await self._lookup(ctx, trace)
        if cached is not None:
            return Turn(self, model, ctx, trace, [chat.replay(cached, trace)], cached=True)
        with trace.timed("tokenize"):
            prompt, sampling = await chat.prepare(request, images, trace)
            pins = await chat.pins(request, prompt, caller.salt)
        drafts = Drafts(ctx.draft, (*ctx.references, *([request.prediction] if request.prediction else [])))
        runs = [await chat.start(prompt, sampling, caller, ctx.owner, trace, deadline, pins, drafts)]
        try:
            for index in range(1, request.n):
                runs.append(await chat.start(prompt, _choice(sampling, index), caller, ctx.owner, Trace(), deadline))
        except BaseException:
            for run in runs:
                await run.events.aclose()
            raise
        return Turn(self, model, ctx, trace, runs, cached=False, pins=pins)

    async def _lookup(self, ctx: RequestContext, trace: Trace) -> StoredResponse | None:
        for index, layer in enumerate(self.responses.layers):
            with trace.timed(layer.name):
                found = await layer.lookup(ctx, trace)
            if found is not None:
                trace.served_by = layer.name
                for later in self.responses.layers[index + 1 :]:
                    trace.record(later.name, LayerOutcome.of(BYPASS, reason=f"{layer.name}_hit"))
                return found
        return None
