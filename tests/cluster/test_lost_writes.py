"""A failover that loses acknowledged writes (asynchronous replication) is detected, and the
log that went back is ended so that every reader re-syncs: never a silent wrong history.

The replica of the namespace's primary is paused (SIGSTOP) and its replication link cut while
engines write, so the primary acknowledges records the replica never gets; the primary is then
SIGKILLed and the replica, resumed, is promoted without them. The daemon's next write finds the
log's head below the last offset it wrote: it ends the log (fenced) and stops (exit 3).
Restarted, it starts a new log epoch from a state the reducer accepts: its own tier dropped, the
engine's GPU tier re-announced under a new incarnation (never a delta about blocks the new log
lacks); the bridge publishes the new log after clears; tier, log, Snapshot and bridge agree.
Every wait is on a condition, with a deadline.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import redis

from events.logkeys import LogKeys
from offloadd.client import OffloadClient
from tests.cluster.stack import Node, check_node, log_state, wait_until
from tests.support.redis_cluster import RedisCluster
from tests.support.synthetic_engine import SyntheticPublisher


def _head(client: redis.Redis, keys: LogKeys) -> int:
    return int(client.get(keys.head) or 0)


def _publisher_matches_log(pub: SyntheticPublisher, target: str) -> bool:
    """Once its batches are acked, the log holds exactly the GPU tier the engine holds."""
    pub.resync_if_reset()
    if not pub.stream.flush(5.0):
        return False
    with OffloadClient(target) as client:
        return set(log_state(client).blocks(pub.engine_id, "GPU")) == set(pub.view())


def test_lost_writes_end_the_log_and_start_a_new_epoch(tmp_path: Path, cluster: RedisCluster) -> None:
    keys = LogKeys("lossy")
    node = Node.start(tmp_path / "n", cluster.url, keys.namespace)
    try:
        storer, pub = node.storer, node.publisher
        assert storer is not None and pub is not None
        wait_until(lambda: storer.stats.stores >= 20 and pub.stream.acked_seq >= 20, 30,
                   "stores and GPU batches acknowledged before the failover")
        primary, replica = cluster.node_of_key(keys.head)
        assert replica is not None and replica.proc is not None and primary.proc is not None
        seed = redis.Redis(port=primary.port)
        epoch = seed.get(keys.epoch)
        # The replica stops reading and its link is cut (what was sent is in its socket buffer):
        # the primary acknowledges what the replica never gets.
        os.kill(replica.proc.pid, signal.SIGSTOP)
        assert seed.execute_command("CLIENT", "KILL", "TYPE", "replica") == 1
        cut, stores, acked = _head(seed, keys), storer.stats.stores, pub.stream.acked_seq
        # Acknowledged records the replica lacks, well within the cluster's validity window.
        wait_until(lambda: _head(seed, keys) >= cut + 5 and storer.stats.stores >= stores + 3
                   and pub.stream.acked_seq >= acked + 3, 5, "writes acknowledged after the cut")
        seed.close()
        primary.stop(kill=True)
        os.kill(replica.proc.pid, signal.SIGCONT)
        assert node.daemon.proc is not None
        code = node.daemon.proc.wait(timeout=90)
        assert code == 3, node.daemon.log_tail()
        assert "went back from offset" in node.daemon.log_path.read_text()
        node.daemon.proc = None
        node.daemon.restart()
        check = redis.Redis(port=replica.port)
        new_epoch = check.get(keys.epoch)
        check.close()
        assert isinstance(new_epoch, bytes) and new_epoch != epoch  # a new log epoch
        stores = storer.stats.stores
        # The engine learnt of the new epoch from its acks and re-announced its tier; writes go on.
        wait_until(lambda: pub.stream.log_epoch == new_epoch.decode() and pub.num_resyncs >= 1
                   and storer.stats.stores >= stores + 10, 60, "engines writing to the new epoch")
        pub.stop()
        wait_until(lambda: _publisher_matches_log(pub, node.daemon.target), 30,
                   "the new log holds the engine's GPU tier")
        node.stop_engines()
        check_node(node)
    finally:
        node.close()
