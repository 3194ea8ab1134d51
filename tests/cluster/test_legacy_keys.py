"""Keys of daemons before hash tags (``kvd:<ns>:*``) are renamed to ``kvd:{<ns>}:*`` at start:
a daemon restarted on an older deployment's Redis keeps its log, its tier and its epoch."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from events.logkeys import LogKeys
from offloadd.client import OffloadClient
from tests.support.offloadd_proc import DaemonProcess
from tests.support.synthetic_engine import SLOT, SyntheticStorer


def _to_legacy(client: redis.Redis, keys: LogKeys) -> int:
    """Rename every key of the namespace to the form daemons before DECISIONS 40 wrote."""
    names = [k.decode() for k in client.scan_iter(match=f"kvd:{{{keys.namespace}}}:*")]
    for name in names:
        client.rename(name, keys.legacy_prefix + name[len(keys.prefix):])
    return len(names)


def test_restart_on_legacy_keys_keeps_log_and_tier(tmp_path: Path, redis_url: str) -> None:
    keys = LogKeys("legacy")
    daemon = DaemonProcess(tmp_path / "d", redis_url, keys.namespace, capacity_bytes=64 * SLOT)
    daemon.start()
    try:
        storer = SyntheticStorer(daemon.target, "e1", chain_len=4, max_chains=5).start()
        deadline = time.monotonic() + 20
        while storer.stats.stores < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        storer.stop()
        assert storer.stats.stores == 5
        with OffloadClient(daemon.target) as c:
            before = c.stats()
        assert daemon.stop() == 0
        client = redis.Redis.from_url(redis_url)
        epoch = client.get(keys.epoch)
        assert _to_legacy(client, keys) >= 5
        assert client.get(keys.legacy_prefix + "epoch") == epoch and client.get(keys.epoch) is None
        daemon.restart()
        with OffloadClient(daemon.target) as c:
            after = c.stats()
        assert (after.num_blocks, after.log_offset) == (before.num_blocks, before.log_offset)
        assert before.num_blocks == 20
        assert client.get(keys.epoch) == epoch  # the same log: readers see no change
        assert list(client.scan_iter(match=f"kvd:{keys.namespace}:*")) == []
        client.close()
    finally:
        daemon.kill()


def test_keys_of_both_forms_are_left_alone(tmp_path: Path, redis_url: str) -> None:
    keys = LogKeys("both")
    client = redis.Redis.from_url(redis_url)
    client.set(keys.legacy_prefix + "bridge:x", b"old")
    daemon = DaemonProcess(tmp_path / "d", redis_url, keys.namespace, capacity_bytes=64 * SLOT)
    client.set(keys.bridge("x"), b"new")
    daemon.start()
    try:
        assert client.get(keys.legacy_prefix + "bridge:x") == b"old"
        assert client.get(keys.bridge("x")) == b"new"
        assert "keys of both forms" in daemon.log_tail()
    finally:
        daemon.kill()
        client.close()
