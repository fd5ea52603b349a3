"""Small units: trace rendering, settings parsing, tenant salts, schema defaults."""

import dataclasses
import re
from pathlib import Path

import pytest

from gateway.checkpoints import builder_digest
from gateway.observability.trace import HIT, LayerOutcome, Trace
from gateway.requests.errors import ApiError
from gateway.requests.schemas import parse_chat_request
from gateway.settings import LIMITS, SETTINGS, Limits, Settings, parse_api_keys, settings_from_env
from gateway.tenancy.auth import Authenticator, load_server_secret


def test_trace_renders_layer_headers_and_server_timing():
    trace = Trace()
    trace.record("prefix", LayerOutcome.of(HIT, cached=3072, prompt=3100, tier="ram"))
    trace.time("exact", 0.1)
    trace.time("prefill", 80.5)
    headers = trace.headers()
    assert headers["X-Cache-Prefix"] == "hit; cached=3072; prompt=3100; tier=ram"
    assert headers["X-Cache-Exact"] == "bypass; reason=disabled"
    assert headers["Server-Timing"] == "exact;dur=0.10, prefill;dur=80.50"


def test_api_keys_parse_and_reject_bad_entries():
    assert parse_api_keys("k1:a, k2:b") == {"k1": "a", "k2": "b"}
    assert parse_api_keys("") == {}
    with pytest.raises(ValueError):
        parse_api_keys("k1")


def test_tenant_salts_are_secret_derived_and_stable(tmp_path):
    secret = load_server_secret(tmp_path / "server.secret")
    assert load_server_secret(tmp_path / "server.secret") == secret and len(secret) == 32
    assert [p.name for p in tmp_path.iterdir()] == ["server.secret"]  # nothing left aside
    auth = Authenticator({"k1": "a", "k2": "b"}, None, secret)
    a, b = auth.caller("Bearer k1"), auth.caller("Bearer k2")
    assert a.tenant == "a" and b.tenant == "b" and a.salt != b.salt
    other_server = Authenticator({"k1": "a"}, None, load_server_secret(tmp_path / "other" / "server.secret"))
    assert other_server.caller("Bearer k1").salt != a.salt
    with pytest.raises(ApiError) as denied:
        auth.caller("Bearer nope")
    assert denied.value.status == 401


def test_admin_routes_need_the_admin_key(tmp_path):
    secret = load_server_secret(tmp_path / "server.secret")
    with pytest.raises(ApiError) as disabled:
        Authenticator({}, None, secret).require_admin("Bearer x")
    assert disabled.value.status == 403
    Authenticator({}, "adm", secret).require_admin("Bearer adm")


def test_request_defaults_and_content_parts():
    request = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "data:x"}],
                },
                {"role": "assistant", "content": None},
            ],
        },
        Limits(default_max_tokens=77),
    )
    assert request.sampling.max_tokens == 77 and request.sampling.temperature == 1.0
    assert request.num_images == 1 and request.stream is False
    assert request.messages[2].parts[0].text == ""


@pytest.mark.parametrize(
    "text,value",
    [(t, True) for t in ("1", "true", "TRUE", "yes", "on", " On ")]
    + [(f, False) for f in ("0", "false", "False", "no", "off")],
)
def test_boolean_settings_accept_every_usual_spelling(text, value, tmp_path):
    settings = settings_from_env(
        "demo", tmp_path, "h", 1, {"STRATA_ALLOW_REMOTE_IMAGES": text, "STRATA_SEMANTIC": text}
    )
    assert settings.allow_remote_images is value and settings.semantic_enabled is value


@pytest.mark.parametrize(
    "variable,value",
    [
        ("STRATA_SEMANTIC", "maybe"),
        ("STRATA_MAX_QUEUE", "ten"),
        ("STRATA_EXACT_STORE", "redis"),
        ("STRATA_REMOTE_IMAGE_ALLOW", "10.0.0.0/33"),
        ("STRATA_REQUEST_TIMEOUT_S", "soon"),
    ],
)
def test_a_bad_setting_names_its_variable(variable, value, tmp_path):
    with pytest.raises(ValueError, match=variable):
        settings_from_env("demo", tmp_path, "h", 1, {variable: value})


def test_unset_variables_keep_the_defaults_declared_once(tmp_path):
    assert settings_from_env("demo", tmp_path, "h", 1, {}) == Settings(
        model="demo", data_dir=tmp_path, host="h", port=1
    )


