"""Incremental detokenisation with stop sequences.

Invariant: `emitted` is always a prefix of the final text. Text that could still become a stop
sequence, or that ends in an incomplete UTF-8 sequence, is held back until it is decided.
"""

from __future__ import annotations

# Tokens re-decoded together on every push: byte-level BPE decodes piecewise (a character's bytes may
# span tokens), so a window is settled only once it decodes to whole characters.
DECODE_WINDOW_TOKENS = 32


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.settled_text = ""  # decoded text of tokens before `window`; ends on a whole character
        self.window: list[int] = []
        self.num_tokens = 0
        self.emitted = 0
        self.text = ""
        self.stopped = False
        self.matched_stop: str | None = None  # the stop sequence that ended the text (the first in the text)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly decided text (maybe empty). Sets `stopped` on a stop hit."""
        self.num_tokens += 1
        self.window.append(token_id)
        self.text = self.settled_text + self.tokenizer.decode(self.window, skip_special_tokens=True)
        if len(self.window) >= DECODE_WINDOW_TOKENS and not self.text.endswith("\ufffd"):
            self.settled_text, self.window = self.text, []
        cut = self._stop_position()
        if cut is not None:
            self.stopped = True
            return self._emit_until(cut)
        if self.text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        return self._emit_until(max(self.emitted, len(self.text) - self.hold))

    def finish(self) -> str:
        """The held-back tail, once generation ended without a stop sequence."""
        if self.stopped:
            return ""
        return self._emit_until(len(self.text.rstrip("\ufffd")))

    def _stop_position(self) -> int | None:
        window_start = max(0, self.emitted - self.hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        if not hits:
            return None
        position, self.matched_stop = min(hits, key=lambda hit: hit[0])
        return position

    def _emit_until(self, end: int) -> str:
        chunk = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return chunk
