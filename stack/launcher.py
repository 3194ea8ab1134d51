"""Brings the stack up as local processes: a private redis-server (unless a Redis URL is given),
offloadd, kv-bridge, two engines and kv-router in front of them, each checked for readiness,
logs in the run directory."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from stack.healthcheck import grpc_serving, http_ok
from stack.supervisor import StackError, Supervisor


@dataclass(frozen=True)
class StackConfig:
    run_dir: Path
    redis_url: str = ""
    """Empty: start a private redis-server in the run directory."""
    namespace: str = "demo"
    model_dir: Path | None = None
    """A Hugging Face directory; None: write a small random-weight model into the run directory."""
    hybrid: bool = False
    arena_bytes: int = 512 << 20
    num_gpu_blocks: int = 48
    topic: str = "kv-events"
    arena_dir: str = "/dev/shm"
    num_engines: int = 2
    """Engines started by ``up`` (kv-router sends requests to them)."""
    router_policy: str = "kv"
    vllm_demo: bool = False
    """Also start a vLLM-style engine (ingest.demo_engine) and kv-ingest following it into the
    log as the source ``vllm-demo``."""
    keep_arena: bool = False
    """Leave the host tiers' arena files in ``arena_dir`` after a stop (default: removed)."""
    second_node: bool = False
    """Also start a second node on the same Redis: its own offloadd (namespace
    ``<namespace>-node2``, node 1's daemon as its fleet peer) and arena, and one engine on it
    whose local misses are served from node 1's tier (issue 21)."""


@dataclass(frozen=True)
class Endpoints:
    redis_url: str
    offloadd: str
    offloadd_metrics: str
    bridge_pub: str
    bridge_replay: str
    bridge_metrics: str
    engines: tuple[str, ...]
    """gRPC Generate targets."""
    engine_urls: tuple[str, ...] = ()
    """Base URLs of the engines' OpenAI HTTP APIs."""
    router: str = ""
    """Base URL of kv-router's OpenAI HTTP API (and its fleet page)."""
    router_grpc: str = ""
    """kv-router's gRPC Generate target."""
    vllm_demo: str = ""
    """The vLLM-style engine's PUB endpoint, when started; kv-ingest's metrics beside it."""
    ingest_metrics: str = ""
    node2_offloadd: str = ""
    """The second node's daemon and its engine's OpenAI base URL, when started."""
    node2_engine_url: str = ""


