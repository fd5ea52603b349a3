"""TextStream: incremental detokenisation and stop sequences on the real tiny tokenizer."""

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
