"""Small units: trace rendering, settings parsing, tenant salts, schema defaults."""

import pytest

from gateway.auth import Authenticator, load_server_secret
from gateway.errors import ApiError
from gateway.schemas import parse_chat_request
from gateway.settings import Limits, parse_api_keys
from gateway.trace import HIT, LayerOutcome, Trace


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
    secret = load_server_secret(tmp_path)
    assert load_server_secret(tmp_path) == secret
    auth = Authenticator({"k1": "a", "k2": "b"}, None, secret)
    a, b = auth.caller("Bearer k1"), auth.caller("Bearer k2")
    assert a.tenant == "a" and b.tenant == "b" and a.salt != b.salt
    other_server = Authenticator({"k1": "a"}, None, load_server_secret(tmp_path / "other"))
    assert other_server.caller("Bearer k1").salt != a.salt
    with pytest.raises(ApiError) as denied:
        auth.caller("Bearer nope")
    assert denied.value.status == 401


def test_admin_routes_need_the_admin_key(tmp_path):
    secret = load_server_secret(tmp_path)
    with pytest.raises(ApiError) as disabled:
        Authenticator({}, None, secret).require_admin("Bearer x")
    assert disabled.value.status == 403
    Authenticator({}, "adm", secret).require_admin("Bearer adm")


def test_request_defaults_and_content_parts():
    request = parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "data:x"}]},
        {"role": "assistant", "content": None}]}, Limits(default_max_tokens=77))
    assert request.sampling.max_tokens == 77 and request.sampling.temperature == 1.0
    assert request.num_images == 1 and request.stream is False
    assert request.messages[2].parts[0].text == ""
