"""The Anthropic Messages API through the official `anthropic` client against a live `strata serve`:
create and stream, images, tools, stop sequences, every error class, count_tokens, cache usage
fields, pings while a prompt prefills, and the same conversation shared with the OpenAI API.

The 2.x client no longer takes sampling parameters as arguments; they go in `extra_body`, as agents
that still send `temperature` put them on the wire."""

from __future__ import annotations

import base64
import io
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.gateway.test_live_server import LiveServer

TINY = "tiny"
ADMIN = "admin-key"
GREEDY = {"temperature": 0}
NO_RESPONSE_CACHES = {"Cache-Control": "no-cache"}  # the engine's prefix cache itself answers
SYSTEM = "You are the build agent of a large repository. Follow the house rules exactly. " * 12
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "run_tests",
        "description": "Run the test suite",
        "input_schema": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]},
    },
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    live = LiveServer(
        tiny_model_path,
        tmp_path_factory.mktemp("anthropic") / "data",
        {
            "STRATA_API_KEYS": "key-a:tenant-a,key-b:tenant-b",
            "STRATA_MODEL_NAME": TINY,
            "STRATA_STREAM_PING_S": "0.02",  # the long prompt below prefills for longer than this
            "STRATA_NORMALIZE_OFF_TENANTS": "tenant-b",
            "STRATA_ADMIN_KEY": ADMIN,
            "STRATA_SSD_CAPACITY_BYTES": str(256 << 20),
            "STRATA_SSD_MIN_HITS": "1000",  # nothing reaches SSD by eviction: only what is pinned there
        },
    )
    yield live
    assert live.stop()


def _client(server, key="key-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def _png_base64(seed: int) -> str:
    pixels = (np.random.default_rng(seed).random((48, 64, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _adds_up(usage) -> int:
    """The prompt's size from the three fields that must add up to it."""
    assert min(usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) >= 0
    creation = usage.cache_creation
    assert creation.ephemeral_5m_input_tokens + creation.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_create_and_stream_give_the_same_answer(server):
    client = _client(server)
    kwargs = {"model": TINY, "max_tokens": 12, "messages": [{"role": "user", "content": "Write a haiku"}]}
    message = client.messages.create(**kwargs, extra_body=GREEDY, extra_headers=NO_RESPONSE_CACHES)
    assert message.type == "message" and message.role == "assistant" and message.model == TINY
    assert message.stop_reason in ("max_tokens", "end_turn") and message.content[0].type == "text"
    with client.messages.stream(**kwargs, extra_body=GREEDY, extra_headers=NO_RESPONSE_CACHES) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.usage.output_tokens == message.usage.output_tokens > 0
    counted = client.messages.count_tokens(model=TINY, messages=kwargs["messages"]).input_tokens
    assert _adds_up(final.usage) == _adds_up(message.usage) == counted


def test_image_blocks_base64_and_the_count_includes_the_image(server):
    client = _client(server)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png_base64(1)}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "Describe it"}]}]
    message = client.messages.create(model=TINY, max_tokens=6, messages=messages, extra_body=GREEDY)
    without = client.messages.count_tokens(model=TINY, messages=[{"role": "user", "content": "Describe it"}])
    counted = client.messages.count_tokens(model=TINY, messages=messages).input_tokens
    assert _adds_up(message.usage) == counted > without.input_tokens + 1  # the image's tokens are in the count


def test_counting_text_that_cannot_fit_the_context_is_refused_before_tokenising(server):
    client = _client(server)
    start = time.perf_counter()
    with pytest.raises(anthropic.BadRequestError) as refused:  # 3.9 MB took 12.3 s of CPU to count
        client.messages.count_tokens(model=TINY, messages=[{"role": "user", "content": "word " * 800_000}])
    assert time.perf_counter() - start < 2 and "context" in str(refused.value)
    fits = client.messages.count_tokens(model=TINY, messages=[{"role": "user", "content": "word " * 2000}])
    assert 2000 < fits.input_tokens < 5000  # counted (this tokenizer splits "word " in two)


