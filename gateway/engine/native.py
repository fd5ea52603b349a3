"""C sources of this package compiled at first use into shared libraries, once per machine; and the
C library's allocator told to keep freed memory.

    built_library(source, flags, libraries) -> Path    compiles (or finds) it; OSError or
                                                       subprocess.SubprocessError where it cannot
    cpu_flags() -> tuple[str, ...]                     -mavx2 -mfma where this CPU lists both
    cpu_features() -> frozenset[str]                   the flags /proc/cpuinfo lists (x86: avx2, ...)
    keep_freed_memory() -> bool                        freed arrays stay with the process (glibc's malloc)

A library is compiled once per digest of its source and flags into the user's cache folder
($XDG_CACHE_HOME/strata, else ~/.cache/strata), written to a temporary file and renamed, so test
workers and servers starting together never load a half-written file. Linux only: macOS runs MLX on
Accelerate and Metal, where none of these are needed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CPU_INFO = Path("/proc/cpuinfo")


def cpu_flags() -> tuple[str, ...]:
    """-mavx2 -mfma where this CPU reports both (x86-64 Linux), else nothing: the compiler's baseline."""
    return ("-mavx2", "-mfma") if {"avx2", "fma"} <= cpu_features() else ()


def cpu_features() -> frozenset[str]:
    """The first processor's `flags` in /proc/cpuinfo (x86 Linux; empty elsewhere)."""
    try:
        reported = next(line for line in CPU_INFO.read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(reported.split(":", 1)[-1].split())


def built_library(source: Path, flags: tuple[str, ...], libraries: tuple[str, ...] = ()) -> Path:
    code = source.read_bytes()
    digest = hashlib.sha256(code + " ".join(flags + libraries).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        raise OSError("no C compiler on PATH" if compiler is None else f"not built on {sys.platform}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, "-o", str(built), str(source), *libraries]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "strata"


# glibc's mallopt() parameters and the values set: a block up to MMAP_THRESHOLD_BYTES (glibc's
# largest) comes from the heap, and the heap keeps up to TRIM_THRESHOLD_BYTES free at its top.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Keep freed blocks of up to 32 MiB in the process for the next step's arrays. By default
    glibc's malloc maps a block past its threshold (128 KiB, rising only as such blocks are freed)
    fresh from the kernel and unmaps it when freed, and returns the heap's free top past 128 KiB: a
    step's arrays (MLX's CPU buffers, numpy's blocks of attention scores, 0.1-16 MiB) are then new
    pages at every step, each faulted in and zeroed by the kernel. Measured with 16 clients on the
    demo model (2-core Xeon): 99,000 minor page faults a second -> 3,500, output 433 -> 469 tok/s.
    The process's memory stays at its peak of such blocks (a few times the largest step's arrays).
    False where the C library has no mallopt (not glibc: macOS, musl)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library the process runs on
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
