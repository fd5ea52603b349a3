"""Build a seeded random-init checkpoint of one model family that its library loads as it would a real one.

No weights can be downloaded here, so tests and the demo server run on models the project builds
itself: the library's own model classes (mlx-vlm for vision families, mlx-lm for text models) with
scaled-down configs, re-initialised with a fixed seed; a byte-level BPE tokenizer trained locally on
`assets/corpus.txt` with the family's special tokens; the family's chat template; and for vision
families the processor configuration its real processor code reads. Weights can be stored in
float32, bfloat16 or float16, and quantised to 4 or 8 bits as mlx-community checkpoints are. The
output is an ordinary model folder (config.json, model.safetensors, tokenizer files, processor files).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .ends_turns import favour_end_of_turn, untie

ASSETS = Path(__file__).parent / "assets"
CORPUS = ASSETS / "corpus.txt"  # public-domain text: the tokenizers' training text and the benchmarks' prompts
VOCAB_SIZE = 8192
SEED = 20261129
DTYPES = ("float32", "bfloat16", "float16")
QUANT_GROUP_SIZE = 64


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
    sliding_window: int  # for families with sliding-window layers


SIZES = {
    "tiny": ModelSize(256, 2, 4, 2, 512, 1, 64, 2, 64),
    "demo": ModelSize(512, 4, 8, 2, 1376, 2, 128, 4, 512),
}


@dataclass(frozen=True, slots=True)
class Recipe:
    """One family's scaled-down build: its library, tokens, template, config and processor files."""

    library: str  # "mlx_vlm" or "mlx_lm": whose classes build (and later load) the weights
    special_tokens: tuple[str, ...]
    eos_token: str
    bos_token: str | None
    pad_token: str
    config: Callable[[ModelSize, dict[str, int]], dict]
    processor_files: Callable[[ModelSize], dict[str, dict]] = lambda size: {}
    # Whole tokens that are not special (decoded into the text like any word): Qwen3's <think> and
    # </think>, by which mlx-lm knows the template has a thinking switch that is on by default.
    added_tokens: tuple[str, ...] = ()
    # Multi-token-prediction layers beside the model, as the real checkpoints ship them (Qwen3.5 and
    # Qwen3-Next: `mtp.*`, one decoder layer): the engine drafts with them (speculative decoding).
    mtp_layers: int = 0


def _qwen2_5_vl_config(size: ModelSize, ids: dict[str, int]) -> dict:
    head_dim = size.hidden_size // size.num_heads
    quarter = head_dim // 2 // 4  # mRoPE sections split head_dim/2 as 1:1.5:1.5 (t, h, w)
    return _text_fields(size) | {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [quarter, quarter * 3 // 2, quarter * 3 // 2]},
        "tie_word_embeddings": True,
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


def _qwen_vl_processor(processor_class: str, patch_size: int, normalisation) -> Callable[[ModelSize], dict]:
    """The Qwen VL line's preprocessor: patches merged 2x2, two frames per temporal patch, up to 448² px."""

    def files(size: ModelSize) -> dict[str, dict]:
        return {
            "preprocessor_config.json": {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": processor_class,
                "patch_size": patch_size,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "min_pixels": 56 * 56,
                "max_pixels": 448 * 448,
            }
            | _normalised(normalisation)
        }

    return files


def _qwen3_vl_config(size: ModelSize, ids: dict[str, int]) -> dict:
    """Qwen3-VL: mRoPE (interleaved sections), a 16-px patch vision tower whose early layers also feed
    the first decoder layers ("deepstack")."""
    head_dim = size.hidden_size // size.num_heads
    half = head_dim // 2
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "torch_dtype": "float32",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "tie_word_embeddings": True,
        "text_config": _text_fields(size)
        | {
            "model_type": "qwen3_vl",
            "head_dim": head_dim,
            "rope_theta": 5000000.0,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16],
                "mrope_interleaved": True,
            },
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": size.vision_depth,
            "hidden_size": size.vision_hidden_size,
            "intermediate_size": size.vision_hidden_size * 2,
            "out_hidden_size": size.hidden_size,
            "num_heads": size.vision_heads,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
            "in_channels": 3,
        },
    }


