"""What the cluster tests share: namespaces on chosen shards, a node (daemon, bridge, storer,
publisher) per namespace, and the checks that a node's tier, log, snapshot and bridge agree."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from events.logkeys import LogKeys
from events.schema import Medium
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from offloadd.client import OffloadClient, OffloadClientError, StoreStats
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_cluster import RedisCluster
from tests.support.synthetic_engine import (
    GROUP,
    SLOT,
    SyntheticPublisher,
    SyntheticStorer,
    served_blocks_match,
)

NUM_SLOTS = 64
TierId = tuple[str, Medium, int]  # (source, medium, group), as CacheState.view() keys them


def namespaces_on_shards(cluster: RedisCluster, count: int) -> list[str]:
    """``count`` namespaces whose keys live on ``count`` different primaries."""
    found: dict[int, str] = {}
    for i in range(200):
        ns = f"node-{i}"
        primary, _ = cluster.node_of_key(LogKeys(ns).head)
        found.setdefault(primary.port, ns)
        if len(found) == count:
            return list(found.values())
    raise RuntimeError(f"fewer than {count} shards")


@dataclass
class Node:
    """One node's processes: its daemon on its namespace, a bridge, a storer, a publisher."""

    daemon: DaemonProcess
    bridge: BridgeProcess
    storer: SyntheticStorer | None = None
    publisher: SyntheticPublisher | None = None
    extra: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, workdir: Path, url: str, namespace: str, *extra: str) -> Node:
        daemon = DaemonProcess(workdir / "d", url, namespace, capacity_bytes=NUM_SLOTS * SLOT,
                               lease_ms=500, extra_args=extra)
        daemon.start()
        bridge = BridgeProcess(url, workdir / "b", namespace=namespace)
        bridge.start()
        node = cls(daemon, bridge)
        node.storer = SyntheticStorer(daemon.target, f"{namespace}-store", chain_len=4).start()
        node.publisher = SyntheticPublisher(daemon.target, f"{namespace}-gpu", pause_s=0.005).start()
        return node

    def stop_engines(self) -> None:
        for part in (self.storer, self.publisher):
            if part is not None:
                part.stop()
        if self.publisher is not None:
            self.publisher.close()

    def close(self) -> None:
        self.stop_engines()
        self.bridge.stop(kill=True)
        self.daemon.kill()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def settled(client: OffloadClient, timeout_s: float = 10.0) -> StoreStats:
    """Stats once nothing is reserved or pinned (writes in doubt resolved, leases expired)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = client.stats()
            if all(s.num_reserved == 0 and s.num_pinned == 0 for s in stats.layouts):
                return stats
        except OffloadClientError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"still reserved or pinned: {client.stats()}")
        time.sleep(0.1)


def cpu_blocks(state: CacheState) -> int:
    return sum(len(v) for k, v in state.view().items() if k[1] == "CPU")


def log_state(client: OffloadClient) -> CacheState:
    state = CacheState()
    for record in client.subscribe(1):
        state.apply(record)
    return state


def quiet_state(client: OffloadClient, timeout_s: float = 15.0) -> CacheState:
    """The log's state once the stopped engines' departures are in it (no GPU tier left, so
    nothing more is appended): the state the Snapshot and the bridge must then show."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = log_state(client)
        if not any(v for k, v in state.view().items() if k[1] == "GPU"):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"GPU tiers left in the log after the engines stopped: {state.counts()}")
        time.sleep(0.05)


def check_node(node: Node) -> CacheState:
    """Once the engines are stopped and their departures logged: the daemon's tier == the log's
    CPU tier == its Snapshot; every served block holds its writer's bytes; the bridge's state (a
    fresh subscriber) == the log's. The log's state."""
    assert node.daemon.proc is not None and node.daemon.proc.poll() is None, node.daemon.log_tail()
    with OffloadClient(node.daemon.target) as client:
        stats = settled(client)
        state = quiet_state(client)
        snap = CacheState.from_snapshot(client.snapshot())
        assert state.violations == [], state.violations[:20]
        assert state == snap
        assert stats.num_blocks == cpu_blocks(state)
        arena = client.register_engine("checker", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            assert node.storer is not None
            st = node.storer.stats
            served, bad = served_blocks_match(client, "checker", arena, sorted(st.committed | st.in_doubt))
        finally:
            arena.close()
        assert bad == []
        assert served == stats.num_blocks
    want = {k: v for k, v in state.view().items() if v}
    deadline = time.monotonic() + 15.0
    with KvEventSubscriber(node.bridge.pub, node.bridge.replay) as sub:
        sub.bootstrap()
        while True:
            sub.poll(100)
            got = {k: v for k, v in sub.view().items() if v}
            if got == want or time.monotonic() > deadline:
                break
    assert got == want, f"the bridge's state is not the log's: {_tier_diff(want, got)}"
    return state


def _tier_diff(want: dict[TierId, frozenset[int]], got: dict[TierId, frozenset[int]]) -> str:
    """Per tier that differs: blocks in the log, blocks at the bridge, a few that differ."""
    none: frozenset[int] = frozenset()
    return "; ".join(f"{k}: log {len(want.get(k, none))}, bridge {len(got.get(k, none))}, e.g. "
                     f"{sorted(want.get(k, none) ^ got.get(k, none))[:5]}"
                     for k in sorted(want.keys() | got.keys()) if want.get(k) != got.get(k))
