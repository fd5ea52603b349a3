"""Incremental detokenisation with stop sequences.

Invariant: `emitted` is always a prefix of the final text, and `settled_text` never changes once
set. Text that could still become a stop sequence, or that ends in an incomplete UTF-8 sequence, is
held back until it is decided; bytes that no later token can complete (a random model's stray
bytes) are settled as U+FFFD after PENDING_TOKENS tokens instead of holding the stream back.
"""

from __future__ import annotations

# Tokens re-decoded together on every push: byte-level BPE decodes piecewise (a character's bytes may
# span tokens), so a window is settled only once it decodes to whole characters.
DECODE_WINDOW_TOKENS = 32
# A UTF-8 character is at most 4 bytes and a token carries at least one: only the last 4 tokens can
# still complete the text's last character. Measured before this bound: the tiny random-init model
# streamed runs of 68 stray bytes, and the stream sent nothing for 0.34 s while the model decoded them.
PENDING_TOKENS = 4


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.settled_text = ""  # decoded text of the tokens before `window`: no later token changes it
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
        self.text = self.settled_text + self._decode(self.window)
        incomplete = self.text.endswith("\ufffd")  # the last character may still be completed
        if incomplete:
            self._settle_stray_bytes()
        elif len(self.window) >= DECODE_WINDOW_TOKENS:
            self.settled_text, self.window = self.text, []
        cut = self._stop_position()
        if cut is not None:
            self.stopped = True
            return self._emit_until(cut)
        end = len(self.text) - self.hold
        if incomplete:  # only the settled text is final
            end = min(end, len(self.settled_text))
        return self._emit_until(max(self.emitted, end))

    def finish(self) -> str:
        """The held-back tail, once generation ended without a stop sequence."""
        if self.stopped:
            return ""
        return self._emit_until(len(self.text.rstrip("\ufffd")))

    def _settle_stray_bytes(self) -> None:
        """Settle all but the window's last PENDING_TOKENS tokens, when the two parts decode apart to
        exactly the text they make together (so no character spans the cut and the text is unchanged)."""
        if len(self.window) <= PENDING_TOKENS:
            return
        head = self._decode(self.window[:-PENDING_TOKENS])
        if self.settled_text + head + self._decode(self.window[-PENDING_TOKENS:]) == self.text:
            self.settled_text += head
            self.window = self.window[-PENDING_TOKENS:]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

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
