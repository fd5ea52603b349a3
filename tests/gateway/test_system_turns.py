"""System and developer messages after the first: rendered where they stand when the template can,
folded into a neighbouring user turn when it cannot (raises, drops or hoists them), and either way a
turn's prompt stays the prefix of the next turn's, on every family."""

from __future__ import annotations

import jinja2
import pytest

from gateway.checkpoints import BUILDABLE_FAMILIES, BuildSpec
from gateway.engine import CacheConfig, Message, ModelRunner, TextPart
from gateway.engine.system_turns import SYSTEM_WRAPPER, SystemPlacement, SystemTurns
from tests.conftest import built_model


def _renderer(source: str):
    environment = jinja2.Environment()

    def fail(message):
        raise jinja2.TemplateError(message)

    environment.globals["raise_exception"] = fail
    template = environment.from_string(source)
    return lambda messages: template.render(messages=messages, add_generation_prompt=True)


IN_PLACE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
STRICT = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
)
HOISTING = (  # every system message first, the others after: a late one moves to the front
    "{% for m in messages if m.role == 'system' %}<system>{{ m.content }}</system>{% endfor %}"
    "{% for m in messages if m.role != 'system' %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
)
DROPPING = (  # Gemma-style: the first system message folded into the first user turn, later ones lost
    "{% set first = messages[0].content if messages[0].role == 'system' else '' %}"
    "{% for m in messages if m.role != 'system' %}<{{ m.role }}>{{ first if loop.first else '' }}"
    "{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
)


def _messages(*roles_and_texts: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": text} for role, text in roles_and_texts]


def test_a_template_that_takes_later_system_turns_keeps_them_in_place():
    turns = SystemTurns(_renderer(IN_PLACE))
    messages = _messages(("system", "S"), ("user", "U"), ("system", "E"), ("assistant", "A"), ("user", "V"))
    assert turns.fit(messages) == (messages, SystemPlacement(num_in_place=1))


@pytest.mark.parametrize("template", [STRICT, HOISTING, DROPPING], ids=["raises", "hoists", "drops"])
def test_a_template_that_cannot_gets_them_folded_into_the_user_turn_beside(template):
    turns = SystemTurns(_renderer(template))
    assert not turns.in_place
    after_user = _messages(("system", "S"), ("user", "U"), ("system", "E"))
    folded, placement = turns.fit(after_user)
    assert folded == _messages(("system", "S"), ("user", "U\n\n" + SYSTEM_WRAPPER.format(text="E")))
    assert placement == SystemPlacement(num_wrapped=1)
    after_assistant = _messages(("user", "U"), ("assistant", "A"), ("system", "E"), ("user", "V"))
    assert turns.fit(after_assistant)[0][-1] == {"role": "user", "content": SYSTEM_WRAPPER.format(text="E") + "\n\nV"}
    between_assistants = _messages(("user", "U"), ("assistant", "A"), ("system", "E"), ("assistant", "B"))
    assert turns.fit(between_assistants)[0][2] == {"role": "user", "content": SYSTEM_WRAPPER.format(text="E")}


def test_leading_system_messages_are_joined_when_the_template_takes_only_one():
    turns = SystemTurns(_renderer(STRICT))
    messages = _messages(("system", "A"), ("system", "B"), ("user", "U"))
    assert turns.fit(messages) == (_messages(("system", "A\n\nB"), ("user", "U")), SystemPlacement())


def test_parts_keep_their_kind_when_folded():
    turns = SystemTurns(_renderer(STRICT))
    image_turn = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "U"}]}
    folded, _ = turns.fit([image_turn, {"role": "system", "content": "E"}])
    assert folded == [
        {
            **image_turn,
            "content": [*image_turn["content"], {"type": "text", "text": "\n\n" + SYSTEM_WRAPPER.format(text="E")}],
        }
    ]


def _turns(late_system: bool) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
    """Claude Code's shape: a system prompt, the user's question, then (optionally) a system message;
    the next turn adds the answer and another question."""
    first = [
        Message("system", (TextPart("You are a coding agent."),)),
        Message("user", (TextPart("What does hello.py print?"),)),
    ]
    if late_system:
        first.append(Message("system", (TextPart("# Environment\nPrimary working directory: /tmp/p"),)))
    second = [*first, Message("assistant", (TextPart("hello"),)), Message("user", (TextPart("And twice?"),))]
    return tuple(first), tuple(second)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("family", BUILDABLE_FAMILIES)
def test_every_family_keeps_the_prefix_across_turns_with_a_system_message_mid_conversation(family):
    """Whatever the template does with it, the late system message costs the next turn no more of
    its prefix than the same conversation without it (the generation prompt's few tokens, at most)."""
    prompts = ModelRunner(built_model(BuildSpec(family, "tiny")), CacheConfig(0, 0, 16), "fp").prompts
    plain = [prompts.build(turn, []) for turn in _turns(late_system=False)]
    late = [prompts.build(turn, []) for turn in _turns(late_system=True)]
    lost_plain = plain[0].num_tokens - _common(plain[0].token_ids, plain[1].token_ids)
    lost_late = late[0].num_tokens - _common(late[0].token_ids, late[1].token_ids)
    assert lost_late <= lost_plain, (family, lost_late, lost_plain)
    placement = late[0].system
    assert placement.num_in_place + placement.num_wrapped == 1
    assert "# Environment" in prompts.tokenizer.decode(list(late[0].token_ids))
