"""The models one server serves: which they are (`--model`, repeated, and STRATA_MODELS_FILE), and each
loaded model's engine and chat service, handed to requests through the model pool.

    model_entries(settings) -> list[ModelEntry]     the first is the default model
    ServedModels(settings, config, default_engine)  the pool; the default model is loaded and pinned
    async with models.lease(name) as model:         model.engine, model.chat, model.stamp; waits (without
        ...                                         holding a thread) while the model loads; 404/503/500
    models.default, models.loaded(), models.statuses()

The default model (the first) is loaded at start and never unloaded: /health/ready, embeddings and
public prefixes speak for it. Every other model loads when a request first names it, on a thread of
its own, after its warm-up; requests for loaded models never wait for that. What unloads, and when,
is the pool's rule (gateway/engine/model_pool.py): least recently used idle models first under
STRATA_MODEL_MEMORY_BYTES, never a pinned one, never one whose engine still runs jobs.

Every model shares the one response store (its scope holds the model's fingerprint) and the SSD tier's
root (each model files its blocks under a folder named by its fingerprint, and block hashes chain from
it), so a model unloaded keeps its prefix blocks on SSD and restores its conversations from there when
it is loaded again; a purge reaches the SSD blocks of the models not loaded too.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio

from ..checkpoints import parse_model_name, resolve_model_path
from ..engine import (
    Engine,
    EngineConfig,
    ModelLoadFailed,
    ModelPool,
    ModelSpec,
    ModelStatus,
    ModelUnavailable,
    Removed,
    UnknownModel,
    model_fingerprint,
    purge_ssd_of,
    release_memory,
    weights_bytes,
)
from ..formats.openai_format import ModelStamp
from ..observability.metrics import ModelGauge
from ..requests.errors import ApiError, echo
from ..settings import Settings
from .chat import ChatService

log = logging.getLogger("strata")

POLL_S = 0.05  # how often a request waiting for its model to load looks again (on the event loop)
ENTRY_FIELDS = {"name", "path", "pinned", "idle_ttl_s", "kv_budget_bytes", "max_context_tokens", "defaults", "aliases"}
DEFAULTABLE = {"temperature", "top_p", "max_tokens"}  # request fields a model's entry may give defaults for
# The model names coding agents ask for by default (Claude Code's claude-* main and side-task models,
# Codex's gpt-* and o-series): a server of one model answers them all with it.
AGENT_ALIASES = ("claude-*", "gpt-*", "o[0-9]*", "codex-*")


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str  # the id clients send as "model"
    path: str  # a model folder, a built-in name ("tiny", "gemma3-tiny", ...) or a hub id
    pinned: bool = False  # never unloaded (the default model always is)
    idle_ttl_s: float = 0.0  # unloaded after this long without a request (0: only to make room)
    kv_budget_bytes: int | None = None  # its own KV budget (default STRATA_KV_BUDGET_BYTES)
    max_context_tokens: int | None = None  # its own bound on prompt + answer (default the server's)
    defaults: dict[str, float] = field(default_factory=dict)  # request fields a request leaves out take these
    aliases: tuple[str, ...] = ()  # other names (glob patterns, `claude-*`) requests may use for it


def model_entries(settings: Settings) -> list[ModelEntry]:
    """The command line's models (the first named by STRATA_MODEL_NAME if set), then the models
    file's. ValueError on a repeated name or a bad file."""
    given = [settings.model, *settings.more_models] if settings.model else []
    entries = [ModelEntry(_default_name(model), model) for model in given]
    if entries and settings.model_name:
        entries[0] = ModelEntry(settings.model_name, entries[0].path)
    if settings.models_file is not None:
        entries += read_models_file(settings.models_file)
    if not entries:
        raise ValueError("no model to serve: give --model or STRATA_MODELS_FILE")
    names = [entry.name for entry in entries]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"model names must differ; repeated: {', '.join(repeated)}")
    if len(entries) == 1 and not entries[0].aliases:
        entries[0] = replace(entries[0], aliases=AGENT_ALIASES)
    return entries


def _default_name(model: str) -> str:
    """A built-in model's own name, a folder's name, or the hub id as given."""
    if (spec := parse_model_name(model)) is not None:
        return spec.name
    return Path(model).name if Path(model).is_dir() else model


def read_models_file(path: Path) -> list[ModelEntry]:
    """`{"models": [{"name", "path", ...}, ...]}` with the fields of ENTRY_FIELDS (name defaults as on
    the command line)."""
    try:
        rows = json.loads(Path(path).read_text())["models"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"STRATA_MODELS_FILE {path}: not a JSON object with a 'models' list ({exc})") from None
    if not isinstance(rows, list):
        raise ValueError(f"STRATA_MODELS_FILE {path}: 'models' must be a list")
    return [_entry(row, f"STRATA_MODELS_FILE {path}: models[{i}]") for i, row in enumerate(rows)]


