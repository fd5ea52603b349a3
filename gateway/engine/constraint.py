"""Constrained decoding on the CPU: an llguidance grammar per sequence, whose token mask is applied
to the logits before sampling, so every token keeps the output inside the grammar.

    Grammars(tokenizer, vocab_size, eos_ids)   one per model (walks the vocabulary once)
        .check(grammar) -> None                raises GrammarError with llguidance's reason
        .matcher(grammar) -> Matcher           one per sequence
    Matcher.mask(logits) -> logits             disallowed tokens at -inf
    Matcher.accept(token)                      advance past the sampled token

llguidance computes the mask as a bit set in C; mlx-vlm applies it with a Metal kernel, which the CPU
build lacks, so here the bits are unpacked by numpy and applied with mx.where. Once the grammar is
complete only the end-of-sequence tokens are allowed, so the sequence ends the usual way.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np


class GrammarError(ValueError):
    """A grammar (a client's JSON schema, say) that llguidance cannot compile."""


# JSON without free whitespace between tokens: a model cannot wander in spaces and newlines, and the
# answer is compact. Strings, numbers and arrays stay as the schema allows.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict) -> str:
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def lark_grammar(lark: str) -> str:
    return _llguidance().LLMatcher.grammar_from_lark(lark)


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        if not isinstance(tokenizer, PreTrainedTokenizerFast):  # mlx-lm's TokenizerWrapper holds it
            tokenizer = tokenizer._tokenizer
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a piece of a UTF-8 character, possibly)."""
        return self.tokenizer.decode_bytes([token])

    def check(self, grammar: str) -> None:
        error = _llguidance().LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error)

    def matcher(self, grammar: str) -> Matcher:
        return Matcher(_llguidance().LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab_size)


class Matcher:
    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        if matcher.is_error():
            raise GrammarError(matcher.get_error())

    def mask(self, logits: mx.array) -> mx.array:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} broke the grammar: {self.matcher.get_error()}")


def _llguidance():
    import llguidance

    return llguidance
