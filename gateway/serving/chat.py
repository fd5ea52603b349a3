"""The engine's side of a chat completion on one model: images, the prompt (with its cheap
bounds), replays of stored answers, the engine job, and a deadline on every wait for it.

    ChatService.prepare(request, images) -> (PreparedPrompt, Sampling)   (prompt, grammar, cheap bounds)
    ChatService.start(prompt, sampling, caller, owner, trace, deadline) -> Run   (after prefill)
    ChatService.replay(stored, trace) -> Run                               (a cached answer, same events)
    ChatService.events(run) -> Started.. Delta.. Finished                  (applied to run.completion)

Knows neither routing (app.py, models.py) nor the order of layers (pipeline.py). Of OpenAI's shapes it builds
only the logprob entries a Delta carries (token text, bytes, logprob, top_logprobs), where the
engine's tokenizer is at hand; the response bodies and SSE chunks are openai_format.py's.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

import anyio

from kvcache import TenantSalt, end_user_salt
from semantic import Owner, StoredResponse, owner_label
from vision import DecodedImage, DecodedVideo

from ..engine import (
    CompiledGrammar,
    Delta,
    Engine,
    Failed,
    Finished,
    GrammarError,
    ImagePart,
    Pin,
    PrefixReport,
    PreparedPrompt,
    PromptError,
    Sampling,
    Started,
    TokenLogprob,
    VisionReport,
    json_schema_grammar,
    return_heap,
)
from ..formats.openai_format import Completion
from ..observability.trace import BYPASS, HIT, MISS, LayerOutcome, MaxTokens, PrefixFacts, Trace
from ..requests.errors import ENGINE_REFUSALS, ApiError, bad_request, engine_refusal, refuse_unless_serving
from ..requests.images import load_image, load_video
from ..requests.schemas import ChatRequest
from ..settings import Settings
from ..tenancy.auth import Caller
from ..tenancy.public_prefixes import PublicPrefixes


@dataclass(slots=True)
class Run:
    """A job past its prefill (or a cached answer): the rest of its events, and the completion they
    fill in. `deadline` (anyio clock) bounds every wait for the next event; None for a replay, which
    never waits."""

    events: AsyncGenerator
    completion: Completion
    deadline: float | None


@dataclass(frozen=True, slots=True)
class Drafts:
    """What the response layers hold for a question they could not answer: drafts the engine verifies
    (speculative decoding). `token_ids`: an answer as generated (the same prompt under other decoding
    parameters); `texts`: answers as text (a refused near-hit, the same question earlier on)."""

    token_ids: tuple[int, ...] = ()
    texts: tuple[str, ...] = ()


def deadline_error(timeout_s: float) -> ApiError:
    return ApiError(504, f"the request did not finish within the server's {timeout_s:g} s deadline", "timeout")


GRAMMAR_COMPILE_S = 10.0  # a schema that takes longer to compile and probe is refused (400)


class ChatService:
    def __init__(self, settings: Settings, engine: Engine):
        self.settings = settings
        self.engine = engine
        self.public = PublicPrefixes(engine.prepare, settings.limits)  # texts whose KV every tenant shares
        self.compile_lane: anyio.CapacityLimiter | None = None  # one grammar compile at a time (made in the loop)

    async def load_images(self, request: ChatRequest) -> list[DecodedImage | DecodedVideo]:
        """Decode every image and video part (CPU work, off the event loop); none: no thread hop."""
        if not request.num_images:
            return []
        return await anyio.to_thread.run_sync(self._load_images_sync, request)

    def _load_images_sync(self, request: ChatRequest) -> list[DecodedImage | DecodedVideo]:
        parts = [
            (part, f"messages[{i}].content[{j}]")
            for i, message in enumerate(request.messages)
            for j, part in enumerate(message.parts)
            if isinstance(part, ImagePart)
        ]
        num_videos = sum(part.video for part, _ in parts)
        return [
            load_video(part.url, self.settings, param, num_videos)
            if part.video
            else load_image(part.url, self.settings, param)
            for part, param in parts
        ]

    async def prepare(
        self, request: ChatRequest, images: list[DecodedImage | DecodedVideo], trace: Trace
    ) -> tuple[PreparedPrompt, Sampling]:
        """Tokenise and compile the output's grammar (off the event loop), after a free bound: a token
        holds at most max_token_bytes bytes, so text that cannot fit whatever its tokens is refused
        before the tokenizer runs. max_tokens is lowered to what the context leaves after the prompt
        (the trace says so when that is less than the client asked)."""
        biased = [token for token, _ in request.sampling.logit_bias if token >= self.engine.info.vocab_size]
        if biased:
            raise bad_request(
                f"'logit_bias' names token {biased[0]}; this model's token ids run from 0 to "
                f"{self.engine.info.vocab_size - 1}",
                "invalid_value",
                "logit_bias",
            )
        limit = self.context_tokens()
        at_least = -(-request.num_text_bytes // self.engine.info.max_token_bytes)
        if at_least >= limit:
            raise _context_error(limit, f"at least {at_least}")
        prompt = await self._prompt(request, images)
        if prompt.num_tokens >= limit:
            raise _context_error(limit, str(prompt.num_tokens))
        max_tokens = min(request.sampling.max_tokens, limit - prompt.num_tokens)
        if request.max_tokens_asked > max_tokens:
            by_context = max_tokens < request.sampling.max_tokens
            trace.max_tokens = MaxTokens(
                request.max_tokens_asked, max_tokens, "context" if by_context else "output_limit"
            )
        trace.system = prompt.system
        grammar = await self._compiled_grammar(request) if _constrained(request) else None
        return prompt, replace(request.sampling, grammar=grammar, max_tokens=max_tokens)

    def context_tokens(self) -> int:
        """Prompt + answer one request may hold on this model (the server's setting or the model's own)."""
        return self.engine.context_tokens(self.settings.limits.max_context_tokens)

    async def _prompt(self, request: ChatRequest, images: list[DecodedImage | DecodedVideo]) -> PreparedPrompt:
        """The request's prompt, rendered and tokenised off the event loop; 400 when the model cannot take it."""
        try:
            prompt = await anyio.to_thread.run_sync(self._prepare_sync, request, images)
        except PromptError as exc:
            raise bad_request(str(exc), exc.code, "messages") from None
        return replace(prompt, public_tokens=self.public.match(prompt.token_ids))

    def _prepare_sync(self, request: ChatRequest, images: list[DecodedImage | DecodedVideo]) -> PreparedPrompt:
        try:
            return self.engine.prepare(request.messages, images, request.tools, request.switches)
        finally:
            if any(isinstance(image, DecodedVideo) for image in images):
                return_heap()  # a clip's full-size frames and the processor's float copies are freed

    async def count_tokens(self, request: ChatRequest) -> int:
        """The prompt's tokens, images expanded, as prepare() would make them; no job runs. Text
        that could not fit the context at COUNT_BYTES_PER_TOKEN bytes a token is refused before the
        tokenizer runs: counting is free to ask for, and 3.9 MB of text took 12.3 s of CPU."""
        limit = self.context_tokens()
        if request.num_text_bytes > limit * COUNT_BYTES_PER_TOKEN:
            raise _context_error(limit, f"more than {request.num_text_bytes // COUNT_BYTES_PER_TOKEN}")
        images = await self.load_images(request)
        prompt = await self._prompt(request, images)
        return prompt.num_tokens

    async def pins(self, request: ChatRequest, prompt: PreparedPrompt, salt: TenantSalt) -> tuple[Pin, ...]:
        """The request's cache breakpoints in prompt tokens, down to whole KV blocks (rendered off the
        event loop, their counts kept per tenant `salt`); a breakpoint the template cannot render
        alone is left out."""
        if not request.breakpoints:
            return ()
        first_is_system = request.messages[0].role == "system"
        counts = [max(mark.num_messages, int(first_is_system)) for mark in request.breakpoints]

        def render() -> list[int | None]:  # through every message: the prompt (but its few generation-prompt tokens)
            whole = len(request.messages)
            return [prompt.num_tokens if n >= whole else self.engine.tokens_through(prompt, n, salt) for n in counts]

        through = await anyio.to_thread.run_sync(render)
        block = self.engine.block_size  # a pin keeps whole blocks: the tail of a partial one is not kept
        return tuple(
            Pin(tokens // block * block, mark.ttl_s, mark.on_ssd)
            for tokens, mark in zip(through, request.breakpoints)
            if tokens is not None
        )

    async def _compiled_grammar(self, request: ChatRequest) -> CompiledGrammar:
        """The output's grammar, compiled off the event loop and off the engine thread, one compile at
        a time, within GRAMMAR_COMPILE_S; 400 invalid_schema when it takes longer (the compile is
        left to finish: its result is cached for a request that sends the same schema again)."""
        if self.compile_lane is None:
            self.compile_lane = anyio.CapacityLimiter(1)
        param = "tools" if request.forced_tool is not None else "response_format"
        try:
            with anyio.fail_after(GRAMMAR_COMPILE_S):
                return await anyio.to_thread.run_sync(
                    self._grammar, request, param, limiter=self.compile_lane, abandon_on_cancel=True
                )
        except TimeoutError:
            raise bad_request(
                f"the {param} schema took longer than {GRAMMAR_COMPILE_S:.0f} s to compile; send a smaller one",
                "invalid_schema",
                param,
            ) from None

    def _grammar(self, request: ChatRequest, param: str) -> CompiledGrammar:
        """The grammar of a forced tool call, else of the response format; 400 when it cannot compile."""
        try:
            if request.forced_tool is not None:
                grammar = self.engine.tools.grammar(request.callable_tools, request.forced_tool or None)
            else:
                schema = (request.response_format or {}).get("schema")
                grammar = json_schema_grammar(json.loads(schema) if schema else {"type": "object"})
            return self.engine.compile_grammar(grammar)
        except (GrammarError, ValueError) as exc:
            raise bad_request(
                f"the {param} schema cannot be used to constrain the output: {_brief(exc)}", "invalid_schema", param
            ) from None

    def replay(self, stored: StoredResponse, trace: Trace) -> Run:
        """A Run whose events come from a stored answer (exact or semantic hit): same shapes, no model.
        Its prompt tokens are the stored ones (a semantic hit reports the stored question's count)."""
        for layer in ("vision", "prefix"):
            trace.record(layer, LayerOutcome.of(BYPASS, reason=f"answered_by_{trace.served_by}"))
        tokens = stored.prompt_tokens
        completion = Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), tokens, tokens)

        async def events() -> AsyncGenerator:
            for piece in re.findall(r"\S*\s*", stored.text)[:-1] or [""]:
                yield Delta(piece)
            yield Finished(stored.finish_reason, stored.completion_tokens, 0.0)

        return Run(events(), completion, None)

    def _cache_salt(self, caller: Caller, owner: Owner) -> TenantSalt | None:
        """An end user's own prefix and vision salt, when the tenant keeps its end users apart and
        the request names one; None: the tenant's."""
        if apart := self.settings.end_user_apart(caller.tenant, owner.end_user):
            return end_user_salt(caller.salt, apart)
        return None

    async def start(
        self,
        prompt: PreparedPrompt,
        sampling: Sampling,
        caller: Caller,
        owner: Owner,
        trace: Trace,
        deadline: float,
        pins: tuple[Pin, ...] = (),
        drafts: Drafts | None = None,
    ) -> Run:
        """Queue the job and wait until its prefill is done (or it failed, or the deadline passed).
        The engine's caches record `owner` (with the tenant) on what the job stores or reuses."""
        refuse_unless_serving(self.engine, self.settings.stuck_after_s)
        references = await self._references(drafts) if drafts else ()
        try:
            label = owner_label(caller.tenant, owner)
            job = self.engine.submit(
                prompt, sampling, caller.salt, label, pins, references, self._cache_salt(caller, owner), caller.tenant
            )
        except ENGINE_REFUSALS as refused:
            raise engine_refusal(refused) from None
        events = self.engine.events(job)
        try:
            first = await self._next(events, deadline)
        except ApiError:
            await events.aclose()  # cancels the job
            raise
        if isinstance(first, Failed):
            raise ApiError(503, first.message, "engine_unavailable")
        assert isinstance(first, Started), f"engine sent {type(first).__name__} before Started"
        trace.time("queue", first.queue_ms)
        trace.time("vision", first.vision_ms)
        trace.time("prefill", first.prefill_ms)
        facts = await self._prefix_facts(prompt, first.prefix)
        trace.prefix = facts
        trace.chain = first.prefix.chain
        trace.record("prefix", prefix_outcome(first.prefix, facts.where if facts else ""))
        trace.record("vision", vision_outcome(first.vision))
        completion = Completion(
            f"chatcmpl-{uuid.uuid4().hex}",
            int(time.time()),
            first.num_prompt_tokens,
            first.num_cached_tokens,
            logprobs=[] if sampling.top_logprobs is not None else None,
            written_tokens=self._written(first.prefix),
        )
        return Run(events, completion, deadline)

    def _written(self, report: PrefixReport) -> int:
        """The prompt's tokens this job stores in the prefix cache: its whole blocks not read from it."""
        if report.status == BYPASS:
            return 0
        return max(0, len(report.chain) * self.engine.block_size - report.num_cached_tokens)

    async def _references(self, drafts: Drafts) -> tuple[tuple[int, ...], ...]:
        """The drafts as token ids (texts tokenised off the event loop), the generated ids first."""
        texts = await anyio.to_thread.run_sync(self.engine.reference_tokens, drafts.texts) if drafts.texts else ()
        return ((drafts.token_ids,) if drafts.token_ids else ()) + texts

    async def _prefix_facts(self, prompt: PreparedPrompt, report: PrefixReport) -> PrefixFacts | None:
        if report.status == BYPASS:
            return None
        where, line = "", ""
        if report.miss_reason == "diverged" and report.miss_in_image:
            where = "image"
        elif report.miss_reason == "diverged":
            at = report.miss_at_token
            where = message_place(prompt.messages, await anyio.to_thread.run_sync(self.engine.message_at, prompt, at))
            line = await anyio.to_thread.run_sync(self.engine.line_at, prompt, at)
        return PrefixFacts(
            report.num_prompt_tokens,
            report.num_cached_tokens,
            report.num_ssd_tokens,
            report.miss_reason,
            report.miss_tier,
            report.miss_lived_s,
            where,
            line,
        )

    async def _next(self, events: AsyncGenerator, deadline: float | None):
        """The next event, or StopAsyncIteration; ApiError(504) once the deadline has passed."""
        if deadline is None:
            return await events.__anext__()
        try:
            with anyio.fail_after(max(deadline - anyio.current_time(), 0.0)):
                return await events.__anext__()
        except TimeoutError:
            raise deadline_error(self.settings.request_timeout_s) from None

    async def events(self, run: Run) -> AsyncGenerator:
        """The run's events, each applied to its completion as it passes."""
        while True:
            try:
                event = await self._next(run.events, run.deadline)
            except StopAsyncIteration:
                return
            self._apply(event, run.completion)
            yield event

    def _apply(self, event, completion: Completion) -> None:
        if isinstance(event, Delta) and completion.logprobs is not None:
            completion.logprobs.extend(self._logprob_entry(entry) for entry in event.logprobs)
        _apply(event, completion)

    def _logprob_entry(self, entry: TokenLogprob) -> dict:
        """OpenAI's shape: the token's text and bytes (a character's bytes may span tokens), its log
        probability and the alternatives'."""
        top = [self._token(token) | {"logprob": logprob} for token, logprob in entry.top]
        return self._token(entry.token) | {"logprob": entry.logprob, "top_logprobs": top}

    def _token(self, token: int) -> dict:
        raw = self.engine.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}


