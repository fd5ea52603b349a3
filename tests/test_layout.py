"""Who may import whom, by a walk over every import statement (relative ones resolved):
the libraries never import the gateway; the engine never imports the rest of the gateway (HTTP);
benchmarks use the engine through its package's public interface only."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("kvcache", "vision", "semantic")
# besides the standard library and itself: the caches it runs and the model libraries beneath them
ENGINE_MAY_IMPORT = {
    "kvcache",
    "vision",
    "mlx",
    "mlx_vlm",
    "mlx_lm",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "PIL",
    "threadpoolctl",
    "llguidance",
    "__future__",
}


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of every module `path` imports; `from ..x import y` resolves against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts) if path.resolve().is_relative_to(ROOT) else []
    package = parts[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)]
            names.append(".".join(base + ([node.module] if node.module else [])))
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


def test_the_engine_never_imports_the_http_side():
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "gateway" / "engine").rglob("*.py")
        for name in _imported_modules(path)
        if not (
            name == "gateway.engine"
            or name.startswith("gateway.engine.")
            or name.split(".")[0] in ENGINE_MAY_IMPORT | sys.stdlib_module_names
        )
    ]
    assert violations == []


def test_benchmarks_use_the_engine_package_only():
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "evals").rglob("*.py")
        for name in _imported_modules(path)
        if name.startswith("gateway.engine.")
    ]
    assert violations == []


def test_relative_imports_are_resolved():
    assert "gateway.schemas" in _imported_modules_of("gateway/engine/x.py", "from ..schemas import Sampling\n")
    assert "gateway.engine.types" in _imported_modules_of("gateway/engine/x.py", "from .types import Sampling\n")


def _imported_modules_of(relative: str, source: str) -> list[str]:
    path = ROOT / relative
    assert not path.exists()
    path.write_text(source)
    try:
        return _imported_modules(path)
    finally:
        path.unlink()


def test_import_walk_detects_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom gateway.app import create_app\n")
    assert "gateway.app" in _imported_modules(bad)


def test_top_level_layout():
    for name in ("pyproject.toml", "gateway", "kvcache", "semantic", "vision", "tests", "evals"):
        assert (ROOT / name).exists(), name
