"""Release checks (`python -m evals ...`) and benchmarks (`python -m evals.bench_*`)."""

from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "gateway/checkpoints/assets/corpus.txt"


def corpus_lines() -> list[str]:
    """The demo corpus's sentences, one per line (its first line names their source)."""
    return CORPUS.read_text().splitlines()[1:]