def _qwen3_5_config(size: ModelSize, ids: dict[str, int], moe: bool = False) -> dict:
    """Qwen3.5: Qwen3-VL's 16-px vision tower (no deepstack) on a hybrid language model, gated-delta
    (recurrent) layers with a full-attention layer every second layer here (every fourth in the real
    checkpoints), partial mRoPE on a quarter of each head; `moe`: Qwen3.5-MoE's experts."""
    head_dim = size.hidden_size // size.num_heads
    half = head_dim // 4 // 2  # rotary half-width: a quarter of the head rotates
    text = _text_fields(size) | {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "head_dim": head_dim,
        "tie_word_embeddings": True,
        "full_attention_interval": 2,
        "linear_num_value_heads": size.num_heads,
        "linear_num_key_heads": size.num_kv_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "type": "default",
            "mrope_section": [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8],
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
        },
    }
    if moe:
        text |= {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": size.intermediate_size // 4,
            "shared_expert_intermediate_size": size.intermediate_size // 4,
            "norm_topk_prob": True,
        }
    vision = _qwen3_vl_config(size, ids)["vision_config"] | {"model_type": "qwen3_5", "deepstack_visual_indexes": []}
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "torch_dtype": "float32",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": True,
        "text_config": text,
        "vision_config": vision,
    }


GEMMA4_SOFT_TOKENS = 64  # image soft tokens at most: 16-px patches pooled 3x3


