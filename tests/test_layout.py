"""The libraries never import the gateway: a walk over every import statement."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("kvcache", "vision", "semantic")


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_libraries_never_import_gateway():
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for library in LIBRARIES
        for path in (ROOT / library).rglob("*.py")
        for name in _imported_modules(path)
        if name == "gateway" or name.startswith("gateway.")
    ]
    assert violations == []


def test_import_walk_detects_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom gateway.app import create_app\n")
    assert "gateway.app" in _imported_modules(bad)


def test_top_level_layout():
    for name in ("pyproject.toml", "gateway", "kvcache", "semantic", "vision", "tests", "evals"):
        assert (ROOT / name).exists(), name
