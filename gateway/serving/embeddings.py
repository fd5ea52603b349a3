"""POST /v1/embeddings, in OpenAI's shape, from one of two models:

- MiniLM (all-MiniLM-L6-v2, 384-d, L2-normalised), an instance of its own (loaded on the first
  request), never the semantic layer's: a bulk request never holds the model a chat's semantic
  lookup needs. Inputs are embedded CHUNK_TEXTS at a time, each chunk a turn of the fair lane
  (tenants in turn: a tenant's flood waits behind one chunk of each other tenant), all under the
  request's deadline; a request whose client left or whose deadline passed stops after its chunk;
- the served model itself when its family pools (qwen3: the last token's final hidden state,
  L2-normalised, as mlx-vlm's qwen3_embedding computes it): one text per engine worker step,
  between decode steps, since only the worker may run the model.

    parse_embeddings_request(body, limits, engine_model) -> EmbeddingsRequest    400s name the field
    Embeddings.create(request, tenant) -> dict                                  the response body

Inputs are bounded as OpenAI bounds them: at most 2,048 texts, 8,192 tokens each and 300,000 tokens
in all (a 400 names the bound), besides the byte bound checked before any tokenising.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from semantic import MiniLMEmbedder

from ..engine import Embedded, Engine, return_heap
from ..requests.errors import ENGINE_REFUSALS, ApiError, bad_request, engine_refusal, refuse_unless_serving
from ..requests.shapes import ANY, INT, STR, Checked, Obj, check
from ..settings import Limits, Settings
from .chat import deadline_error

MODEL_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
CHUNK_TEXTS = 8  # texts per turn of the lane: ~0.05-0.3 s of MiniLM on this CPU, what another tenant may wait
COUNT_TEXTS = 64  # texts tokenised per turn of the lane (no model run: far cheaper than a chunk)
MAX_INPUT_TOKENS = 8192  # OpenAI's bounds per input and per request
MAX_REQUEST_TOKENS = 300_000


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[str, ...]
    base64: bool  # encoding_format "base64": little-endian float32, as OpenAI sends (the openai client asks for it)


EMBEDDINGS_SHAPE = Checked(
    # input: checked whole by the parser (it says token arrays are not taken)
    Obj({"model": STR, "input": ANY, "encoding_format": STR, "dimensions": INT, "user": STR})
)


def parse_embeddings_request(body: dict[str, Any], limits: Limits, engine_model: str | None) -> EmbeddingsRequest:
    """`engine_model`: the served model's name when its family pools (else None)."""
    check(body, EMBEDDINGS_SHAPE, "openai")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "invalid_type", "model")
    if model not in MODEL_NAMES and model != engine_model:
        offered = " or ".join(repr(name) for name in (MODEL_NAMES[0], engine_model) if name)
        raise ApiError(
            404,
            f"embedding model {model[:100]!r} does not exist; this server embeds with {offered}",
            "model_not_found",
            "model",
        )
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs or not all(isinstance(text, str) and text for text in inputs):
        raise bad_request(
            "'input' must be a non-empty string or an array of them (token arrays are not accepted)",
            "invalid_type",
            "input",
        )
    if len(inputs) > limits.max_embedding_inputs:
        raise bad_request(f"at most {limits.max_embedding_inputs} inputs per request", "invalid_value", "input")
    if sum(len(text.encode("utf-8", errors="replace")) for text in inputs) > limits.max_text_bytes:
        raise bad_request(f"the inputs hold more than {limits.max_text_bytes} bytes", "invalid_value", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "invalid_value", "encoding_format")
    if body.get("dimensions") is not None and (model != MODEL_NAMES[0] or body["dimensions"] != MiniLMEmbedder.dim):
        raise bad_request("'dimensions' cannot be chosen: send it unset", "invalid_value", "dimensions")
    return EmbeddingsRequest(model, tuple(inputs), encoding == "base64")


class FairLane:
    """One turn at a time, tenants in turn. Invariant: `busy` while a turn is held; `waiting` holds
    each tenant with waiters (in the order tenants take turns) and their futures, oldest first."""

    def __init__(self) -> None:
        self.busy = False
        self.waiting: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()

    @asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        if self.busy or self.waiting:
            granted = asyncio.get_running_loop().create_future()
            self.waiting.setdefault(tenant, deque()).append(granted)
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    self._pass_on()  # granted as it was cancelled: the turn is ours to hand on
                else:
                    self._forget(tenant, granted)
                raise
        else:
            self.busy = True
        try:
            yield
        finally:
            self._pass_on()

    def _pass_on(self) -> None:
        while self.waiting:
            tenant, queue = self.waiting.popitem(last=False)
            granted = queue.popleft()
            if queue:
                self.waiting[tenant] = queue  # to the back of the line of tenants
            if not granted.done():
                granted.set_result(None)
                return
        self.busy = False

    def _forget(self, tenant: str, granted: asyncio.Future) -> None:
        queue = self.waiting.get(tenant)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self.waiting[tenant]


