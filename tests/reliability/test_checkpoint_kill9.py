"""offloadd ``kill -9`` at random moments while it checkpoints and trims an evicting stream.

The daemon checkpoints every 50 ms and keeps 50 records of log behind its checkpoints, while an
engine stores blocks and evicts its oldest (an LRU GPU tier in steady state), so kills land in a
checkpoint's export, its chunk writes, its pointer swap, a sweep or a trim. After every restart
the daemon must serve from a checkpoint plus its tail, ``kvctl verify`` must find the log, the
checkpoint and the daemon in agreement, and once the engine's stream has resent what the kill
left unacked, the daemon's view of its GPU tier must be what the engine holds.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path

import redis

from events.logkeys import LogKeys
from events.schema import BlockRemoved, BlockStored, Event
from kvctl.main import main as kvctl_main
from offloadd.client import IngestStream, OffloadClient
from tests.offloadd.test_checkpoint import head, recovery_counts, wait_checkpoint
from tests.support.offloadd_proc import DaemonProcess

ENGINE = "evicting-engine"
ARGS = ("--checkpoint-interval-s", "0.05", "--checkpoint-records", "1000000",
        "--retention-records", "50", "--retention-s", "0")


class EvictingEngine:
    """Stores 20 new blocks a batch (200 batches/s on its thread) and evicts the oldest beyond
    ``capacity``."""

    def __init__(self, target: str, capacity: int) -> None:
        self.stream = IngestStream(target, ENGINE, 1, max_pending=1 << 16)  # outlasts any restart
        self.capacity = capacity
        self.resident: dict[int, None] = {}  # in the order stored: the oldest first
        self.next_hash = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def batch(self) -> None:
        events: list[Event] = []
        hashes = tuple(range(self.next_hash, self.next_hash + 20))
        self.next_hash += 20
        events.append(BlockStored(hashes, None, tuple(range(4 * 20)), 4, "GPU"))
        self.resident.update(dict.fromkeys(hashes))
        over = len(self.resident) - self.capacity
        if over > 0:
            oldest = tuple(itertools.islice(self.resident, over))
            for h in oldest:
                del self.resident[h]
            events.append(BlockRemoved(oldest, "GPU"))
        self.stream.submit(events)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.batch()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


def test_kill9_while_checkpointing_an_evicting_tier_recovers_exactly(
    tmp_path: Path, redis_url: str, namespace: str,
) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, extra_args=ARGS)
    keys, admin = LogKeys(namespace), redis.Redis.from_url(redis_url)
    proc.start()
    engine = EvictingEngine(proc.target, capacity=20_000)
    rng = random.Random(17)
    try:
        for _ in range(1000):  # fill the tier before the first kill
            engine.batch()
        assert engine.stream.flush(60), engine.stream.last_error
        wait_checkpoint(admin, keys, head(admin, keys))
        engine.start()
        for kill in range(5):
            time.sleep(rng.uniform(0.2, 0.8))
            proc.kill()
            time.sleep(rng.uniform(0.0, 0.2))
            proc.restart()
            _, ckpt_offset = recovery_counts(proc)
            assert ckpt_offset > 0, f"kill {kill}: recovered without a checkpoint"
        engine.stop()
        assert engine.stream.flush(60), engine.stream.last_error
        assert engine.stream.num_resets == 0 and engine.stream.num_dropped == 0
        with OffloadClient(proc.target) as c:
            snap = c.snapshot()
        assert snap.offset == head(admin, keys)
        mine = [s for s in snap.sources if s.source == ENGINE]
        assert len(mine) == 1
        held = {h for e in mine[0].events for h in e.block_hashes}
        assert held == set(engine.resident)
        # The newest checkpoint, its tail and the daemon agree; and one more restart from here
        # recovers exactly this state.
        wait_checkpoint(admin, keys, snap.offset)
        assert kvctl_main(["verify", redis_url, "--namespace", namespace]) == 0
        proc.kill()
        proc.restart()
        with OffloadClient(proc.target) as c:
            assert c.snapshot() == snap
    finally:
        engine.stop()
        engine.stream.close()
        proc.kill()
        admin.close()
