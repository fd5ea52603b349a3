"""Which models a server serves: `--model` repeated and STRATA_MODELS_FILE, their names, and the clear
errors a bad list gets before anything loads."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from gateway.serving.models import ModelEntry, model_entries, read_models_file


def _file(tmp_path, rows) -> str:
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": rows}))
    return path


def test_command_line_models_come_first_then_the_files_with_their_names(settings, tmp_path):
    folder = tmp_path / "coder-model"
    folder.mkdir()
    given = dataclasses.replace(
        settings,
        model=str(folder),
        model_name=None,
        more_models=("gemma3-tiny", "mlx-community/SmolVLM-256M-Instruct-4bit"),
        models_file=_file(tmp_path, [{"name": "titles", "path": "llama-tiny", "pinned": True, "idle_ttl_s": 60}]),
    )
    assert [(e.name, e.path) for e in model_entries(given)] == [
        ("coder-model", str(folder)),  # a folder: its name
        ("strata-gemma3-tiny", "gemma3-tiny"),  # a built-in model: its own name
        ("mlx-community/SmolVLM-256M-Instruct-4bit", "mlx-community/SmolVLM-256M-Instruct-4bit"),  # a hub id as given
        ("titles", "llama-tiny"),
    ]
    assert model_entries(given)[3] == ModelEntry("titles", "llama-tiny", True, 60.0)
    with_limits = {
        "path": "llama-tiny",
        "kv_budget_bytes": 1 << 24,
        "max_context_tokens": 512,
        "defaults": {"top_p": 0.9},
    }
    limited = model_entries(dataclasses.replace(given, models_file=_file(tmp_path, [with_limits])))[-1]
    assert (limited.name, limited.kv_budget_bytes, limited.max_context_tokens) == ("strata-llama-tiny", 1 << 24, 512)
    assert limited.defaults == {"top_p": 0.9}
    assert model_entries(dataclasses.replace(given, model_name="coder"))[0].name == "coder"


def test_a_models_file_alone_names_every_model(settings, tmp_path):
    alone = dataclasses.replace(settings, model="", models_file=_file(tmp_path, [{"path": "tiny"}]))
    assert [e.name for e in model_entries(alone)] == ["strata-tiny"]


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"name": "a"}], "'path' string"),
        ([{"path": "tiny", "colour": "red"}], "unknown field"),
        ([{"path": "tiny", "pinned": "yes"}], "'pinned' true or false"),
        ([{"path": "tiny", "idle_ttl_s": -1}], "'idle_ttl_s'"),
        ({"path": "tiny"}, "must be a list"),
        ([{"path": "tiny", "defaults": {"seed": 1}}], "'defaults' must be an object of"),
        ([{"path": "tiny", "kv_budget_bytes": 0}], "'kv_budget_bytes' must be a whole number"),
    ],
)
def test_a_bad_models_file_names_the_entry_and_the_problem(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        read_models_file(_file(tmp_path, rows))


def test_two_models_under_one_name_are_refused(settings, tmp_path):
    twice = dataclasses.replace(settings, models_file=_file(tmp_path, [{"name": settings.model_name, "path": "tiny"}]))
    with pytest.raises(ValueError, match="repeated"):
        model_entries(twice)


def test_strata_serve_stops_on_a_bad_models_file_with_the_reason(tmp_path):
    path = _file(tmp_path, [{"path": "tiny", "colour": "red"}])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--data-dir",
            str(tmp_path / "data"),
            "--models-file",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "unknown field" in done.stderr and "models[0]" in done.stderr
