"""The coding agents, driven non-interactively against a live server as the README sets them up (the
acceptance tests in tests/agents and `python -m evals.bench_agent --client claude-code` use them).

    Recorder(upstream)           a loopback proxy in front of the server: every request an agent
                                 sends is kept (body, headers but secrets) and forwarded as it came
    AGENTS[name].turn(setup, prompt, first) -> TurnUsage   one turn (`first`: a new session, else the
                                 agent resumes its last one), the usage the agent itself reports
    Scratch(folder, base_url, api_key)     a scratch project (hello.py) and a HOME of its own per agent

The agents are the npm packages pinned in tests/agents/package.json (`make agents`, run by `make test`,
installs them into tests/agents/node_modules). Each is configured exactly as the README's agent
sections say; only the server's address differs. They run offline: telemetry and update checks off,
loopback only.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

PACKAGES = Path(__file__).parent.parent / "tests" / "agents"  # package.json, the lock, node_modules
BIN = PACKAGES / "node_modules" / ".bin"
HIDDEN_HEADERS = {"authorization", "x-api-key", "host", "content-length", "connection"}
RESPONSE_KEPT = 4000
TURN_TIMEOUT_S = 300


def installed_versions() -> dict[str, str]:
    """The pinned agents' versions, from package.json."""
    return json.loads((PACKAGES / "package.json").read_text())["dependencies"]


# -- the recording proxy ------------------------------------------------------------------------


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    body: dict | None
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    first_byte_s: float = 0.0  # from the request sent upstream to the answer's first byte
    response_start: str = ""  # the answer's first RESPONSE_KEPT characters, for a failure's message


class Recorder:
    """A threaded proxy on a free loopback port that keeps every request and its answer's status and
    headers, streaming the answer back as it comes (SSE included)."""

    def __init__(self, upstream: str):
        self.upstream = upstream  # host:port
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                recorder.forward(self)

            do_GET = do_POST = do_DELETE = _forward

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        size = int(handler.headers.get("content-length") or 0)
        raw = handler.rfile.read(size) if size else b""
        shown = {k.lower(): v for k, v in handler.headers.items() if k.lower() not in HIDDEN_HEADERS}
        exchange = Exchange(handler.command, handler.path, shown, json.loads(raw) if raw else None)
        with self.lock:
            self.exchanges.append(exchange)
        host, port = self.upstream.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=TURN_TIMEOUT_S)
        sent = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        started = time.perf_counter()
        connection.request(handler.command, handler.path, body=raw, headers=sent)
        answer = connection.getresponse()
        exchange.status = answer.status
        exchange.response_headers = {k.lower(): v for k, v in answer.getheaders()}
        handler.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                handler.send_header(key, value)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        while chunk := answer.read1(65536):
            if not exchange.first_byte_s:
                exchange.first_byte_s = time.perf_counter() - started
            if len(exchange.response_start) < RESPONSE_KEPT:
                exchange.response_start += chunk.decode("utf-8", "replace")[
                    : RESPONSE_KEPT - len(exchange.response_start)
                ]
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")
        connection.close()

    def take(self) -> list[Exchange]:
        """The exchanges since the last take."""
        with self.lock:
            taken, self.exchanges = self.exchanges, []
        return taken

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the agents ---------------------------------------------------------------------------------


@dataclass
class TurnUsage:
    """One turn as the agent reports it: prompt tokens sent and, of them, read from the server's cache
    (summed over the turn's requests; Codex reports a session's running totals, turned into the turn's)."""

    prompt_tokens: int
    read_tokens: int
    answer: str
    error: str = ""
    ttft_ms: float | None = None  # the agent's own time to first token, where it reports one (Claude Code)

    @property
    def read_share(self) -> float:
        return self.read_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Scratch:
    """A scratch project and an agent's own HOME, pointed at `base_url`."""

    folder: Path
    base_url: str
    api_key: str = "strata-local"
    model: str = ""  # the server's model name, where the agent's configuration must name one

    def __post_init__(self):
        self.project = self.folder / "project"
        self.home = self.folder / "home"
        self.project.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        (self.project / "hello.py").write_text('print("hello")\n')

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR", "SSL_CERT_FILE")}
        return keep | {"HOME": str(self.home), "PWD": str(self.project), "NO_COLOR": "1"} | extra


