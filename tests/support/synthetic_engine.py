"""Synthetic engines for fault and load tests: the real ``offloadd.client`` without a model.

A :class:`SyntheticStorer` stores chains of blocks (Reserve -> write the slot bytes through the
shared arena -> Commit) and remembers, per full digest, the bytes it wrote, so a test can check
any block the daemon later serves against what the writer wrote. A :class:`SyntheticPublisher`
streams GPU-tier events through :class:`IngestStream` and keeps its own view of what it holds, so
the reducer over the daemon's log can be compared with what the engine sent; like a real engine
(engine.ingest_sink), it re-announces that view when the stream starts a new incarnation (a new
log epoch, a full queue), so its next deltas never name blocks the new incarnation lacks. Both
run on a thread and survive a daemon that goes away (they count errors and keep going).
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from events.hashing import to_wire
from events.schema import BlockRemoved, BlockStored, Event
from offloadd.client import (
    ArenaMapping,
    BlockToStore,
    GroupQuery,
    GroupSpec,
    IngestStream,
    OffloadClient,
    OffloadClientError,
    RetryPolicy,
)

SLOT = 1024
GROUP = GroupSpec(0, "full_attention", 0, 4, SLOT, "uint8", "synthetic-layout")
NO_RETRY = RetryPolicy(attempts=1)


def digest(engine_id: str, i: int) -> bytes:
    return hashlib.sha256(f"{engine_id}/{i}".encode()).digest()


def block_bytes(block_hash: bytes, n: int = SLOT) -> bytes:
    """What a writer puts in the slot of ``block_hash``: derived from the hash, so any reader can
    tell a torn or foreign slot from the right one."""
    seed = hashlib.blake2b(block_hash, digest_size=64).digest()
    return (seed * (n // len(seed) + 1))[:n]


def rss_kb(pid: int) -> int:
    """Resident set size of a live process, from /proc (kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class StorerStats:
    committed: set[bytes] = field(default_factory=set)   # Commit answered OK
    in_doubt: set[bytes] = field(default_factory=set)    # Commit raised: landed or not
    store_latency_s: list[float] = field(default_factory=list)  # reserve+write+commit
    errors: int = 0
    stores: int = 0


class SyntheticStorer:
    """Stores chains of ``chain_len`` new blocks in a loop until stopped."""

    def __init__(self, target: str, engine_id: str, chain_len: int = 8, pause_s: float = 0.0,
                 max_chains: int | None = None) -> None:
        self.target, self.engine_id = target, engine_id
        self.chain_len, self.pause_s, self.max_chains = chain_len, pause_s, max_chains
        self.stats = StorerStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"store-{engine_id}", daemon=True)
        self._next = 0

    def start(self) -> SyntheticStorer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _chain(self) -> list[BlockToStore]:
        out = []
        for i in range(self._next, self._next + self.chain_len):
            parent = digest(self.engine_id, i - 1) if i > self._next else None
            out.append(BlockToStore(digest(self.engine_id, i), parent, (i % 500, 1, 2, 3)))
        self._next += self.chain_len
        return out

    def _run(self) -> None:
        client = OffloadClient(self.target, timeout_s=2.0, retry=NO_RETRY)
        arena: ArenaMapping | None = None
        chains = 0
        try:
            while not self._stop.is_set() and (self.max_chains is None or chains < self.max_chains):
                arena, held = self._hold(arena)
                if held:
                    continue
                try:
                    if arena is None:
                        arena = client.register_engine(self.engine_id, 1, "synthetic", [GROUP]).map_arena(0)
                    self._store_one(client, arena)
                    chains += 1
                except (OffloadClientError, OSError, ValueError) as exc:
                    # Daemon gone or restarted: map the arena again once it is back.
                    self._failed(exc)
                    if arena is not None:
                        arena.close()
                    arena = None
                    self._stop.wait(0.05)
                if self.pause_s:
                    self._stop.wait(self.pause_s)
        finally:
            if arena is not None:
                arena.close()
            client.close()

    def _hold(self, arena: ArenaMapping | None) -> tuple[ArenaMapping | None, bool]:
        """Before each chain: the arena to go on with, and whether to skip storing this round
        (a subclass pauses here; this one never does)."""
        return arena, False

    def _failed(self, exc: Exception) -> None:
        """A store that raised (the daemon gone, restarted or refusing): counted."""
        self.stats.errors += 1

    def _store_one(self, client: OffloadClient, arena: ArenaMapping) -> None:
        blocks = self._chain()
        t0 = time.perf_counter()
        res = client.reserve(self.engine_id, 0, blocks)
        reserved = [b.block_hash for b, (status, _) in zip(blocks, res.blocks, strict=True)
                    if status.name == "RESERVED"]
        for b, (status, slot) in zip(blocks, res.blocks, strict=True):
            if status.name == "RESERVED":
                arena.write(slot, block_bytes(b.block_hash))
        if not res.reservation_id:
            return
        try:
            client.commit(self.engine_id, res.reservation_id)
        except OffloadClientError:
            self.stats.in_doubt.update(reserved)
            raise
        self.stats.store_latency_s.append(time.perf_counter() - t0)
        self.stats.committed.update(reserved)
        self.stats.stores += 1


