"""Prometheus metrics for GET /metrics, through prometheus-client, in the text exposition format.

Names follow vLLM's where vLLM has one, with `strata:` for `vllm:` (num_requests_running,
num_requests_waiting, prefix_cache_queries / prefix_cache_hits counted in tokens,
time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds,
prompt_tokens, generation_tokens, kv_cache_usage_perc), so a vLLM dashboard reads them with its
prefix swapped; the rest are Strata's own. Two sources:

- request-end accounting, in one place: `RequestMetrics.observe(trace, ...)`, called where a
  finished request is counted (pipeline.Turn), updates counters and histograms;
- state read at scrape time: `StateCollector` turns the engine's and the cache layers' snapshots
  into gauges (queue, batch, bytes and budgets per tier) and counters (evictions, spills,
  promotions, quarantined files, purges), and each served model's state, bytes and requests
  (`model` label; the engine gauges above are the default model's).

Labels never carry client values: layer, outcome, tier, reason and route come from fixed
vocabularies, and `model` from the operator's list of models (a semantic refusal's reasons are the guards' names and the operator's risk
categories). `tenant` is a label only with STRATA_METRICS_TENANT_LABEL=1, and tenants come from
the API-key table, never from a request.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .trace import LAYERS, PrefixFacts, Trace

prometheus_client.disable_created_metrics()  # no `_created` twin of every counter: half the series, same facts
CONTENT_TYPE = "text/plain; version=0.0.4"  # the classic text format every Prometheus reads (Litestar adds charset)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TIMED_LAYERS = ("exact", "semantic", "vision")  # the lookups the trace times on their own


class RequestMetrics:
    """Counters and histograms of finished requests, in `registry`."""

    def __init__(self, registry: CollectorRegistry, tenant_label: bool):
        tenant = ["tenant"] if tenant_label else []
        self.tenant_label = tenant_label
        self.requests = Counter(
            "strata:requests",
            "Finished requests, by the layer that answered",
            ["served_by", *tenant],
            registry=registry,
        )
        self.lookups = Counter(
            "strata:cache_lookups",
            "Cache layer outcomes per request (hit, miss, bypass)",
            ["layer", "outcome", *tenant],
            registry=registry,
        )
        self.prefix_queries = Counter(
            "strata:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", tenant, registry=registry
        )
        self.prefix_hits = Counter(
            "strata:prefix_cache_hits",
            "Prompt tokens served by the prefix cache, by tier",
            ["tier", *tenant],
            registry=registry,
        )
        self.prefix_misses = Counter(
            "strata:prefix_cache_misses", "Prefix lookups that stopped short, by why", ["reason"], registry=registry
        )
        self.semantic_refusals = Counter(
            "strata:semantic_refusals",
            "Semantic misses, by the guard or rule that refused (one request may count under several)",
            ["reason"],
            registry=registry,
        )
        self.draft_tokens = Counter(
            "strata:spec_decode_draft_tokens",
            "Draft tokens the engine verified, by proposer",
            ["proposer"],
            registry=registry,
        )
        self.accepted_tokens = Counter(
            "strata:spec_decode_accepted_tokens",
            "Draft tokens the model's own draws confirmed, by proposer",
            ["proposer"],
            registry=registry,
        )
        self.prompt_tokens = Counter("strata:prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("strata:generation_tokens", "Tokens generated or replayed", registry=registry)
        self.ttft = Histogram(
            "strata:time_to_first_token_seconds",
            "From the request to the first piece of the answer",
            ["served_by"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "strata:inter_token_latency_seconds",
            "Between the engine's streamed pieces",
            buckets=TOKEN_GAP_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "strata:e2e_request_latency_seconds",
            "From the request to its last piece",
            ["served_by"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.lookup_seconds = Histogram(
            "strata:cache_lookup_seconds",
            "Time in one layer's lookup",
            ["layer"],
            buckets=LOOKUP_BUCKETS,
            registry=registry,
        )

    def observe(self, trace: Trace, tenant: str, prompt_tokens: int, completion_tokens: int, end: float) -> None:
        """One finished request (`end`: time.perf_counter() at its last piece)."""
        who = [tenant] if self.tenant_label else []
        self.requests.labels(trace.served_by, *who).inc()
        for layer in LAYERS:
            outcome = trace.outcomes[layer]
            self.lookups.labels(layer, outcome.status, *who).inc()
            if layer == "semantic" and outcome.status == "miss":
                for reason in dict(outcome.details).get("reason", "").split(","):
                    self.semantic_refusals.labels(reason or "unknown").inc()
        if trace.prefix is not None:
            self._observe_prefix(trace.prefix, who)
        for proposer, drafted, accepted in trace.speculative.counts if trace.speculative else ():
            self.draft_tokens.labels(proposer).inc(drafted)
            self.accepted_tokens.labels(proposer).inc(accepted)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if trace.first_token_s is not None:
            self.ttft.labels(trace.served_by).observe(trace.first_token_s)
        for gap in trace.token_gaps_s:
            self.itl.observe(gap)
        self.e2e.labels(trace.served_by).observe(end - trace.started)
        for layer in TIMED_LAYERS:
            if layer in trace.timings_ms:
                self.lookup_seconds.labels(layer).observe(trace.timings_ms[layer] / 1000)

    def _observe_prefix(self, facts: PrefixFacts, who: list[str]) -> None:
        (self.prefix_queries.labels(*who) if who else self.prefix_queries).inc(facts.num_prompt_tokens)
        self.prefix_hits.labels("ram", *who).inc(facts.num_cached_tokens - facts.num_ssd_tokens)
        self.prefix_hits.labels("ssd", *who).inc(facts.num_ssd_tokens)
        if facts.why:
            self.prefix_misses.labels(facts.why).inc()


MODEL_STATES = ("unloaded", "loading", "loaded", "unloading")


@dataclass(frozen=True, slots=True)
class ModelGauge:
    name: str
    state: str  # one of MODEL_STATES
    nbytes: int
    requests: int  # queued or running on its engine


class StateCollector(Collector):
    """Gauges and counters read from snapshots at scrape time (the layers keep their own counts).
    `read()` returns (worker snapshot, health, engine cache stats, response cache stats)."""

    def __init__(
        self,
        read: Callable[[], tuple],
        files: dict[str, Path],
        index_bytes: Callable[[], int],
        ssd_daily_write_bytes: int,
        queue_capacity: int,
        models: Callable[[], tuple[list[ModelGauge], int]] = lambda: ([], 0),
    ):
        self.read = read
        self.models = models  # each served model's state, and the memory limit they share
        self.queue_capacity = queue_capacity
        self.files = files  # response layer -> its SQLite file (bytes held on disk)
        self.index_bytes = index_bytes  # the semantic index's vectors in RAM
        self.ssd_daily_write_bytes = ssd_daily_write_bytes

    def collect(self) -> Iterator:
        worker, health, engine_caches, response_caches = self.read()
        yield _gauge("strata:num_requests_running", "Sequences in the decode batch", worker.num_running)
        yield _gauge("strata:num_requests_waiting", "Requests queued for the engine", worker.queue_depth)
        yield _gauge("strata:queue_capacity", "Places in the engine's queue (STRATA_MAX_QUEUE)", self.queue_capacity)
        yield _gauge("strata:engine_up", "1 while the engine worker runs and steps (see /health)", health.alive)
        yield _gauge("strata:engine_ready", "1 once warm-up ended well and the engine is up", health.ready)
        yield from self._bytes(engine_caches, response_caches)
        yield from self._models()
        yield from _bounds(response_caches.get("semantic", {}).get("bounds") or {})
        yield from _layer_counters(engine_caches)
        prefix = engine_caches.get("prefix")
        if prefix:
            used = (prefix["num_bytes"] + prefix["reserved_bytes"]) / max(prefix["budget_bytes"], 1)
            yield _gauge(
                "strata:kv_cache_usage_perc",
                "Share of the KV byte budget held by cached blocks and running sequences (0 to 1)",
                used,
            )
        ssd = engine_caches.get("ssd")
        if ssd:
            yield _gauge("strata:ssd_written_today_bytes", "Bytes the SSD tier wrote today", ssd["written_today_bytes"])
            yield _gauge(
                "strata:ssd_daily_write_budget_bytes", "The SSD tier's write budget per day", self.ssd_daily_write_bytes
            )

    def _models(self) -> Iterator:
        gauges, limit = self.models()
        if not gauges:
            return
        state = GaugeMetricFamily("strata:model_state", "1 for each model's current state", labels=["model", "state"])
        held = GaugeMetricFamily(
            "strata:model_bytes", "What each model holds against the limit (weights, KV, vision)", labels=["model"]
        )
        jobs = GaugeMetricFamily("strata:model_requests", "Requests queued or running on each model", labels=["model"])
        for gauge in gauges:
            for name in MODEL_STATES:
                state.add_metric([gauge.name, name], float(gauge.state == name))
            held.add_metric([gauge.name], float(gauge.nbytes))
            jobs.add_metric([gauge.name], float(gauge.requests))
        yield from (state, held, jobs)
        yield _gauge("strata:model_memory_limit_bytes", "What the loaded models may hold together", limit)

    def _bytes(self, engine_caches: dict, response_caches: dict) -> Iterator:
        held = GaugeMetricFamily("strata:cache_bytes", "Bytes each tier holds", labels=["tier"])
        budget = GaugeMetricFamily("strata:cache_budget_bytes", "Each tier's byte budget", labels=["tier"])
        entries = GaugeMetricFamily(
            "strata:cache_entries", "Entries (blocks, features, answers) each tier holds", labels=["tier"]
        )
        for tier, stats in (
            ("kv_ram", engine_caches.get("prefix")),
            ("kv_ssd", engine_caches.get("ssd")),
            ("vision", engine_caches.get("vision")),
        ):
            if stats:
                held.add_metric([tier], stats["num_bytes"])
                entries.add_metric([tier], stats.get("num_blocks", stats.get("num_entries", 0)))
                budget.add_metric([tier], stats.get("budget_bytes", stats.get("capacity_bytes", 0)))
        for layer, path in self.files.items():
            held.add_metric([layer], _file_bytes(path))
        for layer, stats in response_caches.items():
            if "num_entries" in stats:  # absent while its store cannot be reached
                entries.add_metric([layer], stats["num_entries"])
        held.add_metric(["semantic_index"], self.index_bytes())
        yield from (held, budget, entries)


def _layer_counters(engine_caches: dict) -> Iterator:
    """The cache layers' own running counts, as Prometheus counters."""
    prefix, ssd, vision = (engine_caches.get(name) or {} for name in ("prefix", "ssd", "vision"))
    families = {
        "strata:cache_evictions": (
            "Entries pushed out by a budget, by tier",
            {
                "kv_ram": prefix.get("num_evicted"),
                "kv_ssd": ssd.get("num_evicted_files"),
                "vision": vision.get("num_evicted"),
            },
        ),
        "strata:cache_expired": (
            "Entries dropped past their retention, by tier",
            {
                "kv_ram": prefix.get("num_expired"),
                "kv_ssd": ssd.get("num_expired_files"),
                "vision": vision.get("num_expired"),
            },
        ),
        "strata:cache_purged": (
            "Entries deleted by purges once no owner was left, by tier",
            {
                "kv_ram": prefix.get("num_purged"),
                "kv_ssd": ssd.get("num_purged_blocks"),
                "vision": vision.get("num_purged"),
            },
        ),
    }
    for name, (text, by_tier) in families.items():
        family = CounterMetricFamily(name, text, labels=["tier"])
        for tier, value in by_tier.items():
            if value is not None:
                family.add_metric([tier], value)
        yield family
    if ssd:
        yield CounterMetricFamily("strata:kv_spilled_blocks", "KV blocks written to the SSD tier", ssd["num_spilled"])
        yield CounterMetricFamily(
            "strata:ssd_quarantined_files",
            "SSD files moved to quarantine (unreadable, checksum mismatch)",
            ssd["num_quarantined"],
        )
    if prefix:
        yield CounterMetricFamily(
            "strata:kv_promoted_blocks", "KV blocks read back from SSD into RAM", prefix["num_ssd_promoted"]
        )
        yield CounterMetricFamily(
            "strata:kv_snapshots_superseded",
            "Hybrid models' passing state snapshots (where a request ended) dropped once a later request resumed past them",
            prefix["num_snapshots_superseded"],
        )
        yield CounterMetricFamily(
            "strata:kv_tokens_without_state",
            "Hybrid models' prompt tokens found in cached blocks but recomputed: no state snapshot was held where they end",
            prefix["num_tokens_without_state"],
        )
        skipped = CounterMetricFamily(
            "strata:kv_snapshots_skipped",
            "Hybrid models' state snapshots asked for and not kept, by reason (budget, pinned, chain_cut)",
            labels=["reason"],
        )
        for reason, count in sorted(prefix["snapshot_skips"].items()):
            skipped.add_metric([reason], count)
        yield skipped


