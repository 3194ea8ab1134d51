"""A Sentinel-managed primary (redis+sentinel://sentinel/service): a daemon and a bridge follow
it through a failover. The primary is SIGKILLed while an engine stores; the sentinel promotes
the replica; the daemon reconnects through the sentinel and carries on; tier, log, Snapshot and
bridge agree afterwards. The daemon acknowledges writes once the replica has them, so the
promoted primary holds everything acknowledged; after the promotion it has no replica, so the
killed node is restarted as its replica before writes are acknowledged again.

At load the sentinel may take the just-promoted primary for down (a false +sdown one second after
the switch) and fail over again, to the restarted node before it synced: for a while two nodes
are primaries, the daemon's connections still on the first. Writes there are in doubt and stay
so (no replica confirms them, DECISIONS 59) until the sentinel turns that node into a replica;
the daemon then finds the log as it acknowledged it and carries on (before, it had applied the
unconfirmed writes and ended the log as rewound)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.cluster.stack import Node, check_node
from tests.support.redis_cluster import RedisSentinel


@contextmanager
def _storing_node(tmp_path: Path, namespace: str) -> Iterator[tuple[RedisSentinel, Node]]:
    """A sentinel-managed primary and replica, and a node (daemon acknowledging once the replica
    has a write, engines, bridge) that has stored 20 times; all stopped at the end."""
    sentinel = RedisSentinel(tmp_path / "sentinel", down_after_ms=1000)
    sentinel.start()
    node = None
    try:
        node = Node.start(tmp_path / "n", sentinel.url, namespace, "--redis-wait-replicas", "1",
                          "--redis-wait-timeout-ms", "300")
        assert node.storer is not None
        while node.storer.stats.stores < 20:
            time.sleep(0.05)
        yield sentinel, node
    finally:
        if node is not None:
            node.close()
        sentinel.stop()


def _fail_over_and_rejoin(sentinel: RedisSentinel) -> float:
    """Kill the primary, wait for the sentinel to promote the replica, and bring the old primary
    back as the new one's replica (as an operator or orchestrator does); when it was killed."""
    sentinel.primary.stop(kill=True)
    t0 = time.monotonic()
    while sentinel.master_port() != sentinel.replica.port:
        assert time.monotonic() - t0 < 30, "the sentinel did not promote the replica"
        time.sleep(0.1)
    sentinel.primary.extra = ["--appendonly", "yes", "--replicaof", "127.0.0.1",
                              str(sentinel.replica.port)]
    sentinel.primary.start()
    return t0


@pytest.mark.slow
def test_daemon_follows_a_sentinel_failover(tmp_path: Path) -> None:
    with _storing_node(tmp_path, "sent") as (sentinel, node):
        assert sentinel.master_port() == sentinel.primary.port
        t0 = _fail_over_and_rejoin(sentinel)
        assert node.storer is not None
        stores = node.storer.stats.stores
        while node.storer.stats.stores < stores + 20:
            assert time.monotonic() - t0 < 40, node.daemon.log_tail()
            time.sleep(0.05)
        node.stop_engines()
        state = check_node(node)
        assert state.offset > 0
        client = redis.Redis(port=sentinel.master_port())  # the replica, or the old primary again
        assert client.execute_command("ROLE")[0] == b"master"
        client.close()


def _good_replica(sentinel: RedisSentinel, port: int) -> bool:
    """The sentinel sees the node on ``port`` as a replica it could promote (up, linked)."""
    client = redis.Redis(port=sentinel.sentinel.port, socket_timeout=1.0)
    try:
        replicas: Any = client.sentinel_slaves(sentinel.name)
        return any(int(r["port"]) == port and not (r["is_sdown"] or r["is_odown"] or r["is_disconnected"])
                   for r in replicas)
    finally:
        client.close()


@pytest.mark.slow
def test_daemon_survives_a_second_failover_to_a_node_that_had_not_synced(tmp_path: Path) -> None:
    """What the sentinel did at load in the test above, forced (DECISIONS 59): right after the
    failover, the killed node comes back as the new primary's replica and, before it synced (the
    primary holds a full sync 5 s, repl-diskless-sync-delay), ``SENTINEL FAILOVER`` promotes it
    with its own older data. The first promoted node stays a primary for a while, the daemon's
    connections on it: its writes there stay in doubt (no replica confirms them), and once the
    sentinel made it a replica the daemon settles them against the log the sentinel kept and
    carries on: same log (not ended), stores acknowledged again, tier, log and bridge agree. The
    bridge read records of the first promoted node that the log the sentinel kept does not hold:
    it finds the record it published last gone or changed and publishes the log again after
    AllBlocksCleared (bridge.tip); before, it kept their blocks (4 CPU blocks the log had not)."""
    with _storing_node(tmp_path, "flap") as (sentinel, node):
        t0 = _fail_over_and_rejoin(sentinel)
        assert node.storer is not None
        admin = redis.Redis(port=sentinel.sentinel.port, socket_timeout=2.0)
        try:
            while not _good_replica(sentinel, sentinel.primary.port):
                assert time.monotonic() - t0 < 30, "the sentinel did not see the node come back"
                time.sleep(0.05)
            admin.execute_command("SENTINEL", "FAILOVER", sentinel.name)
        finally:
            admin.close()
        while sentinel.master_port() != sentinel.primary.port:
            assert time.monotonic() - t0 < 40, "the sentinel did not fail over again"
            time.sleep(0.1)
        stores = node.storer.stats.stores
        while node.storer.stats.stores < stores + 20:
            assert time.monotonic() - t0 < 75, node.daemon.log_tail()
            time.sleep(0.05)
        assert "went back" not in node.daemon.log_tail()
        node.stop_engines()
        state = check_node(node)
        assert state.offset > 0
