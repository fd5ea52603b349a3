"""Every benchmark module imports and exposes main(): a release run must not die on a typo."""

import importlib

import pytest


@pytest.mark.parametrize("name", ["bench_engine", "bench_ttft", "bench_layers", "bench_ssd", "false_hits"])
def test_benchmark_module_loads(name):
    module = importlib.import_module(f"evals.{name}")
    assert callable(module.main)