def test_forced_tool_use_streams_input_json_and_round_trips(server):
    client = _client(server)
    ask = [{"role": "user", "content": "Read the README"}]
    forced = {"type": "tool", "name": "read_file"}
    message = client.messages.create(model=TINY, max_tokens=64, tools=TOOLS, tool_choice=forced, messages=ask)
    call = message.content[-1]
    assert message.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "read_file"
    assert isinstance(call.input.get("path"), str) and call.id.startswith("toolu_")
    with client.messages.stream(
        model=TINY, max_tokens=64, tools=TOOLS, tool_choice={"type": "any"}, messages=ask
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].name in ("read_file", "run_tests")
    turn = [
        *ask,
        {
            "role": "assistant",
            "content": [c.model_dump(include={"type", "id", "name", "input"}) for c in message.content],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "# Strata\nA caching gateway."},
                {"type": "text", "text": "Summarise it"},
            ],
        },
    ]
    answer = client.messages.create(model=TINY, max_tokens=8, tools=TOOLS, messages=turn, extra_body=GREEDY)
    assert answer.content and answer.usage.input_tokens + answer.usage.cache_read_input_tokens > 0
    turn[2]["content"][0]["tool_use_id"] = "toolu_nobody_made"
    with pytest.raises(anthropic.BadRequestError, match="no earlier assistant message made"):
        client.messages.create(model=TINY, max_tokens=8, tools=TOOLS, messages=turn)


def test_stop_sequences_end_the_answer_and_are_named(server):
    client = _client(server)
    ask = [{"role": "user", "content": "Count slowly"}]
    free = client.messages.create(model=TINY, max_tokens=24, messages=ask, extra_body=GREEDY)
    words = free.content[0].text.split()
    stop = words[len(words) // 2]
    stopped = client.messages.create(
        model=TINY, max_tokens=24, messages=ask, stop_sequences=[stop, "never-in-the-text-xyz"], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert free.content[0].text.startswith(stopped.content[0].text) and stop not in stopped.content[0].text


BAD_BODIES = [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "system", "content": "x"}]}, "last message"),
    ({"messages": [{"role": "assistant", "content": "prefill"}]}, "last message"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]}, "source"),
    ({"system": 42}, "system"),
    ({"system": [{"type": "image"}]}, "system.0"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"tools": [{"type": 42, "name": "web_search"}]}, "tools.0"),
    ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools.0.name"),
    ({"tool_choice": {"type": "tool", "name": "missing"}}, "tool_choice"),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "ttl"),
    ({"metadata": {"user_id": 7}}, "metadata.user_id"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 5}
            ]
        },
        "A maximum of 4 blocks with cache_control",
    ),
]


@pytest.mark.parametrize(("change", "named"), BAD_BODIES)
def test_bad_bodies_raise_the_clients_bad_request(server, change, named):
    body = {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **change}
    if named == "max_tokens" and "max_tokens" not in change:
        del body["max_tokens"]
    with pytest.raises(anthropic.BadRequestError) as raised:
        _client(server).post("/v1/messages", body=body, cast_to=object)
    error = raised.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    assert _client(server).messages.create(model=TINY, max_tokens=1, messages=[{"role": "user", "content": "ok"}])


def test_each_error_class_and_the_server_keeps_serving(server):
    ask = {"model": TINY, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.AuthenticationError) as raised:
        _client(server, key="wrong").messages.create(**ask)
    assert raised.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as raised:
        _client(server).messages.create(**{**ask, "model": "no-such-model"})
    assert raised.value.body["error"]["type"] == "not_found_error"
    too_large = httpx.post(
        server.url + "/v1/messages", content=b"{" + b" " * (21 << 20) + b"}", headers={"x-api-key": "key-a"}
    )
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
    broken = httpx.post(server.url + "/v1/messages", content=b"{not json", headers={"x-api-key": "key-a"})
    assert broken.status_code == 400 and broken.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError, match=r"context is|bytes of text"):
        _client(server).messages.create(**{**ask, "messages": [{"role": "user", "content": "long " * 40000}]})
    assert _client(server).messages.create(**ask).content  # still serving


def test_x_api_key_and_bearer_both_authenticate(server):
    body = {"model": TINY, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({"x-api-key": "key-b"}, {"Authorization": "Bearer key-b"}):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers).status_code == 200
    assert httpx.post(server.url + "/v1/messages", json=body).status_code == 401


