"""Two nodes' daemons on a real Redis Cluster, a primary killed under them.

Each namespace's keys share one hash tag, so each daemon's log lives on one shard; the two are
picked on different shards. Engines store and publish on both while the primary holding the
first namespace's slot is SIGKILLed; its replica is promoted by the cluster's own failover
(cluster-node-timeout 1 s). Checked: both daemons carry on (writes are accepted again, the
first one's within a few seconds), and afterwards each daemon's tier equals its log and its
Snapshot, every served block holds its writer's bytes, and each bridge publishes the log's state.
The first daemon acknowledges writes only once a replica has them (--redis-wait-replicas 1):
nothing it acknowledged can be lost by the failover, and it accepts writes again once the
promoted primary has a replica (the killed node, restarted); the second, on another shard,
only waits out the cluster's fail state.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from events.logkeys import LogKeys
from kvctl.main import main as kvctl
from tests.cluster.stack import Node, check_node, cpu_blocks, namespaces_on_shards
from tests.support.redis_cluster import RedisCluster


def _wait_stores(node: Node, more_than: int, timeout_s: float) -> float:
    """Seconds until the node's storer has committed more than ``more_than`` chains."""
    assert node.storer is not None
    t0 = time.monotonic()
    while node.storer.stats.stores <= more_than:
        assert time.monotonic() - t0 < timeout_s, f"no write accepted:\n{node.daemon.log_tail()}"
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.slow
def test_daemons_carry_on_when_a_primary_is_killed(tmp_path: Path, cluster: RedisCluster) -> None:
    ns_a, ns_b = namespaces_on_shards(cluster, 2)
    a = Node.start(tmp_path / "a", cluster.url, ns_a, "--redis-wait-replicas", "1",
                   "--redis-wait-timeout-ms", "300")
    b = Node.start(tmp_path / "b", cluster.url, ns_b)
    try:
        _wait_stores(a, 20, 10.0)
        _wait_stores(b, 20, 10.0)
        primary, replica = cluster.node_of_key(LogKeys(ns_a).head)
        assert a.storer is not None and b.storer is not None and replica is not None
        before_a = a.storer.stats.stores
        primary.stop(kill=True)
        t_kill = time.monotonic()
        while cluster.node_of_key(LogKeys(ns_a).head)[0].port != replica.port:  # promoted
            assert time.monotonic() - t_kill < 20.0, "the replica was not promoted"
            time.sleep(0.05)
        promoted_s = time.monotonic() - t_kill
        _wait_stores(b, b.storer.stats.stores, 20.0)
        # a acknowledges a write once a replica has it: the promoted primary has none until
        # the killed node is back (as its replica).
        primary.start()
        _wait_stores(a, before_a, 20.0)
        print(f"replica promoted {promoted_s:.2f} s after the kill; {ns_a}'s writes accepted "
              f"again {time.monotonic() - t_kill:.2f} s after it (once a replica was back)")
        _wait_stores(a, a.storer.stats.stores + 20, 10.0)  # and keep being accepted
        for node in (a, b):
            node.stop_engines()
        state_a, state_b = check_node(a), check_node(b)
        assert a.storer.stats.errors > 0  # the failover was felt
        assert cpu_blocks(state_a) > 0 and cpu_blocks(state_b) > 0
        for ns in (ns_a, ns_b):  # kvctl reads a namespace's log on the cluster too
            assert kvctl(["verify", cluster.url, "--namespace", ns]) == 0
    finally:
        a.close()
        b.close()
