"""What the real-agents work added to the APIs, in-process on the tiny model: max_tokens lowered and
said so, the context as long as the model's, aliases, fields accepted and named when ignored,
Anthropic's cache diagnostics for each reason, and the Responses API's tool kinds and reasoning."""

from __future__ import annotations

import dataclasses
import json

import pytest
from litestar.testing import TestClient

from gateway.engine import Message, TextPart
from gateway.formats.openai_format import Completion
from gateway.formats.responses_api import ToolKinds, output
from gateway.http.app import create_app
from gateway.requests.schemas import parse_chat_request
from gateway.settings import Limits
from tests.conftest import TINY

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


@pytest.fixture
def client(settings, engine):
    with TestClient(create_app(dataclasses.replace(settings, api_keys=KEYS), engine=engine)) as test_client:
        yield test_client


def _messages(client, key="key-a", **body):
    body = {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]} | body
    return client.post("/v1/messages", json=body, headers={"x-api-key": key})


def _chat(client, key="key-a", **body):
    body = {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]} | body
    return client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


def _responses(client, key="key-a", **body):
    body = {"model": TINY, "max_output_tokens": 4, "input": "hi"} | body
    return client.post("/v1/responses", json=body, headers={"authorization": f"Bearer {key}"})


# -- max_tokens --------------------------------------------------------------------------------


def test_max_tokens_above_the_output_limit_is_lowered_and_said_on_every_api(client, settings):
    limit = settings.limits.max_output_tokens
    for answer in (
        _chat(client, max_tokens=100_000, temperature=0),
        _chat(client, max_completion_tokens=100_000, temperature=0),
        _responses(client, max_output_tokens=100_000, temperature=0),
        _messages(client, max_tokens=100_000, temperature=0),
    ):
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-strata-max-tokens"] == f"asked=100000; allowed={limit}; by=output_limit"


def test_max_tokens_past_the_context_is_lowered_to_what_is_left_and_the_answer_ends_there(settings, engine):
    limits = dataclasses.replace(settings.limits, max_context_tokens=48, max_output_tokens=512)
    with TestClient(create_app(dataclasses.replace(settings, limits=limits), engine=engine)) as client:
        answer = _chat(client, max_tokens=400, temperature=0, messages=[{"role": "user", "content": "a b c d e f"}])
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    allowed = 48 - usage["prompt_tokens"]
    assert answer.headers["x-strata-max-tokens"] == f"asked=400; allowed={allowed}; by=context"
    assert usage["completion_tokens"] <= allowed
    assert answer.json()["usage"]["strata"]["max_tokens"] == answer.headers["x-strata-max-tokens"]


@pytest.mark.parametrize("value", [0, -1, 1.5, "32000", True])
def test_a_bad_max_tokens_is_still_a_400(client, value):
    assert _chat(client, max_tokens=value).status_code == 400
    assert _messages(client, max_tokens=value).status_code == 400
    assert _responses(client, max_output_tokens=value).status_code == 400


def test_a_prompt_that_leaves_no_room_is_a_400_naming_the_context(settings, engine):
    limits = dataclasses.replace(settings.limits, max_context_tokens=40)
    with TestClient(create_app(dataclasses.replace(settings, limits=limits), engine=engine)) as client:
        answer = _chat(client, messages=[{"role": "user", "content": "word " * 60}])
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"


def test_the_default_context_is_the_models_own_bounded_by_the_kv_budget(engine):
    assert engine.context_tokens() == min(
        engine.info.max_context_tokens,
        (engine.runner.caches.running_budget_bytes() - engine.runner.state_bytes) // engine.runner.kv_bytes_per_token,
    )
    assert engine.context_tokens(100) == 100


# -- aliases -----------------------------------------------------------------------------------