def _entry(row: object, where: str) -> ModelEntry:
    if not isinstance(row, dict) or not isinstance(row.get("path"), str):
        raise ValueError(f"{where}: an object with a 'path' string")
    if unknown := set(row) - ENTRY_FIELDS:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(ENTRY_FIELDS)}")
    name = row.get("name", _default_name(row["path"]))
    pinned, ttl = row.get("pinned", False), row.get("idle_ttl_s", 0.0)
    if not isinstance(name, str) or not name or not isinstance(pinned, bool):
        raise ValueError(f"{where}: 'name' must be a non-empty string and 'pinned' true or false")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < 0:
        raise ValueError(f"{where}: 'idle_ttl_s' must be a number of seconds >= 0")
    for key in ("kv_budget_bytes", "max_context_tokens"):
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: '{key}' must be a whole number >= 1")
    budget, context = row.get("kv_budget_bytes"), row.get("max_context_tokens")
    defaults, aliases = _defaults(row.get("defaults", {}), where), _aliases(row.get("aliases", []), where)
    return ModelEntry(name, row["path"], pinned, float(ttl), budget, context, defaults, aliases)


def _aliases(raw: object, where: str) -> tuple[str, ...]:
    """Other names for a model: glob patterns (`*`, `?`, `[...]`), matched in the file's order."""
    if not isinstance(raw, list) or not all(isinstance(alias, str) and alias for alias in raw):
        raise ValueError(f"{where}: 'aliases' must be a list of names or glob patterns (claude-*)")
    return tuple(raw)


def _defaults(raw: object, where: str) -> dict[str, float]:
    """A model's default decoding: temperature, top_p, max_tokens (checked again, as a request's, when used)."""
    if not isinstance(raw, dict) or set(raw) - DEFAULTABLE:
        raise ValueError(f"{where}: 'defaults' must be an object of {sorted(DEFAULTABLE)}")
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in raw.values()):
        raise ValueError(f"{where}: 'defaults' values must be numbers")
    return dict(raw)


