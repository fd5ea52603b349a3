"""The in-process MLX engine behind one small interface.

    Engine.prepare(messages, images, tools) -> PreparedPrompt   (any thread: tokenizer + numpy)
    Engine.compile_grammar(grammar) -> CompiledGrammar     (any thread, before submit: GrammarError when it
                                                            cannot compile or exceeds the engine's limits)
    Engine.tools -> ToolFormat                             the model's tool-call format: grammar, parse
    Engine.submit_embedding(token_ids) -> EmbedJob         (poolable models) events: Embedded | Failed
    Engine.submit(prompt, sampling)  -> Job                (event loop; QueueFull when full, OverBudget
                                                            when its KV exceeds the whole memory budget)
    Engine.events(job)               -> async Started, Delta..., Finished | Failed

`ModelRunner` is the same model run step by step on the caller's thread (prefill, then
`decode_alone(runner, prefill, sampling, cancelled)`, which decodes through the worker's own batch
step with one row, then finish), for benchmarks and tools that time one step at a time; only one
thread may use a runner.
Everything public is exported here: code outside the engine imports `gateway.engine`, never its modules.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import logging
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .attention import use_lone_row_kernel
from .batch import DecodeBatch, decode_alone
from .caches import CacheLayer, Removed
from .caching import CacheConfig, PrefixReport, VisionReport, purge_ssd_of
from .constraint import CompiledGrammar, GrammarError, json_schema_grammar
from .decode_kernel import use_decode_kernel
from .fair_queue import QueueFull
from .families import VISION_FAMILIES, UnsupportedModel, family_of
from .jobs import Delta, Embedded, EmbedJob, EngineStopped, Failed, Finished, Job, OverBudget, Started
from .model_pool import (
    ModelLoadFailed,
    ModelPool,
    ModelSpec,
    ModelStatus,
    ModelUnavailable,
    UnknownModel,
    weights_bytes,
)
from .native import cpu_features
from .prompt import PreparedPrompt, PromptError
from .runner import ModelRunner
from .sampling import Draw, Sampler, TokenLogprob, draw_all
from .speculative import SpeculativeReport
from .system_turns import SYSTEM_WRAPPER, SystemPlacement
from .threads import use_split_rows
from .tools import ParsedCall, ToolFormat, tools_text
from .types import ImagePart, Message, Pin, Sampling, Switches, TextPart, Tool, ToolCall
from .vector_products import (
    num_vector_products,
    use_vector_products,
    vector_products_library,
    vector_products_loaded,
)
from .worker import EngineWorker, Health, WorkerSnapshot

log = logging.getLogger("strata.engine")


__all__ = [
    "SYSTEM_WRAPPER",
    "VISION_FAMILIES",
    "CacheConfig",
    "CacheLayer",
    "CompiledGrammar",
    "DecodeBatch",
    "Delta",
    "Draw",
    "EmbedJob",
    "Embedded",
    "Engine",
    "EngineConfig",
    "EngineStopped",
    "Failed",
    "Finished",
    "GrammarError",
    "Health",
    "ImagePart",
    "Job",
    "Message",
    "ModelLoadFailed",
    "ModelPool",
    "ModelRunner",
    "ModelSpec",
    "ModelStatus",
    "ModelUnavailable",
    "OverBudget",
    "ParsedCall",
    "Pin",
    "PrefixReport",
    "PreparedPrompt",
    "PromptError",
    "QueueFull",
    "Removed",
    "Sampler",
    "Sampling",
    "SpeculativeReport",
    "Started",
    "Switches",
    "SystemPlacement",
    "TextPart",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolFormat",
    "UnknownModel",
    "UnsupportedModel",
    "VisionReport",
    "cpu_features",
    "decode_alone",
    "draw_all",
    "family_of",
    "json_schema_grammar",
    "map_large_allocations",
    "model_fingerprint",
    "num_vector_products",
    "purge_ssd_of",
    "release_memory",
    "return_heap",
    "tools_text",
    "use_decode_kernel",
    "use_lone_row_kernel",
    "use_split_rows",
    "use_vector_products",
    "vector_products_library",
    "vector_products_loaded",
    "weights_bytes",
]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_queue: int = 64
    # Prompt tokens one model call runs, over every prompt coming in (a multiple of the block size:
    # chunks end on block boundaries): until the step costs are measured, or always with no budget.
    step_prompt_tokens: int = 128
    caches: CacheConfig = CacheConfig(prefix_budget_bytes=1 << 30, vision_budget_bytes=256 << 20, block_size=32)
    max_num_seqs: int = 16  # sequences on the model at once: decoding, or their prompt coming in
    # Speculative decoding (gateway/engine/speculative.py): the tokens a decode step feeds at most,
    # drafts included; 0 turns it off.
    max_verify_tokens: int = 64
    # A step with decode rows carries the prompt tokens its measured cost fits in this (StepCosts;
    # 0: step_prompt_tokens always). The demo model on a 2-core Xeon, 16 closed-loop clients, fixed
    # lengths: 128 gave ITL p50 48 ms / p99 132 ms, 256 gave 26 / 137 ms, 1.13x the tok/s, half the
    # TTFT: the budget keeps today's slowest step and lets the rest of the steps run without prompts.
    # On a 2-core EPYC (AVX2), slower per step, 125 ms held ~1 prompt chunk in 2 steps: 16 clients
    # gave ITL p50 66-83 ms; 170 ms gave 30-39 ms, ~1.2x the tok/s, the same ITL p99 (docs/engine.md).
    step_budget_ms: float = 170.0

    def __post_init__(self):
        if self.step_prompt_tokens % self.caches.block_size:
            raise ValueError("STRATA_STEP_PROMPT_TOKENS must be a multiple of the KV block size")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # the id clients send as "model"
    path: Path
    fingerprint: str  # sha256 over config, tokenizer and weights: changes whenever outputs may
    max_context_tokens: int
    max_token_bytes: int  # the longest token's bytes: n bytes of text are at least n / this tokens
    vocab_size: int  # token ids run from 0 to this - 1 (logit_bias keys are checked against it)


class Engine:
    def __init__(self, model_path: Path, name: str | None, config: EngineConfig):
        fingerprint = model_fingerprint(Path(model_path))
        self.runner = ModelRunner(model_path, config.caches, fingerprint)
        self.info = ModelInfo(
            name=name or Path(model_path).name,
            path=Path(model_path),
            fingerprint=fingerprint,
            max_context_tokens=self.runner.max_positions,
            max_token_bytes=self.runner.prompts.max_token_bytes,
            vocab_size=self.runner.vocab_size,
        )
        self.worker = EngineWorker(
            self.runner,
            config.max_queue,
            config.step_prompt_tokens,
            config.max_num_seqs,
            config.max_verify_tokens,
            config.step_budget_ms,
        )
        self.prepare = self.runner.prompts.build
        self.message_at = self.runner.prompts.message_at  # any thread (tokenizer and template only)
        self.tokens_through = self.runner.prompts.tokens_through  # any thread, likewise
        self.line_at = self.runner.prompts.line_at  # any thread, likewise
        self.unused_switches = self.runner.prompts.unused_switches  # any thread, likewise
        self.tools = self.runner.prompts.tool_format
        self.poolable = self.runner.poolable  # /v1/embeddings may use this model (its family pools)
        self.submit = self.worker.submit
        self.submit_embedding = self.worker.submit_embedding
        self.reclaimer = ThreadPoolExecutor(1, thread_name_prefix="strata-reclaim")  # reclaim_ssd()
        self.events = self.worker.events
        self.block_size = config.caches.block_size  # tokens per prefix-cache block
        # what the model pool books for it: its weights as loaded, and the RAM its caches may fill
        self.nbytes = self.runner.weights_nbytes + config.caches.prefix_budget_bytes + config.caches.vision_budget_bytes

    def context_tokens(self, configured: int | None = None) -> int:
        """The most tokens (prompt and answer) one request may hold: `configured` (a server setting),
        else the model's own positions (its config); never more than the KV budget holds for one
        running sequence (known once the warm-up measured a token's KV)."""
        limit = configured or self.info.max_context_tokens
        budget = self.runner.caches.running_budget_bytes()
        per_token = self.runner.kv_bytes_per_token
        if budget is None or not per_token:
            return limit
        return max(0, min(limit, (budget - self.runner.state_bytes) // per_token))

    def compile_grammar(self, grammar: str) -> CompiledGrammar:
        return self.runner.grammars.compile(grammar)

    def embedding_tokens(self, text: str) -> tuple[int, ...]:
        """A text's tokens as the family's embedding models read it: the tokenizer's own, then EOS
        (whose hidden state is the pooled one). Any thread."""
        tokenizer = self.runner.tokenizer
        ids = tokenizer.encode(text)
        return tuple(ids if ids and ids[-1] == tokenizer.eos_token_id else [*ids, tokenizer.eos_token_id])

    def reference_tokens(self, texts: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Answers as the model would have generated them (no special tokens): drafts. Any thread."""
        return tuple(tuple(self.runner.tokenizer.encode(text, add_special_tokens=False)) for text in texts if text)

    def token_bytes(self, token: int) -> bytes:
        return self.runner.grammars.token_bytes(token)

    def start(self) -> None:
        self.worker.start()

    def launch(self) -> None:
        """Start the worker without waiting for its warm-up (requests queue; health() says when ready)."""
        self.worker.launch()

    @property
    def num_requests(self) -> int:
        """Jobs queued or in the decode batch."""
        snapshot = self.snapshot()
        return snapshot.queue_depth + snapshot.num_running

    @property
    def busy(self) -> bool:
        """Jobs queued or running on it (the model pool never unloads a busy engine)."""
        snapshot = self.snapshot()  # one read: its counts and its flag from the same instant
        return bool(snapshot.queue_depth or snapshot.num_running or snapshot.busy)

    def health(self, stuck_after_s: float) -> Health:
        return self.worker.health(stuck_after_s)

    def snapshot(self) -> WorkerSnapshot:
        """The worker's counters, queue depth and whether a job is on the model (any thread)."""
        return self.worker.snapshot()

    def cache_stats(self) -> dict:
        """The engine's cache layers' snapshots (prefix, ssd, vision), by layer name."""
        return self.runner.caches.stats()

    def purge_caches(self, selects: Callable[[str], bool], layers: Collection[str], timeout_s: float) -> dict:
        """Take the selected owners off the engine's cache layers (on the worker thread, between two
        steps): what each layer removed. TimeoutError when the worker does not get to it in time."""
        return self.worker.call(lambda: self.runner.caches.purge_owned(selects, layers)).result(timeout_s)

    def reclaim_ssd(self, selects: Callable[[str], bool]) -> Future | None:
        """The SSD tier's part of a purge, on a thread of its own rather than the worker's: for a
        tenant whose data key was shredded, whose blocks are unreadable already, so rewriting its
        segments never pauses decoding. None without an SSD tier; the future's result is the Purged."""
        prefix = self.runner.caches.prefix
        if prefix is None or prefix.ssd is None:
            return None
        return self.reclaimer.submit(prefix.ssd.purge_owned, selects)

    def stop(self, drain_s: float = 10.0) -> None:
        """Stop the worker, then persist admissible KV blocks; the SSD writer drains within drain_s."""
        self.reclaimer.shutdown(wait=True)  # a purge's rewrites finish before the tier closes
        if self.worker.stop():
            self.runner.caches.shutdown(drain_s)
        else:  # the worker still holds the caches: persisting now would race it
            log.warning("engine worker did not stop in time; KV blocks in RAM were not persisted")


def release_memory() -> None:
    """After an engine was stopped and dropped (the model pool unloaded it): collect it, empty MLX's
    buffer cache, and give the freed heap back to the system (glibc keeps it otherwise), so what the
    model held is returned rather than kept by the process. Measured on a demo model loaded and
    unloaded six times: the process's resident memory levels off instead of growing ~50 MiB a time."""
    gc.collect()
    mx.clear_cache()
    return_heap()


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_ALLOCATION = 4 * 1024 * 1024


def map_large_allocations() -> None:
    """Serve allocations of LARGE_ALLOCATION bytes or more from their own mappings, returned to the
    system when freed (glibc; elsewhere nothing). glibc's default threshold rises to 32 MiB once
    large blocks are freed, after which a request's bodies, base64 payloads and decoded frames land
    in the heap and stay there: measured with evals.bench_video, the server kept ~35 MiB more after
    every video request (400 MiB after ten); with this set it levels off ~100 MiB above idle. A fixed
    threshold also turns the dynamic one off. Buffers under it (a decode step's logits) are unaffected."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION)


def return_heap() -> None:
    """Give the heap that bulk work freed back to the system (glibc's malloc_trim; elsewhere
    nothing): glibc keeps freed memory in its arenas, so one large request (thousands of texts to
    embed, a video's frames) would otherwise stay in the process's resident size."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def model_fingerprint(model_path: Path) -> str:
    digest = hashlib.sha256(b"strata-model-v2")
    # every file that can change the outputs: weights, architecture, tokenizer, chat template, processor
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "processor_config.json",
    ):
        path = model_path / name
        if path.exists():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(model_path.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as weights:
            while block := weights.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()