def test_a_one_model_server_answers_the_agents_default_names(settings, engine):
    with TestClient(create_app(dataclasses.replace(settings, model_name=None), engine=engine)) as client:
        listed = client.get("/v1/models").json()["data"][0]
        for name in ("claude-opus-4-7", "claude-haiku-4-5-20251001", "gpt-5.5", "o3", "codex-mini"):
            answer = client.post(
                "/v1/messages",
                json={"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert answer.status_code == 200, (name, answer.text)
            assert answer.json()["model"] == listed["id"]
        unknown = client.post(
            "/v1/chat/completions", json={"model": "llama-3", "messages": [{"role": "user", "content": "hi"}]}
        )
    assert listed["aliases"] == ["claude-*", "gpt-*", "o[0-9]*", "codex-*"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_models_file_aliases_pick_the_first_matching_model(tmp_path, settings, tiny_model_path):
    from gateway.serving.models import model_entries

    models = tmp_path / "models.json"
    entries = [
        {"name": "coder", "path": str(tiny_model_path), "aliases": ["claude-opus-*", "gpt-5*"]},
        {"name": "small", "path": str(tiny_model_path), "aliases": ["claude-*"]},
    ]
    models.write_text(json.dumps({"models": entries}))
    found = model_entries(dataclasses.replace(settings, model="", models_file=models))
    assert [entry.aliases for entry in found] == [("claude-opus-*", "gpt-5*"), ("claude-*",)]
    models.write_text(json.dumps({"models": [{"path": "tiny", "aliases": "claude-*"}]}))
    with pytest.raises(ValueError, match="aliases"):
        model_entries(dataclasses.replace(settings, model="", models_file=models))


# -- fields accepted, honoured or named ---------------------------------------------------------


def test_fields_no_layer_acts_on_are_named_not_refused(client):
    chat = _chat(client, store=True, service_tier="flex", verbosity="high", audio={"voice": "x"}, brand_new_field=1)
    assert chat.status_code == 200
    assert chat.headers["x-strata-ignored"] == "store, service_tier, verbosity, audio, brand_new_field"
    web = {"type": "web_search_20250305", "name": "web_search"}
    message = _messages(client, service_tier="priority", mcp_servers=[{"url": "http://x"}], tools=[web])
    assert message.status_code == 200
    assert (
        message.headers["x-strata-ignored"] == "service_tier, mcp_servers, tools.0 (web_search_20250305: not offered)"
    )
    neutral = _chat(client, store=False, service_tier="auto", modalities=["text"])
    assert "x-strata-ignored" not in neutral.headers


def test_an_odd_field_name_is_shown_as_a_digest_never_echoed_into_a_header(client):
    answer = _chat(client, **{"bad\r\nX-Injected: 1": 1})
    assert answer.status_code == 200 and "x-injected" not in answer.headers
    assert answer.headers["x-strata-ignored"].startswith("?")


def test_the_ignored_fields_are_named_on_a_cached_answer_too(settings, engine):
    cached = dataclasses.replace(settings, exact_store="memory")
    with TestClient(create_app(cached, engine=engine)) as client:
        first = _chat(client, temperature=0, store=True)
        second = _chat(client, temperature=0, store=True)
    assert second.headers["x-cache-layer"] == "exact" and second.headers["x-strata-ignored"] == "store"
    assert first.headers["x-strata-ignored"] == "store"


def test_claude_codes_metadata_names_the_session_and_a_stable_end_user(settings):
    from gateway.formats.anthropic_api import parse_messages_request

    def parsed(session: str):
        user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session})
        body = {
            "model": TINY,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "x"}],
            "metadata": {"user_id": user_id},
        }
        return parse_messages_request(body, settings.limits)

    one, two = parsed("s-1"), parsed("s-2")
    assert one.metadata == {"session_id": "s-1"} and two.metadata == {"session_id": "s-2"}
    assert one.user == two.user and one.user.startswith("sha256:")


def test_parallel_tool_calls_off_keeps_one_call():
    request = parse_chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "parallel_tool_calls": False,
        },
        Limits(),
    )
    assert request.max_tool_calls == 1


def test_a_prediction_is_a_draft_and_changes_no_answer(client):
    messages = [{"role": "user", "content": "Please repeat the harbour timetable for me."}]
    plain = _chat(client, messages=messages, max_tokens=12, temperature=0)
    predicted = _chat(
        client,
        messages=messages,
        max_tokens=12,
        temperature=0,
        prediction={"type": "content", "content": plain.json()["choices"][0]["message"]["content"]},
    )
    assert predicted.status_code == 200 and "x-strata-ignored" not in predicted.headers
    assert predicted.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_cache_write_tokens_count_the_whole_blocks_a_request_stored(client):
    text = "A fresh question about the ferry timetable and the winter tides, asked only here. " * 4
    first = _chat(client, messages=[{"role": "user", "content": text}]).json()["usage"]["prompt_tokens_details"]
    second = _chat(client, messages=[{"role": "user", "content": text}]).json()["usage"]["prompt_tokens_details"]
    assert first["cached_tokens"] == 0 and first["cache_write_tokens"] > 0
    assert second["cached_tokens"] >= first["cache_write_tokens"] and second["cache_write_tokens"] == 0


