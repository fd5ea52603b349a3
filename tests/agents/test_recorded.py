"""What the coding agents sent (fixtures/, recorded by `python -m tests.agents.record` from the pinned
releases and the ones the issue named), replayed in-process without the agents, with the turns a
random-weight model never takes the agents to: tool calls and their results, an image in a tool result.

Every field the agents send is one the server knows (acted on, or ignored by decision and named in
X-Strata-Ignored); every request answers 200; a session's next request reads its prompt from the cache;
system messages mid-conversation keep that prefix whether the template renders them in place or they
are folded into a user turn, and never reach another tenant's cache; the non-streamed answers parse
with the official clients' own types."""

from __future__ import annotations

import base64
import copy
import dataclasses
import io
import json
import shutil
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from litestar.testing import TestClient
from PIL import Image

from gateway.formats import anthropic_api, responses_api
from gateway.http.app import create_app
from gateway.requests import schemas
from gateway.settings import Limits, Settings
from tests.agents.live import AGENT_MODEL
from tests.conftest import built_model

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = sorted(FIXTURES.glob("*.json"))
KNOWN_FIELDS = {
    "/v1/messages": anthropic_api.MESSAGE_FIELDS | set(anthropic_api.MESSAGE_NEUTRAL),
    "/v1/responses": responses_api.RESPONSE_FIELDS | set(responses_api.RESPONSE_NEUTRAL),
    "/v1/chat/completions": schemas.CHAT_FIELDS | set(schemas.CHAT_NEUTRAL),
}
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
MIN_READ_SHARE = 0.98
STRICT_TEMPLATE_GUARD = (
    "{%- for message in messages %}{%- if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}"
)


def _fixture(path: Path) -> dict:
    return json.loads(path.read_text())


