"""The benchmarks' subscriber: a SUB socket on a vLLM-wire publisher (kv-bridge or a bare PUB) and
the one receive loop that checks seq contiguity, times each batch and counts its stored blocks.

Used by bench_bridge, bench_pipeline and bench_ingest; each turns :class:`Received` into the keys
of its own JSON.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq


class _TsOnly(msgspec.Struct, array_like=True):
    ts: float  # array-like decoding skips the rest of [ts, events, dp_rank] without building it


class _Stored(msgspec.Struct):
    type: str
    block_hashes: list[int] = []


class _TsAndHashes(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored]


def subscribe(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: bytes = b"") -> zmq.Socket[bytes]:
    """A SUB on ``endpoint`` with no receive limit (a benchmark's drops would be its own)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


@dataclass(frozen=True)
class Received:
    batches: int
    block_events: int | None  # stored block hashes, when counted
    gaps: int  # places where the seq was not the one after the last
    t_first: float  # wall clock at the first and the last batch (0.0 when none came)
    t_last: float
    latencies_ms: list[float]  # receive time - the batch's ts, sorted

    @property
    def seconds(self) -> float:
        return self.t_last - self.t_first

    @property
    def p50_ms(self) -> float | None:
        return statistics.median(self.latencies_ms) if self.latencies_ms else None

    @property
    def p99_ms(self) -> float | None:
        lat = self.latencies_ms
        return lat[int(0.99 * (len(lat) - 1))] if lat else None

    @property
    def max_ms(self) -> float | None:
        return self.latencies_ms[-1] if self.latencies_ms else None


def receive(sub: zmq.Socket[bytes], idle_s: float, *, batches: int | None = None,
            block_events: int | None = None) -> Received:
    """Receive until ``batches`` batches, or ``block_events`` stored block hashes (counting them
    decodes each batch's events), have come, or nothing came for ``idle_s``. The loop is the
    subscriber's whole cost, which bounds the bare PUB->SUB baselines: keep it lean."""
    decode = _ts_and_blocks if block_events is not None else _ts_only
    max_batches = sys.maxsize if batches is None else batches
    max_blocks = sys.maxsize if block_events is None else block_events
    poll_ms, now_s, seq_of = int(idle_s * 1000), time.time, int.from_bytes
    got = blocks = gaps = 0
    expect = -1
    t_first = t_last = 0.0
    lat: list[float] = []
    while got < max_batches and blocks < max_blocks and sub.poll(poll_ms):
        frames = sub.recv_multipart()
        now = now_s()
        seq = seq_of(frames[1], "big")
        if seq != expect and expect >= 0:
            gaps += 1
        expect = seq + 1
        if got == 0:
            t_first = now
        t_last = now
        ts, n_blocks = decode(frames[2])
        lat.append(now - ts)
        blocks += n_blocks
        got += 1
    lat_ms = sorted(x * 1000 for x in lat)
    return Received(got, None if block_events is None else blocks, gaps, t_first, t_last, lat_ms)


_TS_ONLY = msgspec.msgpack.Decoder(_TsOnly)
_TS_AND_HASHES = msgspec.msgpack.Decoder(_TsAndHashes)


def _ts_only(payload: bytes) -> tuple[float, int]:
    return _TS_ONLY.decode(payload).ts, 0


def _ts_and_blocks(payload: bytes) -> tuple[float, int]:
    batch = _TS_AND_HASHES.decode(payload)
    return batch.ts, sum(len(e.block_hashes) for e in batch.events if e.type == "BlockStored")
