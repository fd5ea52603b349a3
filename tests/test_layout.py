"""Who may import whom, by a walk over every import statement (relative ones resolved):
the libraries never import the gateway nor each other; the engine imports nothing of the rest of
the gateway; benchmarks use the engine through its package's public interface only."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("kvcache", "vision", "semantic")
# besides the standard library and itself: the caches it runs and the model libraries beneath them
PROTOCOL = "gateway/engine/caches.py"  # the cache protocol every layer speaks: typing only
TYPING_ONLY = {"__future__", "_typeshed"}  # _typeshed: type checkers' own, under TYPE_CHECKING
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
    parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts) if path.resolve().is_relative_to(ROOT) else []
    return _imports(path.read_text(), parts)


def _imports(source: str, module: list[str]) -> list[str]:
    """The modules `source` imports, as the module named by the parts `module` would resolve them."""
    package = module[:-1]
    names = []
    for node in ast.walk(ast.parse(source)):
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


def _library_imports(library: str) -> list[str]:
    """`library`'s imports of another of the libraries."""
    others = set(LIBRARIES) - {library}
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / library).rglob("*.py")
        for name in _imported_modules(path)
        if name.split(".")[0] in others
    ]


def test_libraries_never_import_each_other():
    """semantic's stores take a sealer through semantic's own protocol (semantic/sealing.py); the
    gateway wires kvcache's keyring in (gateway/tenancy/keyring.py: SemanticSealer)."""
    assert [violation for library in LIBRARIES for violation in _library_imports(library)] == []


def test_a_library_importing_another_is_found(tmp_path, monkeypatch):
    fake_root = tmp_path / "repo"
    (fake_root / "semantic").mkdir(parents=True)
    (fake_root / "semantic" / "store.py").write_text("from kvcache.sealing import Sealer\nimport numpy\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    assert _library_imports("semantic") == ["semantic/store.py imports kvcache.sealing"]


def _engine_violations(engine: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in engine.rglob("*.py")
        for name in _imported_modules(path)
        if not (
            name == "gateway.engine"
            or name.startswith("gateway.engine.")
            or name.split(".")[0] in ENGINE_MAY_IMPORT | sys.stdlib_module_names | TYPING_ONLY
        )
    ]


def test_the_engine_imports_nothing_of_the_rest_of_the_gateway():
    assert _engine_violations(ROOT / "gateway" / "engine") == []


def test_an_engine_import_of_the_gateway_is_found(tmp_path, monkeypatch):
    fake_engine = tmp_path / "gateway" / "engine"
    fake_engine.mkdir(parents=True)
    (fake_engine / "caching.py").write_text("from ..caches import CacheLayer\nfrom .types import Pin\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _engine_violations(fake_engine) == ["gateway/engine/caching.py imports gateway.caches"]


def test_code_outside_the_engine_uses_its_package_only():
    """The rest of the gateway and the benchmarks import `gateway.engine`, never its modules (the
    tests may: they test those modules one at a time)."""
    outside = [p for p in (ROOT / "gateway").rglob("*.py") if "engine" not in p.relative_to(ROOT).parts]
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in outside + list((ROOT / "evals").rglob("*.py"))
        for name in _imported_modules(path)
        if name.startswith("gateway.engine.")
    ]
    assert violations == []


def test_the_cache_protocol_imports_nothing_of_the_project():
    """The engine may import it only because it holds types alone."""
    names = _imported_modules(ROOT / PROTOCOL)
    assert [n for n in names if n.split(".")[0] not in sys.stdlib_module_names | TYPING_ONLY] == []


# gateway's own layers, lowest first: a module imports from its own layer or those below it, never
# up (settings and blas, at the root, are below all; cli, at the root, is above all; the engine and
# the checkpoint builder import none of these).
GATEWAY_LAYERS = ("requests", "observability", "tenancy", "formats", "serving", "operations", "http")


def _layer(module: str) -> int | None:
    """The layer index of a gateway module name (`gateway.serving.chat`), None outside the layers."""
    parts = module.split(".")
    if parts[0] != "gateway" or len(parts) < 2:
        return None
    if parts[1] in ("settings", "blas"):
        return -1
    if parts[1] == "cli":
        return len(GATEWAY_LAYERS)
    return GATEWAY_LAYERS.index(parts[1]) if parts[1] in GATEWAY_LAYERS else None


def _upward_imports(gateway: Path) -> list[str]:
    violations = []
    for path in gateway.rglob("*.py"):
        module = ".".join(path.relative_to(gateway.parent).with_suffix("").parts)
        own = _layer(module)
        if own is None:
            continue
        for name in _imported_modules(path):
            layer = _layer(name)
            if layer is not None and layer > own:
                violations.append(f"{module} imports {name}")
    return violations


def test_gateway_layers_import_only_their_own_or_lower_layers():
    assert sorted(p.name for p in (ROOT / "gateway").iterdir() if p.is_dir() and not p.name.startswith("_")) == sorted(
        (*GATEWAY_LAYERS, "engine", "checkpoints")
    )
    assert sorted(p.name for p in (ROOT / "gateway").glob("*.py")) == [
        "__init__.py",
        "blas.py",
        "cli.py",
        "settings.py",
    ]
    assert _upward_imports(ROOT / "gateway") == []


def test_an_upward_import_is_found(tmp_path, monkeypatch):
    gateway = tmp_path / "gateway"
    (gateway / "serving").mkdir(parents=True)
    (gateway / "serving" / "chat.py").write_text("from ..http.app import create_app\nfrom ..tenancy import auth\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _upward_imports(gateway) == ["gateway.serving.chat imports gateway.http.app"]


def test_relative_imports_are_resolved():
    module = ["gateway", "engine", "x"]
    assert "gateway.schemas" in _imports("from ..schemas import Sampling\n", module)
    assert "gateway.engine.types" in _imports("from .types import Sampling\n", module)
    assert "gateway.engine" in _imports("from . import types\n", module)


def test_import_walk_detects_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom gateway.http.app import create_app\n")
    assert "gateway.http.app" in _imported_modules(bad)


def test_top_level_layout():
    for name in ("pyproject.toml", "gateway", "kvcache", "semantic", "vision", "tests", "evals"):
        assert (ROOT / name).exists(), name


def test_the_runtime_engine_holds_no_checkpoint_builder():
    """The random-init checkpoint builder is a tool (gateway/checkpoints): the engine loads whatever
    folder it is given and never imports it."""
    engine = ROOT / "gateway" / "engine"
    assert not (engine / "builder.py").exists() and not (engine / "assets").exists()
    imports = [name for path in engine.rglob("*.py") for name in _imported_modules(path)]
    assert not [name for name in imports if name.startswith("gateway.checkpoints")]