def test_a_shared_breakpoint_is_read_from_cache_and_the_fields_add_up(server):
    client = _client(server)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(
        model=TINY, max_tokens=4, system=system, messages=[{"role": "user", "content": "First question?"}]
    )
    second = client.messages.create(
        model=TINY, max_tokens=4, system=system, messages=[{"role": "user", "content": "Second question?"}]
    )
    system_tokens = client.messages.count_tokens(model=TINY, system=SYSTEM, messages=[{"role": "user", "content": "?"}])
    assert first.usage.cache_creation_input_tokens > 100 and first.usage.cache_read_input_tokens == 0
    first_prompt = client.messages.count_tokens(
        model=TINY, system=system, messages=[{"role": "user", "content": "First question?"}]
    )
    assert _adds_up(first.usage) == first_prompt.input_tokens
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens  # whole blocks
    assert second.usage.cache_creation_input_tokens == 0
    assert _adds_up(second.usage) <= system_tokens.input_tokens + 8
    hour = [{"type": "text", "text": "Hourly. " + SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    pinned = client.messages.create(model=TINY, max_tokens=4, system=hour, messages=[{"role": "user", "content": "?"}])
    assert pinned.usage.cache_creation.ephemeral_1h_input_tokens > 100


def test_the_same_conversation_via_openai_anthropic_and_responses_shares_its_caches(server):
    system, question = SYSTEM + " Cross-API.", "Which layer answered?"
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    first = chat.chat.completions.create(
        model=TINY,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=6,
        temperature=0,
    )
    client = _client(server)
    kwargs = {"model": TINY, "max_tokens": 6, "system": system, "messages": [{"role": "user", "content": question}]}
    raw = client.messages.with_raw_response.create(**kwargs, extra_body=GREEDY, extra_headers=NO_RESPONSE_CACHES)
    assert raw.headers["x-cache-prefix"].startswith("hit;")
    assert raw.parse().usage.cache_read_input_tokens >= first.usage.prompt_tokens - 16
    replay = client.messages.with_raw_response.create(**kwargs, extra_body=GREEDY)
    assert replay.headers["x-cache-layer"] == "exact"  # the same request, whichever API stored it
    assert replay.parse().content[0].text == first.choices[0].message.content
    responses = chat.responses.with_raw_response.create(
        model=TINY, instructions=system, input=question, max_output_tokens=6, temperature=0, store=False
    )
    assert responses.headers["x-cache-layer"] == "exact"  # the Responses API parses into the same request
    assert responses.parse().output_text == first.choices[0].message.content
    other_tenant = _client(server, "key-b").messages.create(**kwargs, extra_body=GREEDY)
    assert other_tenant.usage.cache_read_input_tokens == 0


def test_end_users_are_kept_apart_by_metadata_user_id(server):
    """A question about the asker's own data is answered from cache only for the same end user
    (metadata.user_id here, the OpenAI `user` there: one end user across both APIs)."""
    client = _client(server)
    personal = "What is my current account balance?"
    kwargs = {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": personal}]}
    client.messages.create(**kwargs, metadata={"user_id": "alice"}, extra_body=GREEDY)
    bob = client.messages.with_raw_response.create(**kwargs, metadata={"user_id": "bob"}, extra_body=GREEDY)
    assert bob.headers["x-cache-layer"] == "engine" and bob.headers["x-cache-exact"].startswith("miss")
    again = client.messages.with_raw_response.create(**kwargs, metadata={"user_id": "alice"}, extra_body=GREEDY)
    assert again.headers["x-cache-layer"] == "exact"
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    as_alice = chat.chat.completions.with_raw_response.create(
        model=TINY, messages=kwargs["messages"], max_tokens=4, temperature=0, user="alice"
    )
    as_carol = chat.chat.completions.with_raw_response.create(
        model=TINY, messages=kwargs["messages"], max_tokens=4, temperature=0, user="carol"
    )
    assert as_alice.headers["x-cache-layer"] == "exact" and as_carol.headers["x-cache-layer"] == "engine"
    agent_id = (
        '{"device_id": "' + "d" * 64 + '", "account_uuid": "' + "a" * 36 + '", "session_id": "' + "s" * 200 + '"}'
    )
    long_id = client.messages.create(**kwargs, metadata={"user_id": agent_id}, extra_body=GREEDY)
    assert long_id.content  # an id past the 256-character limit stands as its digest, not a 400


def test_pings_while_a_long_prompt_prefills_and_the_client_still_reads_it(server):
    body = {
        "model": TINY,
        "max_tokens": 4,
        "stream": True,
        "system": SYSTEM * 2 + " pinged",
        "messages": [{"role": "user", "content": "Go"}],
    }
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": "key-a"}) as response:
        text = response.read().decode()
    events = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert events[0] == "ping" and events.index("message_start") > 0 and events[-1] == "message_stop"
    client = _client(server)
    with client.messages.stream(
        **{k: v for k, v in body.items() if k != "stream"} | {"system": SYSTEM * 2 + " again"}
    ) as stream:
        assert stream.get_final_message().usage.output_tokens > 0


def test_openai_streams_send_comment_pings_while_a_long_prompt_waits_and_clients_skip_them(server):
    """A queued or prefilling OpenAI stream once sent nothing until its prompt was in; now it sends
    `: ping` comment lines (as the Anthropic stream sends `ping` events), which every SSE client skips."""

    def uncached(tag: str) -> str:  # a prompt no other test sends: its prefill takes longer than a ping
        return " ".join(f"{tag} rule {n} of the ping drill." for n in range(150))

    messages = [{"role": "system", "content": uncached("raw")}, {"role": "user", "content": "Go"}]
    body = {"model": TINY, "max_tokens": 4, "stream": True, "messages": messages}
    auth = {"Authorization": "Bearer key-a"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth) as response:
        text = response.read().decode()
    assert text.startswith(": ping\n\n") and '"content"' in text and text.endswith("data: [DONE]\n\n")
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    messages[0]["content"] = uncached("sdk")
    chunks = list(chat.chat.completions.create(model=TINY, max_tokens=4, stream=True, messages=messages))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    stream = chat.responses.create(
        model=TINY, max_output_tokens=4, stream=True, instructions=uncached("responses"), input="Go"
    )
    kinds = [event.type for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_an_error_after_pings_ends_an_openai_stream_in_the_apis_own_events(server):
    too_long = "word " * 60_000  # ~120,000 tokens: past the tiny model's context, found once tokenised
    auth = {"Authorization": "Bearer key-a"}
    chat = {"model": TINY, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": too_long}]}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, headers=auth) as response:
        text = response.read().decode()
    assert response.status_code == 200 and text.startswith(": ping")
    assert '"code":"context_length_exceeded"' in text and text.endswith("data: [DONE]\n\n")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    with pytest.raises(openai.APIError, match="context"):
        list(client.chat.completions.create(model=TINY, max_tokens=4, stream=True, messages=chat["messages"]))
    responses = {"model": TINY, "max_output_tokens": 4, "stream": True, "input": too_long}
    with httpx.stream("POST", server.url + "/v1/responses", json=responses, headers=auth) as response:
        events = [
            line.removeprefix("event: ") for line in response.read().decode().splitlines() if line.startswith("event: ")
        ]
    assert events == ["response.created", "error", "response.failed"]


def _attributed(cch: str) -> list[dict]:
    line = f"x-anthropic-billing-header: cc_version=2.1.37.8f1; cc_entrypoint=cli; cch={cch};"
    return [{"type": "text", "text": line}, {"type": "text", "text": "Attributed. " + SYSTEM}]


def test_requests_differing_only_in_the_attribution_line_share_their_prefix(server):
    ask = {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": "Plan the change"}]}
    client = _client(server)
    client.messages.create(**ask, system=_attributed("1a2b3"), extra_body=GREEDY)
    raw = client.messages.with_raw_response.create(
        **ask, system=_attributed("9f8e7"), extra_body=GREEDY, extra_headers=NO_RESPONSE_CACHES
    )
    prompt = client.messages.count_tokens(model=TINY, system=_attributed("00000"), messages=ask["messages"])
    assert raw.headers["x-cache-prefix"].startswith("hit;") and raw.headers["x-cache-prefix"].endswith("normalized=1")
    assert raw.parse().usage.cache_read_input_tokens >= prompt.input_tokens - 32  # all but the last partial block
    opted_out = _client(server, "key-b")
    opted_out.messages.create(**ask, system=_attributed("1a2b3"), extra_body=GREEDY)
    kept = opted_out.messages.with_raw_response.create(
        **ask, system=_attributed("9f8e7"), extra_body=GREEDY, extra_headers=NO_RESPONSE_CACHES
    )
    assert "normalized" not in kept.headers["x-cache-prefix"] and "in=system" in kept.headers["x-cache-prefix"]
    assert kept.parse().usage.cache_read_input_tokens < raw.parse().usage.cache_read_input_tokens / 4


def _ssd_blocks(server) -> int:
    stats = httpx.get(server.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return stats["engine_caches"]["ssd"]["num_blocks"]


def test_openai_24h_retention_pins_the_prompt_on_ssd_and_cache_key_is_accepted(server):
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    messages = [{"role": "system", "content": "Retained. " + SYSTEM}, {"role": "user", "content": "Keep me a day"}]
    before = _ssd_blocks(server)
    chat.chat.completions.create(
        model=TINY,
        messages=messages,
        max_tokens=2,
        extra_body={"prompt_cache_retention": "24h", "prompt_cache_key": "agent-7"},
    )
    deadline = time.monotonic() + 10
    while _ssd_blocks(server) <= before and time.monotonic() < deadline:
        time.sleep(0.1)  # the SSD writer runs beside the engine
    prompt = chat.chat.completions.create(model=TINY, messages=messages, max_tokens=1).usage.prompt_tokens
    assert _ssd_blocks(server) - before >= prompt // 32 - 1  # the prompt's whole blocks, at once
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        chat.chat.completions.create(
            model=TINY, messages=messages, max_tokens=1, extra_body={"prompt_cache_retention": "forever"}
        )
