"""Every benchmark module imports and exposes main(): a release run must not die on a typo."""

import importlib
import shutil

import pytest


@pytest.mark.parametrize(
    "name",
    [
        "bench_engine",
        "bench_ttft",
        "bench_layers",
        "bench_ssd",
        "bench_at_rest",
        "bench_load",
        "bench_api",
        "bench_cluster",
        "bench_observability",
        "bench_verifier",
        "bench_agent",
        "bench_models",
        "bench_step",
        "bench_speculative",
        "bench_hybrid_drafts",
        "bench_timing_channel",
        "false_hits",
        "cache_sim",
        "trace_gen",
        "train_verifier",
    ],
)
def test_benchmark_module_loads(name):
    module = importlib.import_module(f"evals.{name}")
    assert callable(module.main)


def test_the_timing_channel_auc_is_the_chance_an_unsent_trial_took_longer():
    from evals.bench_timing_channel import auc

    assert auc([1.0, 2.0], [3.0, 4.0]) == 1.0  # every unsent trial slower: the time tells
    assert auc([3.0, 4.0], [1.0, 2.0]) == 0.0
    assert auc([1.0, 3.0], [2.0, 2.0]) == 0.5
    assert auc([2.0], [2.0]) == 0.5  # a tie counts half


def test_the_load_benchmark_counts_what_it_claims():
    from evals.bench_load import Sample, requests_per_client, summarise

    samples = [Sample(0.1, [0.01, 0.03], 48), Sample(0.3, [0.02], 24), Sample(error="429")]
    row = summarise(samples, wall_s=2.0)
    assert (row["requests"], row["errors"], row["tok_s"]) == (3, 1, 36.0)
    assert row["ttft_p50"] == 0.2 and row["itl_p50"] == 0.02
    assert requests_per_client("distinct", 64, 16) == 2 and requests_per_client("mix", 16, 64) == 6


def test_mix_sessions_share_the_system_prompt_and_every_fourth_opens_with_an_image():
    from evals.bench_load import mix_conversations

    turns = mix_conversations("t", 0, "SYSTEM")
    first_session = [list(next(turns)) for _ in range(3)]
    second_session = [list(next(turns)) for _ in range(3)]
    assert [len(history) for history in first_session] == [2, 3, 4]  # the caller appends no reply here
    assert all(history[0]["content"] == "SYSTEM" for history in first_session + second_session)
    assert isinstance(first_session[0][1]["content"], list)  # client 0, session 0: an image part first
    assert isinstance(second_session[0][1]["content"], str)


def test_the_api_benchmark_runs_every_mode_on_the_tiny_model(tiny_model_path):
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "evals.bench_api",
            "--model",
            str(tiny_model_path),
            "--rows",
            "1",
            "2",
            "--tokens",
            "6",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
        check=True,
    )
    rates = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(rates) == sorted(
        f"{rows}:{mode}"
        for rows in (1, 2)
        for mode in ("free text", "json_schema", "forced tool call", "logprobs (top 5)")
    )
    assert all(rate > 0 for rate in rates.values())


def test_the_ttft_comparison_loads_a_model_with_mtp_layers_in_mlx_vlm(tmp_path):
    """mlx-vlm's stock loader refuses Strata's Qwen3-Next build (its `mtp.safetensors`); the APC
    side of bench_ttft loads the same weights with that file set aside."""
    import mlx_vlm

    from evals.bench_ttft import without_mtp
    from gateway.checkpoints import BuildSpec
    from tests.conftest import built_model

    path = built_model(BuildSpec("qwen3_next", "tiny"))
    assert (path / "mtp.safetensors").exists()
    with pytest.raises(ValueError, match="not in model"):
        mlx_vlm.load(str(path))
    view = without_mtp(path)
    assert (
        not (view / "mtp.safetensors").exists()
        and (view / "model.safetensors").resolve() == (path / "model.safetensors").resolve()
    )
    model, _ = mlx_vlm.load(str(view))
    assert model.language_model is not None
    copy = tmp_path / path.name  # another checkout's build: a folder of the same name elsewhere
    shutil.copytree(path, copy)
    assert (without_mtp(copy) / "model.safetensors").resolve() == (copy / "model.safetensors").resolve()
    assert without_mtp(built_model(BuildSpec("qwen2_5_vl", "tiny"))) == built_model(BuildSpec("qwen2_5_vl", "tiny"))
