"""Prompt normalisation rules: the shipped attribution-line rule, system messages only, tenants that opt out."""

from __future__ import annotations

import json

import pytest

from gateway.engine import Message, Sampling, TextPart
from gateway.requests.normalize import Normalizer, load_rules
from gateway.requests.schemas import ChatRequest

LINE = "x-anthropic-billing-header: cc_version=2.1.37.8f1; cc_entrypoint=cli; cch=1a2b3;"


def _request(*messages: Message) -> ChatRequest:
    return ChatRequest("m", messages, Sampling(4, 0.0, 1.0, None, ()), False, False, {})


def test_the_attribution_line_leaves_the_system_prompt_and_nothing_else_does():
    normalizer = Normalizer(load_rules())
    system = Message("system", (TextPart(LINE), TextPart("You are an agent.\n" + LINE.replace("1a2b3", "ffff0"))))
    user = Message("user", (TextPart(LINE),))
    out, changed = normalizer.apply(_request(system, user), "tenant")
    assert changed and out.messages[0].parts == (TextPart("You are an agent.\n"),)
    assert out.messages[1] == user  # the user's own words are never rewritten
    same, unchanged = normalizer.apply(_request(Message("system", (TextPart("Plain."),)), user), "tenant")
    assert not unchanged and same.messages[0].parts == (TextPart("Plain."),)


def test_two_sessions_differing_only_in_the_line_normalise_alike():
    normalizer = Normalizer(load_rules())
    first, _ = normalizer.apply(_request(Message("system", (TextPart(LINE + "\nRules."),))), "t")
    second, _ = normalizer.apply(
        _request(Message("system", (TextPart(LINE.replace("1a2b3", "9c9c9") + "\nRules."),))), "t"
    )
    assert first == second


def test_a_tenant_that_opts_out_keeps_its_prompt():
    request = _request(Message("system", (TextPart(LINE),)))
    out, changed = Normalizer(load_rules(), off_tenants=("exact-prompts",)).apply(request, "exact-prompts")
    assert not changed and out is request


def test_a_bad_rule_is_refused_at_start_with_its_name(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"rules": [{"name": "broken", "pattern": "(unclosed", "replace": ""}]}))
    with pytest.raises(ValueError, match="broken"):
        load_rules(path)