class SyntheticPublisher:
    """Streams GPU-tier store/remove batches; ``resident`` is the engine's own truth."""

    def __init__(self, target: str, engine_id: str, incarnation: int = 1, seed: int = 0,
                 pause_s: float = 0.0, max_batches: int | None = None, block_size: int = 4,
                 max_resident: int | None = None) -> None:
        self.engine_id, self.pause_s, self.max_batches = engine_id, pause_s, max_batches
        self.max_resident = max_resident  # bounds the state (and so the daemon's memory) in long runs
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.stream = IngestStream(target, engine_id, incarnation, max_pending=1 << 16,
                                   on_reset=self._on_reset)
        self.resident: list[int] = []  # one chain, parents first (removals take its tail)
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._reset = threading.Event()  # the stream waits for our re-announce
        self.num_resyncs = 0
        self.submitted = 0
        self.submit_times: dict[int, float] = {}  # seq -> perf_counter at submit
        self.ack_latency_s: list[float] = []
        self._acked_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pub-{engine_id}", daemon=True)
        self._next = 1

    def start(self) -> SyntheticPublisher:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def next_events(self) -> list[Event]:
        full = self.max_resident is not None and len(self.resident) >= self.max_resident
        if self.resident and (full or self.rng.random() < 0.25):
            n = self.rng.randint(1, min(4, len(self.resident)))
            victims = tuple(self.resident[-n:])
            del self.resident[-n:]
            for h in victims:
                del self._tokens[h]
            return [BlockRemoved(victims, "GPU")]
        n = self.rng.randint(1, 4)
        parent = self.resident[-1] if self.resident else None
        hashes = tuple(to_wire(digest(self.engine_id + "/gpu", self._next + k)) for k in range(n))
        self._next += n
        self.resident.extend(hashes)
        tokens = tuple(self.rng.randrange(32000) for _ in range(n * self.block_size))
        for k, h in enumerate(hashes):
            self._tokens[h] = tokens[k * self.block_size : (k + 1) * self.block_size]
        return [BlockStored(hashes, parent, tokens, self.block_size, "GPU")]

    def held(self) -> list[Event]:
        """Everything resident, as one chain (the re-announce)."""
        if not self.resident:
            return []
        tokens = tuple(t for h in self.resident for t in self._tokens[h])
        return [BlockStored(tuple(self.resident), None, tokens, self.block_size, "GPU")]

    def _on_reset(self, _incarnation: int) -> None:
        # Called on the stream's thread (or ours, queue full): our own thread re-announces, so
        # no delta of ours can slip between the view it reads and the resync (engine.ingest_sink).
        self._reset.set()

    def resync_if_reset(self) -> None:
        """Re-announce the view when the stream asked for it (our thread, or after stop())."""
        if self._reset.is_set():
            self._reset.clear()
            self.stream.resync(self.held())
            self.num_resyncs += 1

    def _run(self) -> None:
        while not self._stop.is_set() and (self.max_batches is None or self.submitted < self.max_batches):
            self.resync_if_reset()
            events = self.next_events()
            t0 = time.perf_counter()
            seq = self.stream.submit(events)
            self.submit_times[seq] = t0
            self.submitted += 1
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def poll_acks(self) -> None:
        """Record submit-to-ack latency of every batch acked since the last call (the caller
        polls, so the resolution is its polling interval)."""
        now, acked = time.perf_counter(), self.stream.acked_seq
        for seq in range(self._acked_seen + 1, acked + 1):
            t0 = self.submit_times.pop(seq, None)
            if t0 is not None:
                self.ack_latency_s.append(now - t0)
        self._acked_seen = max(self._acked_seen, acked)

    def view(self) -> frozenset[int]:
        return frozenset(self.resident)

    def close(self) -> None:
        self.stream.close()


def served_blocks_match(client: OffloadClient, engine_id: str, arena: ArenaMapping,
                        hashes: list[bytes]) -> tuple[int, list[bytes]]:
    """Lookup every hash (not prefix-only); return (how many are served, those whose served slot
    bytes differ from what their writer wrote)."""
    bad: list[bytes] = []
    served = 0
    for start in range(0, len(hashes), 1000):
        part = tuple(hashes[start : start + 1000])
        res = client.lookup(engine_id, [GroupQuery(0, part, prefix_only=False)], pin=True)
        for h, slot in zip(part, res.results[0].slots, strict=True):
            if slot >= 0:
                served += 1
                if arena.read(slot) != block_bytes(h):
                    bad.append(h)
        if res.lease_id:
            client.release(engine_id, res.lease_id)
    return served, bad
