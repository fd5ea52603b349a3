"""GET /admin/diagnosis on the real engine: workloads built to produce each diagnosis (a tiny RAM
budget evicts; a system prompt that changes every request diverges), and X-Cache-Prefix naming where
a prompt diverged (system prompt, an earlier turn, an image, the latest message)."""

from __future__ import annotations

import dataclasses

import pytest
from litestar.testing import TestClient

from gateway.engine import CacheConfig, Engine, EngineConfig
from gateway.http.app import create_app
from gateway.observability.diagnosis import RequestRecord, diagnose
from gateway.observability.trace import PrefixFacts
from tests.conftest import TINY, png_data_url

ADMIN = {"Authorization": "Bearer admin-key"}
QUESTION = "Which records mention the storm of 1911, and on which shelves are they kept?"


def _system(i: int) -> str:
    return (
        f"Archive desk {i}. You answer questions about the museum's catalogue, shelf by shelf, and you cite "
        f"every record you use. Desk {i} covers the maritime collection. "
    ) * 3


def _ask(client, messages, **extra):
    body = {"model": TINY, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def _user(text, image=None):
    content = [{"type": "text", "text": text}]
    if image:
        content.append({"type": "image_url", "image_url": {"url": image}})
    return {"role": "user", "content": content}


@pytest.fixture
def admin_settings(settings):
    return dataclasses.replace(settings, admin_key="admin-key")


def test_a_tiny_ram_budget_is_named_the_bottleneck(tiny_model_path, admin_settings):
    """Five conversations, interleaved: by each one's second turn, its first turn's blocks were pushed
    out of a RAM budget that holds about two prompts."""
    small = Engine(
        tiny_model_path,
        TINY,
        EngineConfig(
            max_queue=8,
            step_prompt_tokens=64,
            caches=CacheConfig(prefix_budget_bytes=1536 << 10, vision_budget_bytes=0, block_size=16, prefix_idle_s=0),
        ),
    )
    small.start()
    try:
        with TestClient(create_app(admin_settings, engine=small)) as client:
            histories = [[{"role": "system", "content": _system(i)}, _user(QUESTION)] for i in range(5)]
            for history in histories:
                answer = _ask(client, history).json()["choices"][0]["message"]["content"]
                history += [{"role": "assistant", "content": answer}, _user("And the ones from 1912?")]
            second_turns = [_ask(client, history).headers["x-cache-prefix"] for history in histories]
            assert all("why=evicted" in h and "from=ram" in h for h in second_turns), second_turns
            report = client.get("/admin/diagnosis", headers=ADMIN).json()
    finally:
        small.stop()
    assert report["requests"] == 10 and report["bottleneck"] == "ram_budget"
    assert report["causes"]["ram_budget"]["share"] >= 0.3
    assert "median_lived_s" in report["causes"]["ram_budget"]
    finding = next(f for f in report["findings"] if "evicted from RAM" in f)
    assert "STRATA_KV_BUDGET_BYTES" in finding and "enable the SSD tier" in finding  # the SSD tier is off here


def test_a_system_prompt_that_changes_every_request_is_named(engine, admin_settings):
    with TestClient(create_app(admin_settings, engine=engine)) as client:
        headers = []
        for minute in range(6):
            system = f"The time is 10:{minute:02d}. " + _system(0)  # what varies comes first: nothing is shared
            headers.append(_ask(client, [{"role": "system", "content": system}, _user(QUESTION)]).headers)
        assert all("why=diverged" in h["x-cache-prefix"] and "in=system" in h["x-cache-prefix"] for h in headers[1:])
        report = client.get("/admin/diagnosis?window_s=600", headers=ADMIN).json()
        assert report["bottleneck"] == "system_prompt" and report["causes"]["system_prompt"]["share"] > 0.7
        assert any("system prompt byte-identical" in f for f in report["findings"])
        lines = report["causes"]["system_prompt"]["diverging_lines"]  # the admin sees which line varies
        assert lines and all(entry["line"].startswith("The time is 10:0") for entry in lines)
        assert sum(entry["requests"] for entry in lines) == 5 and all(len(e["line"]) <= 40 for e in lines)
        assert not any("The time" in value for h in headers for value in h.values())  # never in a header
        assert report["hit_rate"]["exact"] is None  # the exact layer is off in these settings
        assert client.get("/admin/diagnosis").status_code == 401
        assert client.get("/admin/diagnosis?window_s=-1", headers=ADMIN).status_code == 400


def test_a_divergence_names_the_part_of_the_conversation(engine, admin_settings):
    system = {"role": "system", "content": _system(7)}
    first = [system, _user(QUESTION), {"role": "assistant", "content": "Shelves 4 and 9."}, _user("Thanks. And 1912?")]
    edited = [
        system,
        _user(QUESTION),
        {"role": "assistant", "content": "Shelves 5 and 9, mostly."},
        _user("Thanks. And 1912?"),
    ]
    with TestClient(create_app(admin_settings, engine=engine)) as client:
        _ask(client, first)
        assert "in=earlier_turn" in _ask(client, edited).headers["x-cache-prefix"]
        assert (
            "in=latest"
            in _ask(client, first[:3] + [_user("Thanks. Anything on lighthouses?")]).headers["x-cache-prefix"]
        )
        with_image = [system, _user(QUESTION + " See the photo.", png_data_url(seed=1))]
        _ask(client, with_image)
        other_image = [system, _user(QUESTION + " See the photo.", png_data_url(seed=2))]
        assert "in=image" in _ask(client, other_image).headers["x-cache-prefix"]


def test_findings_need_a_fifth_of_the_missed_tokens_and_quiet_windows_say_so():
    def record(at, why, tokens, where="", tier=""):
        return RequestRecord(
            at, ("bypass", "bypass", "bypass", "miss"), PrefixFacts(tokens, 0, 0, why, tier, 30.0, where)
        )

    records = [
        record(100, "expired", 700, tier="ssd"),
        record(100, "cold", 250),
        record(100, "diverged", 50, "image"),
        record(10, "evicted", 9999, tier="ram"),
    ]  # outside the window
    report = diagnose(records, window_s=60, now=120, ssd_enabled=True)
    assert report["requests"] == 3 and report["missed_prefix_tokens"] == 1000
    assert report["bottleneck"] == "ssd_retention" and report["causes"]["ssd_retention"]["share"] == 0.7
    assert report["findings"][0].startswith("70% of missed prefix tokens expired from the SSD tier 30 seconds")
    assert [f for f in report["findings"] if "pixels" in f] == []  # 5%: below the bar
    assert diagnose([], 60, 120, True)["findings"] == ["no requests in the window: nothing to diagnose."]


def test_the_window_says_what_more_ram_would_have_bought():
    """Chat traffic through a RAM budget of 5% of its blocks: the estimate from the records' sampled
    chains is near the pool's replayed truth, now and with more RAM."""
    from evals.cache_sim import rate, replay, working_set
    from evals.trace_gen import generate
    from gateway.observability.diagnosis import RamBudget, sampled_chain

    trace = generate("chat")
    records = [
        RequestRecord(120.0, ("miss",) * 5, None, sampled_chain(bytes.fromhex(b) for b in r.blocks)) for r in trace
    ]
    budget = working_set(trace) // 5
    report = diagnose(records, 60, 120, True, RamBudget(budget * 1000, 1000))
    now, more = report["more_ram"]["estimated_now"], report["more_ram"]["more"]
    assert abs(now - rate(trace, replay(trace, budget, segmented=False))) < 0.02
    assert more["1GiB"] >= now and abs(more["1GiB"] - rate(trace, replay(trace, budget * 20, segmented=False))) < 0.02
    assert any(
        f.startswith("with 1 GiB more RAM the prefix token hit rate would have been ~") for f in report["findings"]
    )