class Embeddings:
    """MiniLM embeddings with a model of their own (loaded on the first request), or the engine's."""

    def __init__(self, engine: Engine, settings: Settings):
        self.embedder: MiniLMEmbedder | None = None
        self.engine = engine
        self.settings = settings
        self.lock = threading.Lock()  # guards loading the model
        self.lane = FairLane()

    @property
    def engine_model(self) -> str | None:
        return self.engine.info.name if self.engine.poolable else None

    async def create(self, request: EmbeddingsRequest, tenant: str) -> dict:
        if request.model in MODEL_NAMES:
            vectors, num_tokens = await self._embed(list(request.inputs), tenant)
        else:
            vectors, num_tokens = await self._engine_embed(request.inputs)
        data = [
            {"object": "embedding", "index": index, "embedding": _encoded(vector, request.base64)}
            for index, vector in enumerate(vectors)
        ]
        return {
            "object": "list",
            "data": data,
            "model": request.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }

    async def _embed(self, texts: list[str], tenant: str) -> tuple[list[np.ndarray], int]:
        """MiniLM's vectors of `texts` and the tokens they were embedded from (after its truncation)."""
        embedder = await anyio.to_thread.run_sync(self._model)
        vectors: list[np.ndarray] = []
        try:
            with anyio.fail_after(self.settings.request_timeout_s):
                counts = await self._counted_tokens(embedder, texts, tenant)
                for start in range(0, len(texts), CHUNK_TEXTS):
                    async with self.lane.turn(tenant):
                        embedded = await anyio.to_thread.run_sync(embedder.embed, texts[start : start + CHUNK_TEXTS])
                    vectors.extend(embedded)
        except TimeoutError:
            raise deadline_error(self.settings.request_timeout_s) from None
        finally:
            if len(texts) > CHUNK_TEXTS:  # bulk work: hand the heap it freed back
                await anyio.to_thread.run_sync(return_heap)  # torch's activations for thousands of texts
        return vectors, sum(min(count, embedder.max_tokens) for count in counts)  # what the model reads

    async def _counted_tokens(self, embedder: MiniLMEmbedder, texts: list[str], tenant: str) -> list[int]:
        """Each text's whole token count, by the model's own tokenizer (in chunks, in turn); 400 past
        OpenAI's bounds."""
        counts: list[int] = []
        for start in range(0, len(texts), COUNT_TEXTS):
            async with self.lane.turn(tenant):
                counted = await anyio.to_thread.run_sync(
                    embedder.count_tokens, texts[start : start + COUNT_TEXTS], False
                )
            counts += counted
            for offset, count in enumerate(counted):
                if count > MAX_INPUT_TOKENS:
                    param = f"input[{start + offset}]"
                    raise bad_request(
                        f"{param} has {count} tokens; at most {MAX_INPUT_TOKENS} per input", "invalid_value", param
                    )
            if sum(counts) > MAX_REQUEST_TOKENS:
                raise bad_request(
                    f"the inputs hold more than {MAX_REQUEST_TOKENS} tokens; at most that many per request",
                    "invalid_value",
                    "input",
                )
        return counts

    def _model(self) -> MiniLMEmbedder:
        with self.lock:
            if self.embedder is None:
                self.embedder = MiniLMEmbedder()
            return self.embedder

    async def _engine_embed(self, inputs: tuple[str, ...]) -> tuple[list[np.ndarray], int]:
        texts = await anyio.to_thread.run_sync(lambda: tuple(self.engine.embedding_tokens(text) for text in inputs))
        limit = self.engine.context_tokens(self.settings.limits.max_context_tokens)
        if (longest := max(len(ids) for ids in texts)) > limit:
            raise bad_request(
                f"an input has {longest} tokens; this model's context is {limit}", "context_length_exceeded", "input"
            )
        refuse_unless_serving(self.engine, self.settings.stuck_after_s)
        try:
            job = self.engine.submit_embedding(texts)
        except ENGINE_REFUSALS as refused:
            raise engine_refusal(refused) from None
        events = self.engine.events(job)
        try:
            with anyio.fail_after(self.settings.request_timeout_s):
                event = await events.__anext__()
        except TimeoutError:
            raise deadline_error(self.settings.request_timeout_s) from None
        finally:
            await events.aclose()
        if not isinstance(event, Embedded):
            raise ApiError(503, getattr(event, "message", "embedding failed"), "engine_unavailable")
        return event.vectors, sum(len(ids) for ids in texts)


def _encoded(vector: np.ndarray, as_base64: bool) -> list[float] | str:
    if as_base64:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
