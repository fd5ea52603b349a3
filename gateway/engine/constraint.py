"""Constrained decoding on the CPU: an llguidance grammar per sequence, whose token mask is applied
to the logits before sampling, so every token keeps the output inside the grammar.

    Grammars(tokenizer, vocab_size, eos_ids)   one per model (walks the vocabulary once)
        .compile(grammar) -> CompiledGrammar   any thread, before admission: compiled, probed, cached;
                                               GrammarError with the limit or llguidance's reason
        .matcher(grammar) -> Matcher           one per sequence: a copy of the compiled start state
    Matcher.mask(logits, closing) -> logits    disallowed tokens at -inf
    Matcher.accept(token)                      advance past the sampled token

llguidance computes the mask as a bit set in C; mlx-vlm applies it with a Metal kernel, which the CPU
build lacks, so here the bits are unpacked by numpy and applied with mx.where. Once the grammar is
complete only the end-of-sequence tokens are allowed, so the sequence ends the usual way.

Closing: a grammar guarantees a well-formed output only if the output ends; a model that never
closes a free string would be cut by max_tokens mid-JSON. So the matcher can measure how many tokens
closing takes from where it stands (a dry run on a copy, every few tokens), and once the budget left
comes down to that (and a few tokens more, as the output may grow before the next measure), closing
takes over: each token is then the longest allowed one of the first tier that has any
- a quote (which ends a string), else tokens made only of `"`, `}` and `]`, else those with `,` and
`:` too, else any (required keys and enum values are spelled out as the grammar forces them). The
dry run follows the same rule, so it counts exactly what closing will take. The reply is then valid
JSON, reported as cut by length. A budget smaller than the shortest valid output still ends cut.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

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


QUOTES = frozenset(b'"')
CLOSERS = QUOTES | frozenset(b"}]")
SEPARATORS = CLOSERS | frozenset(b",:")


COMPILED_CACHE_SIZE = 64  # compiled grammars kept by digest (a tool set sent again compiles once)


@dataclass(frozen=True, eq=False, slots=True)
class CompiledGrammar:
    """A grammar compiled and probed off the engine thread. `start` is an llguidance matcher at the
    grammar's start that is never advanced: each sequence decodes with a copy of it (microseconds),
    so no compile (up to seconds for a hundred tools) ever runs between two decode steps."""

    text: str
    start: Any  # llguidance.LLMatcher (imported only when a grammar is used)


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        if not isinstance(tokenizer, PreTrainedTokenizerFast):  # mlx-lm's TokenizerWrapper holds it
            tokenizer = tokenizer._tokenizer
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()  # by digest, least recent first
        self.lock = threading.Lock()  # guards `compiled` (compiles run on request threads)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a piece of a UTF-8 character, possibly)."""
        return self.tokenizer.decode_bytes([token])

    @functools.cached_property
    def _pieces(self) -> list[bytes]:
        """Each token's bytes; b"" for special tokens (they never close anything). One vocabulary pass."""
        return [b"" if self.tokenizer.is_special_token(t) else self.token_bytes(t) for t in range(self.vocab_size)]

    @functools.cached_property
    def token_lengths(self) -> np.ndarray:
        return np.array([len(piece) for piece in self._pieces])

    @functools.cached_property
    def closing_tiers(self) -> tuple[np.ndarray, ...]:
        """Per token, for each of QUOTES, CLOSERS, SEPARATORS: whether it is made only of those
        characters (a special token never is). A quote first: inside a string only a quote ends it."""
        return tuple(
            np.array([bool(p) and chars.issuperset(p) for p in self._pieces]) for chars in (QUOTES, CLOSERS, SEPARATORS)
        )

    def check(self, grammar: str) -> None:
        error = _llguidance().LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(_first_line(error))

    def compile(self, grammar: str) -> CompiledGrammar:
        """Compile `grammar` and probe it: the shortest way to close it from the start must stay
        within llguidance's limits and end within MAX_CLOSING_TOKENS tokens. Grammars that pass
        are kept by digest. GrammarError names the limit a grammar exceeds."""
        digest = hashlib.sha256(grammar.encode()).hexdigest()
        with self.lock:
            if (known := self.compiled.get(digest)) is not None:
                self.compiled.move_to_end(digest)
                return known
        self.check(grammar)
        start = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
        Matcher(start.deep_copy(), self).probe()
        compiled = CompiledGrammar(grammar, start)
        with self.lock:
            self.compiled[digest] = compiled
            while len(self.compiled) > COMPILED_CACHE_SIZE:
                self.compiled.popitem(last=False)
        return compiled

    def matcher(self, grammar: str | CompiledGrammar) -> Matcher:
        """A sequence's matcher: a copy of a compiled grammar's start, or (a plain grammar, as tools
        and benchmarks pass) compiled here."""
        compiled = grammar if isinstance(grammar, CompiledGrammar) else self.compile(grammar)
        return Matcher(compiled.start.deep_copy(), self)


MAX_CLOSING_TOKENS = 512  # a dry run longer than this counts as this


class Matcher:
    def __init__(self, matcher, grammars: Grammars):
        self.matcher = matcher
        self.grammars = grammars
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))

    def mask(self, logits: mx.array, closing: bool = False) -> mx.array:
        """The logits with what the grammar forbids at -inf; closing: only the closing token stays."""
        allowed = _allowed(self.matcher, self.grammars.vocab_size)
        if closing:
            allowed = np.zeros_like(allowed)
            allowed[self._closing_token(self.matcher)] = True
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def probe(self) -> None:
        """From here, close the output the shortest way (on this matcher: use a copy): GrammarError
        when a step exceeds llguidance's limits or the output cannot end within MAX_CLOSING_TOKENS."""
        for _ in range(MAX_CLOSING_TOKENS):
            if self.matcher.is_accepting():
                return
            if self.matcher.is_error() or not self.matcher.consume_token(self._closing_token(self.matcher)):
                reason = _first_line(self.matcher.get_error())
                raise GrammarError(f"the schema cannot be followed within the grammar engine's limits: {reason}")
        raise GrammarError(
            f"no output of this schema is shorter than {MAX_CLOSING_TOKENS} tokens (a recursion that never ends?)"
        )

    def tokens_to_close(self) -> int:
        """Tokens that closing would take from here, counted on a copy: the matcher does not move."""
        dry = self.matcher.deep_copy()
        for count in range(MAX_CLOSING_TOKENS):
            if dry.is_accepting() or not dry.consume_token(self._closing_token(dry)):
                return count
        return MAX_CLOSING_TOKENS

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} broke the grammar: {_first_line(self.matcher.get_error())}")

    def _closing_token(self, matcher) -> int:
        allowed = _allowed(matcher, self.grammars.vocab_size)
        for tier in self.grammars.closing_tiers:
            if (narrowed := allowed & tier).any():
                allowed = narrowed
                break
        return int(np.argmax(np.where(allowed, self.grammars.token_lengths, -1)))


def _allowed(matcher, vocab_size: int) -> np.ndarray:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)


def _llguidance():
    import llguidance

    return llguidance


def _first_line(error: str) -> str:
    """llguidance's reason, first line only (its verbose errors add the parser state)."""
    lines = error.strip().splitlines()
    return lines[0][:300] if lines else "unknown error"
