"""The shipped alert rules pass promtool (syntax and their own unit tests), and a real Prometheus
(Debian's, installed by `make test`) scrapes a live `strata serve` and answers a query with its series."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import TINY
from tests.gateway.test_live_server import LiveServer, _free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make test` installs it (Debian's prometheus package)"
    return path


@pytest.mark.parametrize(
    "args",
    [["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"], ["check", "config", "prometheus.yml"]],
)
def test_promtool_accepts_the_shipped_files(args):
    done = subprocess.run([_tool("promtool"), *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_real_prometheus_scrapes_strata_and_answers_a_query(tiny_model_path, tmp_path):
    strata = LiveServer(tiny_model_path, tmp_path / "data", {"STRATA_MODEL_NAME": TINY})
    prometheus = None
    try:
        body = {
            "model": TINY,
            "messages": [{"role": "user", "content": "scrape me"}],
            "max_tokens": 3,
            "temperature": 0,
        }
        for _ in range(2):
            assert httpx.post(strata.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        port = _free_port()
        config = (DEPLOY / "prometheus.yml").read_text().replace("scrape_interval: 15s", "scrape_interval: 1s")
        config = config.replace("127.0.0.1:8000", f"127.0.0.1:{strata.port}")
        (tmp_path / "prometheus.yml").write_text(config)
        shutil.copy(DEPLOY / "alerts.yml", tmp_path / "alerts.yml")
        log = (tmp_path / "prometheus.log").open("w")
        prometheus = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        found = _query_until(f"http://127.0.0.1:{port}", 'strata:requests_total{served_by="exact"}', prometheus, log)
        assert float(found["value"][1]) == 1.0 and found["metric"]["job"] == "strata"
        rules = httpx.get(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert {r["name"] for group in rules for r in group["rules"]} >= {
            "StrataCacheHitRateLow",
            "StrataEngineNotReady",
        }
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        assert strata.stop()


def _query_until(url: str, query: str, process: subprocess.Popen, log, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, Path(log.name).read_text()
        try:
            answer = httpx.get(url + "/api/v1/query", params={"query": query}, timeout=5)
            # 503 "Service Unavailable" (plain text) while Prometheus is up but not yet ready
            result = answer.json()["data"]["result"] if answer.status_code == 200 else []
            if result:
                return result[0]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never returned {query}: {Path(log.name).read_text()[-2000:]}")
