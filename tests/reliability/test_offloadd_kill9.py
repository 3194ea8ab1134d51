"""offloadd ``kill -9`` during heavy ingest and stores, then a warm restart.

Injected: three synthetic storers (Reserve -> arena write -> Commit in a loop), two synthetic
event publishers (IngestStream) and one real model engine (LLM + OffloadingConnector +
IngestEventSink) all run while the daemon is SIGKILLed and restarted.
Checked: the reducer over the log equals the daemon's Snapshot with no violations; every
publisher's (and the model engine's) GPU tier in the log equals what it holds, its seqs are
1..N exactly once under one incarnation; every block whose Commit was answered is served, and
every block served has exactly the bytes its writer wrote; the engine generated while the
daemon was down.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from engine.ingest_sink import IngestEventSink
from engine.llm import LLM
from engine.offload.config import OffloadConnectorConfig
from engine.offload.connector import OffloadingConnector
from engine.sampling import SamplingParams
from events.hashing import to_wire
from events.schema import LogRecord
from events.state import CacheState
from offloadd.client import GroupQuery, OffloadClient
from tests.support.offloadd_proc import DaemonProcess
from tests.support.synthetic_engine import (
    GROUP,
    SyntheticPublisher,
    SyntheticStorer,
    served_blocks_match,
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class ModelEngine:
    """A real engine generating in a loop on its own thread; counts finished requests."""

    def __init__(self, model: Path, target: str) -> None:
        self.conn = OffloadingConnector(OffloadConnectorConfig(
            target, "llm-0", "rel-model", timeout_s=1.0, retry_register_s=0.3))
        self.sink = IngestEventSink(target, "llm-0", incarnation=self.conn.incarnation,
                                    watch_interval_s=0.05)
        self.llm = LLM(str(model), event_sink=self.sink, connector=self.conn, num_gpu_blocks=64,
                       max_num_batched_tokens=128, max_model_len=256)
        self.finished: list[float] = []  # monotonic time of each finished request
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm", daemon=True)

    def _run(self) -> None:
        rng = random.Random(0)
        prefixes = [[rng.randrange(512) for _ in range(48)] for _ in range(4)]
        try:
            while not self._stop.is_set():
                prompt = rng.choice(prefixes) + [rng.randrange(512) for _ in range(rng.randint(1, 40))]
                out = self.llm.generate([prompt], PARAMS)
                assert len(out[0].outputs[0].token_ids) == 4
                self.finished.append(time.monotonic())
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def start(self) -> ModelEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def close(self) -> None:
        self.conn.close()
        self.sink.close()


def _log(client: OffloadClient) -> tuple[CacheState, list[LogRecord]]:
    state, records = CacheState(), []
    for record in client.subscribe(1):
        state.apply(record)
        records.append(record)
    return state, records


def _seqs(records: list[LogRecord], source: str) -> tuple[list[int], set[int]]:
    mine = [r for r in records if r.source == source]
    return [r.source_seq for r in mine], {r.incarnation for r in mine}


def _wait(cond: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_kill9_under_load_loses_nothing_and_serves_only_verified_bytes(
    tmp_path: Path, redis_url: str, namespace: str, tiny_model: Path
) -> None:
    daemon = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=64 << 20,
                           chunk_bytes=16 << 20)
    daemon.start()
    storers = [SyntheticStorer(daemon.target, f"store-{i}", chain_len=8).start() for i in range(3)]
    pubs = [SyntheticPublisher(daemon.target, f"pub-{i}", incarnation=11 + i, seed=i, pause_s=0.002).start()
            for i in range(2)]
    engine = ModelEngine(tiny_model, daemon.target).start()
    try:
        time.sleep(2.0)
        before_kill = sum(s.stats.stores for s in storers)
        daemon.kill()
        killed_at = time.monotonic()
        time.sleep(1.5)
        daemon.restart()
        restarted_at = time.monotonic()
        time.sleep(2.0)
        for s in storers:
            s.stop()
        for p in pubs:
            p.stop()
        engine.stop()
        assert engine.error is None, repr(engine.error)
        down = [t for t in engine.finished if killed_at <= t <= restarted_at]
        after = [t for t in engine.finished if t > restarted_at]
        print(f"engine finished {len(engine.finished)} requests ({len(down)} while the daemon was down, "
              f"{len(after)} after); stores {[s.stats.stores for s in storers]}, in doubt "
              f"{[len(s.stats.in_doubt) for s in storers]}, batches {[p.submitted for p in pubs]}")
        assert down and after, f"engine finished {len(down)} while down, {len(after)} after"
        assert before_kill > 0 and sum(s.stats.stores for s in storers) > before_kill
        assert all(p.stream.flush(20) for p in pubs)
        assert engine.sink.stream.flush(20) and engine.conn.flush(20)

        with OffloadClient(daemon.target) as client:
            state, records = _log(client)
            snap = client.snapshot()
            stats = client.stats()
            assert state == CacheState.from_snapshot(snap)
            assert state.violations == []
            assert [r.offset for r in records] == list(range(1, len(records) + 1))
            for p in pubs:  # exactly once, in order, nothing lost
                seqs, incs = _seqs(records, p.engine_id)
                assert seqs == list(range(1, p.submitted + 1)) and incs == {p.stream.incarnation}
                assert state.view().get((p.engine_id, "GPU", 0), frozenset()) == p.view()
            seqs, incs = _seqs(records, "llm-0")
            assert seqs == list(range(1, engine.sink.num_published + 1)) and len(incs) == 1
            gpu = {k: v for k, v in state.view().items() if k[0] == "llm-0" and v}
            pools = {("llm-0", "GPU", p.group_idx): frozenset(to_wire(d) for d in p.hash_to_block)
                     for p in engine.llm.engine.kv.pools if p.hash_to_block}
            assert gpu == pools
            assert stats.evictions == 0
            cpu = state.view().get(("offloadd", "CPU", 0), frozenset())
            arena = client.register_engine("checker", 1, "synthetic", [GROUP]).map_arena(0)
            for s in storers:
                committed = sorted(s.stats.committed)
                assert {to_wire(h) for h in committed} <= cpu  # every answered commit is logged
                served, bad = served_blocks_match(client, "checker", arena, committed + sorted(s.stats.in_doubt))
                assert bad == [] and served >= len(committed)
                assert client.lookup("checker", [GroupQuery(0, tuple(committed[:8]))]).results[0].num_prefix >= 1
            arena.close()
            assert stats.num_blocks == sum(len(v) for k, v in state.view().items() if k[1] == "CPU")
    finally:
        for s in storers:
            s.stop()
        for p in pubs:
            p.stop()
            p.close()
        engine.stop()
        engine.close()
        daemon.kill()
