"""POST /v1/embeddings, in OpenAI's shape, from one of two models:

- MiniLM (all-MiniLM-L6-v2, 384-d, L2-normalised), the model the semantic layer already holds:
  inputs are embedded together, 64 per forward pass, in a worker thread;
- the served model itself when its family pools (qwen3: the last token's final hidden state,
  L2-normalised, as mlx-vlm's qwen3_embedding computes it): one text per engine worker step,
  between decode steps, since only the worker may run the model.

    parse_embeddings_request(body, limits, engine_model) -> EmbeddingsRequest    400s name the field
    Embeddings.create(request) -> dict                                          the response body
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from semantic import Embedder, MiniLMEmbedder

from .chat import deadline_error
from .engine import Embedded, Engine
from .errors import ENGINE_REFUSALS, ApiError, bad_request, engine_refusal
from .settings import Limits, Settings

MODEL_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[str, ...]
    base64: bool  # encoding_format "base64": little-endian float32, as OpenAI sends (the openai client asks for it)


def parse_embeddings_request(body: dict[str, Any], limits: Limits, engine_model: str | None) -> EmbeddingsRequest:
    """`engine_model`: the served model's name when its family pools (else None)."""
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


class Embeddings:
    """Shares the semantic layer's MiniLM when it is on; else loads one on the first request."""

    def __init__(self, embedder: Embedder | None, engine: Engine, settings: Settings):
        self.embedder = embedder
        self.engine = engine
        self.settings = settings
        self.lock = threading.Lock()

    @property
    def engine_model(self) -> str | None:
        return self.engine.info.name if self.engine.poolable else None

    async def create(self, request: EmbeddingsRequest) -> dict:
        if request.model in MODEL_NAMES:
            vectors, num_tokens = await anyio.to_thread.run_sync(self._embed, list(request.inputs))
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

    def _embed(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        with self.lock:
            if self.embedder is None:
                self.embedder = MiniLMEmbedder()
        return list(self.embedder.embed(texts)), sum(self.embedder.count_tokens(texts))

    async def _engine_embed(self, inputs: tuple[str, ...]) -> tuple[list[np.ndarray], int]:
        texts = await anyio.to_thread.run_sync(lambda: tuple(self.engine.embedding_tokens(text) for text in inputs))
        limit = min(self.settings.limits.max_context_tokens, self.engine.info.max_context_tokens)
        if (longest := max(len(ids) for ids in texts)) > limit:
            raise bad_request(
                f"an input has {longest} tokens; this model's context is {limit}", "context_length_exceeded", "input"
            )
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