# -- Anthropic cache diagnostics ----------------------------------------------------------------


def _diagnosed(client, previous_id, key="key-a", **body) -> tuple[dict, str]:
    answer = _messages(client, key=key, diagnostics={"previous_message_id": previous_id}, **body)
    assert answer.status_code == 200, answer.text
    return answer.json()["diagnostics"], answer.json()["id"]


SYSTEM = "You are a careful assistant for the harbour office. " * 6
TURN = [{"role": "user", "content": "When does the first ferry leave on Sundays?"}]


def test_cache_diagnostics_name_each_reason(client):
    first, first_id = _diagnosed(client, None, system=SYSTEM, messages=TURN)
    assert first == {"cache_miss_reason": None}  # opted in: nothing to compare
    appended = [*TURN, {"role": "assistant", "content": "At nine."}, {"role": "user", "content": "And back?"}]
    same, _ = _diagnosed(client, first_id, system=SYSTEM, messages=appended)
    assert same == {"cache_miss_reason": None}
    system, _ = _diagnosed(client, first_id, system=SYSTEM + "Be brief.", messages=TURN)
    assert system["cache_miss_reason"]["type"] == "system_changed"
    assert system["cache_miss_reason"]["cache_missed_input_tokens"] > 0
    tools, _ = _diagnosed(
        client, first_id, system=SYSTEM, messages=TURN, tools=[{"name": "f", "input_schema": {"type": "object"}}]
    )
    assert tools["cache_miss_reason"]["type"] == "tools_changed"
    edited = [{"role": "user", "content": "When does the last ferry leave on Sundays?"}]
    messages, _ = _diagnosed(client, first_id, system=SYSTEM, messages=edited)
    assert messages["cache_miss_reason"]["type"] == "messages_changed"
    other, _ = _diagnosed(client, first_id, system=SYSTEM, messages=TURN, thinking={"type": "disabled"})
    assert other["cache_miss_reason"] == {"type": "unavailable"}
    missing, _ = _diagnosed(client, "msg_nonexistent", system=SYSTEM, messages=TURN)
    assert missing["cache_miss_reason"] == {"type": "previous_message_not_found"}
    stranger, _ = _diagnosed(client, first_id, key="key-b", system=SYSTEM, messages=TURN)
    assert stranger["cache_miss_reason"] == {"type": "previous_message_not_found"}
    plain = _messages(client, system=SYSTEM, messages=TURN).json()
    assert "diagnostics" not in plain


def test_cache_diagnostics_name_a_model_change(tmp_path, settings, engine):
    from gateway.checkpoints import BuildSpec
    from tests.conftest import built_model

    models = tmp_path / "models.json"
    models.write_text(json.dumps({"models": [{"name": "other", "path": str(built_model(BuildSpec("llama", "tiny")))}]}))
    with TestClient(create_app(dataclasses.replace(settings, models_file=models), engine=engine)) as client:
        _, first_id = _diagnosed(client, None, system=SYSTEM, messages=TURN)
        changed, _ = _diagnosed(client, first_id, system=SYSTEM, messages=TURN, model="other")
    assert changed["cache_miss_reason"]["type"] == "model_changed"
    assert changed["cache_miss_reason"]["cache_missed_input_tokens"] > 0


def test_a_streamed_answer_carries_its_diagnostics_in_message_start(client):
    _, first_id = _diagnosed(client, None, system=SYSTEM, messages=TURN)
    streamed = _messages(
        client, stream=True, system=SYSTEM + "!", messages=TURN, diagnostics={"previous_message_id": first_id}
    )
    start = next(
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and "message_start" in line
    )
    assert start["message"]["diagnostics"]["cache_miss_reason"]["type"] == "system_changed"


# -- the Responses API's tool kinds and reasoning ------------------------------------------------


def _completion(text: str) -> Completion:
    return Completion("id", 0, 10, 0, text=text, whole=True)


