"""CPU-tier offload end to end: offloadd and kv-bridge as subprocesses, engines in-process with
the real connector and their KV events published to the daemon, a ZMQ subscriber on topic "test".

Per model (plain, hybrid; and on CUDA a 1B-shaped model, marker ``gpu``):
- latency, as vLLM's ``_latency_test``: 10 new long prompts, each cold, GPU hit, reset, CPU-tier
  ``BlockStored`` (medium exactly "CPU") seen by the subscriber, CPU hit; the CPU hit must beat
  cold in at least 8 of 10;
- accuracy: greedy tokens with CPU-tier hits equal a run without offloading, logits within
  float32 tolerance;
- state: the subscriber's rebuilt state equals the daemon's (CPU tier and engines' GPU tiers) and
  each engine's own GPU tier.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.ingest_sink import IngestEventSink
from engine.llm import LLM
from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from engine.offload.config import OffloadConnectorConfig
from engine.offload.connector import OffloadingConnector
from engine.sampling import SamplingParams
from events.codec_vllm import WireBatch
from events.hashing import BlockHasher, to_wire
from events.schema import BlockStored
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from offloadd.client import OffloadClient
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess

BS = 16


@dataclass(frozen=True)
class Case:
    name: str
    spec: TinyModelSpec
    device: str
    dtype: str
    prompt_len: int
    logits_atol: float
    enforce_eager: bool = False


# Prefill of ~1000 tokens through 4 layers of width 512 costs ~150-400 ms on 2 CPU cores; a CPU
# hit moves 4 MiB of KV (one memcpy) plus two RPCs, ~15-30 ms: a 5-10x margin.
_TINY = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
             num_kv_heads=2, max_position_embeddings=4096)
_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
           num_heads=32, num_kv_heads=8, max_position_embeddings=8192, init_std=0.02)
CASES = [
    pytest.param(Case("plain", TinyModelSpec(**_TINY), "cpu", "float32", 1000, 1e-4), id="plain"),  # type: ignore[arg-type]
    pytest.param(Case("hybrid", TinyModelSpec(**_TINY, hybrid=True, sliding_window=128), "cpu",  # type: ignore[arg-type]
                      "float32", 1000, 1e-4), id="hybrid"),
    pytest.param(Case("1b", TinyModelSpec(**_1B), "cuda", "float32", 4096, 1e-3),  # type: ignore[arg-type]
                 id="gpu-1b", marks=pytest.mark.gpu),
    pytest.param(Case("1b-hybrid", TinyModelSpec(**_1B, hybrid=True, sliding_window=1024), "cuda",  # type: ignore[arg-type]
                      "float32", 4096, 1e-3), id="gpu-1b-hybrid", marks=pytest.mark.gpu),
    # Every step eager: the layer-by-layer load is waited for by the eager attention backend.
    pytest.param(Case("1b-eager", TinyModelSpec(**_1B), "cuda", "float32", 4096, 1e-3, enforce_eager=True),  # type: ignore[arg-type]
                 id="gpu-1b-eager", marks=pytest.mark.gpu),
]


@dataclass
class Stack:
    case: Case
    daemon: DaemonProcess
    sub: KvEventSubscriber
    llm: LLM
    conn: OffloadingConnector
    sink: IngestEventSink
    cpu_stored: set[tuple[int, int]]
    """(group_idx, wire hash) of BlockStored events whose medium is exactly "CPU"."""

    @property
    def hasher(self) -> BlockHasher:
        return self.llm.engine.hasher

    def prompt(self, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(self.case.spec.vocab_size) for _ in range(self.case.prompt_len)]

    def wait_cpu_stored(self, prompt: list[int], timeout_s: float = 20.0) -> bool:
        groups = [g.spec.group_idx for g in self.llm.engine.kv_groups]
        want = {(g, to_wire(d)) for g in groups for d in self.hasher.hash_blocks(prompt)}
        return self.sub.run_until(lambda _s: want <= self.cpu_stored, timeout_s)


@pytest.fixture(scope="module")
def redis_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis-e2e"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=CASES)
def stack(
    request: pytest.FixtureRequest, redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    case: Case = request.param
    if case.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    work = tmp_path_factory.mktemp(f"e2e-{case.name}")
    model = write_tiny_model(work / "model", case.spec)
    ns = "e2e" + uuid.uuid4().hex[:8]
    daemon = DaemonProcess(work / "d", redis_proc.url, ns, capacity_bytes=2 << 30, chunk_bytes=256 << 20)
    shm = None
    if case.device == "cuda" and os.path.isdir("/dev/shm"):
        # A disk-backed file cannot be pinned with cudaHostRegister; tmpfs can (as in production).
        shm = Path(tempfile.mkdtemp(prefix="kvo-e2e-", dir="/dev/shm"))
        daemon.args[daemon.args.index("--arena-dir") + 1] = str(shm)
    daemon.start()
    bridge = BridgeProcess(redis_proc.url, work / "bridge", "--topic", "test", "--start", "beginning",
                           namespace=ns)
    bridge.start()
    sub = KvEventSubscriber(bridge.pub, bridge.replay, topic="test")
    cpu_stored: set[tuple[int, int]] = set()

    def on_batch(_seq: int, batch: WireBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored) and ev.medium == "CPU":
                cpu_stored.update((ev.group_idx, h) for h in ev.block_hashes)

    sub.on_batch(on_batch)
    time.sleep(0.3)  # let the SUB connect before anything is published
    sub.bootstrap()
    conn = OffloadingConnector(OffloadConnectorConfig(daemon.target, "engine-0", case.name))
    sink = IngestEventSink(daemon.target, "engine-0", incarnation=conn.incarnation)
    blocks = case.prompt_len // BS * 3 + 8
    llm = LLM(str(model), event_sink=sink, connector=conn, device=case.device,
              dtype=case.dtype, num_gpu_blocks=blocks, max_num_batched_tokens=case.prompt_len + BS,
              max_model_len=case.prompt_len + 64, enforce_eager=case.enforce_eager)
    yield Stack(case, daemon, sub, llm, conn, sink, cpu_stored)
    conn.close()
    sink.close()
    sub.close()
    bridge.stop()
    daemon.stop()
    if shm is not None:
        shutil.rmtree(shm, ignore_errors=True)


def _generate(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    return time.perf_counter() - t0, out.num_external_cached_tokens


def test_latency(stack: Stack) -> None:
    llm = stack.llm
    params = SamplingParams(max_tokens=1, temperature=0.0)
    _generate(llm, stack.prompt(999), params)  # warm-up: first-call costs are not the tier's
    assert stack.conn.flush() and llm.reset_prefix_cache()
    hit_blocks = (stack.case.prompt_len - 1) // BS
    wins, rows = 0, []
    for i in range(10):
        prompt = stack.prompt(i)
        cold, ext = _generate(llm, prompt, params)
        assert ext == 0
        gpu_hit, _ = _generate(llm, prompt, params)
        assert llm.reset_prefix_cache()
        assert stack.wait_cpu_stored(prompt), f"iteration {i}: CPU-tier BlockStored never arrived"
        cpu_hit, ext = _generate(llm, prompt, params)
        assert ext == hit_blocks * BS
        wins += cpu_hit < cold
        rows.append((cold, gpu_hit, cpu_hit))
        assert stack.conn.flush() and llm.reset_prefix_cache()
    med = [sorted(r[k] for r in rows)[5] * 1e3 for k in range(3)]
    print(f"\n{stack.case.name}: median cold {med[0]:.1f} ms, GPU hit {med[1]:.1f} ms, "
          f"CPU hit {med[2]:.1f} ms; CPU hit beat cold {wins}/10")
    assert wins >= 8, f"CPU hit beat cold only {wins}/10 times: {rows}"


def test_accuracy(stack: Stack) -> None:
    llm, case = stack.llm, stack.case
    params = SamplingParams(max_tokens=8, temperature=0.0, return_logits=True)
    ref = LLM(str(llm.engine.config.model_dir), device=case.device, dtype=case.dtype,
              num_gpu_blocks=llm.engine.config.num_gpu_blocks,
              max_num_batched_tokens=case.prompt_len + BS, max_model_len=case.prompt_len + 64)
    prompts = [stack.prompt(100 + i)[: case.prompt_len - 37 * i] for i in range(2)]
    llm.generate(prompts, params)
    for p in prompts:
        assert stack.wait_cpu_stored(p)
    assert stack.conn.flush() and llm.reset_prefix_cache()
    got = llm.generate(prompts, params)
    gpu_hit = llm.generate(prompts, params)
    want = ref.generate(prompts, params)
    for g, h, w, p in zip(got, gpu_hit, want, prompts, strict=True):
        assert g.num_external_cached_tokens == (len(p) - 1) // BS * BS
        assert g.outputs[0].token_ids == w.outputs[0].token_ids == h.outputs[0].token_ids
        assert g.outputs[0].logits is not None and w.outputs[0].logits is not None
        assert h.outputs[0].logits is not None
        for a, c, b in zip(g.outputs[0].logits, h.outputs[0].logits, w.outputs[0].logits, strict=True):
            # The loaded KV is bit-identical to the computed one, so a CPU hit gives exactly
            # the logits of a GPU hit; against a cold run only the summation order differs.
            assert torch.equal(a, c)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=case.logits_atol)


def test_state(stack: Stack) -> None:
    llm = stack.llm
    llm.generate(stack.prompt(200), SamplingParams(max_tokens=4, temperature=0.0))
    assert stack.conn.flush() and stack.sink.stream.flush(10.0)
    with OffloadClient(stack.daemon.target) as client:
        daemon_view = CacheState.from_snapshot(client.snapshot()).view()
        num_cpu_blocks = client.stats().num_blocks
    assert stack.sub.run_until(lambda s: s.state.view() == daemon_view, 20.0), (
        f"subscriber {stack.sub.state!r} never matched the daemon's state"
    )
    engine_gpu = {
        ("engine-0", "GPU", pool.group_idx): frozenset(to_wire(d) for d in pool.hash_to_block)
        for pool in llm.engine.kv.pools
    }
    view = stack.sub.state.view()
    assert {k: v for k, v in view.items() if k[1] == "GPU"} == {k: v for k, v in engine_gpu.items() if v}
    cpu = {k: v for k, v in view.items() if k[1] == "CPU"}
    assert {k[0] for k in cpu} == {"offloadd"}
    assert sum(len(v) for v in cpu.values()) == num_cpu_blocks