def test_the_docs_list_every_setting_as_declared():
    """Each setting is declared once (gateway/settings.py: SETTINGS, its help is its row in the
    docs' settings table): the table lists exactly the declared variables, each with its declared text."""
    readme = (Path(__file__).parent.parent.parent / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\| `(STRATA_[A-Z_]+)(?:=[^`]*)?` \| (.*) \|$", readme, re.M)
    assert sorted(env for env, _ in rows) == sorted(s.env for s in SETTINGS)
    declared = {s.env: s.help for s in SETTINGS}
    assert [env for env, text in rows if declared[env] != text] == []


def test_every_setting_names_a_real_field_once():
    names = {f.name for f in dataclasses.fields(Settings)} | {LIMITS + f.name for f in dataclasses.fields(Limits)}
    assert all(s.field in names for s in SETTINGS)
    assert len({s.field for s in SETTINGS}) == len({s.env for s in SETTINGS}) == len(SETTINGS)


def test_serve_help_lists_every_flag_and_keeps_secrets_off_the_command_line(capsys):
    from gateway.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    for setting in SETTINGS:
        assert setting.env in shown
        assert (setting.flag is not None and setting.flag in shown) is not setting.secret


def test_a_flag_beats_the_environment_and_its_errors_name_the_flag(tmp_path):
    env = {"STRATA_MAX_QUEUE": "3"}
    assert settings_from_env("demo", tmp_path, "h", 1, env, {"max_queue": "7"}).max_queue == 7
    assert settings_from_env("demo", tmp_path, "h", 1, env, {"max_queue": None}).max_queue == 3
    with pytest.raises(ValueError, match="--max-queue"):
        settings_from_env("demo", tmp_path, "h", 1, env, {"max_queue": "seven"})


def test_builder_digest_keys_the_cached_test_model():
    assert builder_digest("tiny") == builder_digest("tiny") != builder_digest("demo")


def test_the_fair_lane_takes_tenants_in_turn():
    """A tenant with many queued turns waits behind one turn of each other tenant, not all of theirs;
    a waiter cancelled in the queue is skipped."""
    import asyncio

    from gateway.serving.embeddings import FairLane

    async def run() -> list[str]:
        lane, order = FairLane(), []

        async def work(tenant: str) -> None:
            async with lane.turn(tenant):
                order.append(tenant)
                await asyncio.sleep(0.01)

        first = asyncio.create_task(work("flood"))
        await asyncio.sleep(0)  # holds the lane
        queued = [asyncio.create_task(work("flood")) for _ in range(4)]
        await asyncio.sleep(0)
        late = [asyncio.create_task(work("quiet")), asyncio.create_task(work("other"))]
        gone = asyncio.create_task(work("gone"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(first, *queued, *late, return_exceptions=True)
        assert not lane.busy and not lane.waiting
        return order

    order = asyncio.run(run())
    assert order[:4] == ["flood", "flood", "quiet", "other"] and order.count("flood") == 5 and "gone" not in order


# -- Anthropic answer shapes ---------------------------------------------------------------------


def _events(stream_bytes: bytes) -> list[dict]:
    import json as _json

    return [_json.loads(line[6:]) for line in stream_bytes.decode().splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    "text",
    [
        "<think>\nFirst a plan.\n</think>\n\nThe answer.",
        "Plain answer, <think> later is just text",
        "<think>cut short before it closed",
        "",
        "<thi",
    ],
)
def test_a_streamed_anthropic_answer_has_the_blocks_of_the_whole_one(text):
    """Streamed one character at a time, the events rebuild exactly the blocks the JSON answer has:
    a leading <think>...</think> becomes a thinking block, whatever else is text."""
    from gateway.formats.anthropic_api import MessageStream, content_blocks
    from gateway.formats.openai_format import Completion

    whole = Completion("id", 0, 4, 0, text=text, whole=True)
    partial = Completion("id", 0, 4, 0)
    stream = MessageStream("msg_1", "m", partial, None)
    out = b""
    for character in text:
        partial.text += character
        out += stream.delta()
    out += stream.finish({"output_tokens": 1})
    blocks: list[dict] = []
    for event in _events(out):
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            blocks[event["index"]]["text"] += event["delta"]["text"]
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "thinking_delta":
            blocks[event["index"]]["thinking"] += event["delta"]["thinking"]
    expected = content_blocks(whole, None)
    assert [b.get("text", b.get("thinking")) for b in blocks] == [b.get("text", b.get("thinking")) for b in expected]
    assert [b["type"] for b in blocks] == [b["type"] for b in expected]


def test_a_step_prompt_budget_off_the_block_grid_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="STRATA_STEP_PROMPT_TOKENS must be a multiple of STRATA_KV_BLOCK_SIZE"):
        settings_from_env("demo", tmp_path, "h", 1, {"STRATA_STEP_PROMPT_TOKENS": "100"})
    assert settings_from_env("demo", tmp_path, "h", 1, {"STRATA_STEP_PROMPT_TOKENS": "64"}).step_prompt_tokens == 64
