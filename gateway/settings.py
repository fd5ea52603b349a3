"""Settings: one frozen dataclass, built from the environment by the CLI and passed to create_app.

Nothing here is read at import time; tests build Settings directly.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path


EXACT_STORES = ("sqlite", "memory", "off")


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
    max_images: int = 8
    max_context_tokens: int = 16384
    max_output_tokens: int = 4096
    default_max_tokens: int = 256
    max_stop_sequences: int = 4


@dataclass(frozen=True, slots=True)
class Settings:
    model: str  # a model folder or hub id; "demo"/"tiny" mean the embedded models
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the id clients send; defaults to the folder name
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    admin_key: str | None = None
    max_queue: int = 16  # waiting requests; more answer 429
    request_timeout_s: float = 300.0  # server-side deadline of one request, queue wait included; then 504
    http_read_timeout_s: float = 30.0  # a request's headers and body must arrive within this; then closed
    keep_alive_s: int = 5  # idle keep-alive connections are closed after this
    max_connections: int = 256  # open connections; more are answered 503 by uvicorn
    prefill_chunk_tokens: int = 512  # a multiple of kv_block_size
    kv_block_size: int = 32  # tokens per prefix-cache block (README: how it was chosen)
    kv_budget_bytes: int | None = None  # RAM for prefix KV blocks; None = 25% of available RAM; 0 = off
    vision_budget_bytes: int = 256 << 20  # RAM for cached image features; 0 = off
    ssd_capacity_bytes: int = 20 << 30  # KV blocks on disk under DATA_DIR/kv; 0 = no SSD tier
    ssd_retention_s: float = 7 * 24 * 3600.0
    ssd_min_hits: int = 1  # admission: spill only blocks reused at least this often
    ssd_min_prefix_tokens: int = 0  # admission: only blocks at least this deep in a prefix
    ssd_daily_write_bytes: int = 10 << 30  # admission: write budget per day
    kv_quant_bits: int | None = None  # 8 or 4 quantises stored KV blocks (off by default)
    kv_quant_min_tokens: int = 1024  # ... only blocks at least this deep in a prefix
    exact_store: str = "sqlite"  # sqlite (persistent, DATA_DIR/responses.db) | memory | off
    exact_ttl_s: float = 24 * 3600.0  # default entry lifetime; X-Strata-Cache-TTL overrides per request
    max_cache_ttl_s: float = 30 * 24 * 3600.0  # the largest X-Strata-Cache-TTL a client may ask for
    semantic_enabled: bool = True
    semantic_threshold: float = 0.80  # cosine; tuned on evals/data/dev.jsonl
    semantic_require_approved: bool = False  # serve only entries an admin approved
    semantic_ttl_s: float = 7 * 24 * 3600.0
    cache_nondeterministic: bool = False  # also cache sampled (temperature > 0, no seed) answers
    risk_patterns_file: Path | None = None  # None: semantic/risk_patterns.json
    allow_remote_images: bool = False  # http(s) image_url parts
    remote_image_allow: tuple[str, ...] = ()  # CIDRs that may be fetched although not public (e.g. 10.1.0.0/16)
    remote_image_timeout_s: float = 10.0  # total deadline of one fetch: DNS, connect, redirects, body
    remote_image_max_redirects: int = 3
    allow_file_images_under: Path | None = None  # file:// image_url parts below this folder
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        if self.exact_store not in EXACT_STORES:
            raise ValueError(f"exact store must be sqlite, memory or off; got {self.exact_store!r}")
        for cidr in self.remote_image_allow:
            ipaddress.ip_network(cidr, strict=False)  # ValueError names the bad entry

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


def parse_flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use one of {', '.join(_TRUE + _FALSE)})")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _cidrs(text: str) -> tuple[str, ...]:
    cidrs = tuple(filter(None, (c.strip() for c in text.split(","))))
    for cidr in cidrs:
        ipaddress.ip_network(cidr, strict=False)  # ValueError names the bad entry
    return cidrs


def _exact_store(text: str) -> str:
    if text not in EXACT_STORES:
        raise ValueError(f"must be one of {', '.join(EXACT_STORES)}; got {text!r}")
    return text


# environment variable -> (Settings field, parser); an unset or empty variable keeps the field's default
ENVIRONMENT = {
    "STRATA_MODEL_NAME": ("model_name", str),
    "STRATA_API_KEYS": ("api_keys", parse_api_keys),
    "STRATA_ADMIN_KEY": ("admin_key", str),
    "STRATA_MAX_QUEUE": ("max_queue", int),
    "STRATA_REQUEST_TIMEOUT_S": ("request_timeout_s", float),
    "STRATA_HTTP_READ_TIMEOUT_S": ("http_read_timeout_s", float),
    "STRATA_KEEP_ALIVE_S": ("keep_alive_s", int),
    "STRATA_MAX_CONNECTIONS": ("max_connections", int),
    "STRATA_KV_BLOCK_SIZE": ("kv_block_size", int),
    "STRATA_KV_BUDGET_BYTES": ("kv_budget_bytes", int),
    "STRATA_VISION_BUDGET_BYTES": ("vision_budget_bytes", int),
    "STRATA_SSD_CAPACITY_BYTES": ("ssd_capacity_bytes", int),
    "STRATA_SSD_MIN_HITS": ("ssd_min_hits", int),
    "STRATA_SSD_MIN_PREFIX_TOKENS": ("ssd_min_prefix_tokens", int),
    "STRATA_SSD_DAILY_WRITE_BYTES": ("ssd_daily_write_bytes", int),
    "STRATA_KV_QUANT_BITS": ("kv_quant_bits", int),
    "STRATA_EXACT_STORE": ("exact_store", _exact_store),
    "STRATA_EXACT_TTL_S": ("exact_ttl_s", float),
    "STRATA_MAX_CACHE_TTL_S": ("max_cache_ttl_s", float),
    "STRATA_SEMANTIC": ("semantic_enabled", parse_flag),
    "STRATA_SEMANTIC_THRESHOLD": ("semantic_threshold", float),
    "STRATA_SEMANTIC_REQUIRE_APPROVED": ("semantic_require_approved", parse_flag),
    "STRATA_CACHE_NONDETERMINISTIC": ("cache_nondeterministic", parse_flag),
    "STRATA_RISK_PATTERNS_FILE": ("risk_patterns_file", Path),
    "STRATA_ALLOW_REMOTE_IMAGES": ("allow_remote_images", parse_flag),
    "STRATA_REMOTE_IMAGE_ALLOW": ("remote_image_allow", _cidrs),
    "STRATA_REMOTE_IMAGE_TIMEOUT_S": ("remote_image_timeout_s", float),
    "STRATA_FILE_IMAGES_UNDER": ("allow_file_images_under", Path),
}


def settings_from_env(model: str, data_dir: Path, host: str, port: int, env=None) -> Settings:
    """Settings for `strata serve`: the CLI gives model and address, the environment the rest.
    A value that does not parse raises ValueError naming its variable."""
    env = os.environ if env is None else env
    values = {}
    for variable, (name, parse) in ENVIRONMENT.items():
        text = env.get(variable, "")
        if not text.strip():
            continue
        try:
            values[name] = parse(text.strip())
        except ValueError as exc:
            raise ValueError(f"{variable}: {exc}") from None
    try:
        return Settings(model=model, data_dir=Path(data_dir), host=host, port=port, **values)
    except ValueError as exc:
        raise ValueError(f"bad setting: {exc}") from None
