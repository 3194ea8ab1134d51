"""Checkpoints and retention (DESIGN.md 3.5): a checkpoint is written and pointed to, the log is
trimmed behind it, and a kill -9 restart recovers from checkpoint + tail to the same state,
replaying only the tail; a torn checkpoint falls back to the previous one."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import redis

from events.logkeys import LogKeys
from events.schema import BlockStored, LogRecord
from events.state import CacheState
from offloadd.client import IngestStream, OffloadClient
from offloadd.log.checkpoint import Manifest, join, split
from tests.support.offloadd_proc import DaemonProcess

CKPT_ARGS = ("--checkpoint-interval-s", "0.2", "--checkpoint-records", "1000000",
             "--retention-records", "50", "--retention-s", "0")


def pointer(admin: Any, keys: LogKeys) -> tuple[str, ...]:
    raw = admin.get(keys.checkpoint)
    return msgspec.msgpack.decode(raw, type=tuple[str, ...]) if raw else ()


def manifest(admin: Any, keys: LogKeys, ckpt_id: str) -> Manifest:
    return msgspec.msgpack.decode(admin.get(keys.checkpoint_manifest(ckpt_id)), type=Manifest)


def head(admin: Any, keys: LogKeys) -> int:
    return int(admin.get(keys.head) or 0)


def first_offset(admin: Any, keys: LogKeys) -> int:
    entries = admin.xrange(keys.log, "-", "+", count=1)
    return int(entries[0][0].split(b"-")[0]) if entries else 0


def wait_checkpoint(admin: Any, keys: LogKeys, offset: int, timeout_s: float = 20) -> Manifest:
    """The newest checkpoint once it is at ``offset`` or later."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = pointer(admin, keys)
        if ids and (m := manifest(admin, keys, ids[0])).offset >= offset:
            return m
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint at {offset} within {timeout_s}s (pointer {pointer(admin, keys)})")


def log_epoch(admin: Any, keys: LogKeys) -> str:
    return str(admin.get(keys.epoch).decode())


