"""Settings: one frozen dataclass, built from the environment by the CLI and passed to create_app.

Nothing here is read at import time; tests build Settings directly.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcache.quant import QuantConfig
from kvcache.ssd import AdmissionPolicy, SsdConfig
from semantic import SemanticSettings

from .engine import EngineConfig

EXACT_STORES = ("sqlite", "memory", "off")
LOG_FORMATS = ("text", "json")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _default(config: type, name: str):
    """A library's own default for one of its config fields: each default is written once, there."""
    return next(f.default for f in fields(config) if f.name == name)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may ask for. Violations are 4xx errors, never crashes."""

    max_body_bytes: int = 20 * 1024 * 1024
    max_json_depth: int = 32  # a chat body nests ~6 deep; 10^4 once overflowed the parser's stack
    max_messages: int = 1024
    max_parts_per_message: int = 64
    max_text_bytes: int = 4 * 1024 * 1024  # all text parts, UTF-8: checked before any tokenising
    max_user_chars: int = 256  # the OpenAI `user` field and session ids
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096  # checked from the header, before decoding (bombs)
    max_images: int = 8  # image and video parts together
    max_video_bytes: int = 16 * 1024 * 1024  # one video's encoded bytes
    max_video_seconds: float = 120.0  # from the container's header, before any frame is decoded
    max_video_frames: int = 32  # frames sampled at video_sample_fps; a longer clip is refused, never cut
    video_sample_fps: float = 2.0  # frames taken per second of video (Qwen's processors assume 2)
    # the sampled frames of all a request's videos together (each clip gets an equal share; frames
    # are shrunk to it as they are decoded): 16 Mpx is 32 frames of ~724x724, what Qwen's processors keep
    max_video_pixels: int = 16 * 1024 * 1024
    max_video_fps: float = 240.0  # declared frame rate: a 40,000 fps clip is refused before decoding
    # pixels one clip's decoding goes through to reach its last sample (frames between samples are
    # decoded too): 2^33 is 34 s of 4K at 30 fps, or all of a 120 s 1080p clip
    max_video_decode_pixels: int = 1 << 33
    # prompt + answer of one request; None: the model's own context (its config), never more than
    # the KV budget holds for one sequence (Engine.context_tokens)
    max_context_tokens: int | None = None
    # the most tokens one answer may run to; a client asking more (agents ask 32,000 or 128,000) is
    # given this, or what the context has left, and told so (X-Strata-Max-Tokens)
    max_output_tokens: int = 32768
    default_max_tokens: int = 256
    max_stop_sequences: int = 4
    max_tools: int = 128  # functions offered in one request
    max_tool_schema_bytes: int = 64 * 1024  # one function's parameter schema (or a response_format schema), as JSON
    max_top_logprobs: int = 20  # alternatives per token (OpenAI's own bound)
    max_n: int = 8  # choices per request
    # n x max_tokens x (top_logprobs + 1): the log probabilities one request may ask the server to
    # hold (a non-streamed body holds them all; ~40 MB at this bound)
    max_logprob_entries: int = 262_144
    max_embedding_inputs: int = 2048  # texts per /v1/embeddings request (OpenAI's own bound)


@dataclass(frozen=True, slots=True)
class Settings:
    model: str  # a model folder or hub id; "demo"/"tiny" mean the embedded models
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the id clients send; defaults to the folder name
    more_models: tuple[str, ...] = ()  # `--model` given again: served too, loaded when first asked for
    models_file: Path | None = None  # more models, with names, pinning and idle TTLs (gateway/serving/models.py)
    model_memory_bytes: int = 0  # what loaded models may hold together (weights + KV + vision); 0: all of them
    model_load_timeout_s: float = 120.0  # a request waits this long for its model to load; then 503
    conversation_ttl_s: float = 30 * 86400  # stored Responses-API conversations (previous_response_id) live this long
    conversation_quota_bytes: int = 1 << 30  # what one tenant's stored responses may hold (0: no quota)
    stuck_after_s: float = 60.0  # /health is 503 once no engine step ended for this long while work waits
    dashboard_sample_s: float = 5.0  # the dashboard's history: one point this often (an hour of them kept)
    log_format: str = (
        "text"  # json: log records as JSON lines, and one line per request (gateway/observability/requestlog.py)
    )
    metrics_enabled: bool = True  # GET /metrics and the per-request accounting behind it (and the dashboard's)
    metrics_tenant_label: bool = False  # /metrics: a tenant label on per-request series (tenants are operator-set)
    session_ttl_s: float = 0.0  # a session idle this long ends (purged from every layer); 0: only when ended
    sweep_interval_s: float = 60.0  # how often expired exact, semantic and conversation entries are deleted
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    admin_key: str | None = None
    max_queue: int = _default(EngineConfig, "max_queue")  # waiting requests; more answer 429
    max_num_seqs: int = _default(EngineConfig, "max_num_seqs")  # sequences decoding together
    request_timeout_s: float = 300.0  # server-side deadline of one request, queue wait included; then 504
    stream_ping_s: float = 5.0  # a stream whose prompt still waits or prefills sends a ping this often
    http_read_timeout_s: float = 30.0  # a request's headers and body must arrive within this; then closed
    http_header_timeout_s: float = 5.0  # its headers alone within this (a slow-header client goes early)
    keep_alive_s: int = 5  # idle keep-alive connections are closed after this
    max_connections: int = 256  # open connections; more are answered 503 (but /health, /healthz, /health/ready)
    max_connections_per_client: int = 32  # open connections from one address; more are answered 429 (0: no cap)
    step_prompt_tokens: int = _default(EngineConfig, "step_prompt_tokens")  # a multiple of kv_block_size
    step_budget_ms: float = _default(EngineConfig, "step_budget_ms")  # a step with decode rows; 0: fixed chunks
    max_verify_tokens: int = _default(EngineConfig, "max_verify_tokens")  # speculative decoding; 0 = off
    kv_block_size: int = 32  # tokens per prefix-cache block (docs/caches.md: how it was chosen)
    kv_snapshot_blocks: int | None = None  # hybrid models: a lasting state snapshot every N blocks; None: per model
    kv_budget_bytes: int | None = None  # RAM for KV blocks and running sequences; None = 25% of available RAM; 0 = off
    vision_budget_bytes: int = 256 << 20  # RAM for cached image features; 0 = off
    kv_ram_retention_s: float = 86400.0  # prefix KV blocks in RAM nobody used for this long are dropped (0: never)
    kv_pin_fraction: float = 0.25  # of the prefix KV budget, what one tenant's pinned blocks (breakpoints) may hold
    vision_retention_s: float = 86400.0  # cached image features nobody used for this long are dropped (0: never)
    ssd_capacity_bytes: int = _default(SsdConfig, "capacity_bytes")  # KV blocks under DATA_DIR/kv; 0 = no SSD tier
    ssd_retention_s: float = _default(SsdConfig, "retention_s")
    ssd_min_hits: int = _default(AdmissionPolicy, "min_hits")  # admission: spill only blocks reused this often
    ssd_min_prefix_tokens: int = _default(AdmissionPolicy, "min_prefix_tokens")  # only blocks this deep in a prefix
    ssd_daily_write_bytes: int = _default(AdmissionPolicy, "daily_write_bytes")  # admission: write budget per day
    ssd_measured_admission: bool = _default(AdmissionPolicy, "measured")  # measured reuse decides, not min_hits
    secret_file: Path | None = None  # the server secret tenant salts derive from (None: DATA_DIR/server.secret)
    encrypt_at_rest: bool = True  # AES-256-GCM, a data key per tenant: KV on SSD, cached answers, conversations
    key_file: Path | None = None  # the key that wraps tenants' data keys (None: derived from the server secret)
    public_prefixes_file: Path | None = None  # declared public texts (a JSON list): their KV is shared by all tenants
    trace_file: Path | None = None  # a block trace of the traffic (kvcache.blocktrace), for evals.cache_sim
    ssd_dir: Path | None = None  # the KV SSD tier's folder (None: DATA_DIR/kv); may be shared by replicas
    ssd_writer: str = _default(SsdConfig, "writer")  # this replica's name in a shared ssd_dir ("": the only writer)
    kv_quant_bits: int | None = None  # 8 or 4 quantises stored KV blocks (off by default)
    kv_quant_min_tokens: int = _default(QuantConfig, "min_tokens")  # ... only blocks at least this deep in a prefix
    redis_url: str | None = None  # the exact cache and semantic entries in Redis, shared by replicas (over exact_store)
    exact_store: str = "sqlite"  # sqlite (persistent, DATA_DIR/responses.db) | memory | off
    exact_ttl_s: float = 24 * 3600.0  # default entry lifetime; X-Strata-Cache-TTL overrides per request
    max_cache_ttl_s: float = 30 * 24 * 3600.0  # the largest X-Strata-Cache-TTL a client may ask for
    semantic_enabled: bool = True
    semantic_threshold: float = _default(SemanticSettings, "threshold")  # cosine; tuned on evals/data/dev.jsonl
    semantic_require_approved: bool = False  # serve only entries an admin approved
    semantic_verifier: bool = True  # the learned second opinion after the guards (semantic/verifier.py)
    # the share of look-alike lookups (nearest entry has another answer) that may be served, 95% confidence:
    # a bound on semantic false hits per lookup; None: the verifier's fixed bars
    semantic_max_false_hit_rate: float | None = None
    semantic_tenant_bounds: dict[str, float] = field(default_factory=dict)  # tenant -> its own bound
    semantic_ttl_s: float = _default(SemanticSettings, "default_ttl_s")
    cache_nondeterministic: bool = False  # also cache sampled (temperature > 0, no seed) answers
    risk_patterns_file: Path | None = None  # None: semantic/risk_patterns.json
    normalize_rules_file: Path | None = None  # None: gateway/requests/normalize_rules.json (prompts kept cacheable)
    normalize_off_tenants: tuple[str, ...] = ()  # tenants whose system prompts are left exactly as sent
    # tenants ("*": every tenant) whose end users (`user`, Anthropic's metadata.user_id) keep their own
    # caches: prefix and vision salts, exact keys and semantic contexts carry the end user
    isolated_end_user_tenants: tuple[str, ...] = ()
    allow_remote_images: bool = False  # http(s) image_url parts
    remote_image_allow: tuple[Network, ...] = ()  # networks that may be fetched although not public (10.1.0.0/16)
    remote_image_timeout_s: float = 10.0  # total deadline of one fetch: DNS, connect, redirects, body
    remote_image_max_redirects: int = 3
    allow_file_images_under: Path | None = None  # file:// image_url parts below this folder
    limits: Limits = field(default_factory=Limits)

    def end_user_apart(self, tenant: str, end_user: str) -> str:
        """The end user whose caches a request keeps apart from the tenant's other end users: the
        one it names when the tenant is in STRATA_ISOLATE_END_USERS; "" otherwise (the tenant's)."""
        return end_user if self.isolates_end_users(tenant) else ""

    def isolates_end_users(self, tenant: str) -> bool:
        return "*" in self.isolated_end_user_tenants or tenant in self.isolated_end_user_tenants

    def __post_init__(self):
        if self.exact_store not in EXACT_STORES:
            raise ValueError(f"exact store must be sqlite, memory or off; got {self.exact_store!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"STRATA_MAX_NUM_SEQS must be at least 1; got {self.max_num_seqs}")
        if self.step_prompt_tokens < self.kv_block_size or self.step_prompt_tokens % self.kv_block_size:
            raise ValueError(
                f"STRATA_STEP_PROMPT_TOKENS must be a multiple of STRATA_KV_BLOCK_SIZE ({self.kv_block_size}); "
                f"got {self.step_prompt_tokens}"
            )
        if self.step_budget_ms < 0:
            raise ValueError(f"STRATA_STEP_BUDGET_MS must be 0 or more; got {self.step_budget_ms}")
        if self.max_verify_tokens < 0:
            raise ValueError(f"STRATA_MAX_VERIFY_TOKENS must be 0 or more; got {self.max_verify_tokens}")
        bounds = [self.semantic_max_false_hit_rate, *self.semantic_tenant_bounds.values()]
        if any(bound is not None and not 0 < bound < 1 for bound in bounds):
            raise ValueError("a semantic false-hit bound must be between 0 and 1 (exclusive)")
        if self.semantic_tenant_bounds and self.semantic_max_false_hit_rate is None:
            raise ValueError(
                "STRATA_SEMANTIC_TENANT_BOUNDS needs STRATA_SEMANTIC_MAX_FALSE_HIT_RATE (the others' bound)"
            )
        if self.kv_snapshot_blocks is not None and self.kv_snapshot_blocks < 0:
            raise ValueError(f"STRATA_KV_SNAPSHOT_BLOCKS must be 0 or more; got {self.kv_snapshot_blocks}")
        # CIDR strings are parsed here, once (ValueError names a bad one); fetches use the networks
        object.__setattr__(self, "remote_image_allow", tuple(_network(c) for c in self.remote_image_allow))

    @property
    def multi_tenant(self) -> bool:
        return bool(self.api_keys)


def parse_api_keys(text: str) -> dict[str, str]:
    """`key1:tenantA,key2:tenantB` -> {key1: tenantA, ...}; raises ValueError on a bad entry."""
    keys: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        key, sep, tenant = entry.partition(":")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"STRATA_API_KEYS entry {entry!r} is not key:tenant")
        keys[key.strip()] = tenant.strip()
    return keys


def parse_tenant_bounds(text: str) -> dict[str, float]:
    """`billing:0.02,faq:0.1` -> {billing: 0.02, faq: 0.1}; raises ValueError on a bad entry."""
    bounds: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, bound = entry.rpartition(":")
        if not sep or not tenant.strip():
            raise ValueError(f"entry {entry!r} is not tenant:bound")
        bounds[tenant.strip()] = float(bound)
    return bounds


def parse_flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use one of {', '.join(_TRUE + _FALSE)})")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _cidrs(text: str) -> tuple[Network, ...]:
    return tuple(_network(c.strip()) for c in text.split(",") if c.strip())


