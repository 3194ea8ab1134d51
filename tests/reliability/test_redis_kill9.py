"""Redis ``kill -9`` under stores that evict: the host tier must equal the log afterwards.

Injected: a Redis with AOF and ``appendfsync always`` (every acknowledged write survives the
kill), a daemon with 64 slots so nearly every Reserve evicts, three synthetic storers storing
chains in a loop; Redis SIGKILLed for ~2 s and restarted on the same data dir, twice.
Checked, after the storers stop and the daemon has settled its writes in doubt and expired its
leases: Stats.num_blocks == the CPU tier of the reducer over the log == the Snapshot's; nothing
reserved or pinned; every block Lookup serves has exactly its writer's bytes.
"""

from __future__ import annotations

import time
from pathlib import Path

from events.state import CacheState
from offloadd.client import OffloadClient, OffloadClientError, StoreStats
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess
from tests.support.synthetic_engine import GROUP, SLOT, SyntheticStorer, served_blocks_match

NUM_SLOTS = 64
LEASE_MS = 500


def _cpu_blocks(state: CacheState) -> int:
    return sum(len(v) for k, v in state.view().items() if k[1] == "CPU")


def _settled(client: OffloadClient) -> StoreStats | None:
    """Stats once nothing is reserved or pinned (writes in doubt resolved, leases expired)."""
    try:
        stats = client.stats()
    except OffloadClientError:  # a request racing the settle; asked again
        return None
    if all(s.num_reserved == 0 and s.num_pinned == 0 for s in stats.layouts):
        return stats
    return None


def test_redis_kill9_under_evicting_stores_keeps_tier_equal_to_log(tmp_path: Path, namespace: str) -> None:
    redis = RedisProcess(tmp_path / "redis", appendfsync="always")
    redis.start()
    daemon = DaemonProcess(tmp_path / "d", redis.url, namespace, capacity_bytes=NUM_SLOTS * SLOT,
                           lease_ms=LEASE_MS)
    storers: list[SyntheticStorer] = []
    try:
        daemon.start()
        storers = [SyntheticStorer(daemon.target, f"store-{i}", chain_len=8).start() for i in range(3)]
        for _ in range(2):
            time.sleep(1.5)
            redis.stop(kill=True)
            time.sleep(2.0)
            redis.start()
        time.sleep(1.5)
        for s in storers:
            s.stop()
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
        with OffloadClient(daemon.target) as client:
            deadline = time.monotonic() + 10.0
            stats = _settled(client)
            while stats is None and time.monotonic() < deadline:
                time.sleep(0.1)
                stats = _settled(client)
            assert stats is not None, f"still reserved or pinned: {client.stats()}"
            state = CacheState()
            for record in client.subscribe(1):
                state.apply(record)
            snap = CacheState.from_snapshot(client.snapshot())
            stores = [s.stats.stores for s in storers]
            errors = [s.stats.errors for s in storers]
            print(f"stores {stores}, errors {errors}, in doubt {[len(s.stats.in_doubt) for s in storers]}, "
                  f"blocks {stats.num_blocks}, log CPU {_cpu_blocks(state)}, evictions {stats.evictions}")
            assert all(n > 0 for n in stores) and sum(errors) > 0 and stats.evictions > 0
            assert state.violations == []
            assert state == snap
            assert stats.num_blocks == _cpu_blocks(state) == _cpu_blocks(snap)
            arena = client.register_engine("checker", 1, "synthetic", [GROUP]).map_arena(0)
            num_served = 0
            for s in storers:  # every block in the tier was written by a storer: all are served
                served, bad = served_blocks_match(
                    client, "checker", arena, sorted(s.stats.committed | s.stats.in_doubt))
                assert bad == []
                num_served += served
            arena.close()
            assert num_served == stats.num_blocks
    finally:
        for s in storers:
            s.stop()
        daemon.kill()
        redis.stop(kill=True)