def publish(stream: IngestStream, start: int, n: int) -> None:
    """``n`` records: one GPU block each, every tenth removed again."""
    for i in range(start, start + n):
        stream.submit([BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU")])
    assert stream.flush(60)


def metrics_text(proc: DaemonProcess) -> str:
    return str(urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics").read().decode())


def recovery_counts(proc: DaemonProcess) -> tuple[int, int]:
    """(num_records replayed, checkpoint_offset) of the last recovery the daemon logged."""
    text = proc.log_path.read_text(errors="replace")
    reports = re.findall(r"num_records=(\d+).*?checkpoint_offset=(\d+)", text)
    assert reports, proc.log_tail()
    return int(reports[-1][0]), int(reports[-1][1])


@dataclass
class CkptStack:
    """A daemon that checkpoints often, an engine stream into it, and a Redis client."""

    proc: DaemonProcess
    keys: LogKeys
    admin: Any
    stream: IngestStream


@contextmanager
def ckpt_stack(tmp_path: Path, redis_url: str, namespace: str) -> Iterator[CkptStack]:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, extra_args=CKPT_ARGS)
    keys, admin = LogKeys(namespace), redis.Redis.from_url(redis_url)
    proc.start()
    stream = IngestStream(proc.target, "gpu-engine", 3)
    try:
        yield CkptStack(proc, keys, admin, stream)
    finally:
        stream.close()
        proc.kill()


def test_checkpoint_is_pointed_to_and_log_is_trimmed_behind_it(
    tmp_path: Path, redis_url: str, namespace: str,
) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, extra_args=CKPT_ARGS, metrics=True)
    keys, admin = LogKeys(namespace), redis.Redis.from_url(redis_url)
    proc.start()
    try:
        stream = IngestStream(proc.target, "gpu-engine", 3)
        publish(stream, 0, 600)
        m = wait_checkpoint(admin, keys, head(admin, keys))
        assert m.offset == head(admin, keys) and m.format == 2 and m.chunks and m.num_bytes > 0
        publish(stream, 600, 400)
        m2 = wait_checkpoint(admin, keys, head(admin, keys))
        # Nothing is published any more, so no checkpoint follows m2 (there is nothing new) and
        # the trims (every 0.2 s) reach one horizon and stay: the newest 50 records, but never
        # past the oldest kept checkpoint + 1 (its fallback's tail stays).
        kept = [manifest(admin, keys, i).offset for i in pointer(admin, keys)]
        assert len(kept) == 2 and kept[0] == m2.offset == head(admin, keys)
        horizon = min(head(admin, keys) - 50 + 1, min(kept) + 1)
        assert horizon > 1
        deadline = time.monotonic() + 20
        while (first := first_offset(admin, keys)) != horizon:
            assert first < horizon and time.monotonic() < deadline, (first, horizon, kept)
            time.sleep(0.05)
        # Only the kept checkpoints' keys remain: their manifests and the chunks they list.
        ckpt_keys = {k.decode() for k in admin.scan_iter(match=keys.checkpoint_manifest("*"))}
        shared = {k for k in ckpt_keys if k.startswith(keys.checkpoint_content_prefix)}
        assert {k.split(":")[3] for k in ckpt_keys - shared} == set(pointer(admin, keys))
        listed = {a for i in pointer(admin, keys) for a in manifest(admin, keys, i).chunks}
        assert shared == {keys.checkpoint_content(a) for a in listed}
        with OffloadClient(proc.target) as c:
            assert c.snapshot().offset == head(admin, keys)
        # The gauges are read from the daemon's stats, refreshed by its next trim pass: they
        # come to say what Redis says.
        want = {f"offloadd_checkpoint_offset {float(m2.offset)}", f"offloadd_log_first_offset {float(first)}"}
        deadline = time.monotonic() + 20
        while not want <= set((text := metrics_text(proc)).splitlines()):
            assert time.monotonic() < deadline, [ln for ln in text.splitlines()
                                                 if ln.startswith(("offloadd_checkpoint_offset", "offloadd_log_"))]
            time.sleep(0.05)
        stream.close()
    finally:
        proc.kill()


def test_kill9_recovers_from_checkpoint_plus_tail_whatever_the_history(
    tmp_path: Path, redis_url: str, namespace: str,
) -> None:
    with ckpt_stack(tmp_path, redis_url, namespace) as st:
        proc, keys, admin, stream = st.proc, st.keys, st.admin, st.stream
        replayed = []
        done = 0
        for history in (1000, 9000):  # 1k records of history, then 10k
            publish(stream, done, history)
            done += history
            wait_checkpoint(admin, keys, head(admin, keys))
            publish(stream, done, 30)  # the tail
            done += 30
            with OffloadClient(proc.target) as c:
                before, stats = c.snapshot(), c.stats()
            proc.kill()
            proc.restart()
            num_records, ckpt_offset = recovery_counts(proc)
            assert ckpt_offset > 0 and num_records == before.offset - ckpt_offset
            replayed.append(num_records)
            with OffloadClient(proc.target) as c:
                assert c.snapshot() == before
                assert c.stats() == stats
        assert first_offset(admin, keys) > 1000  # the history is gone from the log
        assert all(n <= 60 for n in replayed), replayed  # the tail, not the history


def test_torn_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, redis_url: str, namespace: str,
) -> None:
    with ckpt_stack(tmp_path, redis_url, namespace) as st:
        proc, keys, admin, stream = st.proc, st.keys, st.admin, st.stream
        publish(stream, 0, 300)
        wait_checkpoint(admin, keys, head(admin, keys))
        publish(stream, 300, 300)
        wait_checkpoint(admin, keys, head(admin, keys))
        publish(stream, 600, 20)
        with OffloadClient(proc.target) as c:
            before = c.snapshot()
        proc.kill()
        ids = pointer(admin, keys)  # read after the kill: a checkpoint may have come meanwhile
        assert len(ids) == 2
        previous = manifest(admin, keys, ids[1])
        newest = manifest(admin, keys, ids[0])
        only_newest = [i for i, a in enumerate(newest.chunks) if a not in previous.chunks]
        admin.delete(keys.checkpoint_content(newest.chunks[only_newest[0]]))
        proc.restart()
        num_records, ckpt_offset = recovery_counts(proc)
        assert ckpt_offset == previous.offset
        assert num_records == before.offset - previous.offset
        assert f"unusable (chunk {only_newest[0]} missing)" in proc.log_path.read_text()
        with OffloadClient(proc.target) as c:
            assert c.snapshot() == before


def test_split_then_join_is_the_snapshot() -> None:
    state = CacheState()
    seqs = {"e0": 0, "e1": 0, "e2": 0}
    for i in range(1, 40):
        source = f"e{i % 3}"
        seqs[source] += 1
        state.apply(LogRecord(i, source, 1, seqs[source], 0.0,
                              (BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU"),)))
    snap = state.export()
    for per_chunk in (1, 5, 13, 1000):
        chunks = list(split(snap, per_chunk))
        assert all(sum(len(p.events) for p in c) <= per_chunk for c in chunks)
        assert join(snap.offset, chunks) == snap
        assert CacheState.from_snapshot(join(snap.offset, chunks)) == state


def test_the_log_epoch_is_set_only_by_the_namespaces_owner(redis_url: str) -> None:
    """Recovery's epoch write is fenced by the owner lease like every other write."""
    import asyncio

    import redis.asyncio as aioredis

    from events.logkeys import LogKeys
    from events.state import CacheState
    from offloadd.log.metadata import MetadataStore, OwnershipLost

    keys = LogKeys("epochfence")

    async def scenario() -> tuple[str, str, str | None]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        await client.set(keys.owner, "7:daemon-a")
        md.owner = "7:daemon-a"
        first = await md.set_epoch("e1", only_if_absent=True)
        kept = await md.set_epoch("e2", only_if_absent=True)  # one is there: it stays
        md.owner = "6:daemon-old"  # a daemon whose lease was taken over
        try:
            await md.set_epoch("e3", only_if_absent=False)
            refused = None
        except OwnershipLost as exc:
            refused = str(exc)
        now = await client.get(keys.epoch)
        await client.aclose()
        assert now == b"e1"
        return first, kept, refused

    first, kept, refused = asyncio.run(scenario())
    assert (first, kept) == ("e1", "e1")
    assert refused is not None and "no longer owned by this daemon" in refused