def test_reasoning_comes_back_as_its_own_item_with_a_summary_when_asked(engine):
    items, message = output(_completion("<think>plan it</think>\n\nThe answer."), None, ToolKinds(), summary=True)
    assert [item["type"] for item in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert items[0]["summary"] == [{"type": "summary_text", "text": "plan it"}]
    assert items[0]["encrypted_content"] is None
    assert message["content"] == "The answer." and message["reasoning_content"] == "plan it"
    plain, _ = output(_completion("The answer."), None, ToolKinds(), summary=True)
    assert [item["type"] for item in plain] == ["message"]


def test_custom_and_namespaced_calls_go_back_as_their_own_kinds(engine):
    body = {
        "tools": [
            {"type": "custom", "name": "apply_patch"},
            {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
        ]
    }
    kinds = ToolKinds.of(body)
    calls = (
        '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "spawn", "arguments": {"task": "x"}}\n</tool_call>'
    )
    items, _ = output(_completion(calls), engine.tools, kinds, summary=False)
    custom, spawned = [item for item in items if item["type"] != "message"]
    assert custom["type"] == "custom_tool_call" and custom["input"] == "*** Begin Patch"
    assert spawned["type"] == "function_call" and spawned["namespace"] == "agents"


def test_additional_tools_are_offered_where_they_stand(client):
    item = {
        "type": "additional_tools",
        "role": "developer",
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
    }
    answer = _responses(client, input=[{"role": "user", "content": "hi"}, item, {"role": "user", "content": "go"}])
    assert answer.status_code == 200, answer.text
    forced = _responses(
        client,
        input=[item, {"role": "user", "content": "go"}],
        tool_choice={"type": "function", "name": "lookup"},
        max_output_tokens=64,
    )
    assert forced.status_code == 200, forced.text
    assert any(out["type"] == "function_call" and out["name"] == "lookup" for out in forced.json()["output"])


def test_a_late_developer_message_is_rendered_where_it_stands(client):
    late = [{"role": "user", "content": "hi"}, {"role": "developer", "content": "Answer in French."}]
    assert _chat(client, messages=late).headers["x-strata-system-messages"] == "in_place=1"
    assert _responses(client, input=late).headers["x-strata-system-messages"] == "in_place=1"


def test_a_thinking_block_goes_back_to_the_template_as_the_turns_reasoning(settings):
    from gateway.formats.anthropic_api import parse_messages_request

    body = {
        "model": TINY,
        "max_tokens": 1,
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "a"}],
            },
            {"role": "user", "content": "y"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "then", "signature": ""}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": "z"},
        ],
    }
    kept = parse_messages_request(body, settings.limits).messages
    assert [m.reasoning for m in kept if m.role == "assistant"] == ["hmm", "then"]
    edit = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    cleared = parse_messages_request(body | {"context_management": edit}, settings.limits).messages
    assert [m.reasoning for m in cleared if m.role == "assistant"] == ["", "then"]
    assert Message("assistant", (TextPart("a"),)).reasoning == ""


def _count(client, **body) -> int:
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}]} | body
    answer = client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "key-a"})
    assert answer.status_code == 200, answer.text
    return answer.json()["input_tokens"]


def test_a_deferred_tool_stays_out_of_the_prompt_until_a_reference_loads_it(client):
    lookup = {"name": "lookup", "description": "Look a word up.", "input_schema": {"type": "object"}}
    deferred = {**lookup, "defer_loading": True}
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]}
    reference = {"type": "tool_reference", "tool_name": "lookup"}
    found = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [reference]}]}
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    before = [{"role": "user", "content": "find a tool"}, call]
    assert _count(client, tools=[search, deferred]) == _count(client, tools=[search])
    with_plain = _count(client, tools=[search, lookup], messages=[*before, found])
    loaded = _count(client, tools=[search, deferred], messages=[*before, found])
    without = _count(
        client, tools=[search], messages=[*before, {**found, "content": [{**found["content"][0], "content": "none"}]}]
    )
    assert loaded > without and loaded != with_plain  # its definition stands in the tool result, not in the tool list


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_image_in_a_tool_result_reaches_the_model(client, route):
    from tests.conftest import png_data_url

    data = png_data_url(64, 48).split(",", 1)[1]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    messages = [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [image]},
                {"type": "text", "text": "what is it?"},
            ],
        },
    ]
    body = {
        "model": TINY,
        "max_tokens": 2,
        "messages": messages,
        "tools": [{"name": "shot", "input_schema": {"type": "object"}}],
    }
    answer = client.post(route, json=body, headers={"x-api-key": "key-a"})
    assert answer.status_code == 200, answer.text
    if route == "/v1/messages":
        assert (
            answer.headers["x-cache-vision"].startswith(("miss", "hit"))
            and "images=1" in answer.headers["x-cache-vision"]
        )
