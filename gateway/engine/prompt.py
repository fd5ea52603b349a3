"""Turn validated messages and decoded images into the token ids and image inputs the model runs on.

Pure CPU work (tokenizer and numpy image processor): it runs in a thread pool, not on the engine's
MLX worker, so bad or oversized prompts are rejected before they queue.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import numpy as np

from vision import DecodedImage, PixelHash

from .types import ImagePart, Message


@dataclass(frozen=True, slots=True)
class PromptImage:
    pixel_hash: PixelHash
    pixel_values: np.ndarray  # (num_patches, patch_dim) float32, as the vision tower takes it
    grid_thw: tuple[int, int, int]
    token_start: int  # index of the image's first <|image_pad|> token in token_ids
    num_tokens: int


class PromptError(ValueError):
    """Input the model cannot take (an image its processor refuses). `code` is a stable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# Client text is bracketed by these private-use code points while the chat template renders, so that
# special tokens can be told apart by origin afterwards; clients' own copies of them are removed.
CLIENT_START, CLIENT_END = "\ue000", "\ue001"
_MARKERS = re.compile("([\ue000\ue001])")  # captured: _unmark splits on them and keeps which one
ZERO_WIDTH_SPACE = "\u200b"


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
        # Every added token is matched by the tokenizer wherever its text appears, special or not.
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        self.control_tokens = tuple(sorted({t.content for t in added.values() if len(t.content) > 1}
                                           | {t for t in self.tokenizer.all_special_tokens if len(t) > 1}))
        # A token decodes to at most this many bytes, so a text of n bytes is at least n / this tokens
        # (vocabulary strings are at least as long in UTF-8 as the bytes they stand for).
        self.max_token_bytes = max(len(t.encode("utf-8")) for t in self.tokenizer.get_vocab())

    def build(self, messages: tuple[Message, ...], images: list[DecodedImage]) -> PreparedPrompt:
        marked = self.tokenizer.apply_chat_template(
            [self._template_message(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        ids = self.tokenizer.encode(self._neutralise(marked), add_special_tokens=False)
        processed = [self._process_image(image) for image in images]
        return self._expand_image_tokens(ids, processed)

    def _template_message(self, message: Message) -> dict:
        role = "system" if message.role == "developer" else message.role
        parts = [
            {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": _mark_client_text(p.text)}
            for p in message.parts
        ]
        if len(parts) == 1 and parts[0]["type"] == "text":
            return {"role": role, "content": parts[0]["text"]}
        return {"role": role, "content": parts}

    def _neutralise(self, marked: str) -> str:
        """The rendered prompt without markers, where every control token that contains any client
        character is broken by a zero-width space: one part ending '<|im_' and the next starting
        'start|>' no longer make a control token once the template joins them."""
        text, spans = _unmark(marked)
        starts = [start for start, _ in spans]
        cuts = set()
        for token in self.control_tokens:
            at = text.find(token)
            while at >= 0:
                if _overlaps(spans, starts, at, at + len(token)):
                    cuts.add(at + 1)
                at = text.find(token, at + 1)
        if not cuts:
            return text
        pieces, previous = [], 0
        for cut in sorted(cuts):
            pieces += [text[previous:cut], ZERO_WIDTH_SPACE]
            previous = cut
        return "".join(pieces) + text[previous:]

    def _process_image(self, image: DecodedImage) -> tuple[PixelHash, np.ndarray, tuple[int, int, int]]:
        try:
            out = self.image_processor([np.asarray(image.image).transpose(2, 0, 1)])
        except ValueError as exc:  # e.g. Qwen's resize: "absolute aspect ratio must be smaller than 200"
            raise PromptError("invalid_image", f"the model cannot take a {image.width}x{image.height} image: {exc}") from None
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


def _mark_client_text(text: str) -> str:
    """Markers go inside the text's outer whitespace, so a template that trims content trims alike."""
    text = _MARKERS.sub("", text)
    core = text.strip()
    if not core:
        return text
    start = text.index(core[0])
    return text[:start] + CLIENT_START + core + CLIENT_END + text[start + len(core):]


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without markers, and the [start, end) spans of client text in it, in order."""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    length, start = 0, None
    for piece in _MARKERS.split(marked):
        if piece == CLIENT_START:
            start = length
        elif piece == CLIENT_END:
            spans.append((start, length))
        else:
            pieces.append(piece)
            length += len(piece)
    return "".join(pieces), spans


def _overlaps(spans: list[tuple[int, int]], starts: list[int], begin: int, end: int) -> bool:
    """Whether [begin, end) shares a character with a span (spans are sorted and disjoint)."""
    i = max(bisect.bisect_right(starts, begin) - 1, 0)  # the last span starting at or before begin
    while i < len(spans) and spans[i][0] < end:
        if spans[i][1] > begin:
            return True
        i += 1
    return False