class ServedModel:
    """One loaded model: its engine, the chat service on it, and the name and fingerprint answers carry."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.chat = ChatService(settings, engine)
        self.stamp = ModelStamp(engine.info.name, engine.info.fingerprint)

    @property
    def nbytes(self) -> int:
        return self.engine.nbytes

    @property
    def requests(self) -> int:
        return self.engine.num_requests

    @property
    def busy(self) -> bool:
        """Jobs queued or running: a stream outlives the lease that started it."""
        return self.engine.busy

    def stop(self) -> None:
        self.engine.stop()
        log.info("model %r unloaded", self.engine.info.name)


class ServedModels:
    def __init__(
        self,
        settings: Settings,
        engine_config: Callable[[Settings], EngineConfig],
        entries: list[ModelEntry],
        default_engine: Engine,
    ):
        """`entries[0]` is the default model, already loaded as `default_engine`; `engine_config` maps
        settings to an engine's configuration (a model's own KV budget goes through it too)."""
        self.settings = settings
        self.engine_config = engine_config
        self.config = engine_config(settings)  # the server's
        self.entries = {entry.name: entry for entry in entries[1:]}
        # (pattern, model) in the entries' order: the first pattern a name matches picks the model
        served = [default_engine.info.name, *(entry.name for entry in entries[1:])]
        self.aliases = [(alias, name) for entry, name in zip(entries, served) for alias in entry.aliases]
        specs = [
            ModelSpec(entry.name, entry.path, self._estimate(entry), entry.pinned, entry.idle_ttl_s)
            for entry in entries[1:]
        ]
        self.default = ServedModel(default_engine, settings)
        name = default_engine.info.name  # entries[0]'s, unless the caller named its engine otherwise
        default_spec = ModelSpec(name, entries[0].path, default_engine.nbytes, pinned=True)
        limit = settings.model_memory_bytes or sum(spec.estimate_bytes for spec in [default_spec, *specs])
        self.pool = ModelPool([default_spec, *specs], self._load, limit, after_unload=release_memory)
        self.pool.adopt(default_spec.name, self.default)
        self.fingerprints: dict[str, str] = {}  # model path -> fingerprint, for purging unloaded models' SSD

    def _estimate(self, entry: ModelEntry) -> int:
        """Weights on disk plus the cache budgets (a hub id is fetched here, at start-up, to know them)."""
        caches = self._config(entry).caches
        weights = weights_bytes(resolve_model_path(entry.path, self.settings.data_dir))
        return weights + caches.prefix_budget_bytes + caches.vision_budget_bytes

    def _config(self, entry: ModelEntry) -> EngineConfig:
        if entry.kv_budget_bytes is None:
            return self.config
        return self.engine_config(replace(self.settings, kv_budget_bytes=entry.kv_budget_bytes))

    def _settings(self, entry: ModelEntry) -> Settings:
        if entry.max_context_tokens is None:
            return self.settings
        limits = replace(self.settings.limits, max_context_tokens=entry.max_context_tokens)
        return replace(self.settings, limits=limits)

    def _load(self, spec: ModelSpec) -> ServedModel:
        """On the pool's loading thread: the engine, warmed up (a failed warm-up fails the load)."""
        log.info("loading model %r (%s)", spec.name, spec.path)
        entry = self.entries[spec.name]
        engine = Engine(resolve_model_path(spec.path, self.settings.data_dir), spec.name, self._config(entry))
        try:
            engine.start()
        except BaseException:
            engine.stop()
            raise
        log.info("model %r loaded: %d bytes booked", spec.name, engine.nbytes)
        served = ServedModel(engine, self._settings(entry))
        log.info("model %r: context %d tokens per request", spec.name, served.chat.context_tokens())
        return served

    def resolve(self, name: str) -> str:
        """The served model a request's model name stands for: itself, else the model whose alias
        matches it first; a name neither serves nor matches stays as it is (a 404 at lease)."""
        if name in self.pool.slots:
            return name
        return next((model for alias, model in self.aliases if fnmatch.fnmatchcase(name, alias)), name)

    def aliases_of(self, name: str) -> list[str]:
        return [alias for alias, model in self.aliases if model == name]

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[ServedModel]:
        """The named model (or the one its alias names) for one request's start (its jobs then keep
        it loaded while they run)."""
        name = self.resolve(name)
        model = await self._acquire(name)
        try:
            yield model
        finally:
            self.pool.release(name)

    async def _acquire(self, name: str) -> ServedModel:
        deadline = anyio.current_time() + self.settings.model_load_timeout_s
        attempt = 0
        while True:
            try:
                model, attempt = self.pool.poll(name, attempt)
                if model is not None:
                    return model  # type: ignore[return-value]  # the pool holds ServedModels
                if anyio.current_time() >= deadline:
                    raise ModelUnavailable(self.pool.why_waiting(name))
            except UnknownModel:
                raise ApiError(
                    404,
                    f"model {echo(name)} does not exist; this server serves {self.names()}",
                    "model_not_found",
                    "model",
                ) from None
            except ModelUnavailable as exc:
                raise ApiError(503, f"{exc}; retry later", "model_unavailable", "model", {"Retry-After": "5"}) from None
            except ModelLoadFailed as exc:
                raise ApiError(500, str(exc), "model_load_failed", "model") from None
            await anyio.sleep(POLL_S)

    def with_defaults(self, body: dict) -> dict:
        """A request body with its model's default decoding for the fields it leaves out (max_tokens
        as each API names it: max_completion_tokens, max_output_tokens)."""
        model = body.get("model")
        entry = self.entries.get(self.resolve(model)) if isinstance(model, str) else None
        if entry is None or not entry.defaults:
            return body
        defaults = dict(entry.defaults)
        if {"max_completion_tokens", "max_output_tokens"} & set(body) and "max_tokens" in defaults:
            del defaults["max_tokens"]
        return {**defaults, **body}

    def names(self) -> str:
        return ", ".join(repr(status.name) for status in self.pool.statuses())

    def loaded(self) -> list[ServedModel]:
        return self.pool.loaded_models()  # type: ignore[return-value]  # the pool holds ServedModels

    def statuses(self) -> list[ModelStatus]:
        return self.pool.statuses()

    def gauges(self) -> list[ModelGauge]:
        """Each model's state and booked bytes, and the requests on its engine (0 when not loaded)."""
        requests = {model.stamp.name: model.requests for model in self.loaded()}
        return [ModelGauge(s.name, s.state, s.nbytes, requests.get(s.name, 0)) for s in self.statuses()]

    def purge_unloaded_ssd(self, selects: Callable[[str], bool]) -> list[Removed]:
        """The SSD blocks of the models not loaded now (each model's are in a folder of its own): the
        selected owners taken off; what each removed (none without an SSD tier)."""
        removed = []
        for status in self.statuses():
            if status.state == "unloaded":
                fingerprint = self._fingerprint(self.pool.slots[status.name].spec.path)
                if (found := purge_ssd_of(self.config.caches, fingerprint, selects)) is not None:
                    removed.append(found)
        return removed

    def _fingerprint(self, path: str) -> str:
        """A model's fingerprint without loading it (its files hashed once, then remembered)."""
        if path not in self.fingerprints:
            self.fingerprints[path] = model_fingerprint(resolve_model_path(path, self.settings.data_dir))
        return self.fingerprints[path]

    def expire_idle(self, now: float) -> int:
        """For the sweep: the models unloaded for being idle past their TTL."""
        return len(self.pool.expire_idle())

    def close(self) -> None:
        """Stop every model loaded on demand (the default model's engine is its owner's to stop)."""
        self.pool.close(keep=self.default)
