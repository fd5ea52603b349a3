"""One request through the layers, cheapest first: exact -> semantic -> engine.

    Pipeline.start(request, caller, headers, body_size) -> Turn     (a cached answer or a started job)
    Turn.events()   the answer's events, applied to turn.completion; at the end of a whole answer the
                    one request-end step runs: every response layer stores it, the counters count it
    Turn.finish()   the same, drained (non-streaming)

Each response layer has one interface (`lookup(ctx, trace) -> StoredResponse | None`, then
`store(ctx, answer)` after an engine answer); the first hit answers and the later layers record
`bypass; reason=<layer>_hit`. Request-end accounting happens in `Turn._end` only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import anyio

from semantic import Answer, StoredResponse

from .auth import Caller
from .chat import ChatService, Run
from .engine import Finished
from .openai_format import Completion
from .responses import RequestContext, ResponseCaches
from .schemas import ChatRequest
from .stats import LayerCounters
from .trace import BYPASS, LayerOutcome, Trace

T = TypeVar("T")

OFF_LOOP_BYTES = 64 * 1024  # bodies above this are parsed and canonicalised in a worker thread


async def off_loop(body_size: int, work: Callable[[], T]) -> T:
    """CPU work on a request body (parsing, canonical keys, risk rules): on the event loop while the
    body is small, in a worker thread above OFF_LOOP_BYTES, so one large body never stalls the rest."""
    return work() if body_size <= OFF_LOOP_BYTES else await anyio.to_thread.run_sync(work)


@dataclass(slots=True)
class Turn:
    """One request from its first layer to its last event."""

    pipeline: Pipeline
    ctx: RequestContext
    trace: Trace
    run: Run
    cached: bool  # answered by a response layer: nothing to store, nothing to abandon

    @property
    def completion(self) -> Completion:
        return self.run.completion

    async def events(self) -> AsyncIterator:
        try:
            async for event in self.pipeline.chat.events(self.run):
                if isinstance(event, Finished) and not self.cached:
                    self.trace.time("decode", event.decode_ms)
                yield event
        finally:
            await self.run.events.aclose()  # a client gone early cancels the job
        if self.completion.whole:
            await self._end()

    async def finish(self) -> None:
        async for _ in self.events():
            pass

    async def _end(self) -> None:
        if not self.cached:
            answer = Answer(self.completion.text, self.completion.finish_reason, self.completion.completion_tokens,
                            self.completion.prompt_tokens)
            for layer in self.pipeline.responses.layers:
                await layer.store(self.ctx, answer)
        self.pipeline.counters.add(self.trace)


class Pipeline:
    def __init__(self, chat: ChatService, responses: ResponseCaches, counters: LayerCounters):
        self.chat = chat
        self.responses = responses
        self.counters = counters

    async def start(self, request: ChatRequest, caller: Caller, headers, body_size: int) -> Turn:
        deadline = anyio.current_time() + self.chat.settings.request_timeout_s
        self.chat.check_model(request)
        trace = Trace()
        with trace.timed("prepare"):
            images = await self.chat.load_images(request)
            ctx = await off_loop(body_size, partial(self.responses.context, request, caller, headers, images))
        cached = await self._lookup(ctx, trace)
        if cached is not None:
            return Turn(self, ctx, trace, self.chat.replay(cached, trace), cached=True)
        with trace.timed("tokenize"):
            prompt = await self.chat.prepare(request, images)
        run = await self.chat.start(prompt, request, caller, trace, deadline)
        return Turn(self, ctx, trace, run, cached=False)

    async def _lookup(self, ctx: RequestContext, trace: Trace) -> StoredResponse | None:
        for index, layer in enumerate(self.responses.layers):
            with trace.timed(layer.name):
                found = await layer.lookup(ctx, trace)
            if found is not None:
                trace.served_by = layer.name
                for later in self.responses.layers[index + 1:]:
                    trace.record(later.name, LayerOutcome.of(BYPASS, reason=f"{layer.name}_hit"))
                return found
        return None
