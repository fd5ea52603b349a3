"""Matrix products of a few rows through BLAS's matrix-vector product (vector_products.c), preloaded.

    vector_products_library() -> str | None   the built library (compiled at first use, once per
                                              machine: gateway/engine/native.py); None where it
                                              cannot be built (no C compiler, not Linux)
    vector_products_loaded() -> bool          this process runs on it (it was in LD_PRELOAD at start)
    use_vector_products(enabled)              switches it for the process (benchmarks measure both)
    num_vector_products() -> int              products it has sent to sgemv so far (tests)

Why: a lone sequence's decode step multiplies one row by every weight (a few sequences' steps, a
few rows), and OpenBLAS's sgemm packs the weight before multiplying. The library must be in
LD_PRELOAD, before the BLAS, when the process starts; gateway/blas.py starts the server so. In a
process without it, the last three are no-ops (False, 0).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from functools import cache
from pathlib import Path

from .native import built_library

log = logging.getLogger("strata.engine")

SOURCE = Path(__file__).with_name("vector_products.c")
FLAGS = ("-O2", "-fPIC", "-shared")


@cache
def vector_products_library() -> str | None:
    try:
        return str(built_library(SOURCE, FLAGS, ("-ldl",)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("one-row products keep BLAS's sgemm (the library cannot be built here: %s)", exc)
        return None


def vector_products_loaded() -> bool:
    return _global(ctypes.c_int, "strata_vector_products") is not None


def use_vector_products(enabled: bool) -> None:
    switch = _global(ctypes.c_int, "strata_vector_products")
    if switch is not None:
        switch.value = int(enabled)


def num_vector_products() -> int:
    counter = _global(ctypes.c_long, "strata_num_vector_products")
    return counter.value if counter is not None else 0


@cache
def _global(kind: type[ctypes.c_int] | type[ctypes.c_long], name: str):
    """The library's variable `name`, where this process has the library (its symbols are global:
    preloaded), else None. Looked up once: what a process preloads is fixed at its start."""
    try:
        return kind.in_dll(ctypes.CDLL(None), name)
    except ValueError:
        return None
