"""POST /v1/embeddings: sentence embeddings from MiniLM (all-MiniLM-L6-v2, 384-d, L2-normalised), the
model the semantic layer already holds, in OpenAI's shape. Inputs are embedded together, 64 per
forward pass, in a worker thread. The engine's VLM offers no pooled embeddings here.

    parse_embeddings_request(body, limits) -> EmbeddingsRequest     400s name the field
    Embeddings.create(request) -> dict                              the response body
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from semantic import Embedder, MiniLMEmbedder

from .errors import ApiError, bad_request
from .settings import Limits

MODEL_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[str, ...]
    base64: bool  # encoding_format "base64": little-endian float32, as OpenAI sends (the openai client asks for it)


def parse_embeddings_request(body: dict[str, Any], limits: Limits) -> EmbeddingsRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "invalid_type", "model")
    if model not in MODEL_NAMES:
        raise ApiError(404, f"embedding model {model!r} does not exist; this server embeds with {MODEL_NAMES[0]!r}",
                       "model_not_found", "model")
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs or not all(isinstance(text, str) and text for text in inputs):
        raise bad_request("'input' must be a non-empty string or an array of them (token arrays are not accepted)",
                          "invalid_type", "input")
    if len(inputs) > limits.max_embedding_inputs:
        raise bad_request(f"at most {limits.max_embedding_inputs} inputs per request", "invalid_value", "input")
    if sum(len(text.encode("utf-8", errors="replace")) for text in inputs) > limits.max_text_bytes:
        raise bad_request(f"the inputs hold more than {limits.max_text_bytes} bytes", "invalid_value", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "invalid_value", "encoding_format")
    if body.get("dimensions") not in (None, MiniLMEmbedder.dim):
        raise bad_request(f"'dimensions' must be {MiniLMEmbedder.dim} for {MODEL_NAMES[0]}", "invalid_value", "dimensions")
    return EmbeddingsRequest(model, tuple(inputs), encoding == "base64")


class Embeddings:
    """Shares the semantic layer's MiniLM when it is on; else loads one on the first request."""

    def __init__(self, embedder: Embedder | None):
        self.embedder = embedder
        self.lock = threading.Lock()

    async def create(self, request: EmbeddingsRequest) -> dict:
        vectors, num_tokens = await anyio.to_thread.run_sync(self._embed, list(request.inputs))
        data = [{"object": "embedding", "index": index, "embedding": _encoded(vector, request.base64)}
                for index, vector in enumerate(vectors)]
        return {"object": "list", "data": data, "model": request.model,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    def _embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        with self.lock:
            if self.embedder is None:
                self.embedder = MiniLMEmbedder()
        return self.embedder.embed(texts), sum(self.embedder.count_tokens(texts))


def _encoded(vector: np.ndarray, as_base64: bool) -> list[float] | str:
    if as_base64:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
