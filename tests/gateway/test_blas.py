"""OpenBLAS must give the same model outputs as MLX's bundled reference BLAS, within fp32 tolerance."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gateway.blas import env_with_openblas, openblas_library

PROBE = """
import sys
import numpy as np
from gateway.blas import blas_in_use
from gateway.engine.caching import CacheConfig
from gateway.engine.runner import ModelRunner
from gateway.engine import Message, TextPart

runner = ModelRunner(sys.argv[1], CacheConfig(0, 0, 64), 'probe')
prompt = runner.prompts.build((Message("user", (TextPart("The quick brown fox jumps over the lazy dog. " * 20),)),), [])
result = runner.prefill(prompt, b'salt', 64, lambda: False)
np.save(sys.argv[2], np.array(result.logits))
print(blas_in_use())
"""


def _logits(model_path, out_path, env) -> tuple[str, np.ndarray]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(model_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1], np.load(out_path)


@pytest.mark.skipif(openblas_library() is None, reason="no system OpenBLAS on this platform")
def test_openblas_matches_reference_blas(tiny_model_path, tmp_path):
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    fast_blas, fast = _logits(tiny_model_path, tmp_path / "fast.npy", env_with_openblas(base))
    slow_blas, slow = _logits(tiny_model_path, tmp_path / "slow.npy", {**base, "STRATA_BLAS": "reference"})
    assert (fast_blas, slow_blas) == ("openblas", "reference")
    np.testing.assert_allclose(fast, slow, rtol=1e-4, atol=1e-5)
    assert int(fast.argmax()) == int(slow.argmax())


def test_reference_blas_can_be_forced():
    assert env_with_openblas({"STRATA_BLAS": "reference"}) is None
