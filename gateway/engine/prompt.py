"""Turn validated messages and decoded images into the token ids and image inputs the model runs on.

Pure CPU work (tokenizer and numpy image processor): it runs in a thread pool, not on the engine's
MLX worker, so bad or oversized prompts are rejected before they queue.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from vision import DecodedImage, DecodedVideo, PixelHash

from .families import Family
from .system_turns import SystemPlacement, SystemTurns
from .tools import ToolFormat, call_spec
from .types import ImagePart, Message, Switches, Tool


@dataclass(frozen=True, slots=True)
class PromptImage:
    pixel_hash: PixelHash
    # What the family's processor made of the image, as the model's get_input_embeddings takes it:
    # pixel_values plus the family's metadata (image_grid_thw, pixel_attention_mask, image_sizes...).
    inputs: dict[str, np.ndarray]
    token_ids: tuple[int, ...]  # the image's expansion: placeholders and the family's markers around them
    token_start: int  # index of the expansion's first token in the prompt's token_ids
    num_slot_tokens: int = 1  # the template's tokens it replaces: its placeholder (and a video's markers)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_video(self) -> bool:
        return "pixel_values_videos" in self.inputs

    @property
    def grid_thw(self) -> tuple[int, int, int] | None:
        """The Qwen VL line's (temporal, height, width) patch grid; None for other families."""
        grid = self.inputs.get("video_grid_thw" if self.is_video else "image_grid_thw")
        if grid is None:
            return None
        temporal, height, width = (int(v) for v in grid[0])
        return temporal, height, width


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
    messages: tuple[Message, ...] = ()  # what it was built from (to say which message a token is in)
    tools: tuple[Tool, ...] = ()
    switches: Switches = Switches()  # the template's thinking and effort switches it was rendered with
    public_tokens: int = 0  # its first tokens are exactly a declared public text (shared across tenants)
    system: SystemPlacement = SystemPlacement()  # how its later system messages were rendered

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


LINE_WINDOW_TOKENS = 128  # tokens decoded on each side of a diverging token to find its line
PREFIX_COUNTS = 256  # breakpoint prefixes whose token counts are kept (Claude Code's first one: ~17 ms to count)


