"""Which BLAS MLX runs on, and how to start a process on an optimised one.

The Linux mlx-cpu wheel bundles a reference BLAS (~3 GFLOP/s). Debian's OpenBLAS, preloaded before
the process starts, is 10-30x faster. Before it goes the engine's one-row products library
(gateway/engine/vector_products.c: a lone sequence's decode step 1.6-1.8x faster, two to four
sequences' ~1.3x), where it can be built. macOS uses Accelerate and needs none of this.

OpenBLAS picks its kernels by CPU model. A model it does not know gets its oldest x86-64 kernels
(Prescott, SSE3): a 5th-generation Xeon (family 6, model 207) under KVM, reporting itself as
"Intel(R) Xeon(R) Processor", multiplied at 51 GFLOP/s there against 197 with the AVX-512 kernels
(512 x 512 x 1536, 2 cores, OpenBLAS 0.3.21). So the preload also names the kernels the CPU's own flags allow
(OPENBLAS_CORETYPE) when, and only when, OpenBLAS would pick weaker ones; a core type set by hand
is never overridden.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
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
    other product on to it, unless one_row_products is False) on the best kernels this CPU allows,
    or None if OpenBLAS is preloaded already or cannot be."""
    library = openblas_library()
    if not sys.platform.startswith("linux") or library is None or library in env.get("LD_PRELOAD", ""):
        return None
    if env.get("STRATA_BLAS") == "reference":  # benchmarks and the BLAS test ask for the slow one
        return None
    from .engine import cpu_features, vector_products_library  # the CLI has imported the engine already

    preload = [vector_products_library() if one_row_products else None, library, env.get("LD_PRELOAD")]
    kernels = {}
    if "OPENBLAS_CORETYPE" not in env:
        core = better_core_type(cpu_features(), openblas_core(library))
        kernels = {"OPENBLAS_CORETYPE": core} if core else {}
    return {**env, "LD_PRELOAD": ":".join(filter(None, preload))} | kernels


# OpenBLAS's x86-64 core types by the widest vector instructions their kernels use: 3 AVX-512,
# 2 AVX2 and FMA, 1 AVX, 0 SSE. A name missing here (another architecture, a newer core) is never
# replaced.
CORE_LEVELS = {
    **dict.fromkeys(("sapphirerapids", "cooperlake", "skylakex"), 3),
    **dict.fromkeys(("haswell", "zen", "excavator"), 2),
    **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller"), 1),
    **dict.fromkeys(("prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "opteron", "barcelona"), 0),
    **dict.fromkeys(("opteron_sse3", "bobcat", "katmai", "coppermine", "northwood", "banias", "athlon"), 0),
}
# The core type each level names, and the CPU flags it needs (as /proc/cpuinfo spells them).
LEVEL_CORES = (
    (3, "SkylakeX", frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})),
    (2, "Haswell", frozenset({"avx2", "fma"})),
    (1, "Sandybridge", frozenset({"avx"})),
)


def better_core_type(features: frozenset[str], detected: str | None) -> str | None:
    """The core type to ask OpenBLAS for: the widest the CPU's flags allow, where it is wider than
    the one OpenBLAS picked itself (`detected`, as openblas_get_corename spells it); else None."""
    level = CORE_LEVELS.get((detected or "").lower())
    if level is None:
        return None
    return next((core for wider, core, needs in LEVEL_CORES if wider > level and needs <= features), None)


CORE_PROBE = (
    "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.openblas_get_corename.restype = ctypes.c_char_p; "
    "print(lib.openblas_get_corename().decode())"
)


@functools.cache
def openblas_core(library: str) -> str | None:
    """The core type OpenBLAS picks on its own on this machine (it decides when loaded, so a short
    process loads it), or None where that cannot be read."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    try:
        done = subprocess.run(
            [sys.executable, "-S", "-c", CORE_PROBE, library],
            env=env | {"OPENBLAS_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def env_with_wider_kernels(env: dict[str, str]) -> dict[str, str] | None:
    """A copy of env naming wider OpenBLAS kernels than this process runs on, where the CPU allows
    them and no core type is set; else None."""
    if "OPENBLAS_CORETYPE" in env:
        return None
    from .engine import cpu_features

    core = better_core_type(cpu_features(), core_in_use())
    return {**env, "OPENBLAS_CORETYPE": core} if core else None


def core_in_use() -> str | None:
    """The core type of the OpenBLAS this process runs on, or None (another BLAS)."""
    try:
        corename = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode()


def reexec_with_openblas(argv: list[str]) -> None:
    """Replace this process with the same command on OpenBLAS, if it is not already on it, or on
    wider kernels, if it runs on OpenBLAS preloaded by hand on narrower ones than the CPU allows."""
    env = env_with_openblas(dict(os.environ)) or env_with_wider_kernels(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "gateway.cli", *argv], env)


BLAS_VARIABLES = ("LD_PRELOAD", "OPENBLAS_CORETYPE")

if __name__ == "__main__":  # what the server's BLAS adds to its environment, as NAME=value words
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    preloaded = env_with_openblas(base) or {}
    print(" ".join(f"{name}={preloaded[name]}" for name in BLAS_VARIABLES if name in preloaded and name not in base))
