"""OpenBLAS must give the same model outputs as MLX's bundled reference BLAS, within fp32 tolerance."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gateway.blas import BLAS_VARIABLES, better_core_type, env_with_openblas, openblas_core, openblas_library
from gateway.engine import cpu_features

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


AVX512 = frozenset({"sse3", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
AVX2 = frozenset({"sse3", "avx", "avx2", "fma"})


@pytest.mark.parametrize(
    ("features", "detected", "wanted"),
    [
        (AVX512, "Prescott", "SkylakeX"),  # a Xeon OpenBLAS does not know (KVM) falls back to SSE3
        (AVX2, "Prescott", "Haswell"),
        (frozenset({"avx"}), "Prescott", "Sandybridge"),
        (AVX512, "Zen", "SkylakeX"),  # AVX-512 on a core OpenBLAS gives AVX2 kernels
        (AVX512, "SkylakeX", None),  # OpenBLAS's own choice is as wide as the flags
        (AVX512, "Cooperlake", None),
        (AVX2, "Haswell", None),
        (AVX2, "Zen", None),
        (AVX512 - {"avx512bw"}, "Haswell", None),  # AVX-512 without every part SkylakeX's kernels use
        (frozenset(), "Prescott", None),  # no flags read: nothing to ask for
        (AVX512, "ARMV8", None),  # a name this table does not rank is left alone
        (AVX512, None, None),  # OpenBLAS's choice could not be read
    ],
)
def test_better_core_type_asks_for_the_widest_kernels_the_flags_allow(features, detected, wanted):
    assert better_core_type(features, detected) == wanted


@pytest.mark.skipif(openblas_library() is None, reason="no system OpenBLAS on this platform")
def test_a_core_type_set_by_hand_is_kept():
    env = env_with_openblas({"PATH": os.environ["PATH"], "OPENBLAS_CORETYPE": "Sandybridge"})
    assert env is not None and env["OPENBLAS_CORETYPE"] == "Sandybridge"


@pytest.mark.skipif(openblas_library() is None, reason="no system OpenBLAS on this platform")
def test_the_server_blas_runs_the_widest_kernels_this_cpu_allows():
    """A process started on the server's environment runs OpenBLAS on kernels no narrower than the
    CPU's flags allow, whatever OpenBLAS would have picked on its own."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    env = env_with_openblas(base)
    assert env is not None
    code = "from gateway.blas import core_in_use; print(core_in_use())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    core = done.stdout.strip()
    assert core in (openblas_core(openblas_library()), env.get("OPENBLAS_CORETYPE"))
    assert better_core_type(cpu_features(), core) is None, (core, openblas_core(openblas_library()))


@pytest.mark.skipif(openblas_library() is None, reason="no system OpenBLAS on this platform")
def test_python_m_gateway_blas_prints_the_variables_the_makefile_sets():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.blas"], env=base, capture_output=True, text=True, timeout=120, check=True
    )
    words = dict(word.split("=", 1) for word in done.stdout.split())
    assert words == {name: value for name, value in env_with_openblas(base).items() if name in BLAS_VARIABLES}
    assert openblas_library() in words["LD_PRELOAD"].split(":")


@pytest.mark.skipif(openblas_library() is None, reason="no system OpenBLAS on this platform")
def test_openblas_preloaded_by_hand_gets_the_wider_kernels_too():
    """`strata serve` started with OpenBLAS in LD_PRELOAD already starts again on the kernels the
    CPU allows where OpenBLAS picked narrower ones, and not again once they are named."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    code = "from gateway.blas import env_with_wider_kernels as w; import os; e = w(dict(os.environ)); print(e and e['OPENBLAS_CORETYPE'])"
    by_hand = base | {"LD_PRELOAD": openblas_library()}
    done = subprocess.run([sys.executable, "-c", code], env=by_hand, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    wanted = better_core_type(cpu_features(), openblas_core(openblas_library()))
    assert done.stdout.strip() == str(wanted)
    named = by_hand | {"OPENBLAS_CORETYPE": wanted or "Haswell"}
    done = subprocess.run([sys.executable, "-c", code], env=named, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "None"
