"""The acceptance matrix: Claude Code, Codex CLI and opencode, the npm releases pinned beside this
file, each holding a three-turn session against a live `strata serve` on the agents' test model,
configured exactly as the README's agent sections say (only the server's port differs: the agents
talk to it through the recording proxy, which keeps what they sent for the failure message).

Each turn must end without an API error, with an answer, and from the second turn on the agent itself
must report at least 98% of the prompt read from the server's cache."""

from __future__ import annotations

import json

import pytest

from evals.agent_clients import AGENTS, BIN, RUNS, Recorder, Scratch, installed_versions
from tests.agents.live import start_agent_server

PROMPTS = ("What does hello.py print?", "And what would it print twice?", "Thank you. One more idea?")
MIN_READ_SHARE = 0.98


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    # pings every 50 ms: each agent's first turn (a ~12,500-token prompt) streams `: ping` comment
    # lines (or Anthropic `ping` events) before its answer, as a queued or slow prompt does in use
    server = start_agent_server(tmp_path_factory.mktemp("agents"), {"STRATA_STREAM_PING_S": "0.05"})
    yield server
    assert server.stop()


def test_the_pinned_agents_are_installed():
    """`make test` installs them (npm, package-lock.json beside this file); never skipped."""
    versions = installed_versions()
    for agent in AGENTS.values():
        package = json.loads((BIN.parent / agent.package / "package.json").read_text())
        assert package["version"] == versions[agent.package], f"{agent.package}: run `make agents`"


@pytest.mark.parametrize("run", sorted(RUNS))
def test_an_agent_holds_a_session_read_from_the_cache(agent_server, run, tmp_path):
    recorder = Recorder(agent_server.url.removeprefix("http://"))
    agent = RUNS[run]()
    scratch = Scratch(tmp_path, recorder.url, model=agent_server.model)
    try:
        for index, prompt in enumerate(PROMPTS):
            turn = agent.turn(scratch, prompt, first=index == 0)
            sent = recorder.take()
            failed = [(e.path, e.status) for e in sent if e.status != 200]
            assert not turn.error and not failed, f"turn {index + 1}: {turn.error} {failed}"
            assert sent and turn.answer.strip(), f"turn {index + 1}: no answer ({len(sent)} requests)"
            if index:
                assert turn.read_share >= MIN_READ_SHARE, (index + 1, turn, [e.response_headers for e in sent])
    finally:
        recorder.close()