def _settings(model: Path, data_dir: Path) -> Settings:
    return Settings(
        model=str(model),
        data_dir=data_dir,
        model_name=AGENT_MODEL.name,
        api_keys=KEYS,
        exact_store="off",
        semantic_enabled=False,
        kv_budget_bytes=1 << 30,
        limits=Limits(max_body_bytes=20 << 20),
    )


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = _settings(built_model(AGENT_MODEL), tmp_path_factory.mktemp("recorded") / "data")
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def strict_client(tmp_path_factory):
    """The agents' model with a template that refuses system messages after the first (as the real
    Qwen3.5 and Gemma templates do): later ones are folded into a user turn."""
    folder = tmp_path_factory.mktemp("strict") / "strict-agent-model"
    shutil.copytree(built_model(AGENT_MODEL), folder)
    template = STRICT_TEMPLATE_GUARD + (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    with TestClient(create_app(_settings(folder, folder.parent / "data"))) as test_client:
        yield test_client


# -- replaying ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    status: int
    headers: dict
    text: str
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def read_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ignored(self) -> str:
        return self.headers.get("x-strata-ignored", "")


def send(client: TestClient, path: str, body: dict, key: str = "key-a", headers: dict | None = None) -> Answer:
    sent = {
        "x-api-key" if path.startswith("/v1/messages") else "authorization": key
        if path.startswith("/v1/messages")
        else f"Bearer {key}"
    }
    response = client.post(path, json=body, headers=sent | (headers or {}))
    answer = Answer(response.status_code, dict(response.headers), response.text)
    if response.status_code == 200:
        answer.prompt_tokens, answer.cached_tokens = _usage(path.split("?")[0], response.text, bool(body.get("stream")))
    return answer


def _usage(path: str, text: str, streamed: bool) -> tuple[int, int]:
    """(prompt tokens, read from the cache) as each API reports them."""
    if not streamed:
        return _usage_of(path, json.loads(text))
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    if path == "/v1/messages":
        usage = next(e["message"]["usage"] for e in events if e["type"] == "message_start")
        return _usage_of(path, {"usage": usage})
    if path == "/v1/responses":
        return _usage_of(path, next(e["response"] for e in events if e["type"] == "response.completed"))
    return _usage_of(path, next(e for e in events if e.get("usage")))


def _usage_of(path: str, body: dict) -> tuple[int, int]:
    usage = body["usage"]
    if path == "/v1/messages":
        read = usage["cache_read_input_tokens"]
        return usage["input_tokens"] + read + usage["cache_creation_input_tokens"], read
    if path == "/v1/responses":
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def replay(client: TestClient, fixture: dict, key: str = "key-a") -> list[Answer]:
    return [send(client, e["path"], e["body"], key, _agent_headers(e)) for e in fixture["exchanges"]]


def _agent_headers(exchange: dict) -> dict:
    kept = ("anthropic-beta", "anthropic-version", "user-agent", "session-id", "x-claude-code-session-id")
    return {name: value for name, value in exchange["headers"].items() if name in kept}


# -- the recorded sessions ------------------------------------------------------------------------


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_every_field_an_agent_sends_is_known(path):
    """A field the server neither acts on nor ignores by decision fails here: record, then decide."""
    for exchange in _fixture(path)["exchanges"]:
        route = exchange["path"].split("?")[0]
        unknown = set(exchange["body"]) - KNOWN_FIELDS[route]
        assert not unknown, f"{path.stem} sends {sorted(unknown)} on {route}"


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_a_recorded_session_replays_and_reads_its_prefix_from_the_cache(client, path):
    answers = replay(client, _fixture(path))
    assert all(a.status == 200 for a in answers), [(a.status, a.text[:300]) for a in answers]
    assert answers[-1].read_share >= MIN_READ_SHARE, (answers[-1].prompt_tokens, answers[-1].cached_tokens)
    for answer in answers:  # the conversation is rendered whole: no message or item is left out
        assert not any(note.startswith(("messages", "input")) for note in answer.ignored.split(", ")), answer.ignored


def test_claude_codes_fields_are_acted_on(client):
    """Its system message inside `messages` is rendered where it stands; thinking and effort are
    named as ignored only because the tiny model's template has no switch; its max_tokens (128000
    for the Opus name it asks for by default) is lowered to the server's output limit, and said so."""
    fixture = _fixture(FIXTURES / "claude-code-2.1.332.json")
    last = replay(client, fixture)[-1]
    assert last.headers["x-strata-system-messages"] == "in_place=1"
    assert set(last.ignored.split(", ")) == {
        "thinking (no switch in this model's template)",
        "effort (no switch in this model's template)",
    }
    assert fixture["exchanges"][-1]["body"]["max_tokens"] == 128000
    assert last.headers["x-strata-max-tokens"] == "asked=128000; allowed=32768; by=output_limit"


def test_codex_tools_it_cannot_use_here_are_named_not_refused(client):
    answers = replay(client, _fixture(FIXTURES / "codex-named-model-0.171.0.json"))
    notes = answers[-1].ignored.split(", ")
    assert "client_metadata" in notes and any(n.endswith("(web_search: not offered)") for n in notes), notes


def test_mid_conversation_system_messages_stay_with_their_tenant(client):
    """Tenant b sends tenant a's recorded session: nothing of a's prefix is read, system messages included."""
    fixture = _fixture(FIXTURES / "claude-code-2.1.328.json")
    replay(client, fixture, key="key-a")
    other = send(client, "/v1/messages", fixture["exchanges"][-1]["body"], key="key-b")
    assert other.status == 200 and other.cached_tokens == 0


def test_a_template_that_refuses_later_system_turns_gets_them_folded_and_keeps_the_prefix(strict_client):
    answers = replay(strict_client, _fixture(FIXTURES / "claude-code-2.1.332.json"))
    assert all(a.status == 200 for a in answers), [a.text[:300] for a in answers]
    assert answers[-1].headers["x-strata-system-messages"] == "wrapped=1"
    assert answers[-1].read_share >= MIN_READ_SHARE


# -- turns the agents' test model never reaches: tool calls, results, an image in a result ---------


def _png() -> str:
    pixels = (np.random.default_rng(7).random((48, 64, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _claude_turns(body: dict) -> list[dict]:
    """Claude Code's next turns: a Read call and its result, then a screenshot read as a tool result
    (the cache marker moves to the last message each turn, as Claude Code moves it)."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png()}}
    steps = [
        ("toolu_01", "Read", {"file_path": "hello.py"}, [{"type": "text", "text": 'print("hello")'}]),
        ("toolu_02", "Read", {"file_path": "screen.png"}, [image]),
    ]
    turns, messages = [], _unmarked(body["messages"])
    for call_id, name, arguments, result in steps:
        messages = messages + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": name, "input": arguments}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]},
        ]
        marked = copy.deepcopy(messages)
        marked[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        turns.append(body | {"messages": marked})
    return turns


def _unmarked(messages: list[dict]) -> list[dict]:
    """The messages without the last one's cache marker (the system message keeps its own)."""
    messages = copy.deepcopy(messages)
    for message in messages[-1:]:
        for block in message["content"] if isinstance(message["content"], list) else []:
            block.pop("cache_control", None)
    return messages


def _codex_turns(body: dict) -> list[dict]:
    """Codex's next turns: a shell call, a custom (freeform) tool call, then view_image's output."""
    image = {"type": "input_image", "image_url": "data:image/png;base64," + _png()}
    steps = [
        [
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": '{"cmd": "cat hello.py"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": 'print("hello")'},
        ],
        [
            {"type": "custom_tool_call", "call_id": "call_2", "name": "exec", "input": "text('hi')"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "hi"},
        ],
        [
            {"type": "function_call", "call_id": "call_3", "name": "view_image", "arguments": '{"path": "s.png"}'},
            {"type": "function_call_output", "call_id": "call_3", "output": [image]},
        ],
    ]
    turns, items = [], list(body["input"])
    for step in steps:
        items = items + step
        turns.append(body | {"input": items})
    return turns


def _opencode_turns(body: dict) -> list[dict]:
    """opencode's next turns: a read call and its result, then a result that carries an image."""
    image = [
        {"type": "text", "text": "screen:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png()}},
    ]
    steps = [
        ("call_1", "read", '{"filePath": "hello.py"}', 'print("hello")'),
        ("call_2", "read", '{"filePath": "s.png"}', image),
    ]
    turns, messages = [], list(body["messages"])
    for call_id, name, arguments, result in steps:
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
        turns.append(body | {"messages": messages})
    return turns


NEXT_TURNS = {"claude-code": _claude_turns, "codex": _codex_turns, "opencode": _opencode_turns}


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_tool_turns_and_images_in_tool_results_continue_the_prefix(client, path):
    fixture = _fixture(path)
    replay(client, fixture)
    last = fixture["exchanges"][-1]
    for number, body in enumerate(NEXT_TURNS[fixture["agent"]](last["body"]), start=3):
        answer = send(client, last["path"], body)
        assert answer.status == 200, (number, answer.text[:500])
        assert answer.read_share >= MIN_READ_SHARE, (number, answer.prompt_tokens, answer.cached_tokens)
        assert not any(n.startswith(("messages", "input")) for n in answer.ignored.split(", ")), answer.ignored


def test_unstreamed_answers_parse_with_the_official_clients(client):
    for name, validate in (
        ("claude-code-2.1.332", anthropic.types.Message.model_validate),
        ("codex-0.171.0", openai.types.responses.Response.model_validate),
        ("opencode-1.18.33", openai.types.chat.ChatCompletion.model_validate),
    ):
        exchange = _fixture(FIXTURES / f"{name}.json")["exchanges"][-1]
        answer = send(client, exchange["path"], exchange["body"] | {"stream": False})
        assert answer.status == 200, answer.text[:300]
        assert validate(json.loads(answer.text))
