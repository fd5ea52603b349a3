"""`strata cluster up`: Redis, two Strata replicas and HAProxy on loopback, the shape of a deployment
over several machines run on one, with the shipped proxy config (deploy/haproxy/haproxy.cfg).

    Cluster(model, folder, port).start()   redis-server, replicas a and b (ports port+1, port+2,
                                           sharing the exact and semantic caches in Redis and the KV
                                           SSD tier in FOLDER/kv-shared), HAProxy on `port`
    Cluster.stop()                         the proxy, then the replicas (SIGTERM: they persist their
                                           KV and drain), then Redis; every process waited for
    run(...)                               `strata cluster up`: a replica that dies is started again
                                           (the proxy sends its sessions to the other meanwhile);
                                           Redis or the proxy dying stops the cluster

Replicas log to FOLDER/<name>.log, the proxy to FOLDER/haproxy.log. Redis keeps no snapshot: the
cluster's shared cache lives as long as the cluster does.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROXY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
REPLICAS = ("a", "b")  # the names the proxy config gives its servers
START_TIMEOUT_S = 600.0  # a first start builds the demo model
RESTART_AFTER_S = 10.0  # a replica that died is started again at most this often
MIN_PORT = 10000  # free_ports draws from here up to the ephemeral range


class Cluster:
    def __init__(self, model: str, folder: Path, port: int = 8000, extra_env: dict[str, str] | None = None):
        self.model = model
        self.folder = Path(folder)
        self.port = port
        self.extra_env = extra_env or {}
        self.processes: dict[str, subprocess.Popen] = {}  # name -> process, in start order
        self.started: dict[str, float] = {}  # name -> time.monotonic() of its last start
        self.redis_url = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def replica_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port + 1 + REPLICAS.index(name)}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._build_once()
        try:
            self.redis_url = self._start_redis()
            for name in REPLICAS:
                self._start_replica(name)
            for name in REPLICAS:
                _wait_http(self.replica_url(name) + "/health/ready", self.processes[name], self._log(name))
            self._start_proxy()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for name in reversed(list(self.processes)):  # proxy, replicas, then Redis
            process = self.processes.pop(name)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def _build_once(self) -> None:
        """A built-in model ('demo', ...) is built once under FOLDER/models, not once per replica;
        the replicas serve that folder under the name the client knows."""
        from ..checkpoints import parse_model_name, resolve_model_path

        if parse_model_name(self.model) is not None:
            self.extra_env.setdefault("STRATA_MODEL_NAME", self.model)
            self.model = str(resolve_model_path(self.model, self.folder))

    def _start_redis(self, port: int | None = None) -> str:
        port = port or free_ports(1, avoid=range(self.port, self.port + 1 + len(REPLICAS)))
        binary = _required("redis-server")
        folder = self.folder / "redis"
        folder.mkdir(exist_ok=True)
        self._spawn(
            "redis",
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(folder),
            ],
        )
        _wait_port(port, self.processes["redis"], self._log("redis"))
        return f"redis://127.0.0.1:{port}/0"

    def restart_redis(self) -> None:
        """Redis again on its port, empty (it keeps no snapshot), as after a crash or a failover."""
        process = self.processes["redis"]
        if process.poll() is None:
            process.kill()
            process.wait()
        self._start_redis(int(self.redis_url.rsplit(":", 1)[1].split("/")[0]))

    def restart_replica(self, name: str) -> bool:
        """Start a replica that exited again, unless it started less than RESTART_AFTER_S ago (a
        replica that cannot start is not restarted in a tight loop). True when started."""
        if time.monotonic() - self.started.get(name, 0.0) < RESTART_AFTER_S:
            return False
        self._start_replica(name)
        return True

    def _start_replica(self, name: str) -> None:
        port = self.port + 1 + REPLICAS.index(name)
        env = {
            "STRATA_REDIS_URL": self.redis_url,
            "STRATA_SSD_DIR": str(self.folder / "kv-shared"),
            "STRATA_SSD_WRITER": name,
            "STRATA_SECRET_FILE": str(self.folder / "server.secret"),
            # behind the proxy every client is the proxy: the per-client cap is the proxy's
            # (deploy/haproxy/haproxy.cfg), a replica has none
            "STRATA_MAX_CONNECTIONS_PER_CLIENT": "0",
            **self.extra_env,
        }
        self._spawn(
            name,
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--model",
                self.model,
                "--port",
                str(port),
                "--data-dir",
                str(self.folder / name),
            ],
            env,
        )

    def _start_proxy(self) -> None:
        env = {
            "STRATA_PROXY_BIND": f"127.0.0.1:{self.port}",
            **{f"STRATA_REPLICA_{name.upper()}": self.replica_url(name).removeprefix("http://") for name in REPLICAS},
        }
        self._spawn("haproxy", [_required("haproxy"), "-db", "-f", str(PROXY_CONFIG)], env)
        _wait_port(self.port, self.processes["haproxy"], self._log("haproxy"))

    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        environment = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | (env or {})
        self.processes[name] = subprocess.Popen(
            command, env=environment, stdout=self._log(name).open("a"), stderr=subprocess.STDOUT
        )  # a restart keeps the last words
        self.started[name] = time.monotonic()

    def _log(self, name: str) -> Path:
        return self.folder / f"{name}.log"


def run(model: str, folder: Path, port: int) -> int:
    """`strata cluster up`: start, say where, keep the replicas running, wait for Ctrl-C or SIGTERM,
    stop everything."""
    cluster = Cluster(model, folder, port)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # Ctrl-C stops it even where it was started with SIGINT ignored (a script's background job,
    # nohup): Python then installs no handler of its own, and `kill -INT` did nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster.start()
        print(
            f"strata cluster: proxy {cluster.url} -> replicas {', '.join(cluster.replica_url(n) for n in REPLICAS)}; "
            f"logs in {folder}; Ctrl-C stops it",
            flush=True,
        )
        while not stopping:
            time.sleep(0.5)
            for name, process in list(cluster.processes.items()):
                if process.poll() is None:
                    continue
                if name not in REPLICAS:
                    print(f"strata cluster: {name} exited; stopping (see {folder})", file=sys.stderr, flush=True)
                    stopping.append(True)
                elif cluster.restart_replica(name):
                    print(
                        f"strata cluster: replica {name} exited ({process.returncode}); starting it again "
                        f"(see {cluster._log(name)})",
                        file=sys.stderr,
                        flush=True,
                    )
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        print("strata cluster: stopped", flush=True)
    return 0


def _required(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: `make cluster` installs it (apt-get install {name})")
    return path


def free_ports(count: int, avoid: range = range(0)) -> int:
    """The first of `count` consecutive loopback ports free now (a cluster takes its port and the
    next two), none in `avoid`. Chosen below the kernel's ephemeral range: a port from that range
    could be taken, before our server binds it, as the source port of any outgoing connection."""
    low = _ephemeral_low()
    for _ in range(200):
        first = random.randrange(MIN_PORT, low - count)
        ports = range(first, first + count)
        if not any(p in avoid for p in ports) and all(_bindable(p) for p in ports):
            return first
    raise RuntimeError(f"no {count} free loopback ports in a row below {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _wait_port(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log.stem} did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.05)


def _wait_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{log.stem} did not become ready: {log.read_text()[-2000:]}")
        time.sleep(0.2)
