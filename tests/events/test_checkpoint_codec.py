"""events.checkpoint: the checkpoint format shared by the daemon, kv-bridge and kvctl; chunks
are verified against the manifest, and the usability rule picks what a reader may load."""

from __future__ import annotations

import pytest

from events.checkpoint import (
    CheckpointBroken,
    Manifest,
    candidates,
    checkpoint_id,
    decode_ids,
    decode_manifest,
    decode_snapshot,
    encode_chunk,
    encode_ids,
    encode_manifest,
    split,
    unusable,
)
from events.logkeys import LogKeys
from events.schema import BlockStored, LogRecord
from events.state import CacheState, Snapshot

EPOCH = "0123456789abcdef"
KEYS = LogKeys("codec")


def _snapshot(n: int) -> Snapshot:
    state = CacheState()
    for i in range(1, n + 1):
        source = f"e{i % 2}"
        state.apply(LogRecord(i, source, 1, (i + 1) // 2, 0.0,
                              (BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU"),)))
    return state.export()


def _store(snap: Snapshot, per_chunk: int = 3) -> tuple[dict[str, bytes], Manifest]:
    """The keys a daemon writes for ``snap`` (pointer included)."""
    ckpt_id = checkpoint_id(EPOCH, snap.offset)
    store: dict[str, bytes] = {}
    sums = []
    for i, part in enumerate(split(snap, per_chunk)):
        data, checksum = encode_chunk(part)
        store[KEYS.checkpoint_chunk(ckpt_id, i)] = data
        sums.append(checksum)
    manifest = Manifest(ckpt_id, snap.offset, EPOCH, 1.0, tuple(sums), sum(map(len, store.values())))
    store[KEYS.checkpoint_manifest(ckpt_id)] = encode_manifest(manifest)
    return store, manifest


def test_encoded_chunks_decode_to_the_snapshot() -> None:
    snap = _snapshot(11)
    store, manifest = _store(snap)
    raw = store[KEYS.checkpoint_manifest(manifest.ckpt_id)]
    assert decode_manifest(raw, manifest.ckpt_id) == manifest
    datas = [store[KEYS.checkpoint_chunk(manifest.ckpt_id, i)] for i in range(len(manifest.checksums))]
    assert len(datas) == 4 and decode_snapshot(manifest, datas) == snap
    assert decode_ids(encode_ids(["b", "a"])) == ("b", "a") and decode_ids(None) == ()


def test_a_bad_chunk_or_manifest_is_broken() -> None:
    snap = _snapshot(5)
    store, manifest = _store(snap)
    datas: list[object] = [store[KEYS.checkpoint_chunk(manifest.ckpt_id, i)]
                           for i in range(len(manifest.checksums))]
    with pytest.raises(CheckpointBroken, match="chunk 1 checksum mismatch"):
        decode_snapshot(manifest, [datas[0], datas[1] + b"x"])  # type: ignore[operator]
    with pytest.raises(CheckpointBroken, match="chunk 0 missing"):
        decode_snapshot(manifest, [None, datas[1]])
    with pytest.raises(CheckpointBroken, match="manifest missing"):
        decode_manifest(None)
    with pytest.raises(CheckpointBroken, match="manifest names"):
        decode_manifest(store[KEYS.checkpoint_manifest(manifest.ckpt_id)], "other")
    with pytest.raises(CheckpointBroken, match="not a list of ids"):
        decode_ids(b"\xc1")


def test_usable_means_same_epoch_and_the_tail_still_held() -> None:
    manifest = Manifest("10-x", 10, EPOCH, 1.0, (), 0)
    assert unusable(manifest, EPOCH, 11) is None and unusable(manifest, EPOCH, 1) is None
    assert "no longer holds its tail" in (unusable(manifest, EPOCH, 12) or "")
    assert "of log epoch" in (unusable(manifest, "other", 5) or "")


def test_candidates_newest_first_a_torn_one_falls_back() -> None:
    old, new = _snapshot(6), _snapshot(12)
    store_old, m_old = _store(old)
    store_new, m_new = _store(new)
    store = {**store_old, **store_new, KEYS.checkpoint: encode_ids([m_new.ckpt_id, m_old.ckpt_id])}

    def fetch(names: list[str]) -> list[bytes | None]:
        return [store.get(n) for n in names]

    got = list(candidates(KEYS, fetch, EPOCH, 5))
    assert [c.snapshot for c in got] == [new, old] and all(c.problem is None for c in got)
    del store[KEYS.checkpoint_chunk(m_new.ckpt_id, 2)]
    got = list(candidates(KEYS, fetch, EPOCH, 5))
    assert got[0].problem == "chunk 2 missing" and got[1].snapshot == old
    assert list(candidates(KEYS, fetch, EPOCH, 8))[1].problem is not None  # old's tail is gone
