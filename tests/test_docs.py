"""The documentation runs: the README's quick start against a live server, and every page's code
blocks parse as what they say they are (Python compiles, JSON and TOML load, shell passes `bash -n`)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

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
