"""The in-process MLX engine behind one small interface.

    Engine.prepare(messages, images) -> PreparedPrompt     (any thread: tokenizer + numpy)
    Engine.submit(prompt, sampling)  -> Job                (event loop; QueueFull when full)
    Engine.events(job)               -> async Started, Delta..., Finished | Failed
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from .builder import SIZES, ensure_model
from .prompt import PreparedPrompt
from .runner import ModelRunner
from .worker import Delta, EngineWorker, Failed, Finished, Job, QueueFull, Started

log = logging.getLogger("strata.engine")

__all__ = [
    "Delta", "Engine", "Failed", "Finished", "Job", "PreparedPrompt", "QueueFull", "Started",
    "model_fingerprint", "resolve_model_path",
]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # the id clients send as "model"
    path: Path
    fingerprint: str  # sha256 over config, tokenizer and weights: changes whenever outputs may
    max_context_tokens: int


class Engine:
    def __init__(self, model_path: Path, name: str | None, max_queue: int, prefill_chunk_tokens: int):
        self.runner = ModelRunner(model_path)
        self.info = ModelInfo(
            name=name or Path(model_path).name,
            path=Path(model_path),
            fingerprint=model_fingerprint(Path(model_path)),
            max_context_tokens=self.runner.max_positions,
        )
        self.worker = EngineWorker(self.runner, max_queue, prefill_chunk_tokens)
        self.prepare = self.runner.prompts.build
        self.submit = self.worker.submit
        self.events = self.worker.events

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()


def resolve_model_path(model: str, data_dir: Path) -> Path:
    """'demo' and 'tiny' name the embedded models (built into data_dir on first use); a folder is
    used as it is; anything else is treated as a hub id and fetched by mlx-vlm."""
    if model in SIZES:
        return ensure_model(model, Path(data_dir) / "models" / f"strata-{model}")
    if Path(model).exists():
        return Path(model)
    from mlx_vlm.utils import get_model_path

    return Path(get_model_path(model))


def model_fingerprint(model_path: Path) -> str:
    digest = hashlib.sha256(b"strata-model-v1")
    for name in ("config.json", "tokenizer.json", "preprocessor_config.json"):
        path = model_path / name
        if path.exists():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(model_path.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as weights:
            while block := weights.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()
