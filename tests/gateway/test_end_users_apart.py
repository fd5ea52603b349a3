"""A tenant listed in STRATA_ISOLATE_END_USERS keeps its end users apart: one end user's prompt is
never another's cached prefix, answer or draft, so it cannot be timed. A real `strata serve`, the
official openai and anthropic clients, and the side channel measured from outside as ROC AUC (the
attacker's answer time when the victim did or did not send the secret prompt)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from evals.bench_timing_channel import API_KEYS, KEYS, measure
from kvcache import end_user_salt, tenant_salt
from tests.conftest import TINY
from tests.gateway.test_live_server import LiveServer

# The tiny model's after-answer work (storing the answer in the response layers) ends well within
# this (the benchmark's default of 0.5 s is for larger models).
SETTLE_S = 0.15
SYSTEM = "You answer questions about the harbour timetable. " * 40  # ~400 tokens: many blocks


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    live = LiveServer(
        tiny_model_path,
        tmp_path_factory.mktemp("apart") / "data",
        {"STRATA_API_KEYS": API_KEYS, "STRATA_MODEL_NAME": TINY, "STRATA_ISOLATE_END_USERS": "apart"},
    )
    yield live
    assert live.stop()


def _ask(server, tenant: str, user: str | None, question: str, system: str = SYSTEM):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0)
    extra = {"user": user} if user else {}
    return client.chat.completions.with_raw_response.create(
        model=TINY,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
        **extra,
    )


def _cached(raw) -> int:
    return raw.parse().usage.prompt_tokens_details.cached_tokens


def test_an_end_user_salt_is_the_tenants_and_the_users_alone():
    tenant = tenant_salt(b"s" * 32, "apart")
    assert end_user_salt(tenant, "u1") == end_user_salt(tenant, "u1")
    assert len({tenant, end_user_salt(tenant, "u1"), end_user_salt(tenant, "u2")}) == 3
    assert end_user_salt(tenant, "u1") != end_user_salt(tenant_salt(b"s" * 32, "other"), "u1")


def test_end_users_of_an_isolating_tenant_share_no_prefix_and_no_answer(server):
    _ask(server, "apart", "u1", "When does the first ferry leave?")
    other = _ask(server, "apart", "u2", "When does the first ferry leave?")
    assert other.headers["x-cache-layer"] == "engine" and _cached(other) == 0
    assert other.headers["x-cache-prefix"].startswith("miss; cached=0")
    own = _ask(server, "apart", "u1", "And the last one?")
    assert _cached(own) >= 256  # the same end user still reuses its own prefix
    again = _ask(server, "apart", "u1", "When does the first ferry leave?")
    assert again.headers["x-cache-layer"] == "exact"
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key=KEYS["apart"], max_retries=0)
    message = anthropic_client.messages.with_raw_response.create(
        model=TINY,
        system=SYSTEM,
        max_tokens=4,
        messages=[{"role": "user", "content": "Is there a night boat?"}],
        metadata={"user_id": "u3"},
    )
    assert message.parse().usage.cache_read_input_tokens == 0


def test_end_users_of_other_tenants_share_as_before(server):
    system = "You answer questions about the mountain railway. " * 40
    _ask(server, "shared", "u1", "When does the first train leave?", system)
    other = _ask(server, "shared", "u2", "When does the first train leave?", system)
    assert other.headers["x-cache-layer"] == "exact"
    later = _ask(server, "shared", "u2", "And the last one?", system)
    assert _cached(later) >= 256
    # in the isolating tenant, requests that name no end user share with each other (the tenant's salt)
    _ask(server, "apart", None, "Where is the ticket office?", system)
    anonymous = _ask(server, "apart", None, "Is it open on Sundays?", system)
    assert _cached(anonymous) >= 256


def test_a_stored_response_continues_only_under_its_own_end_user_in_an_isolating_tenant(server):
    """Decided: in a tenant that keeps its end users apart, previous_response_id continues a stored
    response only for the end user it was stored for (another end user's, or none, is 404 as an
    unknown id is: no oracle); other tenants' end users share stored responses, as in OpenAI's API."""

    def client(tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0)

    def follow(tenant: str, first_id: str, user: str | None):
        extra = {"user": user} if user else {}
        return client(tenant).responses.create(
            model=TINY, input="Which berth?", max_output_tokens=4, previous_response_id=first_id, **extra
        )

    for tenant, isolating in (("apart", True), ("shared", False)):
        first = client(tenant).responses.create(
            model=TINY, input="Remember the berth number 41.", max_output_tokens=4, user="u1", store=True
        )
        assert follow(tenant, first.id, "u1").output_text is not None  # its own end user continues it
        for stranger in ("u2", None):
            if isolating:
                with pytest.raises(openai.NotFoundError, match="no stored response"):
                    follow(tenant, first.id, stranger)
            else:
                assert follow(tenant, first.id, stranger).output_text is not None


@pytest.mark.serial
def test_the_timing_side_channel_closes_for_an_isolating_tenant(server):
    """40 trials each: where end users share, the attacker's time tells whether the victim sent the
    secret (AUC >= 0.9); where they are apart it does not (AUC within 0.2-0.8: 0.5 +- 3.3 standard
    deviations of the AUC of 20 + 20 trials that tell nothing)."""
    shared = measure(server.url, "shared", 40, 40, seed=1, model=TINY, settle_s=SETTLE_S)
    apart = measure(server.url, "apart", 40, 40, seed=2, model=TINY, settle_s=SETTLE_S)
    print(shared, apart)
    assert shared["cached_tokens_when_sent"] > 0 and shared["auc"] >= 0.9
    assert apart["cached_tokens_when_sent"] == 0 and 0.2 <= apart["auc"] <= 0.8