def _bounds(bounds: dict[str, dict]) -> Iterator:
    """The semantic layer's false-hit bound per operator-set scope ("*": every other tenant)."""
    rows = {scope: row for scope, row in bounds.items() if row["configured"]}
    if not rows:
        return
    families = {
        "bound": GaugeMetricFamily(
            "strata:semantic_false_hit_bound",
            "The share of look-alike lookups (another answer) the semantic layer may serve, which bounds its false hits per lookup",
            labels=["scope"],
        ),
        "estimated_false_hit_rate": GaugeMetricFamily(
            "strata:semantic_false_hit_estimate",
            "The share of the calibration evidence's look-alikes the scope's cut serves",
            labels=["scope"],
        ),
        "calibrated": GaugeMetricFamily(
            "strata:semantic_calibrated", "1 when the scope has the evidence its bound needs", labels=["scope"]
        ),
    }
    for scope, row in rows.items():
        for key, family in families.items():
            family.add_metric([scope], float(row[key]))
    yield from families.values()


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=float(value))


def _file_bytes(path: Path) -> int:
    """A SQLite database's bytes on disk, its write-ahead log included."""
    total = 0
    for part in (path, Path(f"{path}-wal")):
        with contextlib.suppress(OSError):
            total += os.stat(part).st_size
    return total
