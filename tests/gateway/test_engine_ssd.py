"""The SSD tier under the real engine: spill, promote, restart, corruption, kill -9, quantisation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gateway.engine import Message, Sampling, TextPart, decode_alone
from gateway.engine.caching import CacheConfig
from gateway.engine.runner import ModelRunner
from kvcache import TenantSalt
from kvcache.quant import QuantConfig
from kvcache.ssd import AdmissionPolicy, SsdConfig

SALT = TenantSalt(b"S" * 32)
GREEDY = Sampling(8, 0.0, 1.0, None, ())
TEXT = "The harbour master counted the boats that came in with the tide, one by one, every evening. " * 8


def _runner(path, folder, ram_bytes=64 << 20, quant=None, min_hits=0):
    ssd = SsdConfig(folder, admission=AdmissionPolicy(min_hits=min_hits))
    return ModelRunner(path, CacheConfig(ram_bytes, 0, 16, ssd, quant), "tiny")


def _run(runner, text):
    prompt = runner.prompts.build((Message("user", (TextPart(text),)),), [])
    prefill = runner.prefill(prompt, SALT, 64, lambda: False)
    logits = np.array(prefill.logits)
    tokens = list(decode_alone(runner, prefill, GREEDY, lambda: False))
    runner.finish(prefill, tokens)
    return logits, tokens, prefill.prefix


def _assert_same_as_cold(result, cold) -> None:
    assert result[1] == cold[1]
    np.testing.assert_allclose(result[0], cold[0], atol=1e-4)


@pytest.fixture(scope="module")
def cold_result(tiny_model_path):
    return _run(ModelRunner(tiny_model_path, CacheConfig(0, 0, 16), "tiny"), TEXT)


def test_blocks_evicted_from_ram_are_promoted_from_ssd(tiny_model_path, tmp_path, cold_result):
    runner = _runner(tiny_model_path, tmp_path / "kv", ram_bytes=1 << 20)  # ~two prompts' worth of blocks
    _run(runner, TEXT)
    for i in range(3):  # push the first prompt's blocks out of RAM
        _run(runner, f"Unrelated filler number {i}. " * 40)
    runner.caches.prefix.ssd.drain(10)
    logits, tokens, report = _run(runner, TEXT)
    assert report.status == "hit" and "ssd" in report.tier and report.num_ssd_tokens > 0
    _assert_same_as_cold((logits, tokens), cold_result)
    runner.caches.shutdown(10)


def test_restart_reuses_blocks_from_ssd(tiny_model_path, tmp_path, cold_result):
    first = _runner(tiny_model_path, tmp_path / "kv")
    _run(first, TEXT)
    first.caches.shutdown(10)  # persists RAM blocks (min_hits=0 here), writer drains
    second = _runner(tiny_model_path, tmp_path / "kv")
    logits, tokens, report = _run(second, TEXT)
    assert report.tier == "ssd" and report.num_cached_tokens == report.num_ssd_tokens > 0
    _assert_same_as_cold((logits, tokens), cold_result)
    second.caches.shutdown(10)


def test_corrupt_block_is_quarantined_and_the_request_recomputes(tiny_model_path, tmp_path, cold_result):
    first = _runner(tiny_model_path, tmp_path / "kv")
    _run(first, TEXT)
    first.caches.shutdown(10)
    files = sorted((tmp_path / "kv").glob("*/*/*.safetensors"))
    victim = files[len(files) // 2]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x55
    victim.write_bytes(bytes(raw))
    second = _runner(tiny_model_path, tmp_path / "kv")
    logits, tokens, report = _run(second, TEXT)
    ssd = second.caches.prefix.ssd
    assert ssd.counters.num_quarantined == 1
    assert report.num_cached_tokens < report.num_prompt_tokens // 16 * 16  # the chain stops at the bad file
    _assert_same_as_cold((logits, tokens), cold_result)
    second.caches.shutdown(10)


SPILLER = """
import sys
from gateway.engine.caching import CacheConfig
from gateway.engine.runner import ModelRunner
from gateway.engine import Message, Sampling, TextPart, decode_alone
from kvcache.ssd import AdmissionPolicy, SsdConfig
ssd = SsdConfig(sys.argv[2], admission=AdmissionPolicy(min_hits=0))
runner = ModelRunner(sys.argv[1], CacheConfig(1 << 19, 0, 16, ssd), "tiny")
print("ready", flush=True)
i = 0
while True:  # heavy spilling: every prompt evicts earlier blocks to the SSD tier
    prompt = runner.prompts.build((Message("user", (TextPart(f"Spill round {i}. " * 60),)),), [])
    prefill = runner.prefill(prompt, b"S" * 32, 64, lambda: False)
    runner.finish(prefill, [])
    i += 1
"""


def test_kill_9_during_heavy_spilling_then_restart(tiny_model_path, tmp_path, cold_result):
    folder = tmp_path / "kv"
    child = subprocess.Popen(
        [sys.executable, "-c", SPILLER, str(tiny_model_path), str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    assert child.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(folder.glob("*/*/*.safetensors"))) < 10:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    runner = _runner(tiny_model_path, folder)  # reconcile runs here
    ssd = runner.caches.prefix.ssd
    assert ssd.counters.num_quarantined == 0 and ssd.stats().num_files >= 10
    assert not list(folder.glob("*/*/.tmp-*"))
    assert all(len(ssd.read_chain([h])) == 1 for h in list(ssd.index.blocks))  # every indexed block is whole
    logits, tokens, _ = _run(runner, TEXT)
    _assert_same_as_cold((logits, tokens), cold_result)
    runner.caches.shutdown(10)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_blocks_save_bytes_and_report_their_drift(tiny_model_path, tmp_path, cold_result, bits):
    quant = QuantConfig(bits, group_size=32, min_tokens=0)
    runner = _runner(tiny_model_path, tmp_path / "kv", quant=quant)
    _run(runner, TEXT)
    full = ModelRunner(tiny_model_path, CacheConfig(64 << 20, 0, 16), "tiny")
    _run(full, TEXT)
    assert runner.caches.prefix.pool.num_bytes < full.caches.prefix.pool.num_bytes * (0.35 if bits == 8 else 0.22)
    logits, tokens, report = _run(runner, TEXT)
    assert report.status == "hit"
    drift = float(np.abs(logits - cold_result[0]).max())
    assert drift < (0.05 if bits == 8 else 0.5), drift  # measured: see evals.bench_ssd
    if bits == 8:  # measured 100% greedy agreement at 8 bits (evals.bench_ssd)
        assert tokens == cold_result[1]
    else:
        # 4 bits moves the tiny model's logits by ~0.15 while its top two differ by ~0.02 on every prompt
        # tried, so greedy tokens may differ from cold (bench_ssd measures the agreement). What must
        # hold: the same quantised blocks always decode to the same tokens.
        assert _run(runner, TEXT)[1] == tokens
    runner.caches.shutdown(10)
