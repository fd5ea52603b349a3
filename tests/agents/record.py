"""Record what the coding agents send, as fixtures the tests replay without the agents.

    python -m tests.agents.record                      the pinned agents (node_modules beside this file)
    python -m tests.agents.record codex@0.169.0 ...   other releases, installed into a scratch folder

Starts `strata serve --model tiny-agent` (the agents' test model), puts the recording proxy in front,
holds a two-turn session with each agent as the README configures it, and writes the requests (bodies
and headers, no keys) to fixtures/<agent>-<version>.json. Run it after bumping a pinned version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from evals import agent_clients as harness
from tests.agents.live import start_agent_server

PROMPTS = ("What does hello.py print?", "And what would it print twice?")
FIXTURES = Path(__file__).parent / "fixtures"


def record(run: str, bin_dir: Path, version: str, server_url: str, model: str) -> Path:
    """One run (harness.RUNS) of one release: its two turns' requests, as fixtures/<run>-<version>.json."""
    recorder = harness.Recorder(server_url.removeprefix("http://"))
    agent = harness.RUNS[run](bin_dir)
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"strata-record-{run}-"))
        scratch = harness.Scratch(folder, recorder.url, model=model)
        for index, prompt in enumerate(PROMPTS):
            usage = agent.turn(scratch, prompt, first=index == 0)
            print(f"{run} {version} turn {index + 1}: {usage}", flush=True)
    finally:
        recorder.close()
    exchanges = [asdict(exchange) for exchange in recorder.take()]
    path = FIXTURES / f"{run}-{version}.json"
    path.parent.mkdir(exist_ok=True)
    fixture = {"agent": agent.name, "run": run, "version": version, "exchanges": exchanges}
    path.write_text(json.dumps(fixture, indent=1) + "\n")
    return path


def installed(spec: str) -> tuple[str, Path, str]:
    """(agent name, its bin folder, version) for `name@version`, installed into a scratch folder."""
    name, version = spec.rsplit("@", 1)
    package = harness.AGENTS[name].package
    folder = Path(tempfile.mkdtemp(prefix="strata-agents-"))
    subprocess.run(
        ["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund", f"{package}@{version}"], check=True
    )
    return name, folder / "node_modules" / ".bin", version


def main(argv: list[str]) -> None:
    pinned = harness.installed_versions()
    targets = [installed(spec) for spec in argv] or [
        (agent.name, harness.BIN, pinned[agent.package]) for agent in harness.AGENTS.values()
    ]
    server = start_agent_server(Path(tempfile.mkdtemp(prefix="strata-record-")))
    try:
        for name, bin_dir, version in targets:
            for run in (run for run in harness.RUNS if harness.RUNS[run]().name == name):
                print(record(run, bin_dir, version, server.url, server.model))
    finally:
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