def _network(cidr: str | Network) -> Network:
    return ipaddress.ip_network(cidr, strict=False)


def _one_of(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {text!r}")
        return text

    return parse


def _writer_name(text: str) -> str:
    """A name that can be part of a file name: letters, digits, '-' and '_', at most 64."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        raise ValueError(f"must be 1 to 64 letters, digits, '-' or '_'; got {text!r}")
    return text


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting, declared once: the Settings field (and its default; `limits.NAME` for a field of
    Limits), the environment variable, the `strata serve` flag (none for secrets: flags show in the
    process list), a parser, and its description: `strata serve --help` shows it and the settings
    table in docs/cli.md holds it word for word (tests/gateway/test_units.py checks both ways)."""

    field: str
    env: str
    parse: Callable[[str], Any]
    help: str
    secret: bool = False

    @property
    def flag(self) -> str | None:
        return None if self.secret else "--" + self.field.removeprefix(LIMITS).replace("_", "-")

    @property
    def default(self) -> Any:
        if self.field.startswith(LIMITS):
            return next(f.default for f in fields(Limits) if f.name == self.field.removeprefix(LIMITS))
        return next((f.default for f in fields(Settings) if f.name == self.field), None)


LIMITS = "limits."  # a setting named limits.NAME sets a field of Settings.limits


SETTINGS = (
    Setting(
        "model_name",
        "STRATA_MODEL_NAME",
        str,
        (
            "the model id clients send for the first `--model` (default: the model folder's name, e.g. "
            "`strata-demo`, or the hub id as given)"
        ),
    ),
    Setting(
        "api_keys",
        "STRATA_API_KEYS",
        parse_api_keys,
        (
            "`key1:tenantA,key2:tenantB`. When set, every `/v1` request needs `Authorization: Bearer <key>`, and "
            "the tenant comes only from the key. Unset: single-tenant (announced at start-up)."
        ),
        secret=True,
    ),
    Setting("admin_key", "STRATA_ADMIN_KEY", str, "guards `/admin/*`; unset, admin routes answer 403", secret=True),
    Setting(
        "conversation_ttl_s",
        "STRATA_CONVERSATION_TTL_S",
        float,
        ("how long a stored Responses-API conversation can be continued with `previous_response_id` (default 30 days)"),
    ),
    Setting(
        "conversation_quota_bytes",
        "STRATA_CONVERSATION_QUOTA_BYTES",
        int,
        (
            "what one tenant's stored Responses-API turns and images may hold (default 1 GiB; 0: no quota); a "
            "request that could pass it is refused before any work with 413 `storage_quota_exceeded` (`store: "
            "false`, or deleting stored responses, makes room)"
        ),
    ),
    Setting(
        "stuck_after_s",
        "STRATA_STUCK_AFTER_S",
        float,
        (
            "`/health` answers 503 (`stuck: …`) once no engine step has ended for this long while requests wait "
            "(default 60 s)"
        ),
    ),
    Setting(
        "dashboard_sample_s",
        "STRATA_DASHBOARD_SAMPLE_S",
        float,
        "seconds between the points of `/dashboard`'s history (default 5; the last 720 points are kept)",
    ),
    Setting(
        "log_format",
        "STRATA_LOG_FORMAT",
        _one_of(LOG_FORMATS),
        (
            "`text` (default) or `json`: every log line a JSON object, and one line per request (request id, "
            "tenant, status, duration, each layer's outcome, timings, token counts; never prompt or answer text)"
        ),
    ),
    Setting(
        "metrics_enabled",
        "STRATA_METRICS",
        bool,
        "turn `/metrics`, the per-request accounting behind it and the dashboard's data off (default on)",
    ),
    Setting(
        "metrics_tenant_label",
        "STRATA_METRICS_TENANT_LABEL",
        bool,
        (
            "add a `tenant` label to the per-request series of `/metrics` (tenants come from `STRATA_API_KEYS`, "
            "never from requests)"
        ),
    ),
    Setting(
        "session_ttl_s",
        "STRATA_SESSION_TTL_S",
        float,
        (
            "a session (`X-Strata-Session` / `metadata.session_id`) idle this long is ended: purged from every "
            "layer and tier by the sweep (default 0: never)"
        ),
    ),
    Setting(
        "sweep_interval_s",
        "STRATA_SWEEP_INTERVAL_S",
        float,
        (
            "how often a background sweep deletes expired exact entries, semantic entries and stored "
            "conversations, and ends idle sessions (default 60 s); `/admin/stats.sweeps` counts what it removed"
        ),
    ),
    Setting(
        "limits.max_context_tokens",
        "STRATA_MAX_CONTEXT_TOKENS",
        int,
        (
            "prompt + answer of one request (default: the model's own context from its config, as far as the KV "
            "budget holds one sequence of it; the server logs the figure at start-up); a longer prompt is a 400 "
            "`context_length_exceeded`"
        ),
    ),
    Setting(
        "limits.max_output_tokens",
        "STRATA_MAX_OUTPUT_TOKENS",
        int,
        (
            "the most tokens one answer may run to (default 32768); a client's larger `max_tokens` (agents ask "
            "32,000 or 128,000) is lowered to it, and to what the context leaves after the prompt, never refused:"
            " `X-Strata-Max-Tokens: asked=...; allowed=...; by=context|output_limit` says so"
        ),
    ),
    Setting(
        "max_queue",
        "STRATA_MAX_QUEUE",
        int,
        (
            "requests that may wait for the engine (default 64); more answer 429 `queue_full` with `Retry-After`;"
            " one tenant may hold at most half of them (more: 429 `tenant_share`)"
        ),
    ),
    Setting(
        "max_num_seqs",
        "STRATA_MAX_NUM_SEQS",
        int,
        ("sequences on the model at once, decoding or their prompt coming in, one model call a step (default 16)"),
    ),
    Setting(
        "step_prompt_tokens",
        "STRATA_STEP_PROMPT_TOKENS",
        int,
        (
            "prompt tokens one model call runs beside the decode rows, shared by every prompt coming in, until "
            "the steps' costs are measured, or always when `STRATA_STEP_BUDGET_MS` is 0 (default 128; a multiple "
            "of `STRATA_KV_BLOCK_SIZE`)"
        ),
    ),
    Setting(
        "step_budget_ms",
        "STRATA_STEP_BUDGET_MS",
        float,
        (
            "the time a step with decode rows may take: it carries as many prompt tokens as the steps' measured "
            "cost fits in it, so a running stream waits at most about this long for prompts coming in beside it "
            "(default 170; 0: `STRATA_STEP_PROMPT_TOKENS` always); smaller keeps streams' pace steadier, larger "
            "brings prompts in sooner and steps run without prompts more often"
        ),
    ),
    Setting(
        "max_verify_tokens",
        "STRATA_MAX_VERIFY_TOKENS",
        int,
        (
            "tokens a decode step feeds at most over its rows, draft tokens of speculative decoding included "
            "(default 64; 0 turns drafting off)"
        ),
    ),
    Setting(
        "request_timeout_s",
        "STRATA_REQUEST_TIMEOUT_S",
        float,
        (
            "server-side deadline of one request, queue wait included (default 300); then 504 `timeout` and the "
            "job is cancelled"
        ),
    ),
    Setting(
        "stream_ping_s",
        "STRATA_STREAM_PING_S",
        float,
        (
            "a stream whose prompt still waits in the queue or prefills after this long starts at once and keeps "
            "the connection alive this often: `ping` events on `/v1/messages`, `: ping` SSE comment lines (which "
            "every SSE client skips) on `/v1/chat/completions` and `/v1/responses`; an error then ends the stream"
            " in the API's own error events (default 5)"
        ),
    ),
    Setting(
        "http_read_timeout_s",
        "STRATA_HTTP_READ_TIMEOUT_S",
        float,
        "a request's headers and body must arrive within this (default 30); else the connection is closed",
    ),
    Setting(
        "http_header_timeout_s",
        "STRATA_HTTP_HEADER_TIMEOUT_S",
        float,
        "its headers alone within this (default 5): a client that drips its headers is cut early",
    ),
    Setting(
        "keep_alive_s", "STRATA_KEEP_ALIVE_S", int, "idle keep-alive connections are closed after this (default 5)"
    ),
    Setting(
        "max_connections",
        "STRATA_MAX_CONNECTIONS",
        int,
        (
            "open connections (default 256); beyond it uvicorn answers 503 (plain text), but never to `/health`, "
            "`/healthz` and `/health/ready`"
        ),
    ),
    Setting(
        "max_connections_per_client",
        "STRATA_MAX_CONNECTIONS_PER_CLIENT",
        int,
        (
            "open connections from one client address (default 32; 0: none, as behind a proxy, which `strata "
            "cluster` sets for its replicas); one more is answered 429 `too_many_connections` and closed"
        ),
    ),
    Setting("kv_block_size", "STRATA_KV_BLOCK_SIZE", int, "tokens per KV block (default 32, see below)"),
    Setting(
        "kv_snapshot_blocks",
        "STRATA_KV_SNAPSHOT_BLOCKS",
        int,
        (
            "hybrid models: snapshot the recurrent state every this many blocks of a prompt, besides its cache"
            " breakpoints, its images' ends and where it and its reply end (default: chosen per model, so that"
            ' snapshots hold about a quarter of the KV bytes, 8 to 64 blocks; 0: only there; see "Hybrid / recurrent'
            ' families")'
        ),
    ),
    Setting(
        "kv_budget_bytes",
        "STRATA_KV_BUDGET_BYTES",
        int,
        (
            "RAM for KV: cached prefix blocks and the running sequences' own KV (default 25% of available RAM; 0 "
            "turns the prefix cache off, and running sequences are then bounded by `STRATA_MAX_NUM_SEQS` only)"
        ),
    ),
    Setting(
        "vision_budget_bytes",
        "STRATA_VISION_BUDGET_BYTES",
        int,
        "RAM for cached image features (default 256 MiB; 0 = off)",
    ),
    Setting(
        "kv_pin_fraction",
        "STRATA_KV_PIN_FRACTION",
        float,
        (
            "share of the prefix KV budget one tenant's pinned prefixes (Anthropic `cache_control` breakpoints) "
            "may hold (default 0.25; 0: nothing is pinned)"
        ),
    ),
    Setting(
        "kv_ram_retention_s",
        "STRATA_KV_RAM_RETENTION_S",
        float,
        (
            "prefix KV blocks in RAM that nobody used for this long are dropped (default a day; 0: kept until "
            "evicted); the worker checks every 10 s, idle or not, and nothing expired is spilled to SSD (the SSD "
            "tier keeps its own `STRATA_SSD_RETENTION_S`)"
        ),
    ),
    Setting(
        "vision_retention_s",
        "STRATA_VISION_RETENTION_S",
        float,
        (
            "cached image features that nobody used for this long are dropped (default a day; 0: kept until "
            "evicted), checked as above"
        ),
    ),
    Setting(
        "ssd_capacity_bytes",
        "STRATA_SSD_CAPACITY_BYTES",
        int,
        "byte cap of the KV SSD tier under `DATA_DIR/kv` (default 20 GiB, LRU by file; 0 = no SSD tier)",
    ),
    Setting(
        "ssd_retention_s",
        "STRATA_SSD_RETENTION_S",
        float,
        "KV files on SSD unused this long are deleted (default 7 days)",
    ),
    Setting(
        "ssd_min_hits",
        "STRATA_SSD_MIN_HITS",
        int,
        (
            "admission: spill only blocks reused at least this often in RAM (default 1; with measured admission, "
            "until there is evidence)"
        ),
    ),
    Setting(
        "ssd_min_prefix_tokens",
        "STRATA_SSD_MIN_PREFIX_TOKENS",
        int,
        "admission: spill only blocks at least this deep in a prefix (default 0)",
    ),
    Setting(
        "ssd_daily_write_bytes",
        "STRATA_SSD_DAILY_WRITE_BYTES",
        int,
        "admission: the day's write budget (default 10 GiB)",
    ),
    Setting(
        "ssd_measured_admission",
        "STRATA_SSD_MEASURED_ADMISSION",
        parse_flag,
        (
            "admit by `STRATA_SSD_MIN_HITS` alone (default on: once 200 evictions of a kind were seen, the "
            "evicted blocks later requests asked for again at least 20% of the time are written, and others not)"
        ),
    ),
    Setting(
        "secret_file",
        "STRATA_SECRET_FILE",
        Path,
        (
            "the server secret tenant salts derive from (default `DATA_DIR/server.secret`); replicas sharing a KV"
            " tier or a Redis must share it, or their block hashes never agree and their data keys do not open; "
            "the key store `keys.json` lives beside it"
        ),
    ),
    Setting(
        "encrypt_at_rest",
        "STRATA_ENCRYPT_AT_REST",
        parse_flag,
        (
            "store in the clear (default on: KV on SSD, cached answers and questions, conversations sealed with "
            'AES-256-GCM under a key per tenant; see "Data at rest")'
        ),
    ),
    Setting(
        "key_file",
        "STRATA_KEY_FILE",
        Path,
        (
            "32 random bytes (raw, or 64 hex digits) that wrap the tenants' data keys, e.g. a mounted secret "
            "(default: a key derived from the server secret); a missing, malformed or wrong file stops start-up"
        ),
    ),
    Setting(
        "trace_file",
        "STRATA_TRACE_FILE",
        Path,
        (
            "append a block trace of every request to this file (JSON lines: time, a tenant digest, the prompt's "
            "blocks as short salted hashes, whether a response layer answered; no text) for `python -m "
            "evals.cache_sim --trace` and `strata what-if`"
        ),
    ),
    Setting(
        "models_file",
        "STRATA_MODELS_FILE",
        Path,
        (
            'more models to serve, as JSON: `{"models": [{"name": "coder", "path": "DIR, built-in name or hub '
            'id", "pinned": false, "idle_ttl_s": 0, "aliases": ["claude-*"]}]}` (see "Several models in one '
            'server")'
        ),
    ),
    Setting(
        "model_memory_bytes",
        "STRATA_MODEL_MEMORY_BYTES",
        int,
        (
            "what the loaded models may hold together, weights + KV budget + vision budget each (default 0: no "
            "limit, every model may stay loaded); to load one more, the least recently used idle models are "
            "unloaded"
        ),
    ),
    Setting(
        "model_load_timeout_s",
        "STRATA_MODEL_LOAD_TIMEOUT_S",
        float,
        (
            "how long a request waits for its model to load, or for room under the limit (default 120); then 503 "
            "`model_unavailable` with `Retry-After`"
        ),
    ),
    Setting(
        "public_prefixes_file",
        "STRATA_PUBLIC_PREFIXES_FILE",
        Path,
        (
            'a JSON list of public prefixes (`{"system": ..., "tools": [...]}`) whose KV blocks every tenant '
            'shares (see "Public prefixes")'
        ),
    ),
    Setting(
        "ssd_dir",
        "STRATA_SSD_DIR",
        Path,
        (
            "the KV SSD tier's folder (default `DATA_DIR/kv`); replicas may share one (a network file system), "
            "each with its own `STRATA_SSD_WRITER`"
        ),
    ),
    Setting(
        "ssd_writer",
        "STRATA_SSD_WRITER",
        _writer_name,
        (
            "this replica's name among the writers of a shared `STRATA_SSD_DIR` (letters, digits, `-`, `_`): its "
            "own index and journal there, and every KV block written through to SSD as it is stored (not only at "
            "eviction), so another replica can continue its conversations if it dies"
        ),
    ),
    Setting(
        "kv_quant_bits",
        "STRATA_KV_QUANT_BITS",
        int,
        "8 or 4: quantise stored KV blocks (RAM and SSD) at least 1024 tokens deep (default off)",
    ),
    Setting(
        "redis_url",
        "STRATA_REDIS_URL",
        str,
        (
            "`redis://host:port/db`: the exact cache and the semantic entries live in Redis, shared by every "
            "replica pointing at it (purges reach them all; each replica's faiss index follows the others' "
            "changes through a Redis stream); an unreachable Redis makes both layers `bypass; "
            "reason=store_unavailable` until it is back"
        ),
    ),
    Setting(
        "exact_store",
        "STRATA_EXACT_STORE",
        _one_of(EXACT_STORES),
        "`sqlite` (default, `DATA_DIR/responses.db`, survives restarts), `memory` or `off`",
    ),
    Setting("exact_ttl_s", "STRATA_EXACT_TTL_S", float, "default lifetime of exact entries (default 86400)"),
    Setting(
        "max_cache_ttl_s",
        "STRATA_MAX_CACHE_TTL_S",
        float,
        "the largest `X-Strata-Cache-TTL` a client may ask for (default 2592000, 30 days); more is a 400",
    ),
    Setting(
        "semantic_enabled",
        "STRATA_SEMANTIC",
        parse_flag,
        "turn the semantic layer off (it loads MiniLM at start-up, ~5 s)",
    ),
    Setting(
        "semantic_threshold",
        "STRATA_SEMANTIC_THRESHOLD",
        float,
        "cosine threshold before the guards (default 0.80, tuned on `evals/data/dev.jsonl`)",
    ),
    Setting(
        "semantic_require_approved",
        "STRATA_SEMANTIC_REQUIRE_APPROVED",
        parse_flag,
        "serve only semantic entries an admin approved",
    ),
    Setting(
        "semantic_max_false_hit_rate",
        "STRATA_SEMANTIC_MAX_FALSE_HIT_RATE",
        float,
        (
            "the share of look-alike lookups (whose nearest entry has another answer) the semantic layer may "
            "serve, held with 95% confidence (e.g. `0.05`): a bound on its false hits per lookup; unset: the "
            'verifier\'s fixed bars decide (see "The false-hit bound")'
        ),
    ),
    Setting(
        "semantic_tenant_bounds",
        "STRATA_SEMANTIC_TENANT_BOUNDS",
        parse_tenant_bounds,
        ("tenants' own bounds, `billing:0.02,faq:0.10` (needs `STRATA_SEMANTIC_MAX_FALSE_HIT_RATE` for the others)"),
    ),
    Setting(
        "semantic_verifier",
        "STRATA_SEMANTIC_VERIFIER",
        parse_flag,
        "the rule guards alone: no learned verifier after them (on by default)",
    ),
    Setting(
        "cache_nondeterministic",
        "STRATA_CACHE_NONDETERMINISTIC",
        parse_flag,
        "also cache sampled answers (temperature > 0 without a seed) in the exact layer",
    ),
    Setting(
        "risk_patterns_file",
        "STRATA_RISK_PATTERNS_FILE",
        Path,
        ("the risk rules (personal data, medical, ...) as JSON; default and format: `semantic/risk_patterns.json`"),
    ),
    Setting(
        "normalize_rules_file",
        "STRATA_NORMALIZE_RULES_FILE",
        Path,
        (
            "prompt normalisation rules (RE2, JSON; default `gateway/requests/normalize_rules.json`, which "
            "removes Claude Code's attribution line): volatile lines taken out of system messages before any "
            "cache key or token, so the prefix stays shared"
        ),
    ),
    Setting(
        "normalize_off_tenants",
        "STRATA_NORMALIZE_OFF_TENANTS",
        _names,
        "tenants (comma-separated) whose system prompts are never normalised",
    ),
    Setting(
        "isolated_end_user_tenants",
        "STRATA_ISOLATE_END_USERS",
        _names,
        (
            "tenants (comma-separated; `*` for all) whose end users never share cached prefixes or answers (see "
            '"End users apart")'
        ),
    ),
    Setting(
        "allow_remote_images",
        "STRATA_ALLOW_REMOTE_IMAGES",
        parse_flag,
        'accept `http(s)` image URLs (off: only `data:` URLs); see "Remote images"',
    ),
    Setting(
        "remote_image_allow",
        "STRATA_REMOTE_IMAGE_ALLOW",
        _cidrs,
        "comma-separated CIDRs that may be fetched although not public (default none)",
    ),
    Setting(
        "remote_image_timeout_s",
        "STRATA_REMOTE_IMAGE_TIMEOUT_S",
        float,
        "total deadline of one image fetch: DNS, connect, redirects, body (default 10)",
    ),
    Setting("allow_file_images_under", "STRATA_FILE_IMAGES_UNDER", Path, "accept `file://` image URLs below DIR"),
)


def add_setting_flags(parser) -> None:
    """One flag per non-secret setting on an argparse parser; its help names the variable and default."""
    for setting in SETTINGS:
        if setting.flag:
            default = setting.default
            shown = "" if default is None or default is MISSING else f"; default {default}"
            help_text = f"{setting.help} [{setting.env}{shown}]".replace("%", "%%")  # argparse formats help with %
            parser.add_argument(setting.flag, dest=setting.field, metavar="VALUE", default=None, help=help_text)
    secrets = "; ".join(f"{s.env}: {s.help}" for s in SETTINGS if s.secret)
    parser.epilog = f"Flags beat the environment. Secrets come only from the environment: {secrets}."


def default_data_dir() -> Path:
    """The data folder when --data-dir is not given: STRATA_DATA_DIR, else ./strata-data (the one
    place the variable is read)."""
    return Path(os.environ.get("STRATA_DATA_DIR", "strata-data"))


def settings_from_env(
    model: str, data_dir: Path, host: str, port: int, env=None, flags=None, more_models: tuple[str, ...] = ()
) -> Settings:
    """Settings for `strata serve`: the CLI gives model and address; each setting comes from its flag,
    else its environment variable, else the Settings default. A value that does not parse raises
    ValueError naming its flag or variable."""
    env = os.environ if env is None else env
    flags = flags or {}
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        source, text = (
            (setting.flag, flags[setting.field])
            if flags.get(setting.field) is not None
            else (setting.env, env.get(setting.env, ""))
        )
        if not text.strip():
            continue
        try:
            values[setting.field] = setting.parse(text.strip())
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    limits = {name.removeprefix(LIMITS): values.pop(name) for name in list(values) if name.startswith(LIMITS)}
    try:
        return Settings(
            model=model,
            data_dir=Path(data_dir),
            host=host,
            port=port,
            more_models=tuple(more_models),
            limits=Limits(**limits),
            **values,
        )
    except ValueError as exc:
        raise ValueError(f"bad setting: {exc}") from None
