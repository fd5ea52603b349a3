"""What Strata must know about a model family that its library does not say: per-family data, no code.

mlx-vlm and mlx-lm own loading, input preparation (chat template, the processor's image-token
expansion, pixel values and their metadata), the input embeddings and the cache classes. Strata owns
block hashing, image keys at the image's blocks, vision-feature reuse and explicit positions; for that
it needs, per family, only the fields below. A vision family missing here is refused at start-up with
this message; any text model mlx-lm loads runs through the generic text path.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True, slots=True)
class Family:
    model_type: str  # the library's own name, as in config.json
    library: Literal["mlx_vlm", "mlx_lm"]
    # The token the chat template writes for one image part; the family's processor expands it into
    # the image's tokens (placeholders, and for some families row breaks or begin/end markers).
    image_placeholder: str | None = None
    # ... for one video part, in families whose processor takes videos (None: videos refused)
    video_placeholder: str | None = None
    # The tokens the template writes around a video's placeholder, which the processor expands with
    # it (Qwen3-VL repeats them per pair of frames, each group after its "<t seconds>" timestamp).
    video_markers: tuple[str, str] | None = None
    # "mrope": the Qwen VL line's 3-axis positions, computed once per prompt from the image grids.
    # "offset": plain RoPE from the cache offset, which chunked and cached prefill already get right.
    positions: Literal["offset", "mrope"] = "offset"
    # Sliding-window layers (Gemma 3) keep full KV like global layers, and the window is applied as an
    # attention mask (the library's KVCache.make_mask does so in prefill and decode). Blocks then hold
    # every layer's KV, so a reused prefix longer than the window is exact.
    window_as_mask: bool = False
    # The model scales token embeddings by its `embed_scale` when given token ids, but takes
    # `inputs_embeds` as they are (Gemma 4; Gemma 3 scales both): text rows spliced around an
    # image's features must carry the scale.
    scaled_embeds: bool = False


QWEN_VIDEO = ("<|vision_start|>", "<|vision_end|>")
VISION_FAMILIES = {
    f.model_type: f
    for f in (
        Family("qwen2_5_vl", "mlx_vlm", "<|image_pad|>", "<|video_pad|>", QWEN_VIDEO, positions="mrope"),
        Family("qwen2_vl", "mlx_vlm", "<|image_pad|>", "<|video_pad|>", QWEN_VIDEO, positions="mrope"),
        Family("qwen3_vl", "mlx_vlm", "<|image_pad|>", "<|video_pad|>", QWEN_VIDEO, positions="mrope"),
        Family("qwen3_5", "mlx_vlm", "<|image_pad|>", "<|video_pad|>", QWEN_VIDEO, positions="mrope"),
        Family("qwen3_5_moe", "mlx_vlm", "<|image_pad|>", "<|video_pad|>", QWEN_VIDEO, positions="mrope"),
        Family("gemma3", "mlx_vlm", "<start_of_image>", window_as_mask=True),
        Family("gemma4", "mlx_vlm", "<|image|>", window_as_mask=True, scaled_embeds=True),
        Family("smolvlm", "mlx_vlm", "<image>"),
        Family("idefics3", "mlx_vlm", "<image>"),
        Family("mistral3", "mlx_vlm", "[IMG]"),
        Family("llava_onevision", "mlx_vlm", "<image>", "<video>"),
        Family("lfm2_vl", "mlx_vlm", "<image>"),
    )
}


# Text families that need data too (any other text model mlx-lm loads takes the generic path).
TEXT_FAMILIES = {
    f.model_type: f
    for f in (
        # gpt-oss alternates sliding-window and full layers: the window as a mask, as for Gemma 3
        Family("gpt_oss", "mlx_lm", window_as_mask=True),
    )
}


class UnsupportedModel(ValueError):
    """The model folder names a family Strata cannot run; raised at start-up, before any request."""


def family_of(model_path: Path) -> Family:
    """The family of a model folder, from its config.json; UnsupportedModel when Strata lacks it."""
    config = read_config(model_path)
    model_type = str(config.get("model_type", ""))
    if model_type in VISION_FAMILIES:
        return VISION_FAMILIES[model_type]
    if model_type in TEXT_FAMILIES:
        return TEXT_FAMILIES[model_type]
    if "vision_config" in config:
        raise UnsupportedModel(
            f"model type {model_type!r} is a vision model Strata has no family data for (the image "
            f"placeholder its chat template writes and its position scheme); supported vision families: "
            f"{', '.join(sorted(VISION_FAMILIES))}"
        )
    if not _mlx_lm_loads(model_type):
        raise UnsupportedModel(
            f"model type {model_type!r} is loaded by neither mlx-vlm's supported families "
            f"({', '.join(sorted(VISION_FAMILIES))}) nor mlx-lm"
        )
    return Family(model_type, "mlx_lm")


def _mlx_lm_loads(model_type: str) -> bool:
    """Whether mlx-lm has a module for this model type (after its own renames, e.g. mistral -> llama)."""
    from mlx_lm.utils import MODEL_REMAPPING

    module = MODEL_REMAPPING.get(model_type, model_type)
    return module.isidentifier() and importlib.util.find_spec(f"mlx_lm.models.{module}") is not None


def read_config(model_path: Path) -> dict:
    return json.loads((Path(model_path) / "config.json").read_text())
