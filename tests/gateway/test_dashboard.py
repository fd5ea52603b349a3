"""The dashboard in a real browser: Debian's headless Chromium (installed by `make test`), driven over
the DevTools protocol, loads /dashboard from a live `strata serve` after some traffic; every number
the page ties to a series equals what /metrics says, and a screenshot is saved."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from gateway.operations.dashboard import History
from tests.conftest import TINY
from tests.gateway.test_live_server import LiveServer, _free_port

ADMIN = "dashboard-admin"
SCREENSHOT = Path(__file__).resolve().parents[2] / ".test-artifacts" / "dashboard.png"


class DevTools:
    """The few DevTools-protocol calls the test needs, over one page's websocket."""

    def __init__(self, port: int):
        deadline = time.monotonic() + 30
        while True:
            try:
                pages = [
                    t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json() if t["type"] == "page"
                ]
                if pages:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Chromium's DevTools endpoint never answered"
            time.sleep(0.2)
        self.url = pages[0]["webSocketDebuggerUrl"]
        self.next_id = 0

    def __enter__(self) -> DevTools:
        self.connection = connect(self.url, max_size=None, open_timeout=10)
        self.socket = self.connection.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.connection.__exit__(*exc_info)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=30))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_the_dashboard_shows_what_metrics_says_in_a_real_browser(tiny_model_path, tmp_path):
    chromium_path = shutil.which("chromium")
    assert chromium_path, "chromium is missing: `make test` installs it (Debian's chromium package)"
    strata = LiveServer(
        tiny_model_path,
        tmp_path / "data",
        {"STRATA_ADMIN_KEY": ADMIN, "STRATA_MODEL_NAME": TINY, "STRATA_DASHBOARD_SAMPLE_S": "0.5"},
    )
    browser = None
    try:
        prompts = ["Name a harbour.", "Name a lighthouse.", "Name a harbour.", "Name a ship.", "Name a harbour."]
        for prompt in prompts:
            body = {"model": TINY, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
            assert httpx.post(strata.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
            time.sleep(0.6)  # spread over several history points
        assert httpx.get(strata.url + "/admin/dashboard/data", timeout=5).status_code == 401  # its data: admins only
        port = _free_port()
        # The suite runs under LD_PRELOAD=OpenBLAS (for MLX): Chromium must not inherit it (it then never starts)
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        browser = subprocess.Popen(
            [
                chromium_path,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--remote-debugging-port={port}",
                f"--user-data-dir={tmp_path / 'chromium'}",
                "--window-size=1400,1250",
                "about:blank",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with DevTools(port) as page:
            page.call("Network.enable")
            page.call("Network.setExtraHTTPHeaders", headers={"Authorization": f"Bearer {ADMIN}"})
            page.call("Page.enable")
            page.call("Page.navigate", url=strata.url + "/dashboard")
            deadline = time.monotonic() + 30
            while page.evaluate("document.body && document.body.dataset.loaded") != "1":
                assert time.monotonic() < deadline, "the dashboard never loaded its data"
                time.sleep(0.2)
            time.sleep(0.5)  # the charts are drawn in the same pass; let the frame settle for the screenshot
            shown = page.evaluate(
                "JSON.stringify([...document.querySelectorAll('[data-metric]')]"
                ".map(e => [e.dataset.metric, Number(e.dataset.value), e.textContent]))"
            )
            texts = page.evaluate(
                "JSON.stringify({requests: document.getElementById('requests').textContent,"
                " exact: document.getElementById('rate-exact').textContent,"
                " points: document.querySelectorAll('#chart-hits circle').length,"
                " engine: document.getElementById('engine').textContent})"
            )
            SCREENSHOT.parent.mkdir(exist_ok=True)
            SCREENSHOT.write_bytes(base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"]))
        metrics = _metrics(strata.url)
    finally:
        if browser is not None:
            browser.terminate()
            browser.wait(timeout=30)
        assert strata.stop()
    shown, texts = json.loads(shown), json.loads(texts)
    assert len(shown) >= 8
    for key, value, _ in shown:
        assert metrics[key] == value, (key, value, metrics.get(key))
    by_key = {key: text for key, _, text in shown}
    assert by_key['strata:requests_total{served_by="exact"}'] == "exact 2  "  # "Name a harbour." twice more
    assert texts["requests"] == "5" and texts["exact"] == "40.0%"  # 2 hits of 5 exact lookups
    assert texts["engine"] == "engine ready" and texts["points"] > 0  # the hit-rate chart has points
    assert by_key[f'strata:model_bytes{{model="{TINY}"}}'].endswith("iB")  # the models table: the one served
    assert SCREENSHOT.stat().st_size > 20_000


def test_ttft_quantiles_interpolate_like_prometheus():
    from gateway.operations.dashboard import _quantile

    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 8.0)]
    assert _quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (4 - 2) / 4)
    assert _quantile(0.25, buckets) == pytest.approx(0.1)
    assert _quantile(0.5, []) is None and History.__name__ == "History"
