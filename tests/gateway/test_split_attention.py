"""Attention split across the cores (gateway/engine/threads.py's split_rows): every row computed
once, by the engine's thread and the helpers, and each part's lines equal to the whole call's."""

import threading

import mlx.core as mx
import numpy as np
import pytest

from gateway.engine import attention, threads

HEADS, KV_HEADS, DIM = 8, 2, 64


@pytest.fixture
def cores(monkeypatch):
    """Four cores, whatever this machine has, and every call split however small."""
    monkeypatch.setattr(threads, "_num_cores", lambda: 4)
    monkeypatch.setattr(threads, "SPLIT_FROM_SCORES", 1)


def _parts(num_rows: int, num_scores: int) -> list[tuple[int, int, str]]:
    seen: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def work(first: int, last: int) -> None:
        with lock:
            seen.append((first, last, threading.current_thread().name))

    threads.split_rows(work, num_rows, num_scores)
    return sorted(seen)


def test_the_rows_are_split_into_contiguous_parts_each_run_once_the_last_on_the_callers_thread(cores):
    parts = _parts(10, 1 << 20)
    assert [(first, last) for first, last, _ in parts] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert parts[-1][2] == threading.current_thread().name
    assert all(name.startswith("strata-split") for _, _, name in parts[:-1])
    assert [(first, last) for first, last, _ in _parts(2, 1 << 20)] == [(0, 1), (1, 2)]  # no more parts than rows


def test_a_small_call_runs_whole_on_the_callers_thread(monkeypatch):
    monkeypatch.setattr(threads, "_num_cores", lambda: 4)
    assert _parts(16, threads.SPLIT_FROM_SCORES - 1) == [(0, 16, threading.current_thread().name)]
    monkeypatch.setattr(threads, "_num_cores", lambda: 1)
    assert _parts(16, 1 << 30) == [(0, 16, threading.current_thread().name)]


def test_a_part_that_fails_raises_in_the_caller_after_every_part_ran(cores):
    ran = []

    def work(first: int, last: int) -> None:
        ran.append(first)
        if first == 0:
            raise ValueError("part 0")

    with pytest.raises(ValueError, match="part 0"):
        threads.split_rows(work, 8, 1 << 20)
    assert sorted(ran) == [0, 2, 4, 6]
    assert _parts(4, 1 << 20)[0][:2] == (0, 1)  # the helpers still serve


def _qkv(rows: int, queries: int, keys: int, seed: int = 3):
    mx.random.seed(seed)
    return (
        mx.random.normal((rows, HEADS, queries, DIM)),
        mx.random.normal((rows, KV_HEADS, keys, DIM)),
        mx.random.normal((rows, KV_HEADS, keys, DIM)),
    )


def _whole_and_split(monkeypatch, *args, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    monkeypatch.setattr(threads, "SPLIT_FROM_SCORES", 1 << 62)
    whole = np.asarray(attention.causal_attention(*args, **kwargs))
    monkeypatch.setattr(threads, "_num_cores", lambda: 3)
    monkeypatch.setattr(threads, "SPLIT_FROM_SCORES", 1)
    split = np.asarray(attention.causal_attention(*args, **kwargs))
    return whole, split


def _sliding_window(queries: int, keys: int, window: int) -> np.ndarray:
    query_position = np.arange(keys - queries, keys)[:, None]
    key_position = np.arange(keys)[None, :]
    return (key_position <= query_position) & (key_position > query_position - window)


@pytest.mark.parametrize("case", ["causal", "window", "window per row", "sinks"])
def test_a_prompt_chunks_queries_in_parts_equal_the_whole_call_and_the_library(monkeypatch, case):
    q, k, v = _qkv(1, 37, 90)
    mask = None if case in ("causal", "sinks") else _sliding_window(37, 90, 16)
    if case == "window per row":
        mask = mask[None, None]
    sinks = mx.linspace(-2, 4, HEADS) if case == "sinks" else None
    whole, split = _whole_and_split(monkeypatch, q, k, v, 0.125, mask, sinks)
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-6)
    library_mask = "causal" if mask is None else mx.array(mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=library_mask, sinks=sinks)
    np.testing.assert_allclose(split, np.asarray(theirs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("queries", [1, 3])  # decode rows (the C kernel), rows with two drafts (numpy)
def test_a_batchs_rows_in_parts_equal_the_whole_call(monkeypatch, queries):
    q, k, v = _qkv(7, queries, 60)
    keys = np.arange(60)[None, None, None, :]
    padding = np.array([0, 3, 9, 20, 41, 0, 57 - queries])[:, None, None, None]
    mask = (keys >= padding) & (keys <= np.arange(60 - queries, 60)[None, None, :, None])
    whole, split = _whole_and_split(monkeypatch, q, k, v, 0.125, mask)
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-6)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mx.array(mask))
    np.testing.assert_allclose(split, np.asarray(theirs), rtol=0, atol=1e-5)


