"""Release checks (`python -m evals ...`) and benchmarks (`python -m evals.bench_*`)."""

import os
import sys
from pathlib import Path

from gateway.blas import BLAS_VARIABLES, env_with_openblas

CORPUS = Path(__file__).resolve().parents[1] / "gateway/checkpoints/assets/corpus.txt"


def corpus_lines() -> list[str]:
    """The demo corpus's sentences, one per line (its first line names their source)."""
    return CORPUS.read_text().splitlines()[1:]


def as_the_server_runs(module: str) -> None:
    """Start `module` again on the server's BLAS (the one-row products library, OpenBLAS and the
    kernels it is told to use), where it was started otherwise: on MLX's own CPU BLAS an in-process
    benchmark reads several times slower than the server runs."""
    env = env_with_openblas({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    if env is not None and any(os.environ.get(name) != env.get(name) for name in BLAS_VARIABLES):
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
