"""Turn validated messages and decoded images into the token ids and image inputs the model runs on.

Pure CPU work (tokenizer and numpy image processor): it runs in a thread pool, not on the engine's
MLX worker, so bad or oversized prompts are rejected before they queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vision import DecodedImage, PixelHash

from ..schemas import ImagePart, Message


@dataclass(frozen=True, slots=True)
class PromptImage:
    pixel_hash: PixelHash
    pixel_values: np.ndarray  # (num_patches, patch_dim) float32, as the vision tower takes it
    grid_thw: tuple[int, int, int]
    token_start: int  # index of the image's first <|image_pad|> token in token_ids
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: tuple[int, ...]
    images: tuple[PromptImage, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class PromptBuilder:
    """Chat template + tokenizer + image processor of one model."""

    def __init__(self, processor, image_token_id: int):
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.merge_size = int(getattr(self.image_processor, "merge_size", 2))
        self.image_token_id = image_token_id
        self.special_tokens = tuple(t for t in self.tokenizer.all_special_tokens if t.startswith("<|"))

    def build(self, messages: tuple[Message, ...], images: list[DecodedImage]) -> PreparedPrompt:
        text = self.tokenizer.apply_chat_template(
            [self._template_message(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        processed = [self._process_image(image) for image in images]
        return self._expand_image_tokens(ids, processed)

    def count_text_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _template_message(self, message: Message) -> dict:
        role = "system" if message.role == "developer" else message.role
        parts = [
            {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": self._neutralise(p.text)}
            for p in message.parts
        ]
        if len(parts) == 1 and parts[0]["type"] == "text":
            return {"role": role, "content": parts[0]["text"]}
        return {"role": role, "content": parts}

    def _neutralise(self, text: str) -> str:
        """Client text must never inject control tokens (<|im_start|>, <|image_pad|>, ...)."""
        for token in self.special_tokens:
            if token in text:
                text = text.replace(token, token.replace("<|", "<\u200b|"))
        return text

    def _process_image(self, image: DecodedImage) -> tuple[PixelHash, np.ndarray, tuple[int, int, int]]:
        out = self.image_processor([np.asarray(image.image).transpose(2, 0, 1)])
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return image.pixel_hash, np.asarray(out["pixel_values"], dtype=np.float32), (t, h, w)

    def _expand_image_tokens(self, ids: list[int], processed: list) -> PreparedPrompt:
        slots = [i for i, tok in enumerate(ids) if tok == self.image_token_id]
        if len(slots) != len(processed):
            raise ValueError(f"template produced {len(slots)} image slots for {len(processed)} images")
        out: list[int] = []
        images: list[PromptImage] = []
        previous = 0
        for slot, (digest, pixels, grid) in zip(slots, processed):
            out.extend(ids[previous:slot])
            count = grid[0] * grid[1] * grid[2] // (self.merge_size**2)
            images.append(PromptImage(digest, pixels, grid, len(out), count))
            out.extend([self.image_token_id] * count)
            previous = slot + 1
        out.extend(ids[previous:])
        return PreparedPrompt(tuple(out), tuple(images))
