"""A real Redis Cluster on loopback for tests and benchmarks: N primaries with a replica each
(``redis-server --cluster-enabled yes`` + ``redis-cli --cluster create``), and a Sentinel setup
(one primary, one replica, ``redis-server --sentinel``). Nodes can be killed and restarted.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.support.redis_proc import RedisProcess, free_port


def _cluster_port() -> int:
    """A free port below 55536 whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _ping(port: int) -> bool:
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


class _Node(RedisProcess):
    """A redis-server started with extra arguments (cluster or replica or sentinel mode)."""

    def __init__(self, workdir: Path, extra: list[str], appendfsync: str = "everysec") -> None:
        super().__init__(workdir, appendfsync=appendfsync)
        self.extra = extra

    def start(self, timeout_s: float = 10.0) -> None:
        args = [self.exe, *self.extra, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--protected-mode", "no", "--daemonize", "no",
                "--loglevel", "warning", "--save", ""]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {log.name}")
            if _ping(self.port):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")


class RedisCluster:
    """``primaries`` primaries + one replica each; ``node_timeout_ms`` is cluster-node-timeout
    (how long a dead primary takes to be failed over)."""

    def __init__(self, workdir: Path, primaries: int = 3, node_timeout_ms: int = 1000) -> None:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli not found; run scripts/setup")
        self.nodes: list[_Node] = []
        for i in range(primaries * 2):
            d = workdir / f"node{i}"
            d.mkdir(parents=True, exist_ok=True)
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                     "--cluster-node-timeout", str(node_timeout_ms), "--appendonly", "yes",
                     "--cluster-replica-validity-factor", "0"]
            node = _Node(d, extra)
            node.port = _cluster_port()
            self.nodes.append(node)

    @property
    def url(self) -> str:
        """A seed-node list URL (rpc.redis_connect): every node of the cluster."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and every slot has a live primary."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.proc is not None]
            if all(self._state(n.port) == "ok" for n in live) and (
                    len(live) < len(self.nodes) or self._replicated(live[0].port)):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    @staticmethod
    def _replicated(port: int) -> bool:
        """Every slot range has a replica in sync with its primary."""
        client = redis.Redis(port=port, socket_timeout=1.0)
        try:
            ranges = client.execute_command("CLUSTER", "SLOTS")
            if not ranges or any(len(r) < 4 for r in ranges):
                return False
            for r in ranges:
                info = redis.Redis(port=int(r[3][1]), socket_timeout=1.0)
                try:
                    if info.info("replication").get("master_link_status") != "up":
                        return False
                finally:
                    info.close()
            return True
        except redis.RedisError:
            return False
        finally:
            client.close()

    @staticmethod
    def _state(port: int) -> str:
        client = redis.Redis(port=port, socket_timeout=1.0)
        try:
            info = client.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            return next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                         if ln.startswith("cluster_state:")), "")
        except redis.RedisError:
            return ""
        finally:
            client.close()

    def node_of_key(self, key: str) -> tuple[_Node, _Node | None]:
        """(primary, replica) serving ``key``'s slot now (no replica while none is attached)."""
        live = next(n for n in self.nodes if n.proc is not None)
        client = redis.Redis(port=live.port, socket_timeout=2.0)
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *replicas in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    by_port = {n.port: n for n in self.nodes}
                    return by_port[int(primary[1])], by_port[int(replicas[0][1])] if replicas else None
        finally:
            client.close()
        raise RuntimeError(f"no node serves {key!r}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(kill=True)


class RedisSentinel:
    """A primary, a replica and one sentinel watching them as service ``name``."""

    def __init__(self, workdir: Path, name: str = "kvd", down_after_ms: int = 1000) -> None:
        self.name = name
        (workdir / "primary").mkdir(parents=True, exist_ok=True)
        self.primary = _Node(workdir / "primary", ["--appendonly", "yes"])
        (workdir / "replica").mkdir(parents=True, exist_ok=True)
        self.replica = _Node(workdir / "replica",
                             ["--appendonly", "yes", "--replicaof", "127.0.0.1", str(self.primary.port)])
        sdir = workdir / "sentinel"
        sdir.mkdir(parents=True, exist_ok=True)
        conf = sdir / "sentinel.conf"
        conf.write_text(
            f"sentinel monitor {name} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
            f"sentinel failover-timeout {name} 5000\n"
            f"sentinel parallel-syncs {name} 1\n")
        self.sentinel = _Node(sdir, [str(conf), "--sentinel"])
        self.sentinel.port = free_port()

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.name}"

    def start(self, timeout_s: float = 20.0) -> None:
        self.primary.start()
        self.replica.start()
        self.sentinel.start()
        client = redis.Redis(port=self.replica.port, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not sync with the primary")
                time.sleep(0.05)
        finally:
            client.close()

    def master_port(self) -> int:
        client = redis.Redis(port=self.sentinel.port, socket_timeout=1.0)
        try:
            host_port = client.execute_command("SENTINEL", "get-master-addr-by-name", self.name)
            return int(host_port[1])
        finally:
            client.close()

    def stop(self) -> None:
        for node in (self.sentinel, self.replica, self.primary):
            node.stop(kill=True)
