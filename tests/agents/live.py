"""A live `strata serve` on the agents' test model (tiny-agent: its answers end after a few tokens,
and it holds 128k positions), as a user starts it for an agent: one model, so every agent's default
model name reaches it through the built-in aliases."""

from __future__ import annotations

from pathlib import Path

from gateway.checkpoints import BuildSpec
from tests.conftest import built_model
from tests.gateway.test_live_server import LiveServer

AGENT_MODEL = BuildSpec(size="tiny", ends_turns=True)


class AgentServer(LiveServer):
    model = AGENT_MODEL.name  # the served name (the model folder's)


def start_agent_server(folder: Path, extra_env: dict[str, str] | None = None) -> AgentServer:
    return AgentServer(built_model(AGENT_MODEL), folder / "data", {"STRATA_SEMANTIC": "0", **(extra_env or {})})
