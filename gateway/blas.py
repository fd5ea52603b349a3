"""Which BLAS MLX runs on, and how to start a process on an optimised one.

The Linux mlx-cpu wheel bundles a reference BLAS (~3 GFLOP/s). Debian's OpenBLAS, preloaded before
the process starts, is 10-30x faster. Before it goes the engine's one-row products library
(gateway/engine/vector_products.c: a lone sequence's decode step 1.6-1.8x faster, two to four
sequences' ~1.3x), where it can be built. macOS uses Accelerate and needs none of this.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def openblas_library() -> str | None:
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)


@functools.cache
def blas_in_use() -> str:
    """'accelerate', 'openblas' or 'reference', read from what this process has mapped (once: the
    libraries are loaded at start, and reading the map took ~20 ms of the event loop on every admin
    /healthz)."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "openblas" if "libopenblas" in maps else "reference"


def env_with_openblas(env: dict[str, str], one_row_products: bool = True) -> dict[str, str] | None:
    """A copy of env that preloads OpenBLAS (after the one-row products library, which passes every
    other product on to it, unless one_row_products is False), or None if OpenBLAS is preloaded
    already or cannot be."""
    library = openblas_library()
    if not sys.platform.startswith("linux") or library is None or library in env.get("LD_PRELOAD", ""):
        return None
    if env.get("STRATA_BLAS") == "reference":  # benchmarks and the BLAS test ask for the slow one
        return None
    from .engine import vector_products_library  # the CLI has imported the engine already (settings)

    preload = [vector_products_library() if one_row_products else None, library, env.get("LD_PRELOAD")]
    return {**env, "LD_PRELOAD": ":".join(filter(None, preload))}


def reexec_with_openblas(argv: list[str]) -> None:
    """Replace this process with the same command on OpenBLAS, if it is not already on it."""
    env = env_with_openblas(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "gateway.cli", *argv], env)


if __name__ == "__main__":  # the LD_PRELOAD the server runs with (the Makefile runs the tests on it)
    preloaded = env_with_openblas({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    print(preloaded["LD_PRELOAD"] if preloaded else "")
