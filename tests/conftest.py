"""Shared fixtures: the tiny model is built once per checkout (keyed by the builder's inputs), one
engine serves the in-process apps."""

from __future__ import annotations

import base64
import gc
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gateway.checkpoints import BuildSpec, builder_digest, ensure_model
from gateway.engine import CacheConfig, Engine, EngineConfig
from gateway.settings import Limits, Settings

TINY = "strata-tiny"
# Built models are kept here across pytest runs; STRATA_TEST_MODELS points copies of the checkout
# (make mutants) at the same folder.
MODEL_CACHE = Path(os.environ.get("STRATA_TEST_MODELS", Path(__file__).parent.parent / ".strata" / "test-models"))


# What makes a test "live" (`make check` leaves it out): a fixture that starts a model, a server or an
# outside process, or a module that starts one itself.
LIVE_FIXTURES = {
    "tiny_model_path",
    "engine",
    "server",
    "live",
    "redis_server",
    "embedder",
    "app",
    "client",
    "agent_server",
}
LIVE_CALLS = (
    "LiveServer(",
    "start_server(",
    "start_agent_server(",
    "Engine(",
    "ModelRunner(",
    "built_model(",
    "subprocess",
    "RedisServer(",
)


# Seconds each test file took, measured (`pytest --record-durations` rewrites it): the parallel run
# hands out the costliest files first, so no long file starts last while the other workers idle.
# A file it does not list costs 0 and goes last; a stale figure only changes the order.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser) -> None:
    parser.addoption("--record-durations", action="store_true", help=f"rewrite {DURATIONS.name} from this run")


def pytest_collection_modifyitems(items) -> None:
    """Mark the live tests (see LIVE_FIXTURES): `pytest -m "not live"` is the inner loop. Then order
    the files by their measured cost, costliest first (a stable sort: each file's tests stay
    together and in their order, so a module's fixtures still start once)."""
    starts_something: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in starts_something:
            starts_something[path] = any(call in item.path.read_text() for call in LIVE_CALLS)
        if starts_something[path] or LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
    cost = json.loads(DURATIONS.read_text())
    items.sort(key=lambda item: -cost.get(_file_of(item.nodeid), 0.0))


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    file = _file_of(report.nodeid)
    _measured[file] = _measured.get(file, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    """With --record-durations, the run's per-file seconds replace the files' figures (written by
    the process that saw every report: the only one without xdist, the controller with it)."""
    if session.config.getoption("record_durations") and not hasattr(session.config, "workerinput"):
        recorded = json.loads(DURATIONS.read_text()) | {name: round(s, 1) for name, s in _measured.items()}
        ranked = dict(sorted(recorded.items(), key=lambda row: -row[1]))
        DURATIONS.write_text(json.dumps(ranked, indent=1) + "\n")


def pytest_collection_finish(session) -> None:
    """Everything imported by now (MLX, torch, transformers, every test module) lives for the whole
    run: frozen out of the garbage collector, a full collection in this process scans only what the
    tests make. Unfrozen, one took 0.13-0.29 s on a 2-core machine, and timings measured from this
    process (inter-token gaps, /health latency) showed it as a stall of the server."""
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return built_model(BuildSpec(size="tiny"))


def built_model(spec: BuildSpec) -> Path:
    """A built model folder, kept across runs under MODEL_CACHE (keyed by everything it depends on)."""
    return ensure_model(spec, MODEL_CACHE / builder_digest(spec)[:16] / spec.name)


@pytest.fixture(scope="session")
def engine(tiny_model_path):
    live = Engine(
        tiny_model_path,
        TINY,
        EngineConfig(
            max_queue=8,
            step_prompt_tokens=64,
            caches=CacheConfig(prefix_budget_bytes=256 << 20, vision_budget_bytes=64 << 20, block_size=16),
        ),
    )
    live.start()
    yield live
    live.stop()


@pytest.fixture
def settings(tmp_path, tiny_model_path) -> Settings:
    limits = Limits(
        max_body_bytes=2_000_000,
        max_image_bytes=1_000_000,
        max_image_pixels=2000 * 2000,
        max_images=4,
        max_context_tokens=1024,
        max_output_tokens=512,
    )
    # engine-only by default; tests of the response layers turn them on
    return Settings(
        model=str(tiny_model_path),
        data_dir=tmp_path / "data",
        model_name=TINY,
        limits=limits,
        exact_store="off",
        semantic_enabled=False,
    )


@pytest.fixture(scope="session")
def embedder():
    from semantic import MiniLMEmbedder

    return MiniLMEmbedder()


def logits_and_greedy_tokens(runner, prompt, num_tokens: int = 8) -> tuple[np.ndarray, list[int]]:
    """A prompt's last-position logits (float32) and its first greedy tokens, through `runner`."""
    import mlx.core as mx

    from gateway.engine import Sampling, decode_alone
    from kvcache import TenantSalt

    prefill = runner.prefill(prompt, TenantSalt(b"A" * 32), 128, lambda: False)
    logits = np.array(prefill.logits.astype(mx.float32))
    return logits, list(decode_alone(runner, prefill, Sampling(num_tokens, 0.0, 1.0, None, ()), lambda: False))


def key_store_down(monkeypatch, sealer, lost: bytes = b"") -> list[bool]:
    """The tenants' key store out of reach for `sealer`'s digests of data that starts with `lost`
    (every digest by default), while the returned flag's one item is True; the real sealer otherwise."""
    from kvcache.sealing import StoreUnavailable

    down, digest = [True], sealer.digest

    def digest_while_up(tenant, data):
        if down[0] and data.startswith(lost):
            raise StoreUnavailable("the key store is out of reach")
        return digest(tenant, data)

    monkeypatch.setattr(sealer, "digest", digest_while_up)
    return down


def png_data_url(width: int = 64, height: int = 48, seed: int = 0, fmt: str = "PNG") -> str:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    mime = {"PNG": "png", "WEBP": "webp", "BMP": "bmp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


class RedisServer:
    """A real redis-server (Debian's, installed by `make test`) on a free loopback port, no persistence."""

    def __init__(self, folder: Path, port: int | None = None):
        import shutil
        import socket
        import subprocess
        import time

        folder.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        assert binary, "redis-server is missing: `make test` installs it (Debian's redis-server package)"
        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port = port
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.folder = folder
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(folder),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline and self.process.poll() is None, "redis-server did not start"
                time.sleep(0.05)

    def flush(self) -> None:
        """Empty the server (a test that counts entries starts from none)."""
        import redis

        redis.Redis.from_url(self.url).flushall()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
