"""An engine ``kill -9``ed mid-store: it reserved slots, wrote half of their bytes and pinned
blocks, then died before Commit/Release.

Checked: nothing of it is in the log or the CPU tier; while its lease lives the hashes are
IN_FLIGHT to another engine; after the lease expires its slots and pins come back (Stats) and a
new store of the same hashes succeeds with full, correct bytes; the log reduces to the Snapshot.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from events.hashing import to_wire
from events.state import CacheState
from offloadd.client import BlockToStore, GroupQuery, OffloadClient, ReserveStatus
from tests.support.offloadd_proc import REPO, DaemonProcess
from tests.support.synthetic_engine import GROUP, SLOT, block_bytes, digest

N = 6
LEASE_MS = 800


def _store(client: OffloadClient, engine_id: str, blocks: list[BlockToStore]) -> list[ReserveStatus]:
    arena = client.register_engine(engine_id, 1, "synthetic", [GROUP]).map_arena(0)
    res = client.reserve(engine_id, 0, blocks)
    for b, (status, slot) in zip(blocks, res.blocks, strict=True):
        if status == ReserveStatus.RESERVED:
            arena.write(slot, block_bytes(b.block_hash))
    if res.reservation_id:
        client.commit(engine_id, res.reservation_id)
    arena.close()
    return [status for status, _ in res.blocks]


def test_engine_killed_mid_store(tmp_path: Path, redis_url: str, namespace: str) -> None:
    daemon = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=64 * SLOT,
                           lease_ms=LEASE_MS)
    daemon.start()
    try:
        with OffloadClient(daemon.target) as client:
            base = [BlockToStore(digest("base", i), digest("base", i - 1) if i else None, (i, 0, 0, 0))
                    for i in range(4)]
            assert _store(client, "writer", base) == [ReserveStatus.RESERVED] * 4
            head = client.stats().log_offset
            child = subprocess.Popen(
                [sys.executable, "-m", "tests.support.half_store", daemon.target, "victim", str(N)],
                cwd=REPO, stdout=subprocess.PIPE, text=True,
            )
            assert child.stdout is not None
            line = child.stdout.readline().split()
            assert line[0] == "RESERVED" and len(line) == N + 1
            child.kill()
            child.wait()
            killed_at = time.monotonic()
            victim = [BlockToStore(digest("victim", i), digest("victim", i - 1) if i else None, (i, 1, 2, 3))
                      for i in range(N)]
            hashes = tuple(b.block_hash for b in victim)
            stats = client.stats()
            assert (stats.layouts[0].num_reserved, stats.layouts[0].num_pinned) == (N, 4)
            assert stats.num_blocks == 4 and stats.log_offset == head
            assert client.lookup("writer", [GroupQuery(0, hashes, prefix_only=False)]).results[0].slots == (-1,) * N
            # Still leased: another engine is told someone else is storing them.
            other = client.register_engine("other", 1, "synthetic", [GROUP])
            assert other.groups[0].slot_bytes == SLOT
            res = client.reserve("other", 0, victim)
            assert [s for s, _ in res.blocks] == [ReserveStatus.IN_FLIGHT] * N and res.reservation_id == ""
            deadline = killed_at + 10
            while time.monotonic() < deadline:
                layout = client.stats().layouts[0]
                if (layout.num_reserved, layout.num_pinned) == (0, 0):
                    break
                time.sleep(0.05)
            waited = time.monotonic() - killed_at
            stats = client.stats()
            assert (stats.layouts[0].num_reserved, stats.layouts[0].num_pinned) == (0, 0), waited
            assert stats.num_blocks == 4 and stats.log_offset == head  # nothing half written committed
            assert _store(client, "other", victim) == [ReserveStatus.RESERVED] * N
            found = client.lookup("other", [GroupQuery(0, hashes)], pin=True)
            assert found.results[0].num_prefix == N
            arena = client.register_engine("other", 1, "synthetic", [GROUP]).map_arena(0)
            assert [arena.read(s) for s in found.results[0].slots] == [block_bytes(h) for h in hashes]
            arena.close()
            client.release("other", found.lease_id)
            state = CacheState()
            records = list(client.subscribe(1))
            for r in records:
                state.apply(r)
            assert state == CacheState.from_snapshot(client.snapshot())
            assert {r.source for r in records} == {"offloadd"}
            assert state.view()[("offloadd", "CPU", 0)] == frozenset(
                to_wire(h) for h in [b.block_hash for b in base] + list(hashes))
    finally:
        daemon.kill()


def _serve(model: Path, daemon: DaemonProcess, engine_id: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model), "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "-1", "--offloadd", daemon.target, "--offload",
         "--model-namespace", "rel", "--engine-id", engine_id, "--num-gpu-blocks", "48",
         "--max-model-len", "512"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline().rsplit(" ", 1)[1])
    return proc, f"127.0.0.1:{port}"


def _generate(target: str, prompt: list[int]) -> tuple[list[int], int]:
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                       sampling=generate_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(target) as ch:
        out = list(generate_pb2_grpc.GenerateStub(ch).Generate(req, timeout=60))
    return [t for r in out for t in r.token_ids], out[0].num_cpu_cached_tokens


def test_model_engine_killed_while_storing(tmp_path: Path, redis_url: str, namespace: str, tiny_model: Path) -> None:
    """Injected: ``python -m engine serve --offload`` SIGKILLed while it serves a stream of long
    prompts (its connector storing their blocks), right after a poll of Stats saw one of its
    reservations open (a store in flight; on 2 CPU cores its Commit usually lands within the
    millisecond before the kill, so the deterministic mid-store case is the test above). Checked: leases and reservations come back; the
    log reduces to the Snapshot; a new life of the engine fences out the dead one's GPU tier;
    every prompt whose answer the dead engine gave is answered by the new engine from CPU-tier
    hits with the same greedy tokens (nothing torn or half written is served)."""
    daemon = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=64 << 20,
                           chunk_bytes=16 << 20, lease_ms=LEASE_MS)
    daemon.start()
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(200)] for _ in range(40)]
    answered: dict[int, list[int]] = {}
    proc, target = _serve(tiny_model, daemon, "eng-k")
    try:
        with OffloadClient(daemon.target) as client:
            stop = threading.Event()

            def drive() -> None:
                for i, p in enumerate(prompts):
                    if stop.is_set():
                        return
                    try:
                        answered[i] = _generate(target, p)[0]
                    except grpc.RpcError:
                        return  # the engine died under us

            thread = threading.Thread(target=drive)
            thread.start()
            # Kill it while it holds a reservation (mid-store) once a few prompts are answered;
            # if no poll catches one in time, kill it anyway.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(answered) < len(prompts) - 5:
                if len(answered) >= 3 and client.stats().layouts[0].num_reserved > 0:
                    break
            proc.kill()
            proc.wait()
            at_kill = client.stats().layouts[0]
            print(f"at kill: {at_kill.num_ready} ready, {at_kill.num_reserved} reserved, "
                  f"{at_kill.num_pinned} pinned; {len(answered)} prompts answered")
            stop.set()
            thread.join(60)
            assert 3 <= len(answered) < len(prompts), len(answered)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                layout = client.stats().layouts[0]
                if (layout.num_reserved, layout.num_pinned) == (0, 0):
                    break
                time.sleep(0.05)
            assert (layout.num_reserved, layout.num_pinned) == (0, 0)
            proc, target = _serve(tiny_model, daemon, "eng-k")  # a new life, a new incarnation
            for i, tokens in sorted(answered.items()):
                again, cpu_hit = _generate(target, prompts[i])
                assert again == tokens, i
                assert cpu_hit > 0, i
            time.sleep(0.5)  # let the new life's events and stores land
            state = CacheState()
            for r in client.subscribe(1):
                state.apply(r)
            assert state == CacheState.from_snapshot(client.snapshot())
            incarnations = {r.incarnation for r in client.subscribe(1)
                            if r.source == "eng-k" and r.incarnation != 0}  # 0: the daemon's clears
            assert len(incarnations) == 2
            assert state.fence("eng-k") is not None and state.fence("eng-k")[0] == max(incarnations)  # type: ignore[index]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        daemon.kill()
