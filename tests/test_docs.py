"""The documentation runs: the README's quick start against a live server; every page's code blocks
parse as what they say they are (Python compiles, JSON and TOML load, shell passes `bash -n`); each
shell command runs as far as it can without serving (a `strata` command through the CLI's own parser
and settings, a `make` target found in the Makefile, an agent's variables the ones its driver sets);
the models file loads; the agents' configurations are the ones the agent tests drive."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from evals.agent_clients import ClaudeCode, Scratch, codex_config, opencode_config
from gateway import cli
from gateway.serving.models import model_entries, read_models_file
from tests.gateway.test_live_server import LiveServer

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return FENCE.findall(page.read_text())


def _checks() -> list[tuple[str, str, str]]:
    return [
        (f"{page.relative_to(ROOT)}#{index}", language, code)
        for page in PAGES
        for index, (language, code) in enumerate(_blocks(page))
        if language in ("python", "json", "toml", "sh", "bash")
    ]


def test_every_page_is_in_the_site_and_the_readme_is_a_front_door():
    site = (ROOT / "mkdocs.yml").read_text()
    assert all(page.name in site for page in PAGES if page.parent.name == "docs")
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400


@pytest.mark.parametrize("name,language,code", _checks(), ids=[c[0] for c in _checks()])
def test_a_code_block_parses_as_its_language(name, language, code):
    if language == "python":
        compile(code, name, "exec")
    elif language == "json":
        json.loads(code)
    elif language == "toml":
        tomllib.loads(code)
    else:  # a <placeholder> the reader fills in stands for one word
        checked = subprocess.run(
            ["bash", "-n"], input=re.sub(r"<[^<>\n]+>", "VALUE", code), capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stderr


def test_the_readme_quick_start_prints_each_layer_as_it_says(tiny_model_path, tmp_path):
    """The README's Python quick start, run as written against a live server (its address swapped
    for the test server's): the layers answer in the order its comments say."""
    code = next(code for language, code in _blocks(ROOT / "README.md") if language == "python")
    live = LiveServer(tiny_model_path, tmp_path / "data", {"STRATA_MODEL_NAME": "strata-demo"})
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code.replace("http://127.0.0.1:8000", live.url), "README.md", "exec"), {})
    finally:
        assert live.stop()
    lines = printed.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["engine", "exact", "semantic", "engine", "engine"], lines
    assert "prefix: hit" in lines[-1] and "vision: hit" in lines[-1] and "vision: miss" in lines[-2]


def _commands() -> list[tuple[str, list[str]]]:
    """Each command of the pages' shell blocks as argv, its `NAME=value` prefixes and comments kept
    apart; a <placeholder> stands for one word."""
    commands = []
    for name, language, code in _checks():
        if language in ("sh", "bash"):
            for line in code.splitlines():
                words = shlex.split(re.sub(r"<[^<>\n]+>", "VALUE", line), comments=True)
                if words:
                    commands.append((name, words))
    return commands


def _page_block(name: str, language: str) -> str:
    page = ROOT / name.split("#")[0]
    return next(code for found, code in _blocks(page) if found == language)


@pytest.mark.parametrize("name,words", _commands(), ids=[f"{n}:{' '.join(w)[:40]}" for n, w in _commands()])
def test_a_documented_command_runs_up_to_what_it_starts(name, words, tmp_path, monkeypatch):
    env = dict(word.split("=", 1) for word in words if re.fullmatch(r"[A-Z_]+=.*", word))
    argv = [word for word in words if not re.fullmatch(r"[A-Z_]+=.*", word)]
    if argv[0] == "make":
        targets = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert set(argv[1:]) <= set(targets), argv
    elif argv[0] == "strata":
        args = cli.parser().parse_args(argv[1:])
        if args.command == "serve":
            monkeypatch.chdir(tmp_path)  # the page's models.json, where the command expects it
            if "STRATA_MODELS_FILE" in env:
                (tmp_path / "models.json").write_text(_page_block(name, "json"))
            settings = cli.serve_settings(args, env)
            assert [entry.name for entry in model_entries(settings)]
    elif argv[0] == "export":  # an agent's environment (README, Claude Code)
        driver = ClaudeCode().env(Scratch(tmp_path, "http://127.0.0.1:8000", "VALUE"))
        assert set(env) <= set(driver), (env, driver)
        assert env.get("ANTHROPIC_BASE_URL", driver["ANTHROPIC_BASE_URL"]) == driver["ANTHROPIC_BASE_URL"]
    else:
        assert argv[0] == "claude", f"{name}: no test runs {argv[0]!r}"


def test_the_models_file_of_the_docs_loads_as_it_says(tmp_path):
    (tmp_path / "models.json").write_text(_page_block("docs/models.md", "json"))
    vision, titles = read_models_file(tmp_path / "models.json")
    assert (vision.name, vision.path, vision.pinned) == ("vision", "mlx-community/gemma-3-4b-it-4bit", True)
    assert (titles.idle_ttl_s, titles.kv_budget_bytes, titles.max_context_tokens) == (600, 256 << 20, 4096)
    assert titles.defaults == {"max_tokens": 32, "temperature": 0} and not titles.pinned


def test_the_agent_configurations_are_the_ones_the_agent_tests_drive():
    model, url = "strata-tiny-agent", "http://127.0.0.1:8000"
    toml_block = _page_block("README.md", "toml").replace("<a served model's name>", model)
    json_block = _page_block("README.md", "json").replace("<a served model's name>", model)
    assert tomllib.loads(toml_block) == tomllib.loads(codex_config(url))
    assert tomllib.loads(toml_block.replace("# model = ", "model = ")) == tomllib.loads(codex_config(url, model))
    assert json.loads(json_block) == json.loads(opencode_config(url, model))
