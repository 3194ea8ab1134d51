"""KV events to a real offloadd over EventIngest: kill -9 and restart mid-stream, a full unacked
queue, and an engine that starts with no daemon. The reducer over the daemon's log must equal
the engine's own block pool, with every batch applied exactly once."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.ingest_sink import IngestEventSink
from engine.llm import LLM
from engine.sampling import SamplingParams
from events.hashing import to_wire
from events.schema import LogRecord
from events.state import CacheState
from offloadd.client import OffloadClient
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import free_port

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "d", redis_url, "t" + uuid.uuid4().hex[:10])
    proc.start()
    yield proc
    proc.kill()


def _wait(cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _records(target: str, source: str) -> tuple[CacheState, list[LogRecord]]:
    state = CacheState()
    mine = []
    with OffloadClient(target) as client:
        for record in client.subscribe(1):
            state.apply(record)
            if record.source == source:
                mine.append(record)
    return state, mine


def _pool_view(core: EngineCore, source: str) -> dict[tuple[str, str, int], frozenset[int]]:
    return {
        (source, "GPU", p.group_idx): frozenset(to_wire(d) for d in p.hash_to_block)
        for p in core.kv.pools
        if p.hash_to_block
    }


def _daemon_view(state: CacheState, source: str) -> dict[tuple[str, str, int], frozenset[int]]:
    return {k: v for k, v in state.view().items() if k[0] == source and k[1] == "GPU" and v}


def _prompts(seed: int, n: int) -> list[list[int]]:
    return [[(seed * 31 + i * 7 + j) % 256 for j in range(20 + 9 * i)] for i in range(n)]


def _llm(model: Path, sink: IngestEventSink, engine_id: str) -> LLM:
    cfg = EngineConfig(model_dir=str(model), engine_id=engine_id, num_gpu_blocks=24, max_num_batched_tokens=64)
    return LLM.from_config(cfg, event_sink=sink)


def test_daemon_killed_and_restarted_mid_stream(hybrid_model: Path, daemon: DaemonProcess) -> None:
    sink = IngestEventSink(daemon.target, "eng-a", incarnation=7, watch_interval_s=0.05)
    llm = _llm(hybrid_model, sink, "eng-a")
    try:
        llm.generate(_prompts(0, 4), PARAMS)
        assert sink.stream.flush(10)
        daemon.kill()
        # Generation goes on with the daemon gone; the batches wait in the unacked queue.
        for seed in range(1, 4):
            outs = llm.generate(_prompts(seed, 4), PARAMS)
            assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        _wait(lambda: not sink.is_connected)
        assert sink.num_pending > 0
        pending_seqs = sink.num_pending
        daemon.restart()
        llm.generate(_prompts(9, 3), PARAMS)
        assert sink.stream.flush(15)
        state, mine = _records(daemon.target, "eng-a")
        assert _daemon_view(state, "eng-a") == _pool_view(llm.engine, "eng-a")
        assert [r.source_seq for r in mine] == list(range(1, sink.num_published + 1))
        assert {r.incarnation for r in mine} == {7}
        assert state.fence("eng-a") == (7, sink.num_published)
        assert [v for v in state.violations if v.source == "eng-a"] == []
        assert pending_seqs <= sink.num_published and sink.stream.num_dropped == 0
        assert any(p.hash_to_block for p in llm.engine.kv.pools)
    finally:
        sink.close()


def test_full_unacked_queue_resyncs_with_a_new_incarnation(plain_model: Path, daemon: DaemonProcess) -> None:
    sink = IngestEventSink(daemon.target, "eng-b", max_pending=2, watch_interval_s=0.05)
    llm = _llm(plain_model, sink, "eng-b")
    try:
        llm.generate(_prompts(0, 2), PARAMS)
        assert sink.stream.flush(10)
        first = sink.incarnation
        daemon.kill()
        for seed in range(1, 6):
            llm.generate(_prompts(seed, 3), PARAMS)
        assert sink.stream.num_resets >= 1 and sink.stream.num_dropped > 0
        assert sink.incarnation > first
        daemon.restart()
        llm.generate(_prompts(7, 1), PARAMS)
        assert sink.stream.flush(15)
        state, _ = _records(daemon.target, "eng-b")
        # The dropped batches are gone, but the re-announced state makes the daemon exact again.
        assert _daemon_view(state, "eng-b") == _pool_view(llm.engine, "eng-b")
        assert state.fence("eng-b") is not None and state.fence("eng-b")[0] == sink.incarnation  # type: ignore[index]
    finally:
        sink.close()


def test_reset_reannounces_before_any_other_batch(plain_model: Path, daemon: DaemonProcess) -> None:
    """After a reset the new incarnation opens with AllBlocksCleared and the engine's whole GPU
    tier: the batch that caused the reset (and any before the re-announce) is not sent, so no
    record removes a block the new incarnation never announced."""
    sink = IngestEventSink(daemon.target, "eng-c", max_pending=2, watch_interval_s=0.05)
    llm = _llm(plain_model, sink, "eng-c")
    try:
        llm.generate(_prompts(0, 2), PARAMS)
        assert sink.stream.flush(10)
        daemon.kill()
        for seed in range(1, 6):
            llm.generate(_prompts(seed, 3), PARAMS)
        assert sink.stream.num_resets >= 1
        daemon.restart()
        llm.generate(_prompts(7, 1), PARAMS)
        assert sink.stream.flush(15)
        state, records = _records(daemon.target, "eng-c")
        first = next(r for r in records if r.incarnation == sink.incarnation)
        assert first.source_seq == 1 and first.events[-1].medium == "GPU"
        assert any(type(e).__name__ == "AllBlocksCleared" for e in first.events)
        assert [v for v in state.violations if v.source == "eng-c"] == []
        assert _daemon_view(state, "eng-c") == _pool_view(llm.engine, "eng-c")
    finally:
        sink.close()


def test_engine_serves_without_a_daemon(plain_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="engine.ingest_sink")
    sink = IngestEventSink(f"127.0.0.1:{free_port()}", "eng-c", watch_interval_s=0.05)
    try:
        outs = _llm(plain_model, sink, "eng-c").generate(_prompts(0, 2), PARAMS)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
        assert not sink.is_connected and sink.num_pending == sink.num_published > 0
        _wait(lambda: "unreachable" in caplog.text)
        assert "still serving" in caplog.text
    finally:
        sink.stream.close()


def test_cli_serve_reports_a_missing_daemon_in_logs_and_metrics(plain_model: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(plain_model), "--host", "127.0.0.1",
         "--port", "0", "--offloadd", f"127.0.0.1:{free_port()}", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().rsplit(" ", 1)[1])
        metrics_port = int(proc.stdout.readline().rsplit(" ", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=list(range(40))),
                sampling=generate_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
            )
            assert list(generate_pb2_grpc.GenerateStub(ch).Generate(req))[-1].finished
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "kv_engine_offloadd_connected 0.0" in body
        assert "kv_engine_events_unacked_batches 1.0" in body
        assert "kv_engine_events_unacked_capacity 1024.0" in body
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        assert proc.stderr is not None
        assert "unreachable" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
