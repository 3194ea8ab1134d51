"""Checkpoints, trimming and recovery on a Redis Cluster: the checkpoint scripts, the chunk
pipeline, the SCAN of unfinished checkpoints and the log trim all run on the namespace's shard;
a warm restart loads the checkpoint and replays only the tail; a bridge started after the trim
bootstraps from the checkpoint and publishes the daemon's state."""

from __future__ import annotations

import time
from pathlib import Path

from events.logkeys import LogKeys
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from offloadd.client import IngestStream, OffloadClient
from rpc.redis_connect import connect
from tests.offloadd.test_checkpoint import (
    CKPT_ARGS,
    first_offset,
    head,
    pointer,
    publish,
    recovery_counts,
    wait_checkpoint,
)
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_cluster import RedisCluster


def test_checkpoint_trim_and_recovery_on_a_cluster(tmp_path: Path, shared_cluster: RedisCluster) -> None:
    cluster = shared_cluster
    keys = LogKeys("ckpt")
    admin = connect(cluster.url)
    proc = DaemonProcess(tmp_path / "d", cluster.url, keys.namespace, extra_args=CKPT_ARGS)
    proc.start()
    stream = IngestStream(proc.target, "gpu-engine", 3)
    bridge = None
    try:
        publish(stream, 0, 400)
        wait_checkpoint(admin, keys, 400)
        publish(stream, 400, 200)
        wait_checkpoint(admin, keys, head(admin, keys))
        deadline = time.monotonic() + 10
        while first_offset(admin, keys) <= 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_offset(admin, keys) > 1  # trimmed behind the checkpoints
        assert len(pointer(admin, keys)) == 2
        with OffloadClient(proc.target) as c:
            before = CacheState.from_snapshot(c.snapshot())
        assert proc.stop() == 0
        proc.restart()
        replayed, ckpt_offset = recovery_counts(proc)
        assert ckpt_offset > 0 and replayed < 600 - ckpt_offset + 50
        with OffloadClient(proc.target) as c:
            assert CacheState.from_snapshot(c.snapshot()) == before
        bridge = BridgeProcess(cluster.url, tmp_path / "b", namespace=keys.namespace)
        bridge.start()
        want = {k: v for k, v in before.view().items() if v}
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            sub.bootstrap()
            deadline = time.monotonic() + 15
            while {k: v for k, v in sub.view().items() if v} != want and time.monotonic() < deadline:
                sub.poll(100)
            assert {k: v for k, v in sub.view().items() if v} == want
    finally:
        stream.close()
        if bridge is not None:
            bridge.stop(kill=True)
        proc.kill()
        admin.close()
