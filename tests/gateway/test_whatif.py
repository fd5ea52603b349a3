"""`strata what-if`: the hit rates it prints for a recorded trace are the replayed pool's (LRU), RAM
alone and with an SSD tier, and a trace it cannot read is a clear error."""

from __future__ import annotations

import re

from evals.cache_sim import rate, replay, working_set
from evals.trace_gen import generate
from gateway.cli import main
from gateway.operations.whatif import GRID_RAM, GRID_SSD, RAM_SHARES


def _write(tmp_path, records):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(r.line() + "\n" for r in records))
    return path


def test_what_if_prints_the_replayed_hit_rates_and_the_ttft_they_imply(tmp_path, capsys):
    records = generate("rag")[:1500]
    assert (
        main(["what-if", "--trace", str(_write(tmp_path, records)), "--prefill-us", "700", "--ssd-read-us", "5"]) == 0
    )
    out = capsys.readouterr().out
    ram_alone = out.split("RAM alone")[1].split("RAM + an SSD")[0]
    rows = re.findall(r"(\d+) blocks \|\s+([\d.]+)% \|\s+(\d+) \|\s+([\d.]+)s", ram_alone)
    assert len(rows) == len(RAM_SHARES)
    tokens_per_request = sum(len(r.blocks) for r in records) * 32 / len(records)
    for blocks, shown, recomputed, ttft in rows:
        replayed = rate(records, replay(records, int(blocks), segmented=False))
        assert abs(float(shown) / 100 - replayed) < 0.0006, blocks
        assert abs(int(recomputed) - (1 - replayed) * tokens_per_request) <= 1
        assert abs(float(ttft) - int(recomputed) * 700e-6) < 0.01
    grid = out.split("RAM + an SSD")[1].splitlines()[2:]
    assert len(grid) == len(GRID_RAM)
    size = working_set(records)
    for line, ram_share in zip(grid, GRID_RAM):
        cells = [float(rate) / 100 for rate in re.findall(r"([\d.]+)%", line)]
        assert len(cells) == len(GRID_SSD) and cells == sorted(cells)  # more SSD never hits less
        ram = max(1, int(size * ram_share))
        ssd = max(1, int(size * GRID_SSD[-1]))
        # an exclusive LRU tier behind RAM holds what one LRU of both sizes together would
        assert abs(cells[-1] - rate(records, replay(records, ram + ssd, segmented=False))) < 0.0006


def test_what_if_on_a_trace_it_cannot_read_says_why(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert main(["what-if", "--trace", str(missing)]) == 2
    assert "strata:" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["what-if", "--trace", str(empty)]) == 2
    assert "no engine request with a full block" in capsys.readouterr().err