class PromptBuilder:
    """Chat template + tokenizer + image processor of one model."""

    def __init__(self, processor, family: Family):
        self.processor = processor
        self.tokenizer = _hf_tokenizer(processor)
        self.placeholder = family.image_placeholder
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_format = ToolFormat(template)
        # The template's own switches: Qwen3's enable_thinking, gpt-oss's reasoning_effort.
        self.switch_names = frozenset(name for name in (THINKING, EFFORT) if name in str(template or ""))
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.placeholder) if self.placeholder else None
        self.video_placeholder = family.video_placeholder
        self.video_placeholder_id = (
            self.tokenizer.convert_tokens_to_ids(self.video_placeholder) if self.video_placeholder else None
        )
        self.video_markers = family.video_markers
        self.video_marker_ids = (
            tuple(self.tokenizer.convert_tokens_to_ids(m) for m in family.video_markers)
            if family.video_markers
            else None
        )
        # Processors tokenise with the tokenizer's defaults (some cannot be told otherwise): the tokens it
        # adds around a lone placeholder (a BOS, say) are cut from each image's expansion.
        alone = self.tokenizer.encode(self.placeholder) if self.placeholder else []
        self.added_before = alone.index(self.placeholder_id) if self.placeholder else 0
        self.added_after = len(alone) - self.added_before - 1 if self.placeholder else 0
        # Every added token is matched by the tokenizer wherever its text appears, special or not.
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        self.control_tokens = tuple(
            sorted(
                {t.content for t in added.values() if len(t.content) > 1}
                | {t for t in self.tokenizer.all_special_tokens if len(t) > 1}
            )
        )
        self.system_turns = SystemTurns(self._render_plain)
        # Breakpoints' token counts, by (scope, messages, tools, switches): each recurs every turn.
        self._prefix_tokens = functools.lru_cache(maxsize=PREFIX_COUNTS)(self._count_prefix)
        # A token decodes to at most this many bytes, so a text of n bytes is at least n / this tokens
        # (vocabulary strings are at least as long in UTF-8 as the bytes they stand for).
        self.max_token_bytes = max(len(t.encode("utf-8")) for t in self.tokenizer.get_vocab())

    def build(
        self,
        messages: tuple[Message, ...],
        images: Sequence[DecodedImage | DecodedVideo],
        tools: tuple[Tool, ...] = (),
        switches: Switches = Switches(),
    ) -> PreparedPrompt:
        """`images`: the decoded image and video parts, in order. `switches`: what the request asks of
        the template's thinking and effort switches (unused_switches says which this template lacks)."""
        if images and self.placeholder is None:
            raise PromptError("images_unsupported", "this model is a text model: it does not take images")
        if self.video_placeholder is None and any(isinstance(item, DecodedVideo) for item in images):
            raise PromptError("videos_unsupported", "this model's processor does not take videos")
        marked, placement = self._render(messages, tools, switches, generation=True)
        ids = self.tokenizer.encode(self._neutralise(marked), add_special_tokens=False)
        processed = [
            self.process_video(item) if isinstance(item, DecodedVideo) else self.process_image(item) for item in images
        ]
        prompt = self._expand_image_tokens(ids, processed)
        return replace(prompt, messages=messages, tools=tools, switches=switches, system=placement)

    def unused_switches(self, switches: Switches) -> list[str]:
        """What a request asked of the template's switches that this model's template has none for."""
        unused = ["thinking"] if switches.thinking is not None and THINKING not in self.switch_names else []
        if switches.effort is not None and not self.switch_names:
            unused.append("effort")
        return unused

    def _switch_options(self, switches: Switches) -> dict:
        """The template variables for the request's switches: the effort level where the template has
        one, else its thinking switch (effort none or minimal turns thinking off)."""
        options: dict = {}
        thinking = switches.thinking
        if switches.effort is not None and EFFORT in self.switch_names:
            options[EFFORT] = EFFORT_LEVELS[switches.effort]
        elif switches.effort is not None and thinking is None:
            thinking = switches.effort not in ("none", "minimal")
        if thinking is not None and THINKING in self.switch_names:
            options[THINKING] = thinking
        return options

    def _render(
        self, messages: tuple[Message, ...], tools: tuple[Tool, ...], switches: Switches, generation: bool
    ) -> tuple[str, SystemPlacement]:
        """The template's text of the conversation (client text marked), later system messages
        placed as the template can take them."""
        rendered, specs = self.tool_format.template_messages(
            [self._template_message(m) for m in messages], tuple(_marked_tool(tool) for tool in tools)
        )
        rendered, placement = self.system_turns.fit(rendered)
        extra = ({"tools": specs} if specs else {}) | self._switch_options(switches)
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=generation, **extra)
        return text, placement

    def _render_plain(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def message_at(self, prompt: PreparedPrompt, token: int) -> int | None:
        """The index of the message that holds the prompt's `token` (len(messages): the generation
        prompt after them); None when the template cannot render part of the conversation alone.
        Renders about log2(messages) prefixes of it: meant for the rare question, not every request."""
        try:
            low, high = 1, len(prompt.messages)
            while low < high:  # the fewest leading messages whose tokens reach past `token`
                middle = (low + high) // 2
                if self._num_tokens_through(prompt, middle) > token:
                    high = middle
                else:
                    low = middle + 1
            if not prompt.messages or self._num_tokens_through(prompt, low) <= token:
                return len(prompt.messages)
            return low - 1
        except Exception:  # noqa: BLE001 - a template that refuses a partial conversation (role order checks)
            return None

    def line_at(self, prompt: PreparedPrompt, token: int, width: int = 40) -> str:
        """The first `width` characters of the prompt's line that holds `token` (decoded from up to
        LINE_WINDOW_TOKENS around it: a longer line shows from where the window starts)."""
        before = self.tokenizer.decode(list(prompt.token_ids[max(0, token - LINE_WINDOW_TOKENS) : token]))
        after = self.tokenizer.decode(list(prompt.token_ids[token : token + LINE_WINDOW_TOKENS]))
        return (before.rsplit("\n", 1)[-1] + after.split("\n", 1)[0])[:width]

    def tokens_through(self, prompt: PreparedPrompt, count: int, scope: bytes) -> int | None:
        """How many of the prompt's tokens its first `count` messages make (0: the tools and system
        header alone, where the template renders them first); None when the template cannot render
        that part alone. For the prefixes a client asks to keep (cache breakpoints): they recur turn
        after turn, so their counts are kept per `scope` (the tenant's salt: no tenant's timing shows
        that another sent the same prefix)."""
        try:
            return min(self._num_tokens_through(prompt, count, scope), prompt.num_tokens)
        except Exception:  # noqa: BLE001 - a template that refuses a partial conversation (role order checks)
            return None

    def _num_tokens_through(self, prompt: PreparedPrompt, count: int, scope: bytes | None = None) -> int:
        """Tokens of the first `count` messages rendered alone, images expanded as in the prompt
        (counted again unless a `scope` keeps them)."""
        messages = prompt.messages[:count]
        count_text = self._prefix_tokens if scope is not None else self._count_prefix
        num_images = sum(isinstance(part, ImagePart) for m in messages for part in m.parts)
        expansion = sum(image.num_tokens - image.num_slot_tokens for image in prompt.images[:num_images])
        return count_text(scope, messages, prompt.tools, prompt.switches) + expansion

    def _count_prefix(
        self, scope: bytes | None, messages: tuple[Message, ...], tools: tuple[Tool, ...], switches: Switches
    ) -> int:
        marked, _ = self._render(messages, tools, switches, generation=False)
        return len(self.tokenizer.encode(self._neutralise(marked), add_special_tokens=False))

    def _template_message(self, message: Message) -> dict:
        role = "system" if message.role == "developer" else message.role
        parts = [
            {"type": "video" if p.video else "image"}
            if isinstance(p, ImagePart)
            else {"type": "text", "text": _mark_client_text(p.text)}
            for p in message.parts
        ]
        rendered = {"role": role, "content": parts}
        if len(parts) == 1 and parts[0]["type"] == "text":
            rendered["content"] = parts[0]["text"]
        if message.reasoning:  # an earlier answer's thinking: templates that render it read this key
            rendered["reasoning_content"] = _mark_client_text(message.reasoning)
        if message.tool_calls:
            rendered["tool_calls"] = [
                call_spec(
                    replace(
                        call,
                        id=_mark_client_text(call.id),
                        name=_mark_client_text(call.name),
                        arguments=_marked_json(call.arguments),
                    )
                )
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = _mark_client_text(message.tool_call_id)
        return rendered

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

    def process_image(self, image: DecodedImage) -> PromptImage:
        """The image through the family's own processor: its token expansion and pixel inputs
        (token_start is filled in when the expansion takes its place in the prompt)."""
        # the processor refuses some images, e.g. Qwen's "absolute aspect ratio must be smaller than
        # 200", Pixtral's "height and width must be > 0"
        refused = f"the model cannot take a {image.width}x{image.height} image"
        return self._processed(
            image.pixel_hash, str(self.placeholder), {"images": [image.image]}, "invalid_image", refused
        )

    def process_video(self, video: DecodedVideo) -> PromptImage:
        """The video's sampled frames through the family's own video processor: its token expansion
        (frames merged in pairs by the Qwen VL line; with the family's markers around the placeholder,
        which Qwen3-VL repeats per pair after a timestamp) and pixel inputs, keyed by the frames' pixels."""
        start, end = self.video_markers or ("", "")
        frames = [np.asarray(frame) for frame in video.frames]
        refused = f"the model cannot take a {video.width}x{video.height} video"
        text = start + str(self.video_placeholder) + end
        processed = self._processed(video.pixel_hash, text, {"videos": [frames]}, "invalid_video", refused)
        return replace(processed, num_slot_tokens=3 if self.video_markers else 1)

    def _processed(self, key: PixelHash, text: str, visual: dict, code: str, refused: str) -> PromptImage:
        """`text` (a placeholder, with its markers) and the pixels through the family's processor."""
        try:
            out = self.processor(text=[text], **visual, return_tensors="np")
        except Exception as exc:  # noqa: BLE001 - library code refusing a client's pixels, whatever it raises
            raise PromptError(code, f"{refused}: {exc}") from None
        ids = [int(t) for t in out["input_ids"][0]]
        inputs = {k: np.asarray(v) for k, v in out.items() if k not in _TEXT_OUTPUTS}
        return PromptImage(key, inputs, tuple(ids[self.added_before : len(ids) - self.added_after]), 0)

    def _expand_image_tokens(self, ids: list[int], processed: list[PromptImage]) -> PreparedPrompt:
        """Each image or video slot of the rendered template replaced by its expansion, in order."""
        placeholders = {self.placeholder_id, self.video_placeholder_id} - {None}
        slots = [i for i, tok in enumerate(ids) if tok in placeholders]
        if len(slots) != len(processed):
            raise ValueError(f"template produced {len(slots)} image slots for {len(processed)} images")
        if any((ids[slot] == self.video_placeholder_id) != item.is_video for slot, item in zip(slots, processed)):
            raise ValueError("the template's image and video slots are not in the parts' order")
        out: list[int] = []
        images: list[PromptImage] = []
        previous = 0
        for slot, image in zip(slots, processed):
            first = slot - (image.num_slot_tokens > 1)  # a video's markers go with its placeholder
            if image.num_slot_tokens > 1 and (ids[first], ids[slot + 1]) != self.video_marker_ids:
                raise ValueError("the template's video placeholder is not between the family's video markers")
            out.extend(ids[previous:first])
            images.append(replace(image, token_start=len(out)))
            out.extend(image.token_ids)
            previous = first + image.num_slot_tokens
        out.extend(ids[previous:])
        return PreparedPrompt(tuple(out), tuple(images))


# Processor outputs about the text, not the image: the prompt's own ids replace them.
_TEXT_OUTPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


# The template variables a request's switches set, by the names chat templates give them, and the
# effort levels harmony templates (gpt-oss) know for each effort a client may ask.
THINKING, EFFORT = "enable_thinking", "reasoning_effort"
EFFORT_LEVELS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium"} | dict.fromkeys(
    ("high", "xhigh", "max"), "high"
)


def _hf_tokenizer(processor):
    """A processor's tokenizer (mlx-vlm), or the tokenizer itself (mlx-lm's TokenizerWrapper, which
    forwards the Hugging Face tokenizer's methods)."""
    return getattr(processor, "tokenizer", processor)


def _mark_client_text(text: str) -> str:
    """Markers go inside the text's outer whitespace, so a template that trims content trims alike."""
    text = _MARKERS.sub("", text)
    core = text.strip()
    if not core:
        return text
    start = text.index(core[0])
    return text[:start] + CLIENT_START + core + CLIENT_END + text[start + len(core) :]


# JSON-schema keywords stay unmarked (templates may look them up); every other key and string is client text.
SCHEMA_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "items",
        "enum",
        "description",
        "additionalProperties",
        "anyOf",
        "oneOf",
        "allOf",
        "default",
        "const",
        "format",
        "title",
        "$defs",
        "$ref",
        "minimum",
        "maximum",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
    }
)


def _marked(value):
    """Every string in a JSON value marked as client text, keys too (but schema keywords)."""
    if isinstance(value, str):
        return _mark_client_text(value)
    if isinstance(value, list):
        return [_marked(item) for item in value]
    if isinstance(value, dict):
        return {key if key in SCHEMA_KEYWORDS else _mark_client_text(key): _marked(item) for key, item in value.items()}
    return value


def _marked_json(text: str) -> str:
    try:
        return json.dumps(_marked(json.loads(text)), ensure_ascii=False)
    except ValueError:
        return _mark_client_text(text)


def _marked_tool(tool: Tool) -> Tool:
    return Tool(_mark_client_text(tool.name), _mark_client_text(tool.description), _marked_json(tool.parameters))


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without markers, and the [start, end) spans of client text in it, in order."""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    length, start = 0, None
    for piece in _MARKERS.split(marked):
        if piece == CLIENT_START:
            start = length
        elif piece == CLIENT_END:
            assert start is not None, "the markers come in pairs, start first"
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
