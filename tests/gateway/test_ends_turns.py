"""The agents' test model (gateway/checkpoints/ends_turns.py): an answer's first token shows text.

A token that shows nothing on its own (whitespace, a lone byte of a longer character) as a whole
answer left a coding agent's turn without an answer (opencode, one fresh-clone run of the agents'
acceptance tests). Its head row is a share of the end-of-turn row, so, like the end of the turn, it
is seldom an answer's first token: the probability the model gives all of them at the first answer
position is checked here on the real built model, against what the unchanged random rows gave.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gateway.checkpoints import BuildSpec
from gateway.checkpoints.ends_turns import INVISIBLE_SHARE, _invisible
from gateway.engine import CacheConfig, Message, ModelRunner, TextPart
from tests.conftest import built_model

PROMPTS = ("What does hello.py print?", "And what would it print twice?", "Thank you. One more idea?")


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(built_model(BuildSpec(size="tiny", ends_turns=True)), CacheConfig(0, 0, 64), "ends-turns")


def _first_position_probabilities(runner, text: str) -> np.ndarray:
    prompt = runner.prompts.build((Message("user", (TextPart(text),)),), [])
    logits = runner.prefill(prompt, b"salt", 64, lambda: False).logits.astype(mx.float32)
    return np.array(mx.softmax(logits.reshape(-1), axis=-1))


def test_tokens_that_show_no_text_are_seldom_an_answers_first_token(runner):
    tokenizer = runner.tokenizer
    head = np.array(runner.lm.lm_head.weight.astype(mx.float32))
    invisible = _invisible(tokenizer, head.shape[0])
    end_row = head[tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert invisible.sum() >= 10  # whitespace and lone bytes of this byte-level vocabulary
    assert "a" not in [tokenizer.decode([t]).strip() for t in np.flatnonzero(invisible)]
    np.testing.assert_allclose(head[invisible], np.tile(INVISIBLE_SHARE * end_row, (invisible.sum(), 1)), atol=1e-6)
    for text in PROMPTS:
        first = _first_position_probabilities(runner, text)
        uniform_share = invisible.sum() / len(first)  # what rows like every other token's would get
        assert first[invisible].sum() < uniform_share / 4, (text, first[invisible].sum(), uniform_share)
