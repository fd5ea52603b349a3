"""The operator's dashboard: GET /dashboard (a page with no data in it) and GET /admin/dashboard/data
(admin key), which the page polls every few seconds.

    samples(registry) -> {"name{label="value",...}": value}   every series of /metrics at one instant
    History(registry, sample_s).sample(now)                    one point (every sample_s; the last 720 kept)

The data answer carries the same series as /metrics, keyed as /metrics prints them, so what the page
shows is what Prometheus would scrape; and the history the page draws: per sample interval, each
layer's hit rate, the prefix token hit rate, TTFT p50 and p95 (from the histogram's buckets, as
Prometheus' histogram_quantile does) and the queue. The page draws its own SVG: no build step, no
asset from the internet.
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path

import anyio
from litestar import Request, Response, get
from prometheus_client import CollectorRegistry

from ..observability.trace import LAYERS
from .admin import require_admin

HISTORY_POINTS = 720  # an hour at the default STRATA_DASHBOARD_SAMPLE_S (5 s)
PAGE = (Path(__file__).parent / "dashboard.html").read_text()


def samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class History:
    """Points of the last hour, oldest first; each compares two consecutive samples."""

    def __init__(self, registry: CollectorRegistry, sample_s: float):
        self.registry = registry
        self.sample_s = sample_s
        self.points: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self.previous: dict[str, float] | None = None

    def sample(self, now: float) -> None:
        current = samples(self.registry)
        if self.previous is not None:
            self.points.append(_point(now, self.previous, current))
        self.previous = current

    async def run(self) -> None:
        """Sample in a worker thread, as /metrics renders: collecting reads files and may ask Redis."""
        while True:
            await anyio.to_thread.run_sync(self.sample, time.time())
            await anyio.sleep(self.sample_s)


def _point(now: float, before: dict[str, float], after: dict[str, float]) -> dict:
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    rates = {}
    for layer in LAYERS:
        hits = delta(f'strata:cache_lookups_total{{layer="{layer}",outcome="hit"}}')
        misses = delta(f'strata:cache_lookups_total{{layer="{layer}",outcome="miss"}}')
        rates[layer] = hits / (hits + misses) if hits + misses else None
    queried = delta("strata:prefix_cache_queries_total")
    reused = sum(delta(f'strata:prefix_cache_hits_total{{tier="{t}"}}') for t in ("ram", "ssd"))
    buckets = _bucket_deltas(before, after, "strata:time_to_first_token_seconds_bucket")
    return {
        "t": now,
        "hit_rate": rates,
        "prefix_tokens": reused / queried if queried else None,
        "ttft_p50": _quantile(0.5, buckets),
        "ttft_p95": _quantile(0.95, buckets),
        "waiting": after.get("strata:num_requests_waiting", 0.0),
        "running": after.get("strata:num_requests_running", 0.0),
    }


def _bucket_deltas(before: dict[str, float], after: dict[str, float], name: str) -> list[tuple[float, float]]:
    """(upper bound, requests at or under it) over the interval, summed over every label but `le`."""
    counts: dict[float, float] = {}
    for key, value in after.items():
        if key.startswith(name + "{"):
            bound = float(key.split('le="')[1].split('"')[0])
            counts[bound] = counts.get(bound, 0.0) + value - before.get(key, 0.0)
    return sorted(counts.items())


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q (None: no requests)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # the highest finite bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


@get("/dashboard", media_type="text/html", include_in_schema=False)
async def dashboard_page() -> str:
    """The page itself holds no data: it asks for the admin key (kept in the tab's sessionStorage)
    unless the browser already sends an Authorization header, then polls the data route."""
    return PAGE


@get("/admin/dashboard/data", guards=[require_admin])
async def dashboard_data(request: Request) -> Response:
    history: History = request.app.state.history
    current = await anyio.to_thread.run_sync(samples, history.registry)
    return Response(
        {"t": time.time(), "metrics": current, "history": list(history.points), "sample_s": history.sample_s},
        headers={"Cache-Control": "no-store"},
    )


DASHBOARD_ROUTES = [dashboard_page, dashboard_data]
