"""The model's own drafter: the multi-token-prediction (MTP) layers some checkpoints ship beside the
model (Qwen3.5 and Qwen3-Next: `mtp.*`, one decoder layer). From the model's last hidden state at a
position and the embedding of the token that follows it, the layer predicts the token after that;
fed its own output, it predicts on. mlx-vlm's splitter finds and loads the layers (its drafter class
holds them); the engine runs them per row, on a KV cache of the row's own (ModelHeads).

A row's MTP cache holds one entry per position the row decoded since its heads started following
it, each made from the model's own hidden state (exact, as the checkpoints were trained); the draft
steps' entries are dropped at the next step. Prompt positions have none: a prefix-cache hit never
computed their hidden states."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import mlx.core as mx

log = logging.getLogger("strata.engine")


def load_heads(model_path: Path, model) -> object | None:
    """The checkpoint's MTP drafter (mlx-vlm's class, bound to the model's embedding and output
    head), or None when the folder has no MTP layers or mlx-vlm has no drafter for the family."""
    from mlx_vlm.speculative.drafters.mtp_split import detect_mtp_splitter

    try:
        splitter = detect_mtp_splitter(model_path)
    except Exception as exc:  # noqa: BLE001 - a folder mlx-vlm cannot read for MTP simply has none
        log.warning("the checkpoint's MTP layers cannot be read (%s): no drafts from them", exc)
        return None
    if splitter is None:
        return None
    drafter = splitter.load(model_path)
    mx.eval(drafter.parameters())
    return drafter.bind(model)


class ModelHeads:
    """A row's proposer from the model's MTP layers. follow() feeds it each step's verified
    positions (the model's hidden states there and the tokens taken after them); propose() then
    drafts from the last one. Its cache holds the followed positions, then the last draft's steps
    (`num_speculative` entries, dropped before the next follow or draft)."""

    name = "mtp"
    # a trained head's first drafts are mostly kept (~0.8 reported for Qwen3-Next's; a hybrid row's
    # rejection costs a replay, so a first rate much below this would never let a row try)
    first_rate = 0.8

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.cache: list = drafter.make_cache()
        self.num_speculative = 0
        self.position = 0  # the next followed position
        self.length = -1  # len(generated) the seed follows; -1: nothing followed since the last reset
        self.seed_token = 0  # the heads' guess of the next token
        self.seed_hidden: mx.array | None = None  # (1, 1, hidden) the heads' output it came from

    def reset(self) -> None:
        """Forget every position (a step went unfollowed): the next follow starts a new cache."""
        self.cache = self.drafter.make_cache()
        self.num_speculative, self.length, self.seed_hidden = 0, -1, None

    def follow(self, hidden: mx.array, tokens: Sequence[int], position: int, length: int) -> None:
        """The step's verified positions: `hidden` (n, hidden) the model's pre-norm hidden states at
        the n positions from `position` on, `tokens` the n tokens taken after them; `length` is then
        len(generated)."""
        self._drop_speculative()
        if self.length >= 0 and position != self.position:
            self.reset()
        ids = mx.array([list(tokens)], dtype=mx.int32)
        out = self._forward(ids, hidden[None], position)
        self.position, self.length = position + len(tokens), length
        self.seed_hidden = out[:, -1:]
        token = mx.argmax(self._logits(self.seed_hidden), axis=-1)
        mx.eval(token, [state for layer in self.cache for state in layer.state])
        self.seed_token = _int(token)

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        self._drop_speculative()
        if self.seed_hidden is None or len(generated) != self.length or k < 1:
            return []
        tokens, hidden = [self.seed_token], self.seed_hidden
        while len(tokens) < k:
            hidden = self._forward(mx.array([[tokens[-1]]], dtype=mx.int32), hidden, self.position + len(tokens) - 1)
            self.num_speculative += 1
            tokens.append(_int(mx.argmax(self._logits(hidden), axis=-1)))
        return tokens

    def _forward(self, ids: mx.array, hidden: mx.array, position: int) -> mx.array:
        drafter = self.drafter
        embeds = drafter._input_embed(ids) * drafter._input_embed_scale
        positions = mx.arange(position, position + ids.shape[1], dtype=mx.int32)[None]
        return drafter._forward_hidden(embeds, hidden.astype(embeds.dtype), self.cache, positions)

    def _logits(self, hidden: mx.array) -> mx.array:
        return self.drafter._lm_head_fn(hidden.reshape(-1, hidden.shape[-1]))[-1]

    def _drop_speculative(self) -> None:
        if self.num_speculative:
            for layer in self.cache:
                layer.trim(self.num_speculative)
            self.num_speculative = 0


def _int(token: mx.array) -> int:
    return int(cast(int, token.item()))
