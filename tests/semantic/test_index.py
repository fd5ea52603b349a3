"""PartitionedIndex on real faiss: exhaustive while small, inverted lists past FLAT_UP_TO (rebuilt
in the background as it grows), with removal exact throughout and adds and removes made during a
rebuild kept."""

from __future__ import annotations

import numpy as np
import pytest

import semantic.index as index_module
from semantic.index import PartitionedIndex

DIM = 32


def _vectors(n: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(index_module, "FLAT_UP_TO", 2000)


def test_a_partition_past_the_threshold_gets_inverted_lists_that_still_find_every_entry(small_threshold):
    index = PartitionedIndex(DIM)
    vectors = _vectors(5000)
    index.add("p", list(range(1, 5001)), vectors)
    index.settle()
    assert index.kind("p") == "ivf" and len(index) == 5000
    found = sum(index.search("p", vectors[i], 1)[0][0] == i + 1 for i in range(0, 5000, 50))
    assert found >= 95  # recall@1 of the entry itself over 100 probes
    index.add("other", [9001], _vectors(1, seed=1))
    assert index.kind("other") == "exhaustive"  # partitions are sized on their own


def test_removal_stays_exact_in_inverted_lists(small_threshold):
    index = PartitionedIndex(DIM)
    vectors = _vectors(3000)
    index.add("p", list(range(1, 3001)), vectors)
    index.settle()
    assert index.remove(7) and not index.remove(7)
    assert all(entry_id != 7 for entry_id, _ in index.search("p", vectors[6], 10))
    assert len(index) == 2999


def test_adds_and_removes_during_a_rebuild_are_kept(small_threshold, monkeypatch):
    import threading

    gate, started = threading.Event(), threading.Event()
    inverted = index_module._inverted

    def slow(*args):
        started.set()
        gate.wait(10)
        return inverted(*args)

    monkeypatch.setattr(index_module, "_inverted", slow)
    index = PartitionedIndex(DIM)
    vectors = _vectors(2600)
    index.add("p", list(range(1, 2501)), vectors[:2500])
    assert started.wait(10)
    index.add("p", list(range(2501, 2601)), vectors[2500:])  # during the rebuild
    assert index.remove(3) and index.remove(2550)
    assert index.search("p", vectors[2509], 1)[0][0] == 2510  # the old index serves meanwhile
    gate.set()
    index.settle()
    assert index.kind("p") == "ivf"
    assert index.search("p", vectors[2509], 1)[0][0] == 2510
    assert all(entry_id not in (3, 2550) for entry_id, _ in index.search("p", vectors[2], 50))
    assert all(entry_id != 2550 for entry_id, _ in index.search("p", vectors[2549], 50))
    assert index.partitions["p"].index.ntotal == 2598


def test_a_partition_is_retrained_as_it_grows(small_threshold):
    index = PartitionedIndex(DIM)
    index.add("p", list(range(1, 2101)), _vectors(2100))
    index.settle()
    first = index.partitions["p"].trained_size
    index.add("p", list(range(2101, 4 * first + 1)), _vectors(4 * first - 2100, seed=2))
    index.settle()
    assert index.partitions["p"].trained_size == 4 * first
