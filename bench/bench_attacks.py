#!/usr/bin/env python
"""Attack run (issue "truth under faults", items 1-10): one stack, well-behaved clients running
throughout, a sequence of faults and hostile inputs, and the same checks after each one.

Stack: redis-server (AOF, ``appendfsync always``), offloadd with a 64-slot arena in two chunk
files (nearly every Reserve evicts), kv-bridge, and a KvEventSubscriber following the bridge.
Well-behaved clients: a SyntheticStorer (Reserve -> write -> Commit chains of 8) and a
SyntheticPublisher (GPU-tier events through IngestStream, re-announcing its tier when the stream
resets), both counting their requests and failures, with the time of every failure.

After each scenario the clients are paused, the stack settles, and the bench records:
``kvctl verify`` exit code; Stats.num_blocks == CPU tier of the log (OffloadClient.subscribe(1)
replayed into CacheState) == the subscriber's CPU tier for source 'offloadd'; the publisher's GPU
tier in the log == what it holds; well-behaved requests failed inside the fault window (the fault
itself, e.g. Redis down) vs outside it (caused by another client's input: must be 0); blocks lost
(committed and acknowledged, neither served by Lookup nor logged as removed); inputs tried.

Run: ``python bench/bench_attacks.py [--seconds-per-scenario 10] [--out bench/results/attacks.json]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import cbor2  # noqa: E402
import grpc  # noqa: E402
import redis  # noqa: E402
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc  # noqa: E402

from events.codec_proto import EventBatch, batch_to_proto  # noqa: E402
from events.hashing import to_wire  # noqa: E402
from events.logkeys import LogKeys  # noqa: E402
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from events.state import CacheState  # noqa: E402
from events.subscriber import KvEventSubscriber  # noqa: E402
from kvctl.main import main as kvctl_main  # noqa: E402
from offloadd.client import (  # noqa: E402
    BlockToStore,
    GroupQuery,
    GroupSpec,
    IngestStream,
    OffloadClient,
    OffloadClientError,
    RetryPolicy,
)
from tests.support.bridge_proc import BridgeProcess  # noqa: E402
from tests.support.offloadd_proc import DaemonProcess  # noqa: E402
from tests.support.redis_proc import RedisProcess  # noqa: E402
from tests.support.synthetic_engine import (  # noqa: E402
    GROUP,
    SLOT,
    SyntheticPublisher,
    SyntheticStorer,
    block_bytes,
    digest,
    rss_kb,
)

NUM_SLOTS = 64
CHUNK_SLOTS = 32
LEASE_MS = 500
ENGINE_LEASE_S = 2.0
OWNER_LEASE_S = 2.0
STORER, PUBLISHER = "good-store", "good-pub"
ACK = log_pb2.PublishAck
FAULT_SIGNATURES = ("Redis unreachable", "failed to connect", "Connection refused", "did not write")

UNLOGGABLE = {
    "tag": cbor2.dumps([cbor2.CBORTag(1234, 5)]),
    "int beyond 2^64": cbor2.dumps([2**70]),
    "negative int beyond -2^63": cbor2.dumps([-(2**70)]),
    "undefined": b"\x81\xf7",
    "simple value": b"\x81\xf0",
    "map": cbor2.dumps([{"a": 1}]),
    "nested tag": cbor2.dumps([["x", cbor2.CBORTag(99, "y")]]),
}

DEPARTING_PUBLISHER = """
import sys, time
from events.schema import BlockStored
from offloadd.client import IngestStream
s = IngestStream(sys.argv[1], sys.argv[2])
s.submit((BlockStored((7001, 7002), None, tuple(range(8)), 4, "GPU"),))
assert s.flush(10)
print("READY", flush=True)
time.sleep(600)
"""


# -- well-behaved clients -------------------------------------------------------------------


class GoodStorer(SyntheticStorer):
    """SyntheticStorer that can be paused (and drop its arena mapping) and that timestamps its
    failures, so each one can be put inside or outside a fault window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused = threading.Event()
        self.idle = threading.Event()
        self.unmap = False
        self.failures: list[tuple[float, str]] = []
        self.commit_time: dict[bytes, float] = {}

    def _hold(self, arena: Any) -> tuple[Any, bool]:
        if not self.paused.is_set():
            self.idle.clear()
            return arena, False
        if arena is not None and self.unmap:
            arena.close()
            arena = None
        self.idle.set()
        self._stop.wait(0.02)
        return arena, True

    def _failed(self, exc: Exception) -> None:
        super()._failed(exc)
        self.failures.append((time.monotonic(), f"{type(exc).__name__}: {exc}"[:240]))

    def _store_one(self, client: OffloadClient, arena: Any) -> None:
        before = len(self.stats.committed)
        super()._store_one(client, arena)
        if len(self.stats.committed) != before:  # stamp what this Commit acknowledged
            now = time.monotonic()
            for d in self.stats.committed - self.commit_time.keys():
                self.commit_time[d] = now

    def pause(self, unmap: bool = False, timeout_s: float = 10.0) -> bool:
        self.unmap = unmap
        self.idle.clear()
        self.paused.set()
        return self.idle.wait(timeout_s)

    def resume(self) -> None:
        self.unmap = False
        self.paused.clear()


