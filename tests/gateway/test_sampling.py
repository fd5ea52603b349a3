"""Sampled draws (gateway/engine/sampling.py) against the filters' definitions in MLX ops
(evals/bench_sampling.py's `mlx_filtered`, how Strata drew before): the same tokens kept with the same
probabilities, exact quantiles, a nucleus found past its first candidates, u spread evenly over [0, 1)
by the seeds, and no draw ever landing on a token the filters dropped."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from evals.bench_sampling import mlx_filtered
from gateway.engine import Sampler, Sampling
from gateway.engine.sampling import KEY_STRIDE, NUCLEUS_CANDIDATES, PICK_BLOCK, pick, sample, uniform, weights

SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 40},
    {"temperature": 1.2, "min_p": 0.05},
    {"temperature": 0.7, "top_k": 200, "min_p": 0.01, "top_p": 0.8},
]


def _sampling(**options) -> Sampling:
    return Sampling(**({"max_tokens": 8, "top_p": 1.0, "seed": 3, "stop": ()} | options))


def _logits(size: int, spread: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(size) * spread).astype(np.float32)


def _reference(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    return np.asarray(mx.softmax(mlx_filtered(mx.array(logits), sampling)))


@pytest.mark.parametrize("options", SETTINGS)
@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])
def test_the_weights_keep_the_tokens_the_mlx_filters_keep_at_their_probabilities(options, spread):
    sampling = _sampling(**options)
    logits = _logits(5000, spread)
    expected = _reference(logits, sampling)
    kept = weights(logits.copy(), sampling)
    probabilities = kept / kept.sum(dtype=np.float64)
    differ = (kept > 0) != (expected > 0)  # only where exp() underflows: numpy keeps subnormals, MLX flushes them
    assert probabilities[differ].max(initial=0.0) < 1e-30 and expected[differ].max(initial=0.0) < 1e-30
    np.testing.assert_allclose(probabilities, expected, rtol=1e-4, atol=1e-9)


def test_a_flat_distribution_finds_its_nucleus_past_the_first_candidates():
    """A random-init model's logits are nearly flat: top_p 0.95 keeps most of the vocabulary, far more
    than the first NUCLEUS_CANDIDATES (and than eight times as many)."""
    logits = _logits(20 * NUCLEUS_CANDIDATES, 0.05, seed=1)
    sampling = _sampling(temperature=1.0, top_p=0.95)
    kept = weights(logits.copy(), sampling)
    assert np.count_nonzero(kept) > 8 * NUCLEUS_CANDIDATES
    assert np.array_equal(kept > 0, _reference(logits, sampling) > 0)


def test_quantiles_of_u_land_on_each_token_in_proportion_to_its_weight():
    """u at the midpoints of N equal steps: each token is drawn within one step of N x its probability."""
    kept = np.array([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 1.0] * 400, dtype=np.float32)  # over three PICK_BLOCKs
    assert kept.size > 3 * PICK_BLOCK
    steps = 20000
    counts = np.bincount([pick(kept, (i + 0.5) / steps) for i in range(steps)], minlength=kept.size)
    expected = kept / kept.sum() * steps
    assert np.all(np.abs(counts - expected) <= 1.0)
    assert not counts[kept == 0].any()


def test_u_at_either_end_draws_the_first_and_last_tokens_with_weight():
    kept = np.zeros(3 * PICK_BLOCK + 5, dtype=np.float32)
    kept[[7, PICK_BLOCK + 2, 2 * PICK_BLOCK - 1]] = [0.25, 1.0, 0.25]
    assert pick(kept, 0.0) == 7
    assert pick(kept, np.nextafter(1.0, 0.0)) == 2 * PICK_BLOCK - 1


def test_draws_follow_the_distribution_and_the_seeds_spread_u_evenly():
    values = np.array([uniform(1234 + index * KEY_STRIDE) for index in range(20000)])
    assert values.min() >= 0.0 and values.max() < 1.0
    assert np.all(np.abs(np.histogram(values, bins=10, range=(0, 1))[0] - 2000) < 200)
    logits = np.log(np.array([0.5, 0.3, 0.2, 1e-12], dtype=np.float32))
    sampling = _sampling(temperature=1.0)
    tokens = np.bincount([sample(logits.copy(), sampling, u) for u in values], minlength=4)
    np.testing.assert_allclose(tokens[:3] / values.size, [0.5, 0.3, 0.2], atol=0.015)


def test_a_seeded_sampler_draws_the_same_tokens_and_another_seed_others():
    logits = mx.array(_logits(8192, 2.0, seed=4))
    first, again = Sampler(_sampling(temperature=0.9, top_p=0.95)), Sampler(_sampling(temperature=0.9, top_p=0.95))
    other = Sampler(_sampling(temperature=0.9, top_p=0.95, seed=4))
    draws = [first(logits, tuple(range(index))) for index in range(16)]
    assert draws == [again(logits, tuple(range(index))) for index in range(16)]
    assert draws != [other(logits, tuple(range(index))) for index in range(16)]
    assert len(set(draws)) > 8  # each token index has its own u