def _gemma4_config(size: ModelSize, ids: dict[str, int]) -> dict:
    """Gemma 4 (the 26B/31B layout: no per-layer inputs, no KV shared across layers): sliding-window
    and full layers, the full ones with wider heads and proportional RoPE on a quarter of them; a
    vision tower of 16-px patches pooled 3x3 into soft tokens."""
    head_dim = size.hidden_size // size.num_heads
    text = _text_fields(size) | {
        "model_type": "gemma4_text",
        "head_dim": head_dim,
        "global_head_dim": 2 * head_dim,
        "num_global_key_value_heads": size.num_kv_heads,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "sliding_window": size.sliding_window,
        "layer_types": ["sliding_attention", "full_attention"] * (size.num_layers // 2),
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": True,
    }
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_hidden_size * 2,
        "num_hidden_layers": size.vision_depth,
        "num_attention_heads": size.vision_heads,
        "num_key_value_heads": size.vision_heads,
        "head_dim": size.vision_hidden_size // size.vision_heads,
        "global_head_dim": size.vision_hidden_size // size.vision_heads,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "default_output_length": GEMMA4_SOFT_TOKENS,
        "position_embedding_size": 1024,
    }
    return {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "torch_dtype": "float32",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": size.hidden_size,
        "image_token_id": ids["<|image|>"],
        "audio_token_id": ids["<|audio|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "boa_token_id": ids["<|audio>"],
        "eoa_token_id": ids["<audio|>"],
        "pad_token_id": ids["<pad>"],
        "vision_soft_tokens_per_image": GEMMA4_SOFT_TOKENS,
        "eos_token_id": [ids["<turn|>"], ids["<eos>"]],
        "tie_word_embeddings": True,
        "text_config": text,
        "vision_config": vision,
    }


def _gemma4_processor(size: ModelSize) -> dict[str, dict]:
    return {
        "processor_config.json": {"processor_class": "Gemma4Processor", "image_seq_length": GEMMA4_SOFT_TOKENS},
        "preprocessor_config.json": {
            "image_processor_type": "Gemma4ImageProcessor",
            "processor_class": "Gemma4Processor",
            "patch_size": 16,
            "max_soft_tokens": GEMMA4_SOFT_TOKENS,
            "pooling_kernel_size": 3,
            "do_normalize": False,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_resize": True,
            "do_convert_rgb": True,
        },
    }


LFM2_TILE, LFM2_MAX_IMAGE_TOKENS = 128, 16  # 16-px patches, 2x2 pixel-unshuffled: 16 tokens per tile


def _lfm2_vl_config(size: ModelSize, ids: dict[str, int]) -> dict:
    """LFM2-VL: a SigLIP2 (NaFlex) tower whose patches are pixel-unshuffled 2x2 into the language
    model, LFM2, a hybrid of gated short-convolution layers (recurrent: a 3-token window) and
    attention layers; large images are split into tiles plus a thumbnail."""
    return {
        "model_type": "lfm2_vl",
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "torch_dtype": "float32",
        "image_token_id": ids["<image>"],
        "image_token_index": ids["<image>"],
        "eos_token_id": ids["<|im_end|>"],
        "downsample_factor": 2,
        "encoder_patch_size": 16,
        "max_image_tokens": LFM2_MAX_IMAGE_TOKENS,
        "min_image_tokens": 4,
        "tile_size": LFM2_TILE,
        "max_num_patches": LFM2_MAX_IMAGE_TOKENS * 4,
        "projector_hidden_size": size.hidden_size,
        "text_config": {
            "model_type": "lfm2",
            "hidden_size": size.hidden_size,
            "block_dim": size.hidden_size,
            "conv_dim": size.hidden_size,
            "conv_dim_out": size.hidden_size,
            "num_hidden_layers": size.num_layers,
            "intermediate_size": size.intermediate_size,
            "block_ff_dim": size.intermediate_size,
            "block_auto_adjust_ff_dim": False,
            "num_attention_heads": size.num_heads,
            "num_heads": size.num_heads,
            "num_key_value_heads": size.num_kv_heads,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 32768,
            "eos_token_id": ids["<|im_end|>"],
            "layer_types": ["conv", "full_attention"] * (size.num_layers // 2),
            "tie_word_embeddings": True,
        },
        "vision_config": {
            "model_type": "lfm2_vl",
            "hidden_size": size.vision_hidden_size,
            "intermediate_size": size.vision_hidden_size * 2,
            "num_hidden_layers": size.vision_depth,
            "num_attention_heads": size.vision_heads,
            "patch_size": 16,
            "num_patches": LFM2_MAX_IMAGE_TOKENS * 4,
            "vision_use_head": False,
        },
    }


def _lfm2_vl_processor(size: ModelSize) -> dict[str, dict]:
    image = {
        "image_processor_type": "Lfm2VlImageProcessor",
        "processor_class": "Lfm2VlProcessor",
        "downsample_factor": 2,
        "encoder_patch_size": 16,
        "min_image_tokens": 4,
        "max_image_tokens": LFM2_MAX_IMAGE_TOKENS,
        "tile_size": LFM2_TILE,
        "max_num_patches": LFM2_MAX_IMAGE_TOKENS * 4,
    } | _normalised(HALF)
    return {
        "preprocessor_config.json": image,
        "processor_config.json": {"processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True},
    }


GEMMA3_IMAGE_SIZE, GEMMA3_IMAGE_TOKENS = 224, 64  # 16x16 patches of 14 px, pooled 2x2


def _gemma3_config(size: ModelSize, ids: dict[str, int]) -> dict:
    head_dim = size.hidden_size // size.num_heads
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "float32",
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "mm_tokens_per_image": GEMMA3_IMAGE_TOKENS,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": size.hidden_size,
            "num_hidden_layers": size.num_layers,
            "intermediate_size": size.intermediate_size,
            "num_attention_heads": size.num_heads,
            "num_key_value_heads": size.num_kv_heads,
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,
            "vocab_size": VOCAB_SIZE,
            "rms_norm_eps": 1e-6,
            # one global layer per `pattern` layers, the others local with a sliding window
            "sliding_window": size.sliding_window,
            "sliding_window_pattern": size.num_layers,
            "mm_tokens_per_image": GEMMA3_IMAGE_TOKENS,
            "max_position_embeddings": 32768,
        },
        "vision_config": _siglip_vision(size, "siglip_vision_model", GEMMA3_IMAGE_SIZE),
    }


def _gemma3_processor(size: ModelSize) -> dict[str, dict]:
    return {
        "preprocessor_config.json": {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "size": {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
            "resample": 2,
            "do_pan_and_scan": False,
        }
        | _normalised(HALF),
        "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": GEMMA3_IMAGE_TOKENS},
    }


SMOLVLM_TILE, SMOLVLM_IMAGE_TOKENS = 224, 64  # 16x16 patches of 14 px per tile, pixel-shuffled 2x2


def _smolvlm_config(size: ModelSize, ids: dict[str, int]) -> dict:
    return {
        "model_type": "smolvlm",
        "architectures": ["SmolVLMForConditionalGeneration"],
        "torch_dtype": "float32",
        "image_token_id": ids["<image>"],
        "scale_factor": 2,
        "eos_token_id": [ids["<end_of_utterance>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "text_config": _text_fields(size)
        | {"model_type": "llama", "rope_theta": 100000.0, "tie_word_embeddings": False},
        "vision_config": _siglip_vision(size, "smolvlm_vision", SMOLVLM_TILE),
    }


def _smolvlm_processor(size: ModelSize) -> dict[str, dict]:
    """Images are split into tiles of SMOLVLM_TILE px plus a global view, as SmolVLM's processor does."""
    return {
        "preprocessor_config.json": {
            "image_processor_type": "SmolVLMImageProcessor",
            "processor_class": "SmolVLMProcessor",
            "do_image_splitting": True,
            "max_image_size": {"longest_edge": SMOLVLM_TILE},
            "size": {"longest_edge": 2 * SMOLVLM_TILE},
            "resample": 1,
            "do_pad": True,
        }
        | _normalised(HALF),
        "processor_config.json": {"processor_class": "SmolVLMProcessor", "image_seq_len": SMOLVLM_IMAGE_TOKENS},
    }


PIXTRAL_LONGEST_EDGE = 224  # images keep their aspect ratio: one token per 28x28 px, a break per row


def _mistral3_config(size: ModelSize, ids: dict[str, int]) -> dict:
    return {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "torch_dtype": "float32",
        "image_token_index": ids["[IMG]"],
        "spatial_merge_size": 2,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "eos_token_id": [ids["</s>"]],
        "text_config": _text_fields(size)
        | {
            "model_type": "mistral",
            "head_dim": size.hidden_size // size.num_heads,
            "rope_theta": 1000000000.0,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
        },
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": size.vision_hidden_size,
            "head_dim": size.vision_hidden_size // size.vision_heads,
            "num_hidden_layers": size.vision_depth,
            "intermediate_size": size.vision_hidden_size * 2,
            "num_attention_heads": size.vision_heads,
            "patch_size": 14,
            "image_size": PIXTRAL_LONGEST_EDGE,
            "rope_theta": 10000.0,
        },
    }


def _mistral3_processor(size: ModelSize) -> dict[str, dict]:
    return {
        "preprocessor_config.json": {
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "PixtralProcessor",
            "patch_size": {"height": 14, "width": 14},
            "size": {"longest_edge": PIXTRAL_LONGEST_EDGE},
            "resample": 3,
        }
        | _normalised(CLIP),
        "processor_config.json": {
            "processor_class": "PixtralProcessor",
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
            "patch_size": 14,
            "spatial_merge_size": 2,
        },
    }


ONEVISION_TILE = 112  # 8x8 patches of 14 px: 64 tokens per tile, AnyRes over up to 2x2 tiles
ONEVISION_PINPOINTS = [[112, 112], [112, 224], [224, 112], [224, 224]]


def _llava_onevision_config(size: ModelSize, ids: dict[str, int]) -> dict:
    return {
        "model_type": "llava_onevision",
        "architectures": ["LlavaOnevisionForConditionalGeneration"],
        "torch_dtype": "float32",
        "image_token_index": ids["<image>"],
        "video_token_index": ids["<video>"],
        "image_grid_pinpoints": ONEVISION_PINPOINTS,
        "vision_aspect_ratio": "anyres_max_9",
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "projector_hidden_act": "gelu",
        "use_image_newline_parameter": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "text_config": _text_fields(size)
        | {"model_type": "qwen2", "rope_theta": 1000000.0, "tie_word_embeddings": True},
        "vision_config": _siglip_vision(size, "siglip_vision_model", ONEVISION_TILE) | {"vision_use_head": False},
    }


def _llava_onevision_processor(size: ModelSize) -> dict[str, dict]:
    return {
        "preprocessor_config.json": {
            "image_processor_type": "LlavaOnevisionImageProcessor",
            "processor_class": "LlavaOnevisionProcessor",
            "size": {"height": ONEVISION_TILE, "width": ONEVISION_TILE},
            "image_grid_pinpoints": ONEVISION_PINPOINTS,
            "resample": 3,
            "do_pad": True,
        }
        | _normalised(HALF),
        # frames at the tile size the tiny tower takes (real checkpoints: 384 px, as the image tiles)
        "video_preprocessor_config.json": {
            "video_processor_type": "LlavaOnevisionVideoProcessor",
            "processor_class": "LlavaOnevisionProcessor",
            "size": {"height": ONEVISION_TILE, "width": ONEVISION_TILE},
            "resample": 3,
        }
        | _normalised(HALF),
        "processor_config.json": {
            "processor_class": "LlavaOnevisionProcessor",
            "num_image_tokens": (ONEVISION_TILE // 14) ** 2,
            "vision_feature_select_strategy": "full",
            "image_token": "<image>",
            "video_token": "<video>",
        },
    }


def _llama_config(size: ModelSize, ids: dict[str, int]) -> dict:
    return _text_fields(size) | {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|eot_id|>"], ids["<|end_of_text|>"]],
    }


def _qwen3_config(size: ModelSize, ids: dict[str, int]) -> dict:
    return _text_fields(size) | {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": size.hidden_size // size.num_heads,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
    }


def _qwen3_next_config(size: ModelSize, ids: dict[str, int]) -> dict:
    """A hybrid model: gated-delta (recurrent) layers with a full-attention layer every second layer,
    and a small mixture of experts. Its recurrent state cannot be cut into blocks."""
    head_dim = size.hidden_size // size.num_heads
    return _qwen3_config(size, ids) | {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "full_attention_interval": 2,
        "partial_rotary_factor": 0.25,
        "linear_num_value_heads": size.num_heads,
        "linear_num_key_heads": size.num_kv_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": size.intermediate_size // 4,
        "shared_expert_intermediate_size": size.intermediate_size // 4,
        "norm_topk_prob": True,
    }


def _nemotron_h_config(size: ModelSize, ids: dict[str, int]) -> dict:
    """Nemotron-H: Mamba-2 layers (recurrent: a convolution window and an SSM state) with attention
    and MLP blocks between them, "M*M-" repeated; no positional encoding (the Mamba layers order)."""
    head_dim = size.hidden_size // size.num_heads
    return {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "max_position_embeddings": 32768,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": head_dim,
        "attention_bias": False,
        "mamba_num_heads": size.num_heads,
        "mamba_head_dim": head_dim,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "M", "-"] * (size.num_layers // 2),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": ids["<s>"],
        "eos_token_id": [ids["</s>"], ids["<extra_id_1>"]],
    }


def _gpt_oss_config(size: ModelSize, ids: dict[str, int]) -> dict:
    """gpt-oss: a mixture of experts whose attention alternates sliding-window and full layers, each
    head with a learned attention sink (a logit every query also attends to)."""
    return _text_fields(size) | {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "head_dim": size.hidden_size // size.num_heads,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": size.sliding_window,
        "layer_types": ["sliding_attention", "full_attention"] * (size.num_layers // 2),
        "rope_theta": 150000,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": [ids["<|return|>"], ids["<|end|>"]],
    }


def _siglip_vision(size: ModelSize, model_type: str, image_size: int) -> dict:
    """A SigLIP-style vision tower (Gemma 3, SmolVLM, LLaVA-OneVision) of 14-px patches."""
    return {
        "model_type": model_type,
        "hidden_size": size.vision_hidden_size,
        "num_hidden_layers": size.vision_depth,
        "intermediate_size": size.vision_hidden_size * 2,
        "num_attention_heads": size.vision_heads,
        "patch_size": 14,
        "image_size": image_size,
    }


CLIP = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])  # mean, std
HALF = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])


