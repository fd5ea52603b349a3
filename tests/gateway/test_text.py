"""TextStream: incremental detokenisation and stop sequences on the real tiny tokenizer."""

import random

from gateway.engine.text import TextStream


def _ids(engine, text):
    return engine.runner.tokenizer.encode(text, add_special_tokens=False)


def test_streamed_pieces_join_to_the_decoded_text(engine):
    text = "The river flows south, past 12 old mills and a café. " * 5
    stream = TextStream(engine.runner.tokenizer, ())
    pieces = [stream.push(i) for i in _ids(engine, text)] + [stream.finish()]
    assert "".join(pieces) == text
    assert stream.num_tokens == len(_ids(engine, text))


def test_stop_sequence_cuts_before_it_and_never_leaks(engine):
    stream = TextStream(engine.runner.tokenizer, ("STOP",))
    emitted = ""
    for token in _ids(engine, "alpha beta STOP gamma"):
        emitted += stream.push(token)
        assert "STOP"[:2] not in emitted[len("alpha beta ") :] or stream.stopped
        if stream.stopped:
            break
    emitted += stream.finish()
    assert stream.stopped and emitted == "alpha beta "


def test_partial_stop_prefix_is_released_when_it_does_not_complete(engine):
    stream = TextStream(engine.runner.tokenizer, ("xyz",))
    out = "".join(stream.push(t) for t in _ids(engine, "a xy b")) + stream.finish()
    assert out == "a xy b" and not stream.stopped


def _longest_silence(pieces: list[str]) -> int:
    """The most tokens in a row that sent no text."""
    longest = run = 0
    for piece in pieces:
        run = 0 if piece else run + 1
        longest = max(longest, run)
    return longest


def _stray_byte(engine) -> int:
    """A token of one byte that no run of itself ever decodes to a character (a UTF-8 continuation
    or lead byte repeated)."""
    tokenizer = engine.runner.tokenizer
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i] * 5) == "\ufffd" * 5)


def test_stray_bytes_stream_as_replacement_characters_within_four_tokens(engine):
    tokens = [_stray_byte(engine)] * 40 + _ids(engine, " and then words.")
    stream = TextStream(engine.runner.tokenizer, ())
    pieces = [stream.push(token) for token in tokens]
    assert _longest_silence(pieces) <= 4, pieces  # before: nothing until the words, 40 tokens later
    assert "".join(pieces[:40]) == "\ufffd" * 36
    assert "".join(pieces) + stream.finish() == engine.runner.tokenizer.decode(tokens)


def test_characters_split_across_tokens_are_never_cut(engine):
    text = "日本語のテキスト, 👩\u200d👩\u200d👧 and € — " * 4
    stream = TextStream(engine.runner.tokenizer, ())
    pieces = [stream.push(i) for i in _ids(engine, text)] + [stream.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_random_tokens_stream_the_decoded_text_and_hold_little(engine):
    tokenizer = engine.runner.tokenizer
    rng = random.Random(7)
    tokens = [rng.randrange(tokenizer.vocab_size) for _ in range(3000)]
    stream = TextStream(tokenizer, ())
    pieces = [stream.push(token) for token in tokens]
    joined = "".join(pieces) + stream.finish()
    assert joined == tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    assert _longest_silence(pieces) <= 8, pieces
