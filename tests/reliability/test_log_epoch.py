"""Redis loses the log (restarted without its data) under a daemon, an engine and a bridge.

The daemon exits (its log is not what it wrote) and is restarted on a new log epoch. Checked:
the engine re-announces its GPU tier under a new incarnation (once, no RESEND flood), the new
log verifies clean, and the bridge tells its subscriber (a clear batch, seqs continuing) and
publishes the new log, its /healthz 200 again, the subscriber's state equal to the new log's.
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import redis

from engine.ingest_sink import IngestEventSink
from events.codec_vllm import WireBatch
from events.logkeys import LogKeys
from events.logreader import LogReader
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from kvctl.main import main as kvctl_main
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess

ENGINE = "eng-epoch"


class EngineLike:
    """A GPU tier that stores and evicts blocks each step and publishes through the engine's
    real sink, re-announcing everything when the sink asks (as EngineCore._flush_events)."""

    def __init__(self, target: str, max_pending: int) -> None:
        self.sink = IngestEventSink(target, ENGINE, max_pending=max_pending)
        self.resident: dict[int, BlockStored] = {}
        self.num_resend = 0
        self.num_acks = 0
        self._rng = random.Random(7)
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        on_ack = self.sink.stream._on_ack

        def counting(ack: object) -> None:
            self.num_acks += 1
            # Only a RESEND about this incarnation makes the stream rewind. Those about batches
            # of the one before a reset are stale (the stream drops them); how many arrive is
            # how many were in flight, which a loaded machine makes more of.
            stream = self.sink.stream
            self.num_resend += (getattr(ack, "status", 0) == 3
                                and getattr(ack, "incarnation", 0) == stream.incarnation)
            on_ack(ack)  # type: ignore[arg-type]

        self.sink.stream._on_ack = counting  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def step(self) -> None:
        with self._lock:
            events: list[Event] = []
            if self.resident and self._rng.random() < 0.3:
                victim = self._rng.choice(sorted(self.resident))
                del self.resident[victim]
                events.append(BlockRemoved((victim,), "GPU"))
            else:
                self._next += 1
                h = (self._next << 20) | self._rng.randrange(1 << 20)
                ev = BlockStored((h,), None, tuple(range(4)), 4, "GPU")
                self.resident[h] = ev
                events.append(ev)
            self.sink.publish(events)
            if self.sink.take_resync():
                snapshot = list(self.resident.values())
                if snapshot:
                    self.sink.publish(snapshot)

    def view(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self.resident)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.step()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _new_log(url: str, namespace: str) -> CacheState:
    client = redis.Redis.from_url(url)
    try:
        state = CacheState()
        for record in LogReader(client, LogKeys(namespace)).iter_range(1):
            state.apply(record)
        return state
    finally:
        client.close()


def _lose_everything(server: RedisProcess) -> None:
    """Restart Redis without its data, as one without persistence would come back."""
    server.stop()  # waits for the process to exit
    for path in server.workdir.iterdir():
        if path.name.startswith("appendonly") or path.suffix == ".rdb":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    server.start()


@pytest.mark.parametrize("max_pending", [4096, 64])
def test_lost_log_starts_a_new_epoch_everyone_resyncs(
    own_redis: RedisProcess, tmp_path: Path, namespace: str, max_pending: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """4096: the engine's queue holds out, the new epoch in the first ack resets the stream once;
    64: it fills while the daemon is down (queue-full resets), then the epoch resets it again."""
    daemon = DaemonProcess(tmp_path / "d", own_redis.url, namespace)
    daemon.start()
    bridge = BridgeProcess(own_redis.url, tmp_path / "bridge", "--start", "beginning", namespace=namespace)
    bridge.start()
    sub = KvEventSubscriber(bridge.pub, bridge.replay, idle_sync_s=0.3, replay_timeout_s=2.0)
    seen: list[tuple[int, WireBatch]] = []
    sub.on_batch(lambda seq, batch: seen.append((seq, batch)))
    engine = EngineLike(daemon.target, max_pending)
    try:
        time.sleep(0.3)
        sub.bootstrap()
        sub.run_until(lambda _s: False, 1.0)
        old_epoch = engine.sink.stream.log_epoch
        old_incarnation = engine.sink.incarnation
        assert old_epoch and engine.sink.stream.acked_seq > 10

        _lose_everything(own_redis)
        deadline = time.monotonic() + 20
        while daemon.proc is not None and daemon.proc.poll() is None and time.monotonic() < deadline:
            sub.poll(50)
        assert daemon.proc is not None and daemon.proc.poll() not in (None, 0), daemon.log_tail()
        # No daemon, no log: the bridge says so instead of answering 200 at its old offset.
        assert _wait(lambda: bridge.health()[0] == 503
                     and "re-syncing" in bridge.health()[1]["detail"], 5), bridge.health()
        acks_before = engine.num_acks
        resets_before = engine.sink.stream.num_resets
        caplog.set_level(logging.WARNING, logger="offloadd.client.ingest_stream")
        caplog.clear()
        daemon.restart()

        # The engine re-announces under a new incarnation within a few seconds.
        assert _wait(lambda: engine.sink.stream.log_epoch not in ("", old_epoch)
                     and engine.sink.stream.acked_seq > 2, 10), engine.sink.stream.last_error
        assert engine.sink.incarnation != old_incarnation
        # Once the daemon serves: one reset for the new epoch, then a stable stream. Until the
        # engine's stream reconnects (gRPC's backoff, longer on a loaded machine) its small queue
        # may fill again: those resets say so, and there is no other kind.
        settled, acked = engine.sink.stream.num_resets, engine.sink.stream.acked_seq
        assert _wait(lambda: engine.sink.stream.acked_seq > acked + 20, 10)
        assert engine.sink.stream.num_resets == settled, "the stream must settle in the new epoch"
        reasons = [r.getMessage().split(": new incarnation")[0] for r in caplog.records
                   if r.getMessage().startswith("ingest reset (")]
        assert sum("log epoch changed" in why for why in reasons) == 1, reasons
        assert all("log epoch changed" in why or "unacked queue full" in why for why in reasons), reasons
        assert engine.num_acks - acks_before < 2000  # no RESEND livelock
        assert engine.num_resend < 50
        if max_pending > 1000:
            assert resets_before == 0 and engine.sink.stream.num_resets == 1
            assert "log epoch changed" in engine.sink.stream.last_error

        engine.stop()
        assert engine.sink.stream.flush(10)
        state = _new_log(own_redis.url, namespace)
        assert state.view().get((ENGINE, "GPU", 0), frozenset()) == engine.view()
        assert state.violations == []
        assert kvctl_main(["verify", own_redis.url, "--namespace", namespace]) == 0

        # The bridge: the clear signal, then the new log, seqs contiguous; healthy again.
        assert sub.run_until(lambda s: s.state.view() == state.view(), 15), (
            sub.state.view(), state.view(), bridge.output()[-3000:])
        assert _wait(lambda: bridge.health()[0] == 200, 10), bridge.health()
        seqs = [seq for seq, _ in seen]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "seqs must stay contiguous"
        clears = [i for i, (_, b) in enumerate(seen)
                  if any(isinstance(e, AllBlocksCleared) and e.medium is None for e in b.events)]
        assert clears, "the subscriber must be told that the log was replaced"
        after = seen[clears[0] + 1 :]
        assert after and all(not (isinstance(e, AllBlocksCleared) and e.medium is None)
                             for _, b in after for e in b.events)
    finally:
        engine.stop()
        engine.sink.close(0.5)
        sub.close()
        bridge.stop()
        if daemon.proc is not None:
            daemon.stop()


def _wait(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False
