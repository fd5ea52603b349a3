"""Random-init weights that end their turns, for the agents' test model (`tiny-agent`, `demo-agent`).

A random-weight model almost never writes its end-of-turn token: a coding agent then waits for the
whole `max_tokens` and reports the answer as cut short (Claude Code calls it an error, Codex fails the
turn). These models keep their random layers; two things change, both seeded:

- every ordinary token's input embedding gains a shared component, ALPHA along one random unit
  direction u; the generation prompt's last token (what an answer's first token is predicted from)
  gains -ALPHA u; special tokens neither. The residual stream carries a position's own input
  embedding to the final hidden state, whatever the context, so `h . u` there is high after an
  ordinary token and low at an answer's first position (on a model of more layers, attention also
  carries the prompt's u forward: the negative shift outweighs it);
- the output head is untied (a copy of the original embeddings) and its end-of-turn row is BETA u,
  BETA measured so that after an ordinary token the end-of-turn logit sits MARGIN above the
  log-sum-exp of all others; the rows of tokens that show no text on their own are a share of it
  (INVISIBLE_SHARE), so an answer seldom starts with one and shows nothing.

An answer then has at least one token and ends after a few more: measured at temperature 1 (what
agents send) on Claude Code's first prompt (~20k tokens here), 16 answers of the tiny model ran 1 to 5
tokens (median 2), 8 of the demo model 1 to 7; greedy answers are one token long on both. A direction fitted to the final hidden states instead
held on corpus prompts but not on an agent's (its answers ran past 200 tokens there): the residual
path does not depend on what the prompt says.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIT_SEED = 20261203
ALPHA = 4.0  # the shared component of ordinary tokens' embeddings (theirs are N(0, 0.02) per dimension)
MARGIN = 0.0  # the end-of-turn logit over the others' log-sum-exp after an ordinary token, at the median: p = 0.5
NUM_PROMPTS = 24  # short chat prompts whose sampled answers measure BETA
ANSWER_TOKENS = 8
# Tokens that show no text alone (whitespace, a lone byte of a longer character) get this share of
# the end-of-turn row as their head row, so that, like it, they are rarely an answer's first token:
# before, 5 of 800 tiny-model answers to corpus prompts showed no text (one such token, then the end
# of the turn) and an agent's turn then had no answer; with 0.25, 1 of 800, answers as long as before
# (median 2 tokens, at most 15). A share of 0.5 made answers longer (median 3.5) and no fewer empty.
INVISIBLE_SHARE = 0.25


def untie(config: dict) -> None:
    """Give the model an output head of its own (the end-of-turn row changes, not an embedding)."""
    for section in (config, config.get("text_config") or {}):
        if "tie_word_embeddings" in section:
            section["tie_word_embeddings"] = False


def favour_end_of_turn(language_model, tokenizer_dir: Path, end_token: str, corpus: Path) -> None:
    """Shift ordinary tokens' embeddings along u and set the head's end-of-turn row to BETA u (the
    head otherwise a copy of the original embeddings); prompts of `corpus` lines, rendered by the
    tokenizer in `tokenizer_dir`, measure BETA."""
    import mlx.core as mx
    from transformers import AutoTokenizer

    head = getattr(language_model, "lm_head", None)
    if head is None:
        raise ValueError("this family's output head is tied to its embeddings: it cannot be set to end turns")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    end_id = tokenizer.convert_tokens_to_ids(end_token)
    assert isinstance(end_id, int), f"{end_token!r} is not one token"
    rng = np.random.default_rng(FIT_SEED)
    embeddings = np.array(language_model.model.embed_tokens.weight, dtype=np.float32)
    drawn = rng.normal(size=embeddings.shape[1])
    direction = np.asarray(drawn / np.linalg.norm(drawn))
    shifted = embeddings.copy()
    shifted[_ordinary(tokenizer, len(embeddings))] += (ALPHA * direction).astype(np.float32)
    shifted[_generation_prompt(tokenizer, [{"role": "user", "content": "x"}])[-1]] -= (ALPHA * direction).astype(
        np.float32
    )
    language_model.model.embed_tokens.weight = mx.array(shifted)
    lines = corpus.read_text().splitlines()[1:]
    beta = _measured_beta(language_model.model, tokenizer, lines, rng, embeddings, direction, end_id)
    weights = embeddings.copy()
    weights[end_id] = (beta * direction).astype(np.float32)
    weights[_invisible(tokenizer, len(weights))] = (INVISIBLE_SHARE * beta * direction).astype(np.float32)
    head.weight = mx.array(weights)


def _invisible(tokenizer, vocab_size: int) -> np.ndarray:
    """A mask of the ordinary tokens that show no text on their own: whitespace, and the lone bytes
    of a character that takes several (the stream holds them back until a later token completes
    them, and drops them when the answer ends first)."""
    shown = [tokenizer.decode([token]) for token in range(vocab_size)]
    blank = np.array([not text.strip() or "\ufffd" in text for text in shown])
    return blank & _ordinary(tokenizer, vocab_size)


def _ordinary(tokenizer, vocab_size: int) -> np.ndarray:
    """A mask of the tokens an answer is made of: all but the special and added tokens and the
    generation prompt's last token."""
    mask = np.ones(vocab_size, dtype=bool)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    mask[[token for token in special if token < vocab_size]] = False
    mask[_generation_prompt(tokenizer, [{"role": "user", "content": "x"}])[-1]] = False
    return mask


def _generation_prompt(tokenizer, messages: list[dict]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _measured_beta(inner, tokenizer, lines, rng, head: np.ndarray, direction: np.ndarray, end_id: int) -> float:
    """BETA such that, at the median answer position after the first, the end-of-turn logit is MARGIN
    above the others' log-sum-exp (answers sampled with the end-of-turn token held off)."""
    along, spread = [], []
    for _ in range(NUM_PROMPTS):
        messages = [
            {"role": "system", "content": " ".join(rng.choice(lines, 3))},
            {"role": "user", "content": " ".join(rng.choice(lines, 2))},
        ]
        for state in _answer_states(inner, _generation_prompt(tokenizer, messages), rng, head, end_id)[1:]:
            logits = head @ state
            top = logits.max()
            along.append(float(state @ direction))
            spread.append(float(top + np.log(np.exp(logits - top).sum())))
    # rounded: the same value whichever BLAS computed the states (built folders must be identical)
    return round((float(np.median(spread)) + MARGIN) / float(np.median(along)), 1)


def _answer_states(inner, ids: list[int], rng: np.random.Generator, head: np.ndarray, end_id: int) -> list:
    """The final hidden state before each of ANSWER_TOKENS tokens sampled at temperature 1."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in inner.layers]
    tokens = mx.array([ids])
    states = []
    for _ in range(ANSWER_TOKENS):
        state = np.array(inner(tokens, cache=cache)[0, -1], dtype=np.float64)
        states.append(state)
        logits = head @ state
        logits[end_id] = -np.inf  # held off: the answer goes on
        probabilities = np.exp(logits - logits.max())
        tokens = mx.array([[int(rng.choice(len(logits), p=probabilities / probabilities.sum()))]])
    return states
