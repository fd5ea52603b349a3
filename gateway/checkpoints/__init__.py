"""Model folders for Strata to serve: the project's own seeded random-init checkpoints of each family
(builder.py: 'demo' and 'tiny', built offline on first use) and the name -> folder rule the server
and the tools share. Not part of the runtime engine: the engine loads whatever folder it is given."""

from __future__ import annotations

from pathlib import Path

from .builder import (
    CORPUS,
    DEFAULT_FAMILY,
    DTYPES,
    RECIPES,
    SIZES,
    BuildSpec,
    build_model,
    builder_digest,
    ensure_model,
    parse_model_name,
)

BUILDABLE_FAMILIES = tuple(sorted(RECIPES))  # what `strata build-model --family` builds

__all__ = [
    "BUILDABLE_FAMILIES",
    "CORPUS",
    "DEFAULT_FAMILY",
    "DTYPES",
    "RECIPES",
    "SIZES",
    "BuildSpec",
    "build_model",
    "builder_digest",
    "ensure_model",
    "parse_model_name",
    "resolve_model_path",
]


def resolve_model_path(model: str, data_dir: Path) -> Path:
    """'demo' and 'tiny' (and '<family>-demo', '<family>-tiny') name the embedded models, built into
    data_dir on first use; a folder is used as it is; anything else is a hub id fetched by mlx-vlm."""
    if (spec := parse_model_name(model)) is not None:
        return ensure_model(spec, Path(data_dir) / "models" / spec.name)
    if Path(model).exists():
        return Path(model)
    from mlx_vlm.utils import get_model_path

    return Path(get_model_path(model))
