"""Drafts from the caches, seen from outside (a `strata serve` process on the tiny model, the official
`openai` client): the answer kept for the same question under another max_tokens, a near-hit the
semantic guards refused, and the reply to the same question earlier in the conversation are verified
as drafts; another tenant never drafts from them; X-Strata-Speculative, the stream's usage and
/metrics say what was drafted and kept."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.conftest import TINY
from tests.gateway.test_live_server import LiveServer

KEYS = "key-a:tenant-a,key-b:tenant-b"
QUESTION = "Which harbour does the ferry to the island leave from in winter?"


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    live = LiveServer(
        tiny_model_path,
        tmp_path_factory.mktemp("speculative") / "data",
        {"STRATA_API_KEYS": KEYS, "STRATA_MODEL_NAME": TINY, "STRATA_EXACT_STORE": "sqlite"},
    )
    yield live
    assert live.stop()


def _ask(server, key: str, messages, max_tokens: int):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=TINY, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return raw.parse().choices[0].message.content, _speculative(raw.headers["x-strata-speculative"])


def _speculative(value: str) -> dict:
    fields = dict(re.findall(r"(\w+)=([\w,]+)", value))
    return {
        "proposers": set(fields["proposer"].split(",")),
        "drafted": int(fields["drafted"]),
        "accepted": int(fields["accepted"]),
    }


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_same_question_under_another_max_tokens_drafts_its_kept_answer_within_the_tenant(server):
    first, plain = _ask(server, "key-a", _user(QUESTION), 48)
    again, drafted = _ask(server, "key-a", _user(QUESTION), 47)  # another exact key: the engine answers
    other_tenant, theirs = _ask(server, "key-b", _user(QUESTION), 47)
    assert "cache" not in plain["proposers"]
    assert "cache" in drafted["proposers"] and drafted["accepted"] >= 40  # the kept answer, token for token
    assert first.startswith(again) and other_tenant == again  # greedy: the same answer, drafts or not
    assert "cache" not in theirs["proposers"]  # tenant B never drafts from tenant A's answer


def test_the_reply_to_the_same_question_earlier_in_the_conversation_is_a_draft(server):
    question = "What does the lighthouse keeper log each night?"
    reply, _ = _ask(server, "key-b", _user(question), 24)
    history = [*_user(question), {"role": "assistant", "content": reply}, *_user("And in the morning?")]
    conversation = [*history, {"role": "assistant", "content": "Nothing."}, *_user(question)]
    _, drafted = _ask(server, "key-b", conversation, 24)
    assert "cache" in drafted["proposers"] and drafted["drafted"] > 0


def test_a_refused_near_hit_is_a_draft_for_its_own_tenant_only(server):
    _ask(server, "key-a", _user("How do I reset my password?"), 24)
    lookalike = _user("How do I not reset my password?")  # the negation guard refuses the near-hit
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=TINY, messages=lookalike, max_tokens=24, temperature=0)
    assert raw.headers["x-cache-semantic"].startswith("miss") and "score=" in raw.headers["x-cache-semantic"]
    assert "cache" in _speculative(raw.headers["x-strata-speculative"])["proposers"]
    _, theirs = _ask(server, "key-b", lookalike, 24)  # tenant B holds no entry near it: A's is not B's draft
    assert "cache" not in theirs["proposers"]


def test_a_stream_reports_drafts_in_its_usage_and_metrics_count_them_by_proposer(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    stream = client.chat.completions.create(
        model=TINY,
        messages=_user(QUESTION),
        max_tokens=46,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    summary = chunks[-1].usage.model_extra["strata"]
    # every token but the first (drawn after the prompt) and one per step (drawn after the drafts)
    assert _speculative(summary["speculative"])["accepted"] >= 35
    metrics = httpx.get(server.url + "/metrics").text
    drafted = re.search(r'strata:spec_decode_draft_tokens_total\{proposer="cache"\} (\S+)', metrics)
    accepted = re.search(r'strata:spec_decode_accepted_tokens_total\{proposer="cache"\} (\S+)', metrics)
    assert drafted and accepted and float(drafted.group(1)) >= float(accepted.group(1)) >= 75