def port_or_free(preferred: int) -> int:
    """The preferred port when nothing listens there, else any free one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        config.run_dir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor(config.run_dir)
        self.model_dir = config.model_dir or config.run_dir / "model"
        self._engine_count = 0
        self.endpoints: Endpoints | None = None
        self._lock: TextIO | None = None

    def up(self) -> Endpoints:
        cfg = self.config
        self._lock_namespace()
        redis_url = cfg.redis_url or self._start_redis()
        # Through the environment, not argv: a password in a URL must not show in `ps`.
        self.sup.env.update(KVD_REDIS_URL=redis_url, REDIS_URL=redis_url)
        grpc_port, metrics_port = port_or_free(50051), port_or_free(9400)
        self.sup.start("offloadd", _py(
            "offloadd", "--grpc-host=127.0.0.1", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}",
            f"--namespace={cfg.namespace}", f"--arena-dir={cfg.arena_dir}",
            f"--capacity-bytes={cfg.arena_bytes}", f"--chunk-bytes={min(cfg.arena_bytes, 128 << 20)}",
        ), ready=lambda: grpc_serving(f"127.0.0.1:{grpc_port}"))
        pub, replay, bmetrics = port_or_free(5557), port_or_free(5558), port_or_free(9401)
        self.sup.start("kv-bridge", _py(
            "bridge.main", f"--namespace={cfg.namespace}",
            f"--pub=tcp://127.0.0.1:{pub}", f"--replay=tcp://127.0.0.1:{replay}",
            f"--topic={cfg.topic}", f"--metrics-port={bmetrics}", "--metrics-host=127.0.0.1",
        ), ready=lambda: http_ok(f"http://127.0.0.1:{bmetrics}/healthz"))
        self._ensure_model()
        self.endpoints = Endpoints(
            redis_url=redis_url, offloadd=f"127.0.0.1:{grpc_port}",
            offloadd_metrics=f"http://127.0.0.1:{metrics_port}/metrics",
            bridge_pub=f"tcp://127.0.0.1:{pub}", bridge_replay=f"tcp://127.0.0.1:{replay}",
            bridge_metrics=f"http://127.0.0.1:{bmetrics}/metrics", engines=(),
        )
        for _ in range(cfg.num_engines):
            self.add_engine()
        self._start_router()
        if cfg.vllm_demo:
            self._start_vllm_demo()
        if cfg.second_node:
            self._start_second_node()
        return self.endpoints

    def _start_second_node(self) -> None:
        """Node 2: offloadd with node 1's daemon as fleet peer, its own arena, one engine."""
        assert self.endpoints is not None
        cfg = self.config
        grpc_port, metrics_port = port_or_free(50151), port_or_free(9410)
        self.sup.start("node2-offloadd", _py(
            "offloadd", "--grpc-host=127.0.0.1", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}", f"--namespace={cfg.namespace}-node2",
            f"--arena-dir={cfg.arena_dir}", f"--capacity-bytes={cfg.arena_bytes}",
            f"--chunk-bytes={min(cfg.arena_bytes, 128 << 20)}",
            f"--fleet-peers=node1={self.endpoints.offloadd}/{cfg.namespace}", "--fleet-node=node2",
        ), ready=lambda: grpc_serving(f"127.0.0.1:{grpc_port}"))
        port, http = port_or_free(50161), port_or_free(8011)
        self.sup.start("node2-engine-0", _py(
            "engine", "serve", f"--model={self.model_dir}", "--host=127.0.0.1", f"--port={port}",
            f"--http-port={http}", "--served-model-name=demo", "--engine-id=node2-engine-0",
            f"--num-gpu-blocks={cfg.num_gpu_blocks}", f"--offloadd=127.0.0.1:{grpc_port}", "--offload",
        ), ready=lambda: grpc_serving(f"127.0.0.1:{port}"), timeout_s=120)
        self.endpoints = replace(self.endpoints, node2_offloadd=f"127.0.0.1:{grpc_port}",
                                 node2_engine_url=f"http://127.0.0.1:{http}")

    def _start_vllm_demo(self) -> None:
        """A vLLM-style engine's ZMQ publisher and kv-ingest appending it to the log."""
        assert self.endpoints is not None
        pub, replay, metrics = port_or_free(5567), port_or_free(5568), port_or_free(9404)
        pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        self.sup.start("vllm-demo", _py("ingest.demo_engine", f"--pub={pub_ep}", f"--replay={replay_ep}"))
        self.sup.start("kv-ingest", _py(
            "ingest", f"--offloadd={self.endpoints.offloadd}", f"--vllm=vllm-demo={pub_ep},replay={replay_ep}",
            "--metrics-host=127.0.0.1", f"--metrics-port={metrics}",
        ), ready=lambda: http_ok(f"http://127.0.0.1:{metrics}/healthz"))
        self.endpoints = replace(self.endpoints, vllm_demo=pub_ep,
                                 ingest_metrics=f"http://127.0.0.1:{metrics}/metrics")

    def add_engine(self) -> str:
        """Start one more engine attached to the daemon; return its gRPC target."""
        assert self.endpoints is not None, "up() first"
        n = self._engine_count
        self._engine_count += 1
        port, http = port_or_free(50061 + n), port_or_free(8001 + n)
        self.sup.start(f"engine-{n}", _py(
            "engine", "serve", f"--model={self.model_dir}", "--host=127.0.0.1", f"--port={port}",
            f"--http-port={http}", "--served-model-name=demo",
            f"--engine-id=engine-{n}", f"--num-gpu-blocks={self.config.num_gpu_blocks}",
            f"--offloadd={self.endpoints.offloadd}", "--offload",
        ), ready=lambda: grpc_serving(f"127.0.0.1:{port}"), timeout_s=120)
        target = f"127.0.0.1:{port}"
        self.endpoints = replace(self.endpoints, engines=(*self.endpoints.engines, target),
                                 engine_urls=(*self.endpoints.engine_urls, f"http://127.0.0.1:{http}"))
        return target

    def _start_router(self) -> None:
        """kv-router in front of the engines, following the bridge."""
        assert self.endpoints is not None
        ep = self.endpoints
        port, grpc_port = port_or_free(8100), port_or_free(50070)
        engines = [f"--engine=engine-{n}={url},grpc={target}"
                   for n, (url, target) in enumerate(zip(ep.engine_urls, ep.engines, strict=True))]
        self.sup.start("kv-router", _py(
            "router.main", "--host=127.0.0.1", f"--port={port}", f"--grpc-port={grpc_port}", *engines,
            f"--policy={self.config.router_policy}", f"--bridge-pub={ep.bridge_pub}",
            f"--bridge-replay={ep.bridge_replay}", f"--topic={self.config.topic}",
            f"--model={self.model_dir}", "--served-model-name=demo",
        ), ready=lambda: http_ok(f"http://127.0.0.1:{port}/health"))
        self.endpoints = replace(ep, router=f"http://127.0.0.1:{port}", router_grpc=f"127.0.0.1:{grpc_port}")

    def down(self) -> None:
        self.sup.stop_all()
        if self._lock is not None:  # only a stack that owned the namespace removes its files
            if not self.config.keep_arena:
                self._remove_arenas()
            self._lock.close()
            self._lock = None

    def _lock_namespace(self) -> None:
        """Two stacks on one namespace and arena directory (two clones, two terminals) would
        share the arena files, each daemon writing blocks the other's log never recorded."""
        cfg = self.config
        path = Path(cfg.arena_dir) / f"kvd-{cfg.namespace}.stack-lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path, "a+")  # noqa: SIM115 - held open until down()
        except OSError as exc:
            raise StackError(f"cannot use the arena directory {cfg.arena_dir}: {exc}") from exc
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise StackError(f"namespace {cfg.namespace!r} in {cfg.arena_dir} is in use by another kv-stack "
                             f"({holder}); stop it, or give this one --namespace NAME") from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}, run dir {cfg.run_dir}\n")
        lock.flush()
        self._lock = lock

    def _remove_arenas(self) -> None:
        """The host tiers' files in the arena directory (shared memory: RAM until removed), once
        their daemons stopped. A later start finds no arena id and begins with an empty host
        tier (offloadd.log.recovery), which its log records; --keep-arena keeps them instead."""
        cfg = self.config
        names = [cfg.namespace] + ([f"{cfg.namespace}-node2"] if cfg.second_node else [])
        arena = Path(cfg.arena_dir)
        for ns in names:
            for path in [*arena.glob(f"kvd-{ns}-L*-C*"), arena / f"kvd-{ns}.arena-id"]:
                path.unlink(missing_ok=True)
        (arena / f"kvd-{cfg.namespace}.stack-lock").unlink(missing_ok=True)

    def _start_redis(self) -> str:
        exe = shutil.which("redis-server")
        if exe is None:
            raise StackError("redis-server not found: install it (scripts/setup does) or set REDIS_URL")
        port = port_or_free(6390)
        data = self.config.run_dir / "redis"
        data.mkdir(exist_ok=True)
        # A trimmed log keeps the AOF's base small: rewrite after 512 MB, not 64 (DECISIONS 68).
        self.sup.start("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                                 "--appendonly", "yes", "--auto-aof-rewrite-min-size", "512mb",
                                 "--save", "", "--protected-mode", "yes"],
                       ready=lambda: _redis_ping(port))
        return f"redis://127.0.0.1:{port}/0"

    def _ensure_model(self) -> None:
        if (self.model_dir / "config.json").exists():
            return
        # Big enough that a prefill costs clearly more than loading its KV from the host tier.
        args = ["make-tiny-model", str(self.model_dir), "--hidden-size=256",
                "--intermediate-size=768", "--num-layers=6", "--num-heads=8", "--num-kv-heads=4",
                "--max-position-embeddings=4096"]
        if self.config.hybrid:
            args.append("--hybrid")
        self.sup.run_once("make-model", _py("engine", *args))


def _redis_ping(port: int) -> tuple[bool, str]:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return b"PONG" in s.recv(64), f"redis on {port}"
    except OSError as exc:
        return False, f"redis on {port}: {exc}"
