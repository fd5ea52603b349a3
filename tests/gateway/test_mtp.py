"""The model's own drafter: the MTP layers the Qwen3.5 and Qwen3-Next checkpoints ship. The builder
writes them as the real checkpoints have them and mlx-vlm's splitter finds them; a row's heads, fed
step by step (with drafts in between whose cache entries must go), draft what heads fed every
position at once draft; in the engine they draft for a lone hybrid row and the answer stays the
model's own."""

from __future__ import annotations

import mlx.core as mx
import pytest

from gateway.checkpoints import RECIPES, BuildSpec
from gateway.engine import Finished
from gateway.engine.mtp import ModelHeads
from gateway.engine.runner import ModelRunner
from gateway.engine.speculative import batch_width
from tests.conftest import built_model
from tests.gateway.test_preemption import SALT
from tests.gateway.test_verify import GREEDY, _answers, _engine, _messages

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _runner(family: str) -> ModelRunner:
    from gateway.engine import CacheConfig

    return ModelRunner(built_model(BuildSpec(family, "tiny")), CacheConfig(0, 0, 16), "fp")


def test_the_builder_writes_mtp_layers_where_the_real_checkpoints_have_them():
    assert {family for family, recipe in RECIPES.items() if recipe.mtp_layers} == set(MTP_FAMILIES)
    for family in ("qwen3_next", "llama"):
        path = built_model(BuildSpec(family, "tiny"))
        assert (path / "mtp.safetensors").exists() == (family in MTP_FAMILIES)
        assert (_runner(family).heads is not None) == (family in MTP_FAMILIES)


def _hidden_states(runner: ModelRunner, ids: list[int]) -> mx.array:
    """The model's pre-norm hidden states at every position of `ids`, from one plain call."""
    runner.lm(mx.array([ids]), cache=runner.new_cache())
    return runner.lm.model.norm.__dict__.pop("tapped")[0]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_heads_fed_step_by_step_draft_what_heads_fed_at_once_draft(family):
    runner = _runner(family)
    ids = runner.tokenizer.encode("the tide turns at the harbour wall and the ferry leaves at nine " * 3)
    hidden = _hidden_states(runner, ids)
    start, end = 6, len(ids) - 1  # the heads follow positions start..end-1: (hidden there, next token)
    stepwise = ModelHeads(runner.heads)
    position, drafts = start, []
    for size in (1, 3, 2, 5, 1, 4):  # steps that kept different numbers of tokens
        taken = ids[position + 1 : position + size + 1]
        stepwise.follow(hidden[position : position + size], taken, position, position + size + 1)
        position += size
        drafts = stepwise.propose(ids[: position + 1], 4)  # their cache entries must not stay
        assert len(drafts) == 4 and stepwise.num_speculative == 3
    at_once = ModelHeads(runner.heads)
    at_once.follow(hidden[start:position], ids[start + 1 : position + 1], start, len(ids[: position + 1]))
    assert position < end
    assert at_once.propose(ids[: position + 1], 4) == drafts
    assert stepwise.cache[0].offset == at_once.cache[0].offset == position - start + 3


def test_a_gap_in_the_followed_positions_starts_the_heads_over():
    runner = _runner("qwen3_next")
    ids = runner.tokenizer.encode("one two three four five six seven eight nine ten " * 2)
    hidden = _hidden_states(runner, ids)
    gapped = ModelHeads(runner.heads)
    gapped.follow(hidden[2:5], ids[3:6], 2, 0)
    gapped.follow(hidden[8:10], ids[9:11], 8, 11)  # positions 5..7 went unfollowed (the row was in a batch)
    fresh = ModelHeads(runner.heads)
    fresh.follow(hidden[8:10], ids[9:11], 8, 11)
    assert gapped.cache[0].offset == 2
    assert gapped.propose(ids[:11], 3) == fresh.propose(ids[:11], 3)
    assert fresh.propose(ids[:12], 3) == []  # a length the heads did not follow: no draft


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_lone_hybrid_row_drafts_with_the_heads_and_answers_as_plain_decoding(family, monkeypatch):
    # random heads are almost never right: let every row try them (the rate a trained head earns)
    monkeypatch.setattr(ModelHeads, "first_rate", 1.0)
    proposed = []  # (a row's tokens so far, its heads' draft), the first prompt's rows first
    propose = ModelHeads.propose

    def recorded(self, generated, k):
        draft = propose(self, generated, k)
        proposed.append((list(generated), draft))
        return draft

    monkeypatch.setattr(ModelHeads, "propose", recorded)
    engine = _engine(family)
    try:
        prompts = [engine.prepare(m, []) for m in _messages(3)]
        with_heads = [_answers(engine, [prompt], [GREEDY])[0] for prompt in prompts]
        counters = engine.snapshot().counters
        reports = [_report(engine, prompt) for prompt in prompts[:1]]
        engine.worker.proposers = None
        plain = [_answers(engine, [prompt], [GREEDY])[0] for prompt in prompts]
        runner = engine.runner
    finally:
        engine.stop()
    assert with_heads == plain
    assert counters.num_drafted_tokens >= len(prompts)  # every row tried the heads
    assert [name for name, drafted, _ in reports[0].counts if drafted] == ["mtp"]
    _assert_drafted_from_the_models_own_hidden_states(runner, prompts[0].token_ids, proposed)


def _assert_drafted_from_the_models_own_hidden_states(runner, prompt, proposed) -> None:
    """The row's first draft equals that of heads fed, from one plain call over the prompt and the
    reply so far, the hidden states at the reply's positions."""
    generated, draft = next((g, d) for g, d in proposed if d)
    ids = [*prompt, *generated]
    hidden = _hidden_states(runner, ids[:-1])
    first = len(prompt)  # the heads follow the row from its first decode step (the prompt has no entries)
    fresh = ModelHeads(runner.heads)
    fresh.follow(hidden[first:], ids[first + 1 :], first, len(generated))
    assert fresh.propose(generated, len(draft)) == draft


def _report(engine, prompt):
    import asyncio

    async def run():
        async for event in engine.events(engine.submit(prompt, GREEDY, SALT)):
            if isinstance(event, Finished):
                return event.speculative

    return asyncio.run(run())


def test_a_replay_is_paid_only_when_a_draft_is_cut():
    assert batch_width([[1, 2]], [0.8], 2, replay=True) > 0  # a trained head's rate pays on a hybrid row
    assert batch_width([[1, 2]], [0.6], 2, replay=True) == 0
    assert batch_width([[1] * 8], [1.0], 8, replay=True) == 8  # never cut: no replay to pay for