def test_rows_that_share_one_mask_and_the_causal_rows_of_a_batch_split_too(monkeypatch):
    q, k, v = _qkv(4, 12, 30)
    for mask in (_sliding_window(12, 30, 8), None):
        whole, split = _whole_and_split(monkeypatch, q, k, v, 0.125, mask)
        np.testing.assert_allclose(split, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["causal", "window", "drafts"])
def test_blocks_of_a_few_lines_equal_one_piece_and_the_library(monkeypatch, case):
    """A long prompt's chunk is attended in blocks of queries (a batch's rows in blocks of rows):
    here blocks of 3 lines, across 3 parts."""
    rows, queries = (5, 3) if case == "drafts" else (1, 37)
    q, k, v = _qkv(rows, queries, 90)
    mask = None if case == "causal" else _sliding_window(queries, 90, 16)
    whole, _ = _whole_and_split(monkeypatch, q, k, v, 0.125, mask)
    monkeypatch.setattr(attention, "BLOCK_SCORES", 3 * HEADS * 90 * (queries if case == "drafts" else 1))
    blocked = np.asarray(attention.causal_attention(q, k, v, 0.125, mask))
    np.testing.assert_allclose(blocked, whole, rtol=0, atol=1e-6)
    library_mask = "causal" if mask is None else mx.array(mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=library_mask)
    np.testing.assert_allclose(blocked, np.asarray(theirs), rtol=0, atol=1e-5)


def test_blocks_cover_a_parts_lines_in_order_one_line_at_least(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_SCORES", 3 * 720)
    assert attention._blocks(4, 14, 720) == [(4, 7), (7, 10), (10, 13), (13, 14)]
    assert attention._blocks(0, 3, 10_000) == [(0, 1), (1, 2), (2, 3)]  # a line over the bound: alone


def test_a_lone_rows_kv_heads_in_parts_equal_the_whole_call(monkeypatch):
    q, k, v = _qkv(1, 1, 300)
    everything = np.ones((1, 1, 1, 300), dtype=bool)
    whole, split = _whole_and_split(monkeypatch, q, k, v, 0.125, everything)
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-6)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    np.testing.assert_allclose(split, np.asarray(theirs), rtol=0, atol=1e-5)


def test_a_lone_row_over_a_long_context_takes_the_c_kernel_and_a_short_one_keeps_mlxs(monkeypatch):
    calls = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: calls.append(a[1].shape[2]) or real(*a, **kw))
    monkeypatch.setattr(attention, "LONE_ROW_FROM_KEYS", 100)
    sdpa = attention._cpu_prefill(
        lambda q, k, v, cache, scale, mask: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    )
    for keys in (99, 100, 250):
        q, k, v = _qkv(1, 1, keys)
        ours = sdpa(q, k, v, None, 0.125, None)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=1e-5)
    assert calls == [100, 250]  # 99 keys: MLX's own kernel
    holes = np.ones((1, 1, 1, 250), dtype=bool)
    holes[..., 120:180] = False  # a lone row with a mask keeps its mask's meaning
    ours = sdpa(q, k, v, None, 0.125, mx.array(holes))
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mx.array(holes))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=1e-5)
    attention.use_lone_row_kernel(False)
    try:
        sdpa(*_qkv(1, 1, 250), None, 0.125, None)
    finally:
        attention.use_lone_row_kernel(True)
    assert len(calls) == 2  # switched off: MLX's kernel at any length
