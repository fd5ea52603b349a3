"""C sources of this package compiled at first use into shared libraries, once per machine.

    built_library(source, flags, libraries) -> Path    compiles (or finds) it; OSError or
                                                       subprocess.SubprocessError where it cannot
    cpu_flags() -> tuple[str, ...]                     -mavx2 -mfma where this CPU lists both
    cpu_features() -> frozenset[str]                   the flags /proc/cpuinfo lists (x86: avx2, ...)

A library is compiled once per digest of its source and flags into the user's cache folder
($XDG_CACHE_HOME/strata, else ~/.cache/strata), written to a temporary file and renamed, so test
workers and servers starting together never load a half-written file. Linux only: macOS runs MLX on
Accelerate and Metal, where none of these are needed.
"""

from __future__ import annotations

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
