"""kv-bridge as a process: restarts keep the sequence, snapshots, per-source mode, Redis outages."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis
import zmq

from bridge.main import main as bridge_main
from events.logkeys import LogKeys
from events.schema import LogRecord
from events.state import CacheState
from events.subscriber import KvEventSubscriber, SubscriberError
from tests.support.bridge_proc import BridgeProcess, FleetSimulator, LogWriter
from tests.support.redis_proc import RedisProcess


def _full_state(records: list[LogRecord]) -> CacheState:
    state = CacheState()
    for r in records:
        state.apply(r)
    return state


def _collect(bridge: BridgeProcess, topic: str = "kv-events") -> KvEventSubscriber:
    return KvEventSubscriber(bridge.pub, bridge.replay, topic)


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_restarted_bridge_continues_the_sequence(
    redis_url: str, client: redis.Redis, tmp_path: Path, kill: bool
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["engine-a", "engine-b"], seed=4)
    bridge = BridgeProcess(redis_url, tmp_path)
    bridge.start()
    seen: list[int] = []
    sub = _collect(bridge)
    sub.on_batch(lambda seq, _batch: seen.append(seq))
    try:
        assert sub.bootstrap() == 0
        records = sim.write(writer, 21)
        assert sub.run_until(lambda s: s.next_seq == 21)
        bridge.stop(kill=kill)
        records += sim.write(writer, 7)  # written while the bridge is down
        bridge.start()
        for _ in range(10):  # the SUB reconnects meanwhile; the first message it gets shows the gap
            records += sim.write(writer, 1)
            sub.poll(50)  # a SUB re-sends its subscription only when its owner touches it
        assert sub.run_until(lambda s: s.next_seq == 38), bridge.output()
        # Every seq exactly once and in order, whether it came live or by gap-filling replay.
        assert seen == list(range(38))
        assert sub.view() == _full_state(records).view()
        if not kill:
            # A graceful stop saved its exact position: nothing was published twice.
            assert sub.stats.duplicates == 0
    finally:
        sub.close()
        bridge.stop()
    assert int(client.hget(LogKeys().bridge("kv-bridge"), "offset")) == 38
    assert int(client.hget(LogKeys().bridge("kv-bridge"), "seq:kv-events")) == 38


def test_snapshot_then_live_equals_full_replay(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["engine-a", "engine-b", "offloadd"], seed=5)
    records = sim.write(writer, 150)
    bridge = BridgeProcess(redis_url, tmp_path)
    bridge.start()
    stop = threading.Event()
    more: list[LogRecord] = []

    def keep_writing() -> None:
        while not stop.is_set() and len(more) < 200:
            more.extend(sim.write(writer, 1))
            time.sleep(0.002)

    thread = threading.Thread(target=keep_writing)
    thread.start()
    try:
        with _collect(bridge) as snap_sub, _collect(bridge) as replay_sub:
            time.sleep(0.05)
            next_seq = snap_sub.bootstrap()  # while records keep arriving
            assert next_seq >= 150
            replay_sub.replay_from(0)
            thread.join()
            total = len(records) + len(more)
            assert snap_sub.run_until(lambda s: s.next_seq == total, 10)
            assert replay_sub.run_until(lambda s: s.next_seq == total, 10)
            expected = _full_state(records + more)
            assert snap_sub.view() == expected.view()
            assert replay_sub.view() == expected.view()
            assert sorted(snap_sub.state.sources()) == ["engine-a", "engine-b", "offloadd"]
    finally:
        stop.set()
        thread.join()
        bridge.stop()


def test_per_source_mode_numbers_one_engines_records(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["engine-a", "engine-b"], seed=6)
    records = sim.write(writer, 60)
    mine = [r for r in records if r.source == "engine-b"]
    bridge = BridgeProcess(
        redis_url,
        tmp_path,
        "--source",
        "engine-b",
        "--topic",
        "kv@engine-b",
        "--start",
        "beginning",
        "--name",
        "pod-b",
    )
    bridge.start()
    try:
        with KvEventSubscriber(bridge.pub, bridge.replay, "kv@engine-b") as sub:
            assert sub.replay_from(0) == len(mine)
            assert sub.next_seq == len(mine)
            assert sub.view() == _full_state(mine).view()
            assert sub.state.sources() == ["engine-b"]  # from the map layout's source key
        bridge.stop()
        more = sim.write(writer, 30)
        bridge.start()
        mine += [r for r in more if r.source == "engine-b"]
        with KvEventSubscriber(bridge.pub, bridge.replay, "kv@engine-b") as sub:
            assert sub.bootstrap() == len(mine)
            assert sub.view() == _full_state(mine).view()
    finally:
        bridge.stop()


def test_per_source_topics_on_one_socket(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["a", "b"], seed=7)
    records = sim.write(writer, 40)
    bridge = BridgeProcess(
        redis_url, tmp_path, "--per-source", "--topic", "kv@{source}", "--start", "beginning"
    )
    bridge.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(bridge.replay)
        for source in ("a", "b"):
            dealer.send_multipart([b"", b"\0" * 8, f"kv@{source}".encode()])
            seqs = []
            while True:
                assert dealer.poll(5000)
                frames = dealer.recv_multipart()
                if frames[3] == b"":
                    break
                assert frames[1] == f"kv@{source}".encode()
                seqs.append(int.from_bytes(frames[2], "big"))
            assert seqs == list(range(sum(r.source == source for r in records)))
        # vLLM's request has no topic frame: ambiguous with several streams, so it is answered
        # at once with the error end marker a vLLM client ends on (no --default-source here).
        for request in ([b"", b"\0" * 8], [b"", b"snapshot"], [b"", b"\0" * 8, b"kv@nobody"]):
            dealer.send_multipart(request)
            assert dealer.poll(5000), f"{request} got no answer"
            empty, error, end, payload = dealer.recv_multipart()
            assert (empty, end, payload) == (b"", b"\xff" * 8, b"")
            assert error.startswith(b"error: ")
        assert b"4th request frame" in error or b"kv@nobody" in error
        assert 'kvbridge_replay_requests_total{kind="unknown_topic"} 3.0' in bridge.metrics()
        req = ctx.socket(zmq.REQ)  # as vLLM's clients: one frame, the first reply only
        req.connect(bridge.replay)
        req.send((0).to_bytes(8, "big"))
        assert req.poll(5000)
        _error, seq_frame, payload = req.recv_multipart()
        assert (seq_frame, payload) == (b"\xff" * 8, b"")  # vLLM's END_SEQ: the client ends
        with KvEventSubscriber(bridge.pub, bridge.replay, "kv@a") as sub, \
                pytest.raises(SubscriberError, match="--default-source"):
            sub.replay_from(0)  # our subscriber sends vLLM's 3 frames: the error is raised
    finally:
        ctx.destroy(linger=0)
        bridge.stop()


def test_per_source_default_source_answers_vllm_requests(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["a", "b"], seed=9)
    records = sim.write(writer, 30)
    mine = [r for r in records if r.source == "b"]
    bridge = BridgeProcess(redis_url, tmp_path, "--per-source", "--topic", "kv@{source}",
                           "--start", "beginning", "--default-source", "b")
    bridge.start()
    try:
        with KvEventSubscriber(bridge.pub, bridge.replay, "kv@b") as sub:
            assert sub.replay_from(0) == len(mine)  # 3-frame request: b's stream
            assert sub.view() == _full_state(mine).view()
            assert sub.bootstrap() == len(mine)  # a snapshot without a topic too
            assert sub.view() == _full_state(mine).view()
    finally:
        bridge.stop()


def test_redis_outage_is_reported_and_survived(own_redis: RedisProcess, tmp_path: Path) -> None:
    client = redis.Redis.from_url(own_redis.url)
    writer, sim = LogWriter(client), FleetSimulator(["engine-a"], seed=8)
    records = sim.write(writer, 5)
    bridge = BridgeProcess(own_redis.url, tmp_path, "--start", "beginning")
    bridge.start()
    try:
        own_redis.stop()
        deadline = time.monotonic() + 10
        while bridge.health()[0] == 200:
            assert time.monotonic() < deadline, "health never reported the outage"
            time.sleep(0.1)
        code, info = bridge.health()
        assert (code, info["redis"]) == (503, "down")
        assert bridge.proc is not None and bridge.proc.poll() is None
        own_redis.start()
        bridge.wait_healthy(15)
        records += sim.write(writer, 5)
        with _collect(bridge) as sub:
            sub.replay_from(0)  # what the bridge has published so far; the rest comes live
            assert sub.run_until(lambda s: s.next_seq == 10)
            assert sub.view() == _full_state(records).view()
        assert "kvbridge_redis_errors_total" in bridge.metrics()
    finally:
        client.close()
        bridge.stop()


def test_bad_configuration_is_refused_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert bridge_main(["--per-source", "--topic", "plain"]) == 2
    assert "kv-bridge: error: --per-source needs a topic template" in capsys.readouterr().err
    assert bridge_main(["--namespace", "a:b"]) == 2
    assert "namespace must be non-empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bridge_main(["--layout", "json"])
    assert exc.value.code == 2
    assert "invalid choice: 'json'" in capsys.readouterr().err


def test_records_without_events_take_no_seq(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    """A record without events takes no seq (the wire never carries an empty batch); an entry
    that is not a record at all is another matter (test_a_foreign_entry_is_never_skipped)."""
    writer, sim = LogWriter(client), FleetSimulator(["engine-a"], seed=16)
    good = sim.write(writer, 5)
    sim.seqs["engine-a"] += 1
    writer.append("engine-a", [], source_seq=sim.seqs["engine-a"])  # offset 6: no events
    good += sim.write(writer, 2)
    bridge = BridgeProcess(redis_url, tmp_path, "--start", "beginning")
    bridge.start()
    try:
        with _collect(bridge) as sub:
            assert sub.bootstrap() == 7  # seqs 0..6 for offsets 1..5, 7, 8
            assert sub.view() == _full_state(good).view()
        with _collect(bridge) as sub:
            seen: list[int] = []
            sub.on_batch(lambda seq, _b: seen.append(seq))
            assert sub.replay_from(0) == 7
            assert seen == list(range(7))
            assert sub.view() == _full_state(good).view()
    finally:
        bridge.stop()


def test_a_foreign_entry_is_never_skipped(own_redis: RedisProcess, tmp_path: Path) -> None:
    """An entry the daemon did not write (here XADDed by hand at the next offset) holds the
    bridge before it, unhealthy; once it is removed and the real record takes that offset, the
    bridge publishes it (found by the attack run: it had skipped the offset for good)."""
    client = redis.Redis.from_url(own_redis.url)
    writer, sim = LogWriter(client), FleetSimulator(["engine-a"], seed=9)
    records = sim.write(writer, 3)
    bridge = BridgeProcess(own_redis.url, tmp_path, "--start", "beginning")
    bridge.start()
    try:
        with _collect(bridge) as sub:
            sub.replay_from(0)
            assert sub.run_until(lambda s: s.next_seq == 3)
            client.xadd(writer.keys.log, {b"x": b"not a record"}, id="4-0")
            deadline = time.monotonic() + 10
            while bridge.health()[0] == 200:
                assert time.monotonic() < deadline, "health never reported the foreign entry"
                time.sleep(0.1)
            assert "foreign log entry 4" in bridge.health()[1]["detail"]
            client.xdel(writer.keys.log, "4-0")  # what kvctl repair --drop-foreign does
            client.execute_command("XSETID", writer.keys.log, "3-0")
            records += sim.write(writer, 2)  # the real record 4, then 5
            assert sub.run_until(lambda s: s.next_seq == 5)
            assert sub.view() == _full_state(records).view()
            bridge.wait_healthy(10)
    finally:
        client.close()
        bridge.stop()
