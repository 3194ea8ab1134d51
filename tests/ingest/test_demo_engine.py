"""The demo's vLLM-style engine: plausible events (no violations, pools bounded, vLLM hashes),
and its process publishes them on vLLM's wire until SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import zmq

from events.hashing import BlockHasher, to_wire
from events.schema import BlockStored, LogRecord
from events.state import CacheState
from ingest.demo_engine import DemoEngine
from ingest.wire import decode, parse_live
from tests.support.ingest_proc import vllm_endpoints

REPO = Path(__file__).resolve().parents[2]


def test_demo_events_reduce_cleanly_within_the_pool_sizes() -> None:
    engine = DemoEngine(gpu_blocks=16, cpu_blocks=32, block_size=4, seed=1)
    state = CacheState()
    for i in range(200):
        state.apply(LogRecord(i + 1, "demo", 1, i + 1, 0.0, tuple(engine.step())))
    counts = state.counts()
    assert state.violations == []
    assert 0 < counts[("demo", "GPU", 0)] <= 16 and 0 < counts[("demo", "CPU", 0)] <= 32
    # Hashes are vLLM's: every request starts with the system prompt's blocks.
    fresh = DemoEngine(gpu_blocks=16, cpu_blocks=32, block_size=4, seed=1)
    stored = next(e for e in fresh.step() if isinstance(e, BlockStored))
    want = [int(to_wire(d)) for d in BlockHasher(block_size=4).hash_blocks(fresh.system)]
    assert list(stored.block_hashes[:2]) == want and stored.parent_block_hash is None


def test_demo_process_publishes_vllm_batches_and_stops_on_sigterm() -> None:
    pub, replay = vllm_endpoints()
    proc = subprocess.Popen([sys.executable, "-m", "ingest.demo_engine", "--pub", pub, "--replay",
                             replay, "--steps-per-s", "50"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        assert sub.poll(10_000), "no batch from the demo engine"
        frame = parse_live(sub.recv_multipart(), b"")
        assert decode(frame.payload).events
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and b"stopped after" in out