def _run(command: list[str], scratch: Scratch, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=scratch.project,
        env=scratch.env(env),
        capture_output=True,
        text=True,
        timeout=TURN_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


class ClaudeCode:
    """`claude -p` then `claude -p --resume <session>`: README, "Claude Code"."""

    name = "claude-code"
    package = "@anthropic-ai/claude-code"

    def __init__(self, bin_dir: Path = BIN, named: bool = False):
        self.bin_dir = bin_dir  # the release to run (another one's, when recording it)
        self.named = named  # name the server's model (ANTHROPIC_MODEL): a server without aliases needs it
        self.session = ""

    def env(self, scratch: Scratch) -> dict[str, str]:
        named = {"ANTHROPIC_MODEL": scratch.model, "ANTHROPIC_SMALL_FAST_MODEL": scratch.model} if self.named else {}
        return named | {
            "ANTHROPIC_BASE_URL": scratch.base_url,
            "ANTHROPIC_API_KEY": scratch.api_key,
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }

    def turn(self, scratch: Scratch, prompt: str, first: bool) -> TurnUsage:
        command = [str(self.bin_dir / "claude"), "-p", prompt, "--output-format", "json"]
        if not first:
            command += ["--resume", self.session]
        done = _run(command, scratch, self.env(scratch))
        result = _last_json(done.stdout, done.stderr)
        self.session = result.get("session_id", self.session)
        usage = result.get("usage") or {}
        read = usage.get("cache_read_input_tokens", 0)
        prompt_tokens = usage.get("input_tokens", 0) + read + usage.get("cache_creation_input_tokens", 0)
        error = str(result.get("result")) if result.get("is_error") else ""
        return TurnUsage(prompt_tokens, read, str(result.get("result", "")), error, result.get("ttft_ms"))


class Codex:
    """`codex exec` then `codex exec resume <thread>`, a provider in ~/.codex/config.toml: README, "Codex CLI".
    `named`: the config names the server's model (README: optional); else Codex asks for its own default,
    which reaches the model through the server's aliases. Codex sends tools differently for the two."""

    name = "codex"
    package = "@openai/codex"

    def __init__(self, bin_dir: Path = BIN, named: bool = False):
        self.bin_dir = bin_dir
        self.named = named
        self.thread = ""
        self.totals = (0, 0)  # the session's running (input, cached) tokens, as Codex reports them

    def configure(self, scratch: Scratch) -> None:
        config = scratch.home / ".codex" / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(codex_config(scratch.base_url, scratch.model if self.named else ""))

    def turn(self, scratch: Scratch, prompt: str, first: bool) -> TurnUsage:
        self.configure(scratch)
        command = [str(self.bin_dir / "codex"), "exec", "--skip-git-repo-check", "--json"]
        command += [prompt] if first else ["resume", self.thread, prompt]
        done = _run(command, scratch, {"STRATA_API_KEY": scratch.api_key})
        events = _json_lines(done.stdout)
        self.thread = next((e["thread_id"] for e in events if e.get("type") == "thread.started"), self.thread)
        errors = [
            e.get("message") or e.get("error", {}).get("message") for e in events if "error" in str(e.get("type"))
        ]
        answer = " ".join(
            e["item"].get("text", "")
            for e in events
            if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
        )
        completed = [e["usage"] for e in events if e.get("type") == "turn.completed"]
        if not completed:
            return TurnUsage(0, 0, answer, "; ".join(map(str, errors)) or done.stderr[-2000:])
        totals = (completed[-1]["input_tokens"], completed[-1]["cached_input_tokens"])
        turn = TurnUsage(totals[0] - self.totals[0], totals[1] - self.totals[1], answer)
        self.totals = totals
        return turn


def codex_config(base_url: str, model: str = "") -> str:
    """~/.codex/config.toml as the README gives it (`model` named or left to Codex's default)."""
    return (
        (f'model = "{model}"\n' if model else "") + 'model_provider = "strata"\n\n'
        "[model_providers.strata]\n"
        'name = "Strata"\n'
        f'base_url = "{base_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "STRATA_API_KEY"\n'
    )


class OpenCode:
    """`opencode run` then `opencode run --continue`, an openai-compatible provider in the project's
    opencode.json: README, "opencode"."""

    name = "opencode"
    package = "opencode-ai"

    def __init__(self, bin_dir: Path = BIN):
        self.bin_dir = bin_dir

    def turn(self, scratch: Scratch, prompt: str, first: bool) -> TurnUsage:
        (scratch.project / "opencode.json").write_text(opencode_config(scratch.base_url, scratch.model))
        command = [
            str(self.bin_dir / "opencode"),
            "run",
            "--format",
            "json",
            *([] if first else ["--continue"]),
            prompt,
        ]
        done = _run(command, scratch, {"STRATA_API_KEY": scratch.api_key, "OPENCODE_DISABLE_AUTOUPDATE": "1"})
        events = _json_lines(done.stdout)
        errors = [json.dumps(e.get("error"))[:2000] for e in events if e.get("type") == "error"]
        steps = [e["part"]["tokens"] for e in events if e.get("type") == "step_finish"]
        answer = "".join(e["part"].get("text", "") for e in events if e.get("type") == "text")
        prompt_tokens = sum(s["input"] + s["cache"]["read"] + s["cache"]["write"] for s in steps)
        read = sum(s["cache"]["read"] for s in steps)
        return TurnUsage(prompt_tokens, read, answer, "; ".join(errors) or ("" if steps else done.stderr[-2000:]))


def opencode_config(base_url: str, model: str) -> str:
    """opencode.json as the README gives it (the model named as the server lists it)."""
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "Strata",
        "options": {"baseURL": f"{base_url}/v1", "apiKey": "{env:STRATA_API_KEY}"},
        "models": {model: {"name": "Strata"}},  # the name opencode shows; requests send the key
    }
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"strata": provider},
        "model": f"strata/{model}",
        "small_model": f"strata/{model}",
    }
    return json.dumps(config, indent=2)


Agent = ClaudeCode | Codex | OpenCode
AGENTS: dict[str, type[Agent]] = {agent.name: agent for agent in (ClaudeCode, Codex, OpenCode)}
# Each way of running them the tests cover: label -> (agent, how it is set up).
RUNS: dict[str, Callable[..., Agent]] = {
    "claude-code": ClaudeCode,
    "codex": Codex,
    "codex-named-model": partial(Codex, named=True),
    "opencode": OpenCode,
}


def _last_json(stdout: str, stderr: str) -> dict:
    """The last line of stdout that is a JSON object (Claude Code prints its result there)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {"is_error": True, "result": (stdout + stderr)[-2000:]}


def _json_lines(stdout: str) -> list[dict]:
    events = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events