class GoodPublisher(SyntheticPublisher):
    """SyntheticPublisher that re-announces its GPU tier after a stream reset (a new log epoch,
    a full queue), as a real engine does, and can be paused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused = threading.Event()
        self.idle = threading.Event()
        self.lock = threading.Lock()
        self.need_resync = False
        self.resyncs = 0
        self.stream.on_reset = self._on_reset

    def _on_reset(self, _incarnation: int) -> None:
        self.need_resync = True

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                self.idle.set()
                self._stop.wait(0.02)
                continue
            self.idle.clear()
            with self.lock:
                if self.need_resync:
                    self.need_resync = False
                    self.resyncs += 1
                    self.stream.resync([BlockStored((h,), None, (1, 2, 3, 4), 4, "GPU")
                                        for h in self.resident])
                events = self.next_events()
                self.stream.submit(events)
                self.submitted += 1
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def pause(self, timeout_s: float = 10.0) -> bool:
        self.idle.clear()
        self.paused.set()
        return self.idle.wait(timeout_s)

    def resume(self) -> None:
        self.paused.clear()


# -- helpers ----------------------------------------------------------------------------------


def wait_for(cond: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except Exception:  # a probe racing a restart: ask again
            pass
        time.sleep(step_s)
    return False


def kvctl(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = kvctl_main(list(argv))
        except SystemExit as exc:  # argparse
            rc = int(exc.code or 0)
    return rc, (out.getvalue() + err.getvalue()).strip()[-600:]


def gpu_batch(engine: str, incarnation: int, seq: int, block: int, extra: bytes | None) -> events_pb2.EventBatch:
    msg = batch_to_proto(EventBatch(engine, incarnation, seq, time.time(), (
        BlockStored((block,), None, (1, 2, 3, 4), 4, "GPU"),)))
    if extra is not None:
        msg.events[0].block_stored.extra_keys.append(extra)
    return msg


def gpu_of(client: OffloadClient, engine: str) -> set[int]:
    return {h for s in client.snapshot().sources if s.source == engine
            for e in s.events if e.medium == "GPU" for h in e.block_hashes}


def gpu_gone(client: OffloadClient, engine: str, timeout_s: float) -> bool:
    return wait_for(lambda: not gpu_of(client, engine), timeout_s)


def lose_redis_data(server: RedisProcess) -> None:
    server.stop()
    for path in server.workdir.iterdir():
        if path.name.startswith("appendonly") or path.suffix == ".rdb":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    server.start()


# -- the bench --------------------------------------------------------------------------------


class Bench:
    def __init__(self, work: Path, seconds: float, inputs: int) -> None:
        self.work, self.seconds, self.inputs = work, seconds, inputs
        self.ns = "atk" + uuid.uuid4().hex[:8]
        self.keys = LogKeys(self.ns)
        self.redis = RedisProcess(work / "redis", appendfsync="always")
        self.daemon = DaemonProcess(
            work / "d", "", self.ns, capacity_bytes=NUM_SLOTS * SLOT, chunk_bytes=CHUNK_SLOTS * SLOT,
            lease_ms=LEASE_MS, extra_args=("--engine-lease-s", str(ENGINE_LEASE_S),
                                           "--owner-lease-s", str(OWNER_LEASE_S)))
        self.results: list[dict[str, Any]] = []
        self.excluded: set[bytes] = set()  # committed before the log was lost (scenario 4)
        self.windows: list[tuple[float, float]] = []
        self.loss_windows: list[tuple[float, float]] = []  # Redis lost the log: acks in it go too
        self._sub_stop = threading.Event()

    # stack ------------------------------------------------------------------------------
    def start(self) -> None:
        self.redis.start()
        url = self.redis.url
        self.daemon.redis_url = url
        self.daemon.args[self.daemon.args.index("--redis-url") + 1] = url
        self.daemon.start()
        self.bridge = BridgeProcess(url, self.work / "bridge", "--start", "beginning", namespace=self.ns)
        self.bridge.start()
        self.sub = KvEventSubscriber(self.bridge.pub, self.bridge.replay, idle_sync_s=0.5,
                                     replay_timeout_s=2.0)
        time.sleep(0.3)
        self.sub.bootstrap()
        self._sub_thread = threading.Thread(target=self._follow, daemon=True)
        self._sub_thread.start()
        self.storer = GoodStorer(self.daemon.target, STORER, chain_len=8, pause_s=0.02)
        self.publisher = GoodPublisher(self.daemon.target, PUBLISHER, seed=1, pause_s=0.01, max_resident=200)
        self.storer.start()
        self.publisher.start()
        self.admin = redis.Redis.from_url(url)

    def _follow(self) -> None:
        while not self._sub_stop.is_set():
            try:
                self.sub.poll(50)
            except Exception:  # keep following; a failure shows in the check
                time.sleep(0.1)

    def stop(self) -> None:
        for c in (self.storer, self.publisher):
            c.stop(10)
        self.publisher.close()
        self._sub_stop.set()
        self._sub_thread.join(5)
        self.sub.close()
        self.bridge.stop()
        self.daemon.stop()
        self.admin.close()
        self.redis.stop()

    def client(self, timeout_s: float = 5.0) -> OffloadClient:
        return OffloadClient(self.daemon.target, timeout_s=timeout_s, retry=RetryPolicy(attempts=1))

    def daemon_serving(self) -> bool:
        with self.client(1.0) as c:
            c.stats()
        return True

    def restart_daemon(self, timeout_s: float = 30.0) -> None:
        self.daemon.proc = None
        self.daemon.start(timeout_s)

    def stores_past(self, n: int, timeout_s: float) -> bool:
        """Wait until the storer has stored more than ``n`` chains (it works again)."""
        return wait_for(lambda: self.storer.stats.stores > n, timeout_s)

    def wait_daemon_exit(self, timeout_s: float) -> int | None:
        assert self.daemon.proc is not None
        try:
            return self.daemon.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    # checks -----------------------------------------------------------------------------
    def check(self) -> dict[str, Any]:
        t0 = time.monotonic()
        out: dict[str, Any] = {}
        self.storer.pause()
        self.publisher.pause()
        out["daemon_alive"] = self.daemon.proc is not None and self.daemon.proc.poll() is None
        out["publisher_flushed"] = self.publisher.stream.flush(15)
        with self.client() as c:
            def settled() -> bool:
                s = c.stats()
                return all(x.num_reserved == 0 and x.num_pinned == 0 for x in s.layouts)
            out["settled"] = wait_for(settled, 10, 0.1)
            stats = c.stats()
            records = list(c.subscribe(1))
            state = CacheState()
            removed: set[int] = set()
            clears = 0
            for r in records:
                state.apply(r)
                if r.source == "offloadd":
                    for e in r.events:
                        if isinstance(e, BlockRemoved) and e.medium == "CPU":
                            removed.update(e.block_hashes)
                        elif isinstance(e, AllBlocksCleared) and e.medium in ("CPU", None):
                            clears += 1
            log_cpu = frozenset(state.blocks("offloadd", "CPU", 0))
            out["log_records"] = len(records)
            out["violations"] = len(state.violations)
            out["stats_blocks"] = stats.num_blocks
            out["log_cpu_blocks"] = len(log_cpu)
            out["evictions_total"] = stats.evictions
            # what the subscriber rebuilt
            sub_ok = wait_for(lambda: self.sub.view().get(("offloadd", "CPU", 0), frozenset()) == log_cpu, 15, 0.1)
            sub_cpu = self.sub.view().get(("offloadd", "CPU", 0), frozenset())
            out["subscriber_cpu_blocks"] = len(sub_cpu)
            out["subscriber_stats"] = {k: getattr(self.sub.stats, k) for k in
                                       ("batches", "gaps", "replayed", "lost", "duplicates", "malformed")}
            gpu_log = frozenset(state.blocks(PUBLISHER, "GPU", 0))
            out["publisher_gpu_equal"] = gpu_log == self.publisher.view()
            out["publisher_gpu"] = [len(gpu_log), len(self.publisher.view())]
            sub_all_equal = wait_for(lambda: self.sub.view() == state.view(), 5, 0.1)
            out["subscriber_full_view_equal_log"] = sub_all_equal
            out["stats_eq_log_eq_sub"] = stats.num_blocks == len(log_cpu) and sub_ok
            # blocks lost: committed, acknowledged, neither served nor logged as removed
            c.register_engine("checker", 1, "synthetic", [GROUP])
            committed = sorted(self.storer.stats.committed - self.excluded)
            served: list[bytes] = []
            for i in range(0, len(committed), 1000):
                part = tuple(committed[i:i + 1000])
                res = c.lookup("checker", [GroupQuery(0, part, prefix_only=False)])
                served += [d for d, slot in zip(part, res.results[0].slots, strict=True) if slot >= 0]
            served_set = set(served)
            lost = [d for d in committed if d not in served_set and to_wire(d) not in removed]
            with_log = [d for d in lost if any(a <= self.storer.commit_time.get(d, -1) <= b
                                               for a, b in self.loss_windows)]
            self.excluded |= set(with_log)  # reported once, in the scenario that lost the log
            out["committed_checked"] = len(committed)
            out["served"] = len(served)
            out["blocks_lost"] = len(lost) - len(with_log)
            out["blocks_lost_with_the_log"] = len(with_log)
            pub_clears = [r.offset for r in records if r.source == PUBLISHER and r.incarnation == 0
                          and any(isinstance(e, AllBlocksCleared) for e in r.events)]
            out["publisher_cleared_by_daemon_at"] = pub_clears
            out["log_cpu_clears"] = clears
            bad = 0
            sample = served[-64:]
            if sample:
                got = c.read_blocks("checker", 0, sample)
                bad = sum(g.data != block_bytes(d) for g, d in zip(got, sample, strict=True))
            out["served_bytes_wrong"] = bad
        rc, text = kvctl("verify", self.redis.url, "--namespace", self.ns)
        out["kvctl_verify_rc"] = rc
        if rc != 0:
            out["kvctl_verify_out"] = text
        out["check_s"] = round(time.monotonic() - t0, 2)
        self.storer.resume()
        self.publisher.resume()
        return out

    # running a scenario -----------------------------------------------------------------
    def run(self, num: int, name: str, body: Callable[[], dict[str, Any]]) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] scenario {num}: {name}", flush=True)
        self.windows = []
        s0 = (self.storer.stats.stores, self.storer.stats.errors, len(self.storer.failures))
        p0 = (self.publisher.submitted, self.publisher.stream.num_dropped, self.publisher.stream.num_resets,
              self.publisher.resyncs)
        t0 = time.monotonic()
        try:
            detail = body()
            error = None
        except Exception as exc:  # record it, recover the stack, go on
            detail, error = {}, f"{type(exc).__name__}: {exc}"[:600]
            print("  scenario raised:", error, flush=True)
        dur = time.monotonic() - t0
        # the stack must be up before checking: restart what a scenario left down
        if self.redis.proc is None:
            self.redis.start()
        if self.daemon.proc is None or self.daemon.proc.poll() is not None:
            detail["bench_restarted_daemon_after_scenario"] = True
            self.restart_daemon()
        fails = self.storer.failures[s0[2]:]
        in_window = [f for f in fails if any(a - 0.5 <= f[0] <= b + 0.5 for a, b in self.windows)]
        # A failure after the window whose message names the fault itself (a Redis connection
        # the restart broke, a daemon not yet back) is the fault's too, reported apart; any
        # other failure outside the windows counts against the attack.
        late = [f for f in fails if f not in in_window and self.windows
                and any(sig in f[1] for sig in FAULT_SIGNATURES)]
        outside = [f for f in fails if f not in in_window and f not in late]
        res: dict[str, Any] = {
            "num": num, "name": name, "seconds": round(dur, 1), "error": error, **detail,
            "storer_requests": (self.storer.stats.stores - s0[0]) + (self.storer.stats.errors - s0[1]),
            "storer_failed_fault": len(in_window) + len(late),
            "storer_failed_fault_after_window": len(late),
            "storer_failed_fault_after_window_samples": sorted({m for _, m in late})[:2],
            "storer_failed_other": len(outside),
            "storer_failed_other_samples": sorted({m for _, m in outside})[:3],
            "storer_failed_fault_samples": sorted({m for _, m in in_window})[:2],
            "publisher_batches": self.publisher.submitted - p0[0],
            "publisher_dropped": self.publisher.stream.num_dropped - p0[1],
            "publisher_resets": self.publisher.stream.num_resets - p0[2],
            "publisher_resyncs": self.publisher.resyncs - p0[3],
            "fault_windows_s": [round(b - a, 2) for a, b in self.windows],
        }
        res["check"] = self.check()
        ck = res["check"]
        res["ok"] = bool(ck["kvctl_verify_rc"] == 0 and ck["stats_eq_log_eq_sub"] and ck["blocks_lost"] == 0
                         and res["storer_failed_other"] == 0 and ck["publisher_gpu_equal"]
                         and ck["served_bytes_wrong"] == 0 and error is None)
        self.results.append(res)
        print(f"  -> ok={res['ok']} verify={ck['kvctl_verify_rc']} stats={ck['stats_blocks']} "
              f"log={ck['log_cpu_blocks']} sub={ck['subscriber_cpu_blocks']} lost={ck['blocks_lost']} "
              f"failed fault/other={res['storer_failed_fault']}/{res['storer_failed_other']} "
              f"inputs={res.get('inputs_tried', '-')}", flush=True)

    def window(self, t0: float) -> None:
        self.windows.append((t0, time.monotonic()))

    # scenarios --------------------------------------------------------------------------
    def s1_bad_extra_keys(self) -> dict[str, Any]:
        tried = unexpected = 0
        reserve_codes: dict[str, int] = {}
        acks: dict[str, int] = {}
        samples: list[str] = []
        deadline = time.monotonic() + self.seconds
        i = rnd = 0
        with self.client(3.0) as att, grpc.insecure_channel(self.daemon.target) as ch:
            stub = log_pb2_grpc.EventIngestStub(ch)
            att.register_engine("attacker", 1, "synthetic", [GROUP])
            while time.monotonic() < deadline:
                for name, bad in UNLOGGABLE.items():
                    i += 1
                    tried += 1
                    try:
                        att.reserve("attacker", 0, [BlockToStore(digest("attacker", i), None, (1, 2, 3, 4), bad)])
                        unexpected += 1
                        samples.append(f"reserve accepted {name}")
                    except OffloadClientError as exc:
                        reserve_codes[exc.code.name] = reserve_codes.get(exc.code.name, 0) + 1
                        if exc.code != grpc.StatusCode.INVALID_ARGUMENT or "extra_keys" not in exc.message:
                            unexpected += 1
                            samples.append(f"reserve {name}: {exc.code.name} {exc.message[:100]}")
                rnd += 1
                batches = []
                for seq, bad in enumerate(UNLOGGABLE.values(), start=1):
                    # the bad batch is refused; the good one with the same seq applies
                    batches += [gpu_batch("attacker-pub", rnd, seq, 10_000 * rnd + seq, bad),
                                gpu_batch("attacker-pub", rnd, seq, 10_000 * rnd + seq, None)]
                tried += len(UNLOGGABLE)
                got = list(stub.Publish(iter(batches), timeout=20))
                for a in got:
                    k = ACK.Status.Name(a.status)
                    acks[k] = acks.get(k, 0) + 1
                statuses = [a.status for a in got]
                if statuses != [ACK.STATUS_REJECTED, ACK.STATUS_APPLIED] * len(UNLOGGABLE):
                    unexpected += 1
                    samples.append(f"publish acks {[ACK.Status.Name(s) for s in statuses]}"[:200])
        traceback = "Traceback" in self.daemon.log_tail(2000)
        return {"inputs_tried": tried, "unexpected_answers": unexpected, "reserve_codes": reserve_codes,
                "publish_acks": acks, "samples": samples[:3], "daemon_traceback": traceback}

    def s2_redis_kill9(self) -> dict[str, Any]:
        kills = 0
        down_s = 2.0
        deadline = time.monotonic() + self.seconds
        recover: list[float] = []
        while time.monotonic() + down_s + 1 < deadline:
            time.sleep(1.0)
            t0 = time.monotonic()
            self.redis.stop(kill=True)
            kills += 1
            time.sleep(down_s)
            self.redis.start()
            t1 = time.monotonic()
            ok = wait_for(lambda: self.daemon.proc is not None and self.daemon.proc.poll() is None
                          and self.daemon_serving(), 10)
            # the window ends when a store goes through again
            n = self.storer.stats.stores
            self.stores_past(n, 10)
            recover.append(round(time.monotonic() - t1, 2))
            self.window(t0)
            if not ok:
                break
        return {"inputs_tried": kills, "redis_kill9": kills, "recover_s": recover,
                "daemon_alive_after": self.daemon.proc is not None and self.daemon.proc.poll() is None}

    def s3_registration(self) -> dict[str, Any]:
        other = GroupSpec(0, "full_attention", 0, 4, SLOT * 2, "uint8", "another-layout")
        same_name = GroupSpec(0, "full_attention", 0, 4, SLOT * 2, "uint8", GROUP.layout)
        tried = unexpected = 0
        codes: dict[str, int] = {}
        samples: list[str] = []
        deadline = time.monotonic() + self.seconds
        with self.client(3.0) as att:
            k = 0
            while time.monotonic() < deadline:
                k += 1
                for eng, spec in ((STORER, other), (f"squat-{k}", same_name)):
                    tried += 1
                    try:
                        att.register_engine(eng, 1, "synthetic", [spec])
                        unexpected += 1
                        samples.append(f"accepted {eng} {spec.layout}")
                    except OffloadClientError as exc:
                        codes[exc.code.name] = codes.get(exc.code.name, 0) + 1
                        if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                            unexpected += 1
                            samples.append(f"{eng}: {exc.code.name} {exc.message[:100]}")
                time.sleep(0.01)
        return {"inputs_tried": tried, "unexpected_answers": unexpected, "codes": codes, "samples": samples[:3]}

    def s4_log_lost(self) -> dict[str, Any]:
        time.sleep(max(1.0, self.seconds / 3))
        t0 = time.monotonic()
        before = set(self.storer.stats.committed)
        lose_redis_data(self.redis)
        rc = self.wait_daemon_exit(20)
        exited_s = round(time.monotonic() - t0, 2)
        restarted = False
        if rc is not None:
            self.restart_daemon()
            restarted = True
        self.excluded |= before
        self.loss_windows.append((t0, time.monotonic()))  # commits acked while Redis stopped
        ok_bridge = wait_for(lambda: self.bridge.health()[0] == 200, 20, 0.1)
        n = self.storer.stats.stores
        stored_again = wait_for(lambda: self.storer.stats.stores > n, 10)
        self.window(t0)
        recovered_s = round(time.monotonic() - t0, 2)
        # what of the blocks committed before the loss the new daemon still serves (should be 0:
        # the new log does not hold them)
        with self.client() as c:
            c.register_engine("checker", 1, "synthetic", [GROUP])
            part = tuple(sorted(before))[-1000:]
            served_old = sum(s >= 0 for s in c.lookup("checker", [GroupQuery(0, part, prefix_only=False)]).results[0].slots) if part else 0
        time.sleep(max(0.0, self.seconds - (time.monotonic() - t0)))
        return {"inputs_tried": 1, "daemon_exit_code": rc, "daemon_exit_after_s": exited_s,
                "operator_step": "restart offloadd (a supervisor would)" if restarted else "none",
                "bridge_healthy_again": ok_bridge, "stores_resumed": stored_again, "recovered_s": recovered_s,
                "blocks_committed_before_loss": len(before), "pre_loss_blocks_still_served_of_last_1000": served_old}

    def s5_truncation(self) -> dict[str, Any]:
        arena = self.daemon.arena_dir
        chunk = next(p for p in sorted(arena.iterdir()) if p.name.endswith("-C1"))
        gen = next(p for p in sorted(arena.iterdir()) if p.name.endswith("-Cgen"))
        full_chunk, full_gen = chunk.stat().st_size, gen.stat().st_size
        rounds = 0
        restored: list[bool] = []
        deadline = time.monotonic() + self.seconds
        with self.client(3.0) as c:
            c.register_engine("checker", 1, "synthetic", [GROUP])
            while time.monotonic() + 2 < deadline:
                time.sleep(1.0)
                # An in-process writer with the chunk mapped would take SIGBUS on a truncated
                # page: the storer drops its mapping first (and the bench's checker reads by RPC).
                self.storer.pause(unmap=True)
                t0 = time.monotonic()
                rounds += 1
                os.truncate(chunk, full_chunk // 2)
                os.truncate(gen, 0)
                recent = sorted(self.storer.stats.committed - self.excluded)[-NUM_SLOTS * 2:]
                with contextlib.suppress(OffloadClientError):
                    c.lookup("checker", [GroupQuery(0, tuple(recent), prefix_only=False)])
                for d in recent:
                    with contextlib.suppress(OffloadClientError):
                        c.read_blocks("checker", 0, [d])
                ok = wait_for(lambda: chunk.stat().st_size == full_chunk, 5)
                self.storer.resume()
                n = self.storer.stats.stores
                self.stores_past(n + 2, 5)  # commits rewrite the table
                ok_gen = wait_for(lambda: gen.stat().st_size == full_gen, 5)
                restored.append(ok and ok_gen)
                self.window(t0)
        text = self.daemon.log_path.read_text(errors="replace")
        return {"inputs_tried": rounds * 2, "truncations": rounds, "files_restored": restored,
                "chunk_warnings": text.count(f"arena chunk {chunk} has"),
                "gen_warnings": text.count(f"generation table {gen} has"),
                "daemon_alive_after": self.daemon.proc is not None and self.daemon.proc.poll() is None,
                "note": "storer paused (mapping dropped) around each truncation"}

    def s6_cheap_input(self) -> dict[str, Any]:
        assert self.daemon.proc is not None
        pid = self.daemon.proc.pid
        rss0 = rss_kb(pid)
        statuses: dict[str, int] = {}
        lock = threading.Lock()
        deadline = time.monotonic() + self.seconds * 0.8

        def one(i: int) -> None:
            eng = f"{i:05d}" + "y" * 2048 if i % 2 else f"inc0-{i}"
            inc = 1 if i % 2 else 0
            msg = gpu_batch(eng, 1, 1, i, None)
            msg.incarnation = inc
            with grpc.insecure_channel(self.daemon.target) as ch:
                got = list(log_pb2_grpc.EventIngestStub(ch).Publish(iter([msg]), timeout=10))
            k = ",".join(ACK.Status.Name(a.status) for a in got) or "none"
            with lock:
                statuses[k] = statuses.get(k, 0) + 1

        n = 0
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            while n < self.inputs and time.monotonic() < deadline:
                list(pool.map(one, range(n, n + 200)))
                n += 200
        rss_mid = rss_kb(pid)
        tiny_codes: dict[str, int] = {}
        with self.client(3.0) as c:
            for k in range(200):
                tiny = GroupSpec(0, "full_attention", 0, 4, 1 + (k % 3), "uint8", f"tiny-{k}")
                try:
                    c.register_engine(f"tiny-{k}", 1, "m", [tiny])
                    tiny_codes["OK"] = tiny_codes.get("OK", 0) + 1
                except OffloadClientError as exc:
                    tiny_codes[exc.code.name] = tiny_codes.get(exc.code.name, 0) + 1
            snap_sources = len(c.snapshot().sources)
        rss1 = rss_kb(pid)
        files = len(list(self.daemon.arena_dir.iterdir()))
        return {"inputs_tried": n + 200, "rejected_publishes": n, "publish_acks": statuses,
                "tiny_register_codes": tiny_codes, "rss_kib_before_mid_after": [rss0, rss_mid, rss1],
                "arena_files_after": files, "sources_in_snapshot": snap_sources}

    def s7_departures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        rounds = 0
        clean_s: list[float] = []
        kill_kept_at_06: list[bool] = []
        kill_cleared_s: list[float] = []
        deadline = time.monotonic() + self.seconds
        with self.client(3.0) as c:
            while time.monotonic() + ENGINE_LEASE_S * 2 < deadline or rounds == 0:
                rounds += 1
                s = IngestStream(self.daemon.target, f"depart-clean-{rounds}")
                s.submit((BlockStored((5000 + rounds,), None, (1, 2, 3, 4), 4, "GPU"),))
                s.flush(10)
                present = bool(gpu_of(c, s.engine_id))
                t0 = time.monotonic()
                s.close()
                ok = gpu_gone(c, s.engine_id, ENGINE_LEASE_S * 3)
                clean_s.append(round(time.monotonic() - t0, 2) if ok and present else -1)
                eng = f"depart-kill-{rounds}"
                proc = subprocess.Popen([sys.executable, "-c", DEPARTING_PUBLISHER, self.daemon.target, eng],
                                        stdout=subprocess.PIPE, cwd=REPO,
                                        env={**os.environ, "PYTHONPATH": str(REPO)})
                assert proc.stdout is not None
                ready = proc.stdout.readline().strip() == b"READY"
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                t0 = time.monotonic()
                time.sleep(ENGINE_LEASE_S * 0.6)
                kill_kept_at_06.append(ready and gpu_of(c, eng) == {7001, 7002})
                ok = gpu_gone(c, eng, ENGINE_LEASE_S * 3)
                kill_cleared_s.append(round(time.monotonic() - t0, 2) if ok else -1)
        out.update({"inputs_tried": rounds * 2, "clean_departure_cleared_s": clean_s,
                    "killed_kept_at_0.6_lease": kill_kept_at_06, "killed_cleared_after_s": kill_cleared_s,
                    "engine_lease_s": ENGINE_LEASE_S})
        return out

    def s8_foreign_entry(self) -> dict[str, Any]:
        time.sleep(1.0)
        head = int(self.admin.get(self.keys.head) or 0)
        t0 = time.monotonic()
        foreign = f"{head + 1}-0"
        try:
            self.admin.xadd(self.keys.log, {"x": "1"}, id=foreign)
            added = "yes"
        except redis.ResponseError as exc:  # the daemon wrote head+1 first: one past it
            head = int(self.admin.get(self.keys.head) or 0)
            foreign = f"{head + 5}-0"
            self.admin.xadd(self.keys.log, {"x": "1"}, id=foreign)
            added = f"retry after {exc}"
        rc = self.wait_daemon_exit(15)
        head_after = int(self.admin.get(self.keys.head) or 0)
        steps: list[str] = []
        verify_rc, verify_out = kvctl("verify", self.redis.url, "--namespace", self.ns)
        if rc is not None:
            steps.append(f"daemon exited {rc}")
            rrc, rout = kvctl("repair", self.redis.url, "--namespace", self.ns, "--drop-foreign")
            steps.append(f"kvctl repair --drop-foreign -> {rrc}")
            if rrc != 0:
                rrc, rout = kvctl("repair", self.redis.url, "--namespace", self.ns, "--drop-foreign", "--force")
                steps.append(f"kvctl repair --drop-foreign --force -> {rrc}")
            self.restart_daemon()
            steps.append("restart offloadd")
        else:
            rrc, rout = kvctl("repair", self.redis.url, "--namespace", self.ns, "--drop-foreign", "--force")
            steps.append(f"daemon still running; kvctl repair --drop-foreign --force -> {rrc}")
        n = self.storer.stats.stores
        wait_for(lambda: self.storer.stats.stores > n, 10)
        self.window(t0)
        time.sleep(max(0.0, self.seconds - (time.monotonic() - t0)))
        return {"inputs_tried": 1, "foreign_id": foreign, "xadd": added, "daemon_exit_code": rc,
                "head_before_after": [head, head_after], "verify_before_repair_rc": verify_rc,
                "verify_before_repair": verify_out[-200:], "operator_steps": steps,
                "repair_out": rout[-300:], "recovered_s": round(time.monotonic() - t0, 2)}

    def s9_two_daemons(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        second = DaemonProcess(self.work / "d2", self.redis.url, self.ns, capacity_bytes=NUM_SLOTS * SLOT,
                               chunk_bytes=CHUNK_SLOTS * SLOT, lease_ms=LEASE_MS,
                               extra_args=("--engine-lease-s", str(ENGINE_LEASE_S),
                                           "--owner-lease-s", str(OWNER_LEASE_S)))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(second.args, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        lines = [ln for ln in done.stderr.strip().splitlines() if not ln.startswith("{")]
        out["second_daemon_rc"] = done.returncode
        out["second_daemon_line"] = lines[-1][:200] if lines else ""
        time.sleep(1.0)
        # takeover: the same arena dir (same host), its own port and socket
        third = DaemonProcess(self.work / "d3", self.redis.url, self.ns, capacity_bytes=NUM_SLOTS * SLOT,
                              chunk_bytes=CHUNK_SLOTS * SLOT, lease_ms=LEASE_MS,
                              extra_args=("--engine-lease-s", str(ENGINE_LEASE_S),
                                          "--owner-lease-s", str(OWNER_LEASE_S)))
        third.args[third.args.index("--arena-dir") + 1] = str(self.daemon.arena_dir)
        assert self.daemon.proc is not None
        t0 = time.monotonic()
        self.daemon.proc.send_signal(signal.SIGSTOP)
        time.sleep(OWNER_LEASE_S + 0.5)
        try:
            third.start(30)
            head = int(self.admin.get(self.keys.head) or 0)
            owner: bytes | None = self.admin.get(self.keys.owner)  # type: ignore[assignment]
            self.daemon.proc.send_signal(signal.SIGCONT)
            rc = self.wait_daemon_exit(20)
            head2 = int(self.admin.get(self.keys.head) or 0)
            # what was written between B's start and A's exit (A must have written nothing)
            new: list[Any] = (self.admin.xrange(self.keys.log, f"{head + 1}-0", "+")  # type: ignore[assignment]
                              if head2 > head else [])
            out.update({"paused_daemon_exit_code": rc, "owner_after_takeover": (owner or b"").decode()[:40],
                        "owner_unchanged": self.admin.get(self.keys.owner) == owner,
                        "log_entries_between_takeover_and_old_exit": len(new),
                        "old_daemon_log_tracebacks": self.daemon.log_tail(400).count("Traceback"),
                        "old_daemon_log_says": [ln[:300] for ln in self.daemon.log_tail(30).splitlines()
                                                if "lost the owner" in ln or "no longer owned" in ln][-1:]})
            if rc is None:
                self.daemon.kill()
        finally:
            if self.daemon.proc is not None and self.daemon.proc.poll() is None:
                self.daemon.proc.send_signal(signal.SIGCONT)
            out["takeover_daemon_stop_rc"] = third.stop()
        self.restart_daemon()
        n = self.storer.stats.stores
        wait_for(lambda: self.storer.stats.stores > n, 10)
        self.window(t0)
        out["recovered_s"] = round(time.monotonic() - t0, 2)
        out["inputs_tried"] = 2
        out["operator_step"] = "bench stopped the takeover daemon and restarted the original (same port)"
        return out

    def s10_sigterm(self) -> dict[str, Any]:
        time.sleep(max(1.0, self.seconds / 2))
        assert self.daemon.proc is not None
        extra = [IngestStream(self.daemon.target, f"conn-{i}") for i in range(3)]
        for i, s in enumerate(extra):
            s.submit((BlockStored((9000 + i,), None, (1, 2, 3, 4), 4, "GPU"),))
            s.flush(10)
        with self.client() as c:
            follower = c.subscribe(1, follow=True)
            next(follower)
            t0 = time.monotonic()
            self.daemon.proc.send_signal(signal.SIGTERM)
            try:
                rc: int | None = self.daemon.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                rc = None
                self.daemon.kill()
            took = round(time.monotonic() - t0, 2)
        self.restart_daemon()
        with self.client() as c:
            kept = all(gpu_of(c, s.engine_id) == {9000 + i} for i, s in enumerate(extra))
        n = self.storer.stats.stores
        wait_for(lambda: self.storer.stats.stores > n, 10)
        self.window(t0)
        for s in extra:
            s.close()
        return {"inputs_tried": 1, "sigterm_rc": rc, "exit_s": took, "connected_sources_kept_after_restart": kept,
                "recovered_s": round(time.monotonic() - t0, 2)}


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| # | scenario | inputs tried | storer requests (failed: fault / other) | publisher batches (dropped) "
            "| blocks lost | Stats / log CPU / subscriber | verify | result |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ck = r["check"]
        rows.append(
            f"| {r['num']} | {r['name']} | {r.get('inputs_tried', '-')} | {r['storer_requests']} "
            f"({r['storer_failed_fault']} / {r['storer_failed_other']}) | {r['publisher_batches']} "
            f"({r['publisher_dropped']}) | {ck['blocks_lost']} | {ck['stats_blocks']} / {ck['log_cpu_blocks']} / "
            f"{ck['subscriber_cpu_blocks']} | {ck['kvctl_verify_rc']} | {'pass' if r['ok'] else 'FAIL'} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds-per-scenario", type=float, default=10.0)
    ap.add_argument("--inputs", type=int, default=3000, help="max rejected publishes in scenario 6")
    ap.add_argument("--only", default="", help="comma-separated scenario numbers")
    ap.add_argument("--out", default=str(REPO / "bench/results/attacks.json"))
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    work = Path(args.workdir) if args.workdir else Path(f"/tmp/bench_attacks_{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    bench = Bench(work, args.seconds_per_scenario, args.inputs)
    scenarios = [
        (1, "bad extra_keys (Reserve + Publish)", bench.s1_bad_extra_keys),
        (2, "Redis kill -9 under load", bench.s2_redis_kill9),
        (3, "RegisterEngine: live id / layout name squatted", bench.s3_registration),
        (4, "Redis restarted empty (log lost)", bench.s4_log_lost),
        (5, "arena chunk + generation table truncated", bench.s5_truncation),
        (6, "rejected publishes (2 KB ids) + tiny block_bytes", bench.s6_cheap_input),
        (7, "publisher departs cleanly / SIGKILLed", bench.s7_departures),
        (8, "foreign entry XADDed into the log", bench.s8_foreign_entry),
        (9, "second daemon; paused daemon taken over", bench.s9_two_daemons),
        (10, "SIGTERM with engines connected", bench.s10_sigterm),
    ]
    only = {int(x) for x in args.only.split(",") if x}
    t_start = time.time()
    bench.start()
    try:
        time.sleep(2.0)
        for num, name, body in scenarios:
            if not only or num in only:
                bench.run(num, name, body)
    finally:
        bench.stop()
    doc = {
        "bench": "bench/bench_attacks.py", "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "seconds_per_scenario": args.seconds_per_scenario, "arena_slots": NUM_SLOTS, "chunk_slots": CHUNK_SLOTS,
        "slot_bytes": SLOT, "redis_appendfsync": "always", "lease_ms": LEASE_MS, "engine_lease_s": ENGINE_LEASE_S,
        "owner_lease_s": OWNER_LEASE_S, "total_s": round(time.time() - t_start, 1),
        "all_ok": all(r["ok"] for r in bench.results), "scenarios": bench.results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    print(table(bench.results))
    print(f"wrote {args.out}; all ok: {doc['all_ok']}")
    return 0 if doc["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
