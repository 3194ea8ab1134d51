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
from pathlib import Path

import pytest
import redis

from tests.cluster.stack import Node, check_node
from tests.support.redis_cluster import RedisSentinel


@pytest.mark.slow
def test_daemon_follows_a_sentinel_failover(tmp_path: Path) -> None:
    sentinel = RedisSentinel(tmp_path / "sentinel", down_after_ms=1000)
    sentinel.start()
    node = None
    try:
        node = Node.start(tmp_path / "n", sentinel.url, "sent", "--redis-wait-replicas", "1",
                          "--redis-wait-timeout-ms", "300")
        assert node.storer is not None
        while node.storer.stats.stores < 20:
            time.sleep(0.05)
        assert sentinel.master_port() == sentinel.primary.port
        sentinel.primary.stop(kill=True)
        t0 = time.monotonic()
        while sentinel.master_port() != sentinel.replica.port:
            assert time.monotonic() - t0 < 30, "the sentinel did not promote the replica"
            time.sleep(0.1)
        # The old primary comes back as the new one's replica (as an operator or orchestrator does).
        sentinel.primary.extra = ["--appendonly", "yes", "--replicaof", "127.0.0.1",
                                  str(sentinel.replica.port)]
        sentinel.primary.start()
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
    finally:
        if node is not None:
            node.close()
        sentinel.stop()
