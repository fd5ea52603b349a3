"""Tools, structured output and logprobs through the official `openai` client against a live server
(a `strata serve` process on the tiny random-init model): what the random weights write is whatever
it is, so every check is one that must hold for any weights."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from tests.conftest import TINY
from tests.gateway.test_live_server import LiveServer

KEYS = "key-a:tenant-a,key-b:tenant-b"
ADMIN = "admin-secret"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 40},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "score", "tags", "ok"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "What will the weather be in Lyon this week?"}]


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("breadth") / "data"
    live = LiveServer(
        tiny_model_path,
        data_dir,
        {"STRATA_API_KEYS": KEYS, "STRATA_ADMIN_KEY": ADMIN, "STRATA_MODEL_NAME": TINY, "STRATA_EXACT_STORE": "sqlite"},
    )
    yield live
    assert live.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)


def _check_call(call, tools: dict) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_forced_tool_call_validates_against_its_schema(server, temperature):
    reply = _client(server).chat.completions.create(
        model=TINY,
        messages=QUESTION,
        tools=[WEATHER, CLOCK],
        temperature=temperature,
        max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    _check_call(choice.message.tool_calls[0], {"get_weather": WEATHER})


def test_required_picks_one_of_the_tools_and_streams_it(server):
    stream = _client(server).chat.completions.create(
        model=TINY,
        messages=QUESTION,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=120,
        stream=True,
        temperature=0.7,
        seed=3,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call["name"]]["function"]["parameters"]
    jsonschema.validate(json.loads(call["arguments"]), schema)


def test_a_tool_conversation_continues_with_the_result(server):
    client = _client(server)
    first = client.chat.completions.create(
        model=TINY, messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=120
    )
    call = first.choices[0].message.tool_calls[0]
    history = QUESTION + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high": 24}'},
    ]
    second = client.chat.completions.create(
        model=TINY, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # the earlier turn (the tools block and the call) comes from the prefix cache
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_tools_are_in_the_exact_key_and_a_replay_parses_the_call_again(server):
    client = _client(server)
    ask = dict(model=TINY, messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    first = client.chat.completions.with_raw_response.create(**ask)
    again = client.chat.completions.with_raw_response.create(**ask)
    assert again.headers["x-cache-exact"].startswith("hit")
    assert (
        again.parse().choices[0].message.tool_calls[0].function
        == first.parse().choices[0].message.tool_calls[0].function
    )
    other = client.chat.completions.with_raw_response.create(**{**ask, "tools": [WEATHER, CLOCK]})
    assert other.headers["x-cache-exact"].startswith("miss")


def test_a_json_schema_answer_validates_in_a_batch_of_concurrent_requests(server):
    async def ask(client, index):
        reply = await client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": f"Rate idea number {index}"}],
            max_tokens=150,
            temperature=1.0,
            seed=index,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "rating", "schema": ANSWER_SCHEMA, "strict": True},
            },
        )
        return reply.choices[0]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0) as client:
            return await asyncio.gather(*(ask(client, i) for i in range(6)))

    for choice in asyncio.run(main()):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)


def test_json_object_answers_are_objects(server):
    reply = _client(server).chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Describe a cat as JSON"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert reply.choices[0].message.content.startswith("{")


def test_logprobs_tokens_join_to_the_text_also_when_streamed(server):
    client = _client(server)
    reply = client.chat.completions.create(
        model=TINY, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    # the bytes join to the text; a random model writes stray UTF-8 bytes, which the text shows as U+FFFD
    # (and drops when a reply is cut inside a character)
    joined = b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace")
    assert joined.rstrip("\ufffd") == reply.choices[0].message.content.rstrip("\ufffd")
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy took the top one
    streamed = client.chat.completions.create(
        model=TINY, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    entries = [
        e
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_logprobs_bypass_the_response_caches(server):
    ask = dict(model=TINY, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True)
    _client(server).chat.completions.create(**ask)
    again = _client(server).chat.completions.with_raw_response.create(**ask)
    assert again.headers["x-cache-exact"] == "bypass; reason=logprobs"


BAD = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch_rockets"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]},
        "tools[0].function.parameters",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
        "response_format",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 1000}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * (4 << 20)}}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "42"}]},
        "messages[1]",
    ),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0]"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]},
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_hostile_tool_and_format_requests_are_400s_naming_the_field(server, extra, param):
    body = {"model": TINY, "messages": QUESTION, "max_tokens": 4, **extra}
    reply = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=30
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


LONG_PROMPT = [
    {
        "role": "user",
        "content": "Tell me three different stories about a lighthouse keeper and a gull "
        "who trade riddles through a long winter on a rocky island. " * 3,
    }
]


def test_n_choices_come_from_one_prefill(server):
    raw = _client(server).chat.completions.with_raw_response.create(
        model=TINY, messages=LONG_PROMPT, n=3, temperature=1.0, seed=11, max_tokens=12
    )
    reply = raw.parse()
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    assert len({choice.message.content for choice in reply.choices}) > 1  # each choice draws its own
    cached = raw.http_response.json()["usage"]["strata"]["choices_cached_tokens"]
    whole_blocks = (reply.usage.prompt_tokens - 1) // 32 * 32  # the server's 32-token blocks
    assert cached[0] == 0 and cached[1:] == [whole_blocks, whole_blocks]
    assert reply.usage.completion_tokens <= 3 * 12 and reply.usage.prompt_tokens > 64
    assert raw.headers["x-cache-exact"] == "bypass; reason=n"


def test_n_choices_stream_each_with_its_index(server):
    stream = _client(server).chat.completions.create(
        model=TINY, messages=QUESTION, n=2, max_tokens=6, stream=True, temperature=0
    )
    texts, finished, ids = {0: "", 1: ""}, set(), set()
    for chunk in stream:
        ids.add(chunk.id)
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and texts[0] == texts[1] != ""  # greedy: the same answer twice
    assert len(ids) == 1


def test_embeddings_equal_minilm_own(server):
    from semantic import MiniLMEmbedder

    texts = ["a cat on a mat", "Quarterly revenue rose by 4%", "ünïcödé ✓"]
    client = _client(server)
    reply = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the client asks for base64
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    expected = MiniLMEmbedder().embed(texts)
    for got in (reply, floats):
        assert [item.index for item in got.data] == [0, 1, 2]
        assert np.abs(np.array([item.embedding for item in got.data]) - expected).max() < 1e-5
    assert reply.usage.prompt_tokens > len(texts)
    single = client.embeddings.create(model="all-MiniLM-L6-v2", input="a cat on a mat")
    assert np.abs(np.array(single.data[0].embedding) - expected[0]).max() < 1e-5


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "all-MiniLM-L6-v2", "input": []}, 400, "input"),
        ({"model": "all-MiniLM-L6-v2", "input": [1, 2, 3]}, 400, "input"),
        ({"model": "all-MiniLM-L6-v2", "input": ["x"] * 3000}, 400, "input"),
        ({"model": "all-MiniLM-L6-v2", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": "text-embedding-3-large", "input": "x"}, 404, "model"),
    ],
)
def test_bad_embedding_requests(server, body, status, param):
    reply = httpx.post(server.url + "/v1/embeddings", json=body, headers={"Authorization": "Bearer key-a"}, timeout=30)
    assert reply.status_code == status and reply.json()["error"]["param"] == param
    assert httpx.post(server.url + "/v1/embeddings", json=body, timeout=30).status_code == 401  # tenants only


TRAVEL = "You are a travel agent. Answer in one short paragraph."


def test_a_three_turn_responses_conversation_reuses_the_earlier_turns(server):
    client = _client(server)
    ask = dict(model=TINY, instructions=TRAVEL, max_output_tokens=16, temperature=0)
    first = client.responses.create(input="Plan a week on the coast for a family of four with two dogs.", **ask)
    second = client.responses.create(previous_response_id=first.id, input="Make it cheaper, please.", **ask)
    third = client.responses.create(previous_response_id=second.id, input="And add one rainy-day idea.", **ask)
    assert first.status in ("completed", "incomplete") and first.output_text == first.output[0].content[0].text
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    # turns 1 and 2 (instructions, both questions and the first answer) come from the prefix cache
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens // 32 * 32
    stranger = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):  # another tenant cannot continue it, nor learn it exists
        stranger.responses.create(previous_response_id=second.id, input="Go on", **ask)


def test_responses_stream_their_events_and_take_images(server):
    from tests.conftest import png_data_url

    stream = _client(server).responses.create(
        model=TINY,
        max_output_tokens=10,
        temperature=0,
        stream=True,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in this picture?"},
                    {"type": "input_image", "image_url": png_data_url()},
                ],
            }
        ],
    )
    kinds, deltas, final = [], [], None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "".join(deltas) and final.usage.input_tokens > 20


def test_responses_call_a_forced_tool_and_continue_with_its_output(server):
    client = _client(server)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER["function"]["parameters"],
    }
    first = client.responses.create(
        model=TINY,
        input="Weather in Lyon?",
        tools=[tool],
        max_output_tokens=120,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    second = client.responses.create(
        model=TINY,
        previous_response_id=first.id,
        tools=[tool],
        max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'}],
    )
    assert second.output[0].type == "message" and second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": []}, 400, "input"),
        ({"input": [{"type": 7}]}, 400, "input[0].type"),
        ({"input": "hi", "tools": [{"name": "no type"}]}, 400, "tools[0].type"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, 400, "input"),
        ({"input": "hi", "include": "reasoning.encrypted_content"}, 400, "include"),
        ({"input": "hi", "reasoning": {"effort": "enormous"}}, 400, "reasoning.effort"),
    ],
)
def test_bad_responses_requests(server, body, status, param):
    reply = httpx.post(
        server.url + "/v1/responses",
        json={"model": TINY, **body},
        headers={"Authorization": "Bearer key-a"},
        timeout=30,
    )
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"input": [{"type": "computer_call"}, {"role": "user", "content": "hi"}]}, "input[0] (computer_call)"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0] (web_search: not offered)"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include.message.output_text.logprobs"),
        ({"input": "hi", "background": True}, "background"),
    ],
)
def test_responses_fields_no_layer_acts_on_are_named_not_refused(server, body, named):
    """Items, tools and options a client may send that mean nothing here (once 400s)."""
    reply = httpx.post(
        server.url + "/v1/responses",
        json={"model": TINY, "max_output_tokens": 2, **body},
        headers={"Authorization": "Bearer key-a"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-strata-ignored"] == named


def test_a_stored_response_can_be_read_back_and_deleted_by_its_tenant_only(server):
    client = _client(server)
    made = client.responses.create(model=TINY, input="Name a colour.", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(made.id).output_text == made.output_text
    stranger = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(made.id)
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):  # nor continued
        client.responses.create(model=TINY, previous_response_id=made.id, input="Another.", max_output_tokens=4)
    unstored = client.responses.create(model=TINY, input="Name a colour.", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


TINY_QUOTE_TOKEN = "1"  # the tiny model's only token whose text holds '"'
OPEN_ENDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "aliases": {"type": "array", "items": {"type": "string"}},
        "born": {"type": "integer"},
    },
    "required": ["name", "aliases", "born"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("max_tokens", [48, 120])
def test_open_ended_schemas_still_close_within_max_tokens(server, max_tokens):
    """Free strings the random model never ends by itself (its one token holding a quote is pushed
    out of reach: sampled at temperature 1, it once closed every string and the object within 120
    tokens): the reply closes in time, valid, cut by length."""
    reply = _client(server).chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Describe a person"}],
        max_tokens=max_tokens,
        temperature=1.0,
        logit_bias={TINY_QUOTE_TOKEN: -100},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": OPEN_ENDED}},
    )
    choice = reply.choices[0]
    jsonschema.validate(json.loads(choice.message.content), OPEN_ENDED)
    assert choice.finish_reason == "length" and reply.usage.completion_tokens <= max_tokens


def test_pydantic_parse_helpers_of_the_openai_client(server):
    from typing import Literal

    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        unit: Literal["c", "f"]

    client = _client(server)
    parsed = client.chat.completions.parse(
        model=TINY,
        messages=QUESTION,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
        max_tokens=80,
    )
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, Weather)
    answer = client.responses.parse(model=TINY, input="Weather?", text_format=Weather, max_output_tokens=80)
    assert isinstance(answer.output_parsed, Weather) or answer.status == "incomplete"


def test_earlier_tool_calls_and_results_are_in_the_exact_key(server):
    def history(arguments: str, result: str) -> list[dict]:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return QUESTION + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result},
        ]

    client = _client(server)
    ask = dict(model=TINY, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0)
    client.chat.completions.create(messages=history('{"city": "Lyon"}', "sunny"), **ask)
    same = client.chat.completions.with_raw_response.create(messages=history('{"city": "Lyon"}', "sunny"), **ask)
    other_call = client.chat.completions.with_raw_response.create(messages=history('{"city": "Oslo"}', "sunny"), **ask)
    other_result = client.chat.completions.with_raw_response.create(messages=history('{"city": "Lyon"}', "snow"), **ask)
    assert same.headers["x-cache-exact"].startswith("hit")
    assert other_call.headers["x-cache-exact"].startswith("miss") and other_result.headers["x-cache-exact"].startswith(
        "miss"
    )