def _normalised(mean_std: tuple[list[float], list[float]]) -> dict:
    """Preprocessor fields every family here shares: RGB, resized, scaled to [0, 1], normalised."""
    mean, std = mean_std
    return {
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": mean,
        "image_std": std,
    }


def _text_fields(size: ModelSize) -> dict:
    return {
        "hidden_size": size.hidden_size,
        "num_hidden_layers": size.num_layers,
        "intermediate_size": size.intermediate_size,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 32768,
        "torch_dtype": "float32",
    }


QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_VL_TOKENS = QWEN_TOKENS + (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_ENDS = ("<|im_end|>", None, "<|endoftext|>")  # eos, bos, pad
RECIPES = {
    "qwen2_5_vl": Recipe(
        "mlx_vlm", QWEN_VL_TOKENS, *QWEN_ENDS, _qwen2_5_vl_config, _qwen_vl_processor("Qwen2_5_VLProcessor", 14, CLIP)
    ),
    "qwen3_vl": Recipe(
        "mlx_vlm", QWEN_VL_TOKENS, *QWEN_ENDS, _qwen3_vl_config, _qwen_vl_processor("Qwen3VLProcessor", 16, HALF)
    ),
    "qwen3_5": Recipe(
        "mlx_vlm",
        QWEN_VL_TOKENS,
        *QWEN_ENDS,
        _qwen3_5_config,
        _qwen_vl_processor("Qwen3VLProcessor", 16, HALF),
        mtp_layers=1,
    ),
    "qwen3_5_moe": Recipe(
        "mlx_vlm",
        QWEN_VL_TOKENS,
        *QWEN_ENDS,
        functools.partial(_qwen3_5_config, moe=True),
        _qwen_vl_processor("Qwen3VLProcessor", 16, HALF),
        mtp_layers=1,
    ),
    "gemma3": Recipe(
        "mlx_vlm",
        (
            "<pad>",
            "<eos>",
            "<bos>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ),
        "<end_of_turn>",
        "<bos>",
        "<pad>",
        _gemma3_config,
        _gemma3_processor,
    ),
    "gemma4": Recipe(
        "mlx_vlm",
        ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>")
        + ("<|audio>", "<audio|>", "<|audio|>", "<|video|>"),
        "<turn|>",
        "<bos>",
        "<pad>",
        _gemma4_config,
        _gemma4_processor,
    ),
    "smolvlm": Recipe(
        "mlx_vlm",
        ("<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>")
        + tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
        "<end_of_utterance>",
        "<|im_start|>",
        "<|endoftext|>",
        _smolvlm_config,
        _smolvlm_processor,
    ),
    "mistral3": Recipe(
        "mlx_vlm",
        (
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[IMG]",
            "[IMG_BREAK]",
            "[IMG_END]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        ),
        "</s>",
        "<s>",
        "<unk>",
        _mistral3_config,
        _mistral3_processor,
    ),
    "lfm2_vl": Recipe(
        "mlx_vlm",
        ("<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<|image_start|>", "<|image_end|>")
        + ("<|img_thumbnail|>",)
        + tuple(f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)),
        "<|im_end|>",
        "<|startoftext|>",
        "<|pad|>",
        _lfm2_vl_config,
        _lfm2_vl_processor,
    ),
    "llava_onevision": Recipe(
        "mlx_vlm", QWEN_TOKENS + ("<image>", "<video>"), *QWEN_ENDS, _llava_onevision_config, _llava_onevision_processor
    ),
    "llama": Recipe(
        "mlx_lm",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|eot_id|>",
        "<|begin_of_text|>",
        "<|end_of_text|>",
        _llama_config,
    ),
    "qwen3": Recipe("mlx_lm", QWEN_TOKENS, *QWEN_ENDS, _qwen3_config, added_tokens=("<think>", "</think>")),
    "qwen3_next": Recipe("mlx_lm", QWEN_TOKENS, *QWEN_ENDS, _qwen3_next_config, mtp_layers=1),
    "nemotron_h": Recipe(
        "mlx_lm", ("<s>", "</s>", "<extra_id_0>", "<extra_id_1>"), "</s>", "<s>", "</s>", _nemotron_h_config
    ),
    "gpt_oss": Recipe(
        "mlx_lm",
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>"),
        "<|return|>",
        None,
        "<|endoftext|>",
        _gpt_oss_config,
    ),
}
# Tokens the family's processor reads as tokenizer attributes (Gemma 3: tokenizer.boi_token ...).
NAMED_TOKENS = {
    "gemma4": {
        "boi_token": "<|image>",
        "eoi_token": "<image|>",
        "image_token": "<|image|>",
        "boa_token": "<|audio>",
        "eoa_token": "<audio|>",
        "audio_token": "<|audio|>",
        "video_token": "<|video|>",
    },
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "smolvlm": {
        "fake_image_token": "<fake_token_around_image>",
        "image_token": "<image>",
        "global_image_token": "<global-img>",
    },
}
DEFAULT_FAMILY = "qwen2_5_vl"
AGENT_SUFFIX = "agent"  # 'tiny-agent': the model ends its turns (BuildSpec.ends_turns)
AGENT_CONTEXT = 131072  # an agent session's positions (Claude Code's first prompt alone is ~16.6k tokens)


@dataclass(frozen=True, slots=True)
class BuildSpec:
    family: str = DEFAULT_FAMILY
    size: str = "tiny"
    dtype: str = "float32"
    quantize: int | None = None  # 4 or 8 bits: affine, group 64, language model only
    # The agents' test model: an output head of its own whose end-of-turn row is fitted so sampled
    # answers end after a few tokens (ends_turns.py), and AGENT_CONTEXT positions.
    ends_turns: bool = False

    def __post_init__(self):
        if self.family not in RECIPES:
            raise ValueError(f"unknown family {self.family!r}; choose one of {sorted(RECIPES)}")
        if self.size not in SIZES:
            raise ValueError(f"unknown model size {self.size!r}; choose one of {sorted(SIZES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.quantize not in (None, 4, 8):
            raise ValueError("quantize takes 4 or 8 bits")

    @property
    def name(self) -> str:
        """The folder name: strata-<size> for the default family in fp32, else with the variant."""
        parts = [] if self.family == DEFAULT_FAMILY else [self.family]
        parts.append(self.size)
        if self.dtype != "float32":
            parts.append(self.dtype)
        if self.quantize:
            parts.append(f"{self.quantize}bit")
        if self.ends_turns:
            parts.append(AGENT_SUFFIX)
        return "strata-" + "-".join(parts)


def build_model(spec: BuildSpec | str, out_dir: Path) -> Path:
    """Write a complete model folder for `spec` (a BuildSpec, or a size of the default family)."""
    spec = BuildSpec(size=spec) if isinstance(spec, str) else spec
    recipe = RECIPES[spec.family]
    out_dir = Path(out_dir)
    tmp_dir = out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    token_ids = _write_tokenizer(tmp_dir, spec.family, recipe)
    config = recipe.config(SIZES[spec.size], token_ids)
    if spec.ends_turns:
        untie(config)
        (config.get("text_config") or config)["max_position_embeddings"] = AGENT_CONTEXT
    _write_weights(config, tmp_dir, spec, recipe)
    for name, content in recipe.processor_files(SIZES[spec.size]).items():
        (tmp_dir / name).write_text(json.dumps(content, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


def builder_digest(spec: BuildSpec | str) -> str:
    """What a built model depends on: this builder, its assets, the spec, and the libraries whose
    classes and trainers write it. Equal digests build identical folders (everything is seeded)."""
    from importlib.metadata import version

    spec = BuildSpec(size=spec) if isinstance(spec, str) else spec
    digest = hashlib.sha256(f"strata-builder-v2|{spec}|".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    for asset in sorted(ASSETS.rglob("*")):
        if asset.is_file():
            digest.update(asset.name.encode() + b"\0" + asset.read_bytes())
    for package in ("mlx", "mlx-vlm", "mlx-lm", "transformers", "tokenizers"):
        digest.update(f"{package}=={version(package)}".encode())
    return digest.hexdigest()


def ensure_model(spec: BuildSpec | str, out_dir: Path) -> Path:
    """Build the model once; later calls reuse the folder (it is complete once renamed in place).
    Processes that ask for the same folder at once (parallel test workers, two servers starting) take
    turns on a lock file beside it: one builds, the others find it built."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out_dir / "config.json").exists():
            build_model(spec, out_dir)
    return out_dir


def parse_model_name(name: str) -> BuildSpec | None:
    """The embedded model a --model name stands for ('demo', 'tiny', 'gemma3-tiny', 'llama-demo', and
    the agents' 'tiny-agent', 'demo-agent'), or None."""
    base = name.removesuffix("-" + AGENT_SUFFIX)
    family, _, size = base.rpartition("-")
    if size in SIZES and (family in RECIPES or not family):
        return BuildSpec(family=family or DEFAULT_FAMILY, size=size, ends_turns=base != name)
    return None


def _token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the trained tokenizer lacks the special token {token!r}")
    return token_id


def _write_tokenizer(out_dir: Path, family: str, recipe: Recipe) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(recipe.special_tokens) - len(recipe.added_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = (ASSETS / "corpus.txt").read_text().splitlines()[1:]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.add_special_tokens(list(recipe.special_tokens))
    tokenizer.add_tokens(list(recipe.added_tokens))
    named = NAMED_TOKENS.get(family, {})
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=recipe.eos_token,
        bos_token=recipe.bos_token,
        pad_token=recipe.pad_token,
        additional_special_tokens=[
            t for t in recipe.special_tokens if t not in (recipe.eos_token, recipe.bos_token, recipe.pad_token)
        ],
        extra_special_tokens=named,
    )
    fast.chat_template = (ASSETS / "templates" / f"{family}.jinja").read_text()
    fast.save_pretrained(str(out_dir))
    (out_dir / "chat_template.jinja").write_text(fast.chat_template)
    return {t: _token_id(tokenizer, t) for t in recipe.special_tokens}


def _write_weights(config: dict, out_dir: Path, spec: BuildSpec, recipe: Recipe) -> None:
    import importlib

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map_with_path

    mx.random.seed(SEED)
    module = importlib.import_module(f"{recipe.library}.models.{spec.family}")
    model = module.Model(_library_config(module, config, recipe.library))
    model.update(tree_map_with_path(_reinit, model.parameters()))
    if spec.ends_turns:
        language_model = model.language_model if recipe.library == "mlx_vlm" else model
        favour_end_of_turn(language_model, out_dir, recipe.eos_token, CORPUS)
    if spec.dtype != "float32":
        dtype = getattr(mx, spec.dtype)
        model.update(tree_map_with_path(lambda path, p: p.astype(dtype), model.parameters()))
    config["torch_dtype"] = spec.dtype
    if spec.quantize:
        quantized = model.language_model if recipe.library == "mlx_vlm" else model
        nn.quantize(
            quantized,
            group_size=QUANT_GROUP_SIZE,
            bits=spec.quantize,
            class_predicate=lambda path, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % QUANT_GROUP_SIZE == 0,
        )
        config["quantization"] = {"group_size": QUANT_GROUP_SIZE, "bits": spec.quantize}
    if recipe.mtp_layers:
        _write_mtp(config, out_dir, spec, recipe.mtp_layers)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})


def _write_mtp(config: dict, out_dir: Path, spec: BuildSpec, num_layers: int) -> None:
    """The MTP layers in `mtp.safetensors`, in mlx-vlm's drafter layout (`mtp.` + its parameter
    names), built by mlx-vlm's own splitter and drafter classes. A file of its own: mlx-lm loads
    `model*.safetensors` only and would refuse the extra keys; mlx-vlm drops `mtp.*` itself. The
    config gains `mtp_num_hidden_layers`, as the real checkpoints have it. Never quantised."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter
    from mlx_vlm.utils import get_model_and_args

    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = num_layers
    splitter = get_mtp_splitter(source_config=config)
    assert splitter is not None, f"mlx-vlm has no MTP drafter for {spec.family}"
    draft_config = {"model_type": splitter.output_model_type, "text_config": splitter.read_text_config(config)}
    arch, _ = get_model_and_args(draft_config)
    drafter = arch.Model(arch.ModelConfig.from_dict(draft_config))
    params = tree_map_with_path(_reinit, drafter.parameters())
    if spec.dtype != "float32":
        params = tree_map_with_path(lambda path, p: p.astype(getattr(mx, spec.dtype)), params)
    weights: dict[str, mx.array] = {f"mtp.{key}": value for key, value in dict(tree_flatten(params)).items()}
    mx.save_safetensors(str(out_dir / "mtp.safetensors"), weights, metadata={"format": "mlx"})


def _library_config(module, config: dict, library: str):
    """The library's own config object for a config.json dict, built as its loader builds it."""
    if library == "mlx_lm":
        return module.ModelArgs.from_dict(dict(config))
    model_config = module.ModelConfig.from_dict(dict(config))
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = module.TextConfig.from_dict(config.get("text_config") or dict(config))
    return model_config


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
