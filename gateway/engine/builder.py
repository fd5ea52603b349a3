"""Build a seeded random-init Qwen2.5-VL checkpoint that `mlx_vlm.load` reads.

No weights can be downloaded here, so tests and the demo server run on a model the project builds
itself: mlx-vlm's own `qwen2_5_vl` classes, re-initialised with a fixed seed, a byte-level BPE
tokenizer trained locally on `assets/corpus.txt`, and the Qwen2-VL chat template. The output is an
ordinary model folder (config.json, model.safetensors, tokenizer files, preprocessor_config.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VOCAB_SIZE = 8192
SEED = 20261129


@dataclass(frozen=True, slots=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vision_depth: int
    vision_hidden_size: int
    vision_heads: int


SIZES = {
    "tiny": ModelSize(256, 2, 4, 2, 512, 1, 64, 2),
    "demo": ModelSize(512, 4, 8, 2, 1376, 2, 128, 4),
}


def build_model(size: str, out_dir: Path) -> Path:
    """Write a complete model folder for `size` ("tiny" or "demo") into `out_dir`; return it."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    out_dir = Path(out_dir)
    tmp_dir = out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    token_ids = _write_tokenizer(tmp_dir)
    config = _model_config(SIZES[size], token_ids)
    (tmp_dir / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(config, tmp_dir)
    _write_processor_config(tmp_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


def builder_digest(size: str) -> str:
    """What a built model depends on: this builder, its assets, the size, and the libraries whose
    classes and trainers write it. Equal digests build identical folders (everything is seeded)."""
    from importlib.metadata import version

    digest = hashlib.sha256(f"strata-builder-v1|{size}|".encode())
    digest.update(Path(__file__).read_bytes())
    for asset in sorted(ASSETS.iterdir()):
        digest.update(asset.name.encode() + b"\0" + asset.read_bytes())
    for package in ("mlx", "mlx-vlm", "transformers", "tokenizers"):
        digest.update(f"{package}=={version(package)}".encode())
    return digest.hexdigest()


def ensure_model(size: str, out_dir: Path) -> Path:
    """Build the model once; later calls reuse the folder (it is complete once renamed in place)."""
    out_dir = Path(out_dir)
    if not (out_dir / "config.json").exists():
        build_model(size, out_dir)
    return out_dir


def _write_tokenizer(out_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = (ASSETS / "corpus.txt").read_text().splitlines()[1:]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    fast.chat_template = (ASSETS / "chat_template.jinja").read_text()
    fast.save_pretrained(str(out_dir))
    (out_dir / "chat_template.jinja").write_text(fast.chat_template)
    return {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}


def _model_config(size: ModelSize, ids: dict[str, int]) -> dict:
    head_dim = size.hidden_size // size.num_heads
    quarter = head_dim // 2 // 4  # mRoPE sections split head_dim/2 as 1:1.5:1.5 (t, h, w)
    return {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": size.hidden_size,
        "num_hidden_layers": size.num_layers,
        "intermediate_size": size.intermediate_size,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [quarter, quarter * 3 // 2, quarter * 3 // 2]},
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": size.vision_depth,
            "hidden_size": size.vision_hidden_size,
            "intermediate_size": size.vision_hidden_size * 2,
            "out_hidden_size": size.hidden_size,
            "num_heads": size.vision_heads,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [size.vision_depth - 1],
            "in_channels": 3,
        },
    }


def _write_weights(config: dict, out_dir: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_vlm.models.qwen2_5_vl import Model, ModelConfig, TextConfig, VisionConfig

    mx.random.seed(SEED)
    model_config = ModelConfig.from_dict(dict(config))
    model_config.vision_config = VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = TextConfig.from_dict(model_config.text_config)
    model = Model(model_config)
    model.update(tree_map_with_path(_reinit, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})


def _reinit(path: str, param):
    """Norms at one, biases at zero, embeddings N(0, 0.02), other weights N(0, 1/fan_in): each layer
    then changes the residual stream by O(1), so greedy output depends on the context instead of
    echoing the last token through the tied embeddings (which a uniform 0.02 init does)."""
    import mlx.core as mx

    if param.ndim == 1:
        return mx.ones_like(param) if _is_norm_like(param) else mx.zeros_like(param)
    std = 0.02 if "embed_tokens" in path else param.shape[-1] ** -0.5
    return (mx.random.normal(param.shape) * std).astype(mx.float32)


def _is_norm_like(param) -> bool:
    import mlx.core as mx

    return bool(mx.all(param == 1).item())


def _write_processor_config(out_dir: Path) -> None:
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": 448 * 448,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