def _apply(event, completion: Completion) -> None:
    if isinstance(event, Delta):
        completion.text += event.text
    elif isinstance(event, Finished):
        completion.completion_tokens = event.num_completion_tokens
        completion.finish_reason = event.finish_reason
        completion.stop_sequence = event.stop_sequence
        completion.token_ids = event.token_ids
        completion.whole = True
    elif isinstance(event, Failed):
        raise ApiError(event.status, event.message, event.code)


def _constrained(request: ChatRequest) -> bool:
    return request.forced_tool is not None or request.response_format is not None


def _brief(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


# More bytes a token than real text averages over a whole prompt (English ~4, code ~3.5, base64 ~2.5
# on the Qwen and Llama tokenizers); only runs of one character do better.
COUNT_BYTES_PER_TOKEN = 8


def _context_error(limit: int, prompt_tokens: str) -> ApiError:
    return bad_request(
        f"this model's context is {limit} tokens; the prompt has {prompt_tokens} tokens, which leaves no room "
        "for an answer",
        "context_length_exceeded",
        "messages",
    )


def prefix_outcome(report: PrefixReport, where: str = "") -> LayerOutcome:
    """`where`: for a divergence, which part of the conversation differs (message_place)."""
    if report.status == BYPASS:
        return LayerOutcome.of(BYPASS, reason=report.reason)
    details: dict[str, object] = {"cached": report.num_cached_tokens, "prompt": report.num_prompt_tokens}
    if report.tier:
        details["tier"] = report.tier
    if report.num_ssd_tokens:
        details.update(ram=report.num_cached_tokens - report.num_ssd_tokens, ssd=report.num_ssd_tokens)
    if report.num_public_tokens:
        details["public"] = report.num_public_tokens
    if report.num_tokens_without_state:  # a hybrid's blocks matched further than a held state reached
        details["no_state"] = report.num_tokens_without_state
    if report.miss_reason:
        details.update(why=report.miss_reason, at=report.miss_at_token)
    if report.miss_tier:
        details.update({"from": report.miss_tier, "lived_s": round(report.miss_lived_s)})
    if where:
        details["in"] = where
    return LayerOutcome.of(report.status, **details)


def message_place(messages, index: int | None) -> str:
    """Which part of a conversation message `index` is: system (a system or developer message),
    latest (the last user message, what follows it, or the generation prompt), or earlier_turn.
    "" when unknown (None)."""
    if index is None:
        return ""
    if index < len(messages) and messages[index].role in ("system", "developer"):
        return "system"
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages))
    return "latest" if index >= last_user else "earlier_turn"


def vision_outcome(report: VisionReport) -> LayerOutcome:
    if report.num_images == 0:
        return LayerOutcome.of(BYPASS, reason="no_images")
    if not report.enabled:
        return LayerOutcome.of(BYPASS, reason="disabled", images=report.num_images)
    return LayerOutcome.of(
        MISS if report.num_misses else HIT,
        images=report.num_images,
        hits=report.num_hits,
        misses=report.num_misses,
        skipped=report.num_skipped,
    )
