"""What a request is to the engine, and what comes back: jobs and their events.

    EngineWorker.submit(...) -> Job          events: Started, Delta..., then Finished | Failed
    EngineWorker.submit_embedding(...) -> EmbedJob   events: Embedded | Failed

A job's events are handed from the engine's thread to the job's own event loop (`send`, any thread);
nothing follows its Finished, Failed or Embedded (`ended`). The errors submit() raises before a job
exists are here too: OverBudget (its KV could never fit) and EngineStopped (the loop has ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

from kvcache import TenantSalt

from .caching import PrefixReport, VisionReport
from .prompt import PreparedPrompt
from .sampling import TokenLogprob
from .speculative import SpeculativeReport
from .types import Pin, Sampling


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
    # drafts verified and accepted, per proposer
    speculative: SpeculativeReport = field(default_factory=SpeculativeReport)
    token_ids: tuple[int, ...] = ()  # the reply as generated (a draft for the same question asked again)


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
    salt: TenantSalt  # the tenant's: the fair queue takes turns by it
    loop: asyncio.AbstractEventLoop
    owner: str | None = None  # the label of who asks (tenant, session, end user): cache purges select by it
    pins: tuple[Pin, ...] = ()  # prompt prefixes to keep cached for a while once the job ends
    # Answers the caches hold for this question (token ids, the tenant's own): drafts to verify
    references: tuple[tuple[int, ...], ...] = ()
    cache_salt: TenantSalt | None = None  # the prefix and vision caches' salt (an end user's); None: salt
    tenant: str = ""  # whose data key seals the KV blocks the job leaves at rest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    queue_ms: float = 0.0  # from submit to admission
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


class EngineStopped(Exception):
    """The worker's loop has ended (stopped, warm-up failed, or broken): nothing queued will run."""
