"""The one-row products library (gateway/engine/vector_products.c), preloaded before OpenBLAS as the
server runs: every shape and transposition MLX can hand cblas_sgemm gives float64's product, the
ones with up to four rows or one column through sgemv, a few decode rows' model logits equal
sgemm's, and a server started by the CLI runs on it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.blas import env_with_openblas, openblas_library
from gateway.engine import vector_products_library

PRODUCTS = r"""
import ctypes, sys
import mlx.core as mx
import numpy as np
from gateway.engine import num_vector_products, use_vector_products, vector_products_loaded

assert vector_products_loaded()
generator = np.random.default_rng(0)
checked = 0
for m, n, k in [(1, 1376, 512), (1, 300, 1), (7, 1, 33), (1, 1, 5), (5, 9, 4), (2, 70, 64), (4, 33, 17), (9, 40, 8)]:
    for transpose_a in (False, True):
        for transpose_b in (False, True):
            a = generator.standard_normal((k, m) if transpose_a else (m, k)).astype(np.float32)
            b = generator.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
            left = mx.array(a).T if transpose_a else mx.array(a)
            right = mx.array(b).T if transpose_b else mx.array(b)
            before = num_vector_products()
            got = np.array(left @ right)
            want = (a.T if transpose_a else a).astype(np.float64) @ (b.T if transpose_b else b).astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{m}x{n}x{k} {transpose_a} {transpose_b}")
            assert (num_vector_products() > before) == (m <= 4 or n == 1), (m, n, k)  # FEW_ROWS
            checked += 1

# addmm's beta: C = beta C + alpha A B, with one row
c, a, b = (generator.standard_normal(shape).astype(np.float32) for shape in ((1, 64), (1, 32), (32, 64)))
got = np.array(mx.addmm(mx.array(c), mx.array(a), mx.array(b), alpha=0.5, beta=2.0))
np.testing.assert_allclose(got, 2.0 * c + 0.5 * (a @ b), rtol=1e-4, atol=1e-4)

# beta 0 over an output full of NaN bits (MLX never clears its output): the product alone
blas = ctypes.CDLL(None)  # the preloaded library's cblas_sgemm comes first
out = np.full((1, 64), np.nan, dtype=np.float32)
pointer = ctypes.c_void_p
blas.cblas_sgemm(101, 111, 111, 1, 64, 32, ctypes.c_float(1.0), a.ctypes.data_as(pointer), 32,
                 b.ctypes.data_as(pointer), 64, ctypes.c_float(0.0), out.ctypes.data_as(pointer), 64)
np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)

# switched off, a one-row product goes to sgemm and gives the same numbers
use_vector_products(False)
before = num_vector_products()
off = np.array(mx.array(a) @ mx.array(b))
assert num_vector_products() == before
use_vector_products(True)
np.testing.assert_allclose(off, a @ b, rtol=1e-4, atol=1e-4)
print("checked", checked)
"""

LOGITS = r"""
import sys
import mlx.core as mx
import numpy as np
from gateway.engine import CacheConfig, DecodeBatch, ModelRunner, PreparedPrompt, num_vector_products, use_vector_products
from kvcache import TenantSalt

runner = ModelRunner(sys.argv[1], CacheConfig(0, 0, 16), "probe")
rows = int(sys.argv[2])
logits = {}
for enabled in (True, False):
    use_vector_products(enabled)
    before = num_vector_products()
    batch = DecodeBatch(runner)
    for row in range(rows):  # prompts of different lengths: the rows' left padding differs
        prompt = PreparedPrompt(tuple(range(3 + row, 60 + 9 * row)), ())
        batch.join(runner.prefill(prompt, TenantSalt(b"t"), 64, lambda: False))
    steps = [np.array(runner.run_step([batch.part([[7]] * rows)])[0]) for _ in range(4)]
    logits[enabled] = np.stack(steps)
    print(enabled, num_vector_products() - before)
np.testing.assert_allclose(logits[True], logits[False], rtol=1e-4, atol=1e-4)
assert (logits[True].argmax(-1) == logits[False].argmax(-1)).all()
"""

needs_preload = pytest.mark.skipif(
    openblas_library() is None or vector_products_library() is None,
    reason="Linux with Debian's OpenBLAS and a C compiler: the library is preloaded only there",
)


def _preloaded(code: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env = env_with_openblas(env)
    assert env is not None
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_preload
def test_products_of_every_shape_equal_float64_and_one_row_goes_through_sgemv():
    assert "checked 32" in _preloaded(PRODUCTS)


@needs_preload
@pytest.mark.parametrize("rows", [1, 3])
def test_a_few_decode_rows_give_the_same_logits_through_sgemv(tiny_model_path, rows):
    counts = dict(line.split() for line in _preloaded(LOGITS, str(tiny_model_path), str(rows)).splitlines()[-2:])
    assert int(counts["True"]) > 0 and int(counts["False"]) == 0  # on: their products went to sgemv


@needs_preload
def test_the_library_is_preloaded_before_openblas():
    env = env_with_openblas({"PATH": os.environ["PATH"], "LD_PRELOAD": "/some/other.so"})
    assert env is not None
    assert env["LD_PRELOAD"].split(":") == [vector_products_library(), openblas_library(), "/some/other.so"]


@pytest.mark.skipif(openblas_library() is None, reason="no system OpenBLAS on this platform")
def test_on_openblas_alone_nothing_changes():
    """A process started on OpenBLAS alone (as mlx-vlm's server in the load benchmark): the
    library's switch and counter are no-ops and products go to OpenBLAS's sgemm."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env = env_with_openblas(env, one_row_products=False)
    assert env is not None and "vector_products" not in env["LD_PRELOAD"]
    code = (
        "import mlx.core as mx\n"
        "from gateway.engine import num_vector_products, use_vector_products, vector_products_loaded\n"
        "use_vector_products(True)\n"
        "mx.eval(mx.ones((1, 64)) @ mx.ones((64, 32)))\n"
        "print(vector_products_loaded(), num_vector_products())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "0"]
